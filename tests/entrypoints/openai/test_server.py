"""The OpenAI-compatible server, end to end: one `fp8serve serve` subprocess on
a free loopback port serving the tiny Llama, driven by the real `openai`
client (and httpx for raw status codes, SSE and disconnects)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from checkpoints import write_tiny_llama
from fp8serve.entrypoints.llm import LLM
from fp8serve.sampling_params import SamplingParams

API_KEY = "test-key"
MODEL = "tiny-llama"
MAX_MODEL_LEN = 128
MAX_BODY = 64 * 1024
ENGINE_ARGS = dict(dtype="float32", kv_cache_memory=1 << 20, max_model_len=MAX_MODEL_LEN)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model_dir, *extra: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "fp8serve.entrypoints.cli", "serve", str(model_dir), "--port", str(self.port),
               "--dtype", "float32", "--kv-cache-memory", "1MiB", "--max-model-len", str(MAX_MODEL_LEN), *extra]
        env = dict(os.environ, OMP_NUM_THREADS="2")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        deadline = time.monotonic() + 300  # a cold start may compile the C++ kernels
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.proc.stdout.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("server did not become healthy")
            time.sleep(0.2)

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return self.proc.returncode, out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("serve") / "llama")


@pytest.fixture(scope="module")
def server(model_dir):
    s = ServerProcess(model_dir, "--api-key", API_KEY, "--served-model-name", MODEL,
                      "--max-request-body-size", str(MAX_BODY))
    yield s
    rc, out = s.stop()
    assert rc == 0, out
    assert "KV cache: float32" in out


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), **ENGINE_ARGS)


def _post(server, path: str, body, key: str | None = API_KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (bytes, str)):
        return httpx.post(server.url + path, content=body, headers={**headers, "content-type": "application/json"},
                          timeout=60, **kw)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60, **kw)


def _metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


# ---------------------------------------------------------------- completions
def test_completion_greedy_matches_offline_llm_and_usage(client, llm):
    prompt = "The quick brown fox"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == len(ref.prompt_token_ids) + 12


def test_completion_stream_equals_non_stream(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_prompt_forms(client, llm):
    ids = llm.get_tokenizer().encode("Hello there")
    r = client.completions.create(model=MODEL, prompt=["Hello there", "Numbers such as"], max_tokens=3,
                                  temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=3, temperature=0)
    assert batch.choices[0].text == r.choices[0].text
    assert batch.usage.prompt_tokens == len(ids) + 2


def _check_prompt_logprobs(got: list, ref, k: int) -> None:
    assert len(got) == len(ref.prompt_token_ids) and got[0] is None
    for i in range(1, len(got)):
        tid = ref.prompt_token_ids[i]
        want = ref.prompt_logprobs[i]
        # The prompt token and the top k, each with its rank and text (token ids as string keys).
        assert set(got[i]) == {str(t) for t, lp in want.items() if t == tid or lp.rank <= k}
        for t, entry in got[i].items():
            assert entry["logprob"] == pytest.approx(want[int(t)].logprob, abs=1e-4)
            assert entry["rank"] == want[int(t)].rank and isinstance(entry["decoded_token"], str)


def test_prompt_logprobs(server, llm):
    """vLLM's prompt_logprobs: per choice on /v1/completions (also next to echo logprobs of a larger k),
    at the top of a /v1/chat/completions response; refused with stream, as stream_options without it.
    It was ignored (logged as an unknown field)."""
    prompt = "The capital of France is Paris"
    ref = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)[0]
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    _check_prompt_logprobs(r.json()["choices"][0]["prompt_logprobs"], ref, 2)
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True,
                                          "logprobs": 5, "prompt_logprobs": 1})
    choice = r.json()["choices"][0]
    _check_prompt_logprobs(choice["prompt_logprobs"], ref, 1)
    want = [ref.prompt_logprobs[i][t].logprob for i, t in enumerate(ref.prompt_token_ids) if i > 0]
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)  # echo's k = 5 unchanged
    messages = [{"role": "user", "content": "hi"}]
    chat = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2,
                                                  "prompt_logprobs": 0}).json()
    ids = _post(server, "/tokenize", {"model": MODEL, "messages": messages}).json()["tokens"]
    chat_ref = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                            use_tqdm=False)[0]
    _check_prompt_logprobs(chat["prompt_logprobs"], chat_ref, 0)
    for body, param in [({"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
                        ({"stream_options": {"include_usage": True}}, "stream_options")]:
        r = _post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_echo_logprobs_for_loglikelihood(client, llm):
    """lm-evaluation-harness local-completions: echo, max_tokens=0, logprobs=k."""
    prompt = "The capital of France is Paris"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=3, temperature=0)
    c = r.choices[0]
    ref = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    n = len(ref.prompt_token_ids)
    assert c.text == prompt
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == n
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):
        want = ref.prompt_logprobs[i][ref.prompt_token_ids[i]].logprob
        assert lp.token_logprobs[i] == pytest.approx(want, abs=1e-4)
        assert 3 <= len(lp.top_logprobs[i]) <= 4
        assert max(lp.top_logprobs[i].values()) >= lp.token_logprobs[i] - 1e-6
    assert "".join(lp.tokens) == prompt


def test_logit_bias(client, llm):
    """OpenAI's logit_bias (token ids as string keys): +100 makes greedy decoding pick that token
    every time, -100 keeps the unbiased greedy choice out, in completions and chat alike."""
    kw = dict(model=MODEL, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    forced = client.completions.create(prompt="The quick brown fox", logit_bias={"77": 100}, **kw)
    assert forced.choices[0].text == llm.get_tokenizer().decode([77] * 4) and forced.usage.completion_tokens == 4
    plain = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    first = plain.outputs[0].token_ids[0]
    banned = client.completions.create(prompt="The quick brown fox", logit_bias={str(first): -100}, logprobs=1, **kw)
    assert banned.choices[0].logprobs.tokens[0] != llm.get_tokenizer().decode([first])
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], logit_bias={"77": 100}, **kw)
    assert chat.choices[0].message.content == llm.get_tokenizer().decode([77] * 4)


def test_n_choices_completions_and_chat(client, server, llm):
    """n samples per prompt (vLLM's indices: prompt i's samples are choices i*n .. i*n+n-1);
    streamed choices equal the non-streamed ones; usage counts each prompt once and every
    sample's tokens; chat numbers its n choices 0..n-1."""
    kw = dict(model=MODEL, max_tokens=5, temperature=1.0, seed=3, n=3, extra_body={"ignore_eos": True})
    prompts = ["Once upon a time", "The quick brown fox"]
    r = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in r.choices] == list(range(6))
    lens = [len(llm.get_tokenizer().encode(p)) for p in prompts]
    assert r.usage.prompt_tokens == sum(lens) and r.usage.completion_tokens == 6 * 5
    offline = llm.generate(prompts, SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True),
                           use_tqdm=False)
    assert [c.text for c in r.choices] == [c.text for o in offline for c in o.outputs]
    assert len({c.text for c in r.choices[:3]}) > 1
    texts = [""] * 6
    finishes = [None] * 6
    for chunk in client.completions.create(prompt=prompts, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                assert finishes[c.index] is None, "a choice finished twice"
                finishes[c.index] = c.finish_reason
    assert texts == [c.text for c in r.choices] and finishes == ["length"] * 6
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw)
    assert [c.index for c in chat.choices] == [0, 1, 2] and chat.usage.completion_tokens == 15
    streamed = [""] * 3
    for chunk in client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == [c.message.content for c in chat.choices]
    _assert_error(_post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}), 400, "n must be",
                  param="n")
    _assert_error(_post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2, "best_of": 3}), 400,
                  "best_of must equal n", param="best_of")
    _assert_error(_post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                         "n": 129}), 400, "n must be", param="n")


def test_generated_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, logprobs=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(x is not None and x <= 0 for x in lp.token_logprobs)
    # Greedy: the chosen token is the most likely one.
    assert all(abs(max(top.values()) - x) < 1e-5 for top, x in zip(lp.top_logprobs, lp.token_logprobs))


def test_vllm_extra_fields_and_unknown_fields(client):
    r = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=8, temperature=0.8, seed=3,
        extra_body={"top_k": 5, "min_p": 0.05, "ignore_eos": True, "repetition_penalty": 1.1, "min_tokens": 2,
                    "skip_special_tokens": True, "include_stop_str_in_output": False, "stop_token_ids": [],
                    "some_unknown_field": 1})
    again = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=8, temperature=0.8, seed=3,
        extra_body={"top_k": 5, "min_p": 0.05, "ignore_eos": True, "repetition_penalty": 1.1, "min_tokens": 2})
    assert r.usage.completion_tokens == 8
    assert r.choices[0].text == again.choices[0].text  # seeded


# ----------------------------------------------------------------------- chat
def test_chat_matches_offline_and_streams(client, llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert chunks[-1].usage.completion_tokens == 8


def test_chat_content_parts(server, client, llm):
    """Text parts are joined as vLLM does; a part of another type, or a text part
    without a string, is the request's error (400 naming messages), not a 500."""
    parts = [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=4,
                                       temperature=0, extra_body={"ignore_eos": True})
    plain = [{"role": "user", "content": "What is the capital of France?"}]
    ref = llm.chat(plain, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert r.choices[0].message.content == ref.outputs[0].text
    for bad_text in (5, None, ["x"]):
        body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": bad_text}]}]}
        _assert_error(_post(server, "/v1/chat/completions", body), 400, "content[0].text must be a string",
                      param="messages")
        _assert_error(_post(server, "/tokenize", body), 400, "content[0].text must be a string", param="messages")
    image = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]
    _assert_error(_post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                                                       "content": image}]}),
                  400, "content[1]: part type 'image_url' is not supported", param="messages")
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=1).usage.completion_tokens == 1


def test_continuous_usage_stats(client):
    """stream_options.continuous_usage_stats (vLLM): every chunk carries its choice's usage so far."""
    for create, kwargs in ((client.completions.create, {"prompt": "Hello"}),
                           (client.chat.completions.create, {"messages": [{"role": "user", "content": "Hello"}]})):
        chunks = list(create(model=MODEL, max_tokens=5, temperature=0, stream=True,
                             stream_options={"include_usage": True, "continuous_usage_stats": True},
                             extra_body={"ignore_eos": True}, **kwargs))
        with_choices = [c for c in chunks if c.choices and c.usage is not None]
        counts = [c.usage.completion_tokens for c in with_choices]
        assert counts and counts == sorted(counts) and counts[-1] == 5, counts
        prompt_tokens = {c.usage.prompt_tokens for c in chunks}
        assert len(prompt_tokens) == 1 and all(c.usage.total_tokens == c.usage.prompt_tokens
                                                + c.usage.completion_tokens for c in chunks)
        assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 5
        # Without it, only the final chunk has usage.
        plain = list(create(model=MODEL, max_tokens=5, temperature=0, stream=True,
                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **kwargs))
        assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob <= 0
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-5)


# --------------------------------------------------------------------- errors
def _assert_error(resp: httpx.Response, status: int, fragment: str = "", param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["code"] == status
    assert fragment.lower() in err["message"].lower()
    if param is not None:
        assert err["param"] == param, err
    return err


def test_validation_errors(server, client):
    long_prompt = list(range(5, 5 + MAX_MODEL_LEN + 1))
    _assert_error(_post(server, "/v1/completions", {"model": MODEL, "prompt": long_prompt}), 400, "context length")
    _assert_error(_post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": MAX_MODEL_LEN}),
                  400, "maximum context length")
    _assert_error(_post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}), 400,
                  "temperature", param="temperature")
    _assert_error(_post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}), 400, "top_p",
                  param="top_p")
    # A union field names itself, not the last step of the validator's path into it.
    _assert_error(_post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["a", 1]}), 400, "stop",
                  param="stop")
    _assert_error(_post(server, "/v1/completions", {"model": MODEL, "prompt": [1, 99999]}), 400, "out of range")
    _assert_error(_post(server, "/v1/completions", b'{"model": "tiny-llama", "prompt": '), 400, "json")
    _assert_error(_post(server, "/v1/completions", {"model": MODEL}), 400, "prompt", param="prompt")
    # A body that is JSON but not an object: the message names the body, not an empty field.
    err = _assert_error(_post(server, "/v1/completions", [1, 2]), 400, "request body: ", param=None)
    assert err["param"] is None and not err["message"].startswith(":"), err
    # A prompt that leaves no room for output is blamed on the prompt (chat: on the messages).
    _assert_error(_post(server, "/v1/completions", {"model": MODEL, "prompt": [5] * MAX_MODEL_LEN,
                                                    "max_tokens": None}), 400, "no room", param="prompt")
    # FastAPI's own errors (unknown route, wrong method, a body it cannot read) in the same shape.
    _assert_error(_post(server, "/v1/nope", {"model": MODEL}), 404, "not found")
    _assert_error(httpx.get(server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}), 405,
                  "method not allowed")
    _assert_error(_post(server, "/v1/completions", b'{"model": "tiny-llama", "prompt": "\xff\xfe"}'), 400)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    _assert_error(_post(server, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}), 400,
                  "logprobs", param="top_logprobs")
    _assert_error(_post(server, "/v1/chat/completions", {**chat, "top_logprobs": 2}), 400, "requires logprobs",
                  param="top_logprobs")
    _assert_error(_post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"abc": 1}}), 400,
                  "logit_bias keys must be token ids", param="logit_bias")
    _assert_error(_post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}), 400,
                  "[-100, 100]", param="logit_bias")
    _assert_error(_post(server, "/v1/chat/completions", {**chat, "logit_bias": {"99999": 1}}), 400,
                  "out of range for a vocabulary", param="logit_bias")
    _assert_error(_post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "min_tokens": 2,
                                                    "stop_token_ids": [99999]}), 400, "out of range",
                  param="stop_token_ids")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10_000)
    # The server is still fine.
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=1).usage.completion_tokens == 1


def test_text_that_is_not_unicode_and_structured_output_are_refused(server, client):
    # JSON's "\ud83d" alone decodes to a lone surrogate, which no tokenizer encodes: the client's error, named.
    lone = json.dumps({"model": MODEL, "prompt": "ab\ud83d", "max_tokens": 1})
    assert "\\ud83d" in lone
    _assert_error(_post(server, "/v1/completions", lone), 400, "prompt is not valid unicode text", param="prompt")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "\udc00"}]}
    _assert_error(_post(server, "/v1/chat/completions", json.dumps(chat)), 400,
                  "messages[1].content is not valid unicode", param="messages")
    _assert_error(_post(server, "/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "stop": ["\ud800"]})),
                  400, "stop[0] is not valid unicode", param="stop")
    _assert_error(_post(server, "/tokenize", json.dumps({"model": MODEL, "prompt": "\udfff"})), 400,
                  "not valid unicode", param="prompt")
    # A surrogate pair is one character: fine.
    pair = json.dumps({"model": MODEL, "prompt": "\U0001f600", "max_tokens": 1})
    assert "\\ud83d\\ude00" in pair
    assert _post(server, "/v1/completions", pair).status_code == 200
    # Asking for structured output, which is not built, fails instead of returning free text.
    _assert_error(_post(server, "/v1/chat/completions", {**chat, "messages": chat["messages"][:1],
                                                         "response_format": {"type": "json_object"}}),
                  400, "response_format type 'json_object' is not supported", param="response_format")
    _assert_error(_post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "guided_choice": ["a", "b"]}),
                  400, "guided_choice is not supported", param="guided_choice")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    _assert_error(_post(server, "/v1/chat/completions", {**chat, "messages": chat["messages"][:1], "tools": tools,
                                                         "tool_choice": "auto"}),
                  400, "tool_choice 'auto' is not supported", param="tool_choice")
    # What is supported still works: text format, tools in the prompt with tool_choice "none" (vLLM's default).
    for extra in ({"response_format": {"type": "text"}}, {"tools": tools}, {"tools": tools, "tool_choice": "none"}):
        r = client.chat.completions.create(model=MODEL, messages=chat["messages"][:1], max_tokens=1, **extra)
        assert r.usage.completion_tokens == 1


def test_auth_model_and_size_errors(server):
    _assert_error(_post(server, "/v1/completions", {"model": MODEL, "prompt": "hi"}, key=None), 401)
    _assert_error(_post(server, "/v1/completions", {"model": MODEL, "prompt": "hi"}, key="wrong"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    _assert_error(_post(server, "/v1/completions", {"model": "nope", "prompt": "hi"}), 404, "does not exist")
    big = {"model": MODEL, "prompt": "a" * (MAX_BODY + 10)}
    _assert_error(_post(server, "/v1/completions", big), 413)
    # Chunked upload (no content-length) is limited as well.
    def gen():
        yield json.dumps(big).encode()
    chunked = httpx.post(server.url + "/v1/completions", content=gen(), timeout=60,
                         headers={"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
    _assert_error(chunked, 413)
    # Health and metrics need no key.
    assert httpx.get(f"{server.url}/health").status_code == 200


# ---------------------------------------------------------- other endpoints
def test_models_tokenize_detokenize(server, client, llm):
    assert [m.id for m in client.models.list().data] == [MODEL]
    tok = _post(server, "/tokenize", {"model": MODEL, "prompt": "Hello there"}).json()
    assert tok["tokens"] == llm.get_tokenizer().encode("Hello there") and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == MAX_MODEL_LEN and tok["token_strs"] is None
    # vLLM's return_token_strs: the tokenizer's pieces, one per id.
    strs = _post(server, "/tokenize", {"model": MODEL, "prompt": "Hello there", "return_token_strs": True}).json()
    assert strs["tokens"] == tok["tokens"]
    assert strs["token_strs"] == llm.get_tokenizer().convert_ids_to_tokens(tok["tokens"])
    assert len(strs["token_strs"]) == len(tok["tokens"]) > 1
    assert _post(server, "/detokenize", {"model": MODEL, "tokens": tok["tokens"]}).json()["prompt"] == "Hello there"
    # Chat messages through the model's chat template, as a chat request renders them.
    messages = [{"role": "user", "content": "Hello there"}]
    chat = _post(server, "/tokenize", {"model": MODEL, "messages": messages})
    assert chat.status_code == 200, chat.text
    ref = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ref = list(ref["input_ids"]) if hasattr(ref, "keys") else list(ref)
    assert chat.json()["tokens"] == ref and chat.json()["count"] == len(ref)


def test_chat_continue_final_message_and_template_kwargs(server, llm):
    """vLLM's chat fields, on /tokenize and /v1/chat/completions: the same prompt as LLM.chat."""
    conv = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "The answer is"}]
    ref = llm.apply_chat_template(conv, continue_final_message=True)
    tok = _post(server, "/tokenize", {"model": MODEL, "messages": conv, "continue_final_message": True})
    assert tok.status_code == 200, tok.text
    assert tok.json()["tokens"] == ref
    chat = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": conv, "continue_final_message": True,
                                                 "add_generation_prompt": False, "max_tokens": 2,
                                                 "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(ref)
    _assert_error(_post(server, "/v1/chat/completions", {"model": MODEL, "messages": conv,
                                                        "continue_final_message": True, "add_generation_prompt": True}),
                  400, "cannot both be true", param="continue_final_message")
    template = "{% for m in messages %}{{ greeting }}, {{ m['content'] }}|{% endfor %}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template": template,
            "chat_template_kwargs": {"greeting": "HELLO"}}
    ids = _post(server, "/tokenize", body).json()["tokens"]
    assert llm.get_tokenizer().decode(ids) == "HELLO, hi|"
    _assert_error(_post(server, "/v1/chat/completions", {**body, "chat_template_kwargs": {"tokenize": False}}),
                  400, "chat_template_kwargs may not set tokenize", param="chat_template_kwargs")


def test_truncate_prompt_tokens(server, llm):
    """vLLM's truncate_prompt_tokens on completions and chat: the last k prompt tokens, before the
    length checks (a prompt over max_model_len is served); a bad value is a 400 naming the field."""
    long = [3 + (i * 7) % 500 for i in range(MAX_MODEL_LEN + 10)]
    body = {"model": MODEL, "prompt": long, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    _assert_error(_post(server, "/v1/completions", body), 400, param="prompt")
    r = _post(server, "/v1/completions", {**body, "truncate_prompt_tokens": 12, "echo": True})
    assert r.status_code == 200, r.text
    ref = llm.generate(long[-12:], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    choice = r.json()["choices"][0]
    assert r.json()["usage"]["prompt_tokens"] == 12
    assert choice["text"] == llm.get_tokenizer().decode(long[-12:]) + ref.outputs[0].text
    conv = [{"role": "user", "content": "word " * 80}]
    chat = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": conv, "max_tokens": 2,
                                                 "truncate_prompt_tokens": 20})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == 20
    for bad, fragment in ((0, "must be an int >= 1"), (MAX_MODEL_LEN + 1, "is more than max_model_len")):
        _assert_error(_post(server, "/v1/completions", {**body, "truncate_prompt_tokens": bad}), 400, fragment,
                      param="truncate_prompt_tokens")
        _assert_error(_post(server, "/v1/chat/completions", {"model": MODEL, "messages": conv,
                                                            "truncate_prompt_tokens": bad}),
                      400, fragment, param="truncate_prompt_tokens")


def test_generation_config_defaults_fill_unset_fields(tmp_path):
    """As vLLM's --generation-config auto: the model's generation_config.json (temperature 0,
    max_new_tokens 6) fills the fields a request leaves unset (greedy, 6 tokens: the offline
    engine's greedy tokens) and caps max_tokens; a request's own temperature wins."""
    import json as _json

    model = write_tiny_llama(tmp_path / "llama")
    (model / "generation_config.json").write_text(_json.dumps({"eos_token_id": 2, "temperature": 0.0,
                                                                "max_new_tokens": 6}))
    ref = LLM(str(model), **ENGINE_ARGS).generate("Once upon", SamplingParams(temperature=0, max_tokens=6,
                                                                             ignore_eos=True), use_tqdm=False)
    s = ServerProcess(model, "--served-model-name", MODEL)
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0, timeout=60)
        for r in (c.completions.create(model=MODEL, prompt="Once upon", extra_body={"ignore_eos": True}),
                  c.completions.create(model=MODEL, prompt="Once upon", max_tokens=50,
                                       extra_body={"ignore_eos": True})):
            assert r.choices[0].text == ref[0].outputs[0].text and r.usage.completion_tokens == 6
        sampled = {c.completions.create(model=MODEL, prompt="Once upon", temperature=2.0, seed=i,
                                        extra_body={"ignore_eos": True}).choices[0].text for i in range(6)}
        assert len(sampled) > 1  # temperature 2: not the greedy text six times
    finally:
        rc, out = s.stop()
    assert rc == 0, out
    assert "Default sampling parameters from the model's generation config: {'temperature': 0.0, 'max_tokens': 6}" \
        in out


def test_chat_template_flag(tmp_path, model_dir, llm):
    """vLLM's serve --chat-template FILE: chat requests (and /tokenize with messages) that name no
    template use it instead of the tokenizer's; a request's own chat_template still wins. A
    template that does not parse stops the server before the model loads, naming the file."""
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Hello there"}]
    s = ServerProcess(model_dir, "--served-model-name", MODEL, "--chat-template", str(template))
    try:
        got = httpx.post(f"{s.url}/tokenize", json={"model": MODEL, "messages": messages}, timeout=60).json()
        assert got["tokens"] == tok.encode("user: Hello there\nassistant:")
        own = httpx.post(f"{s.url}/tokenize", json={"model": MODEL, "messages": messages,
                                                    "chat_template": "[{{ messages[0].content }}]"}, timeout=60)
        assert own.json()["tokens"] == tok.encode("[Hello there]")
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0, timeout=60)
        r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
        assert r.usage.prompt_tokens == len(got["tokens"])
    finally:
        rc, out = s.stop()
    assert rc == 0, out
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    run = subprocess.run([sys.executable, "-m", "fp8serve.entrypoints.cli", "serve", str(model_dir),
                          "--chat-template", str(bad)], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and f"--chat-template file '{bad}': not a valid Jinja template" in run.stderr
    assert "Loaded" not in run.stderr + run.stdout


def test_ping_and_version(server):
    """vLLM's /ping (GET and POST, as /health) and /version."""
    import fp8serve

    assert httpx.get(f"{server.url}/ping").status_code == 200
    assert httpx.post(f"{server.url}/ping").status_code == 200
    assert httpx.get(f"{server.url}/version").json() == {"version": fp8serve.__version__}


def test_metrics_names(server, client):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("fp8serve:num_requests_running", "fp8serve:num_requests_waiting", "fp8serve:kv_cache_usage_perc",
                 "fp8serve:prompt_tokens_total", "fp8serve:generation_tokens_total", "fp8serve:num_preemptions_total",
                 "fp8serve:time_to_first_token_seconds_bucket", "fp8serve:inter_token_latency_seconds_bucket",
                 "fp8serve:e2e_request_latency_seconds_bucket", "fp8serve:prefix_cache_queries_total",
                 "fp8serve:prefix_cache_hits_total"):
        assert re.search(rf"^{name}\{{", text, re.M), name
    info = re.search(r"^fp8serve:cache_config_info\{(.*)\} 1\.0$", text, re.M).group(1)
    assert 'num_blocks="128"' in info and 'block_size="16"' in info and 'kv_cache_dtype="float32"' in info
    assert 'enable_prefix_caching="False"' in info
    assert _metric(server, "fp8serve:prefix_cache_queries_total") == 0  # off: nothing is looked up
    assert _metric(server, "fp8serve:generation_tokens_total") >= 3


def _scrape(server) -> dict[str, float]:
    """Every series of /metrics by its name and labels as printed (`name{a="x",b="y"}`)."""
    text = httpx.get(f"{server.url}/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+\}?) (\S+)$", text, re.M)}


def _series(name: str, **labels) -> str:
    """A series as prometheus_client prints it: labels sorted by name, model_name among them."""
    labels = sorted({**labels, "model_name": MODEL}.items())
    return f"fp8serve:{name}{{{','.join(f'{k}={chr(34)}{v}{chr(34)}' for k, v in labels)}}}"


def test_metrics_of_finished_requests(server, client, llm):
    """vLLM's per-request metrics, from what the engine did: finish reasons, prompt / generated /
    max_tokens / n histograms, queue, prefill, decode and inference time, and the tokens each
    engine step computed, checked exactly against four known requests (one an n = 2)."""
    series = _series
    prompt = "Metrics count what the engine really did, token by token, request by request."
    _wait_kv_free(server)
    before = _scrape(server)
    a = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    b = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, n=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    p = a.usage.prompt_tokens
    # Greedy again (the offline engine's first token is the server's): that token is made a
    # stop token, so the request finishes "stop" after 1 token.
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True,
                                              "stop_token_ids": [greedy.outputs[0].token_ids[0]]})
    assert c.choices[0].finish_reason == "stop" and c.usage.completion_tokens == 1
    after = _scrape(server)

    def delta(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta(series("request_success_total", finished_reason="length")) == 3
    assert delta(series("request_success_total", finished_reason="stop")) == 1
    assert delta(series("request_success_total", finished_reason="abort")) == 0
    assert delta(series("request_prompt_tokens_count")) == 4
    assert delta(series("request_prompt_tokens_sum")) == 4 * p
    assert delta(series("request_generation_tokens_sum")) == 4 + 3 + 3 + 1
    assert delta(series("request_params_max_tokens_sum")) == 4 + 3 + 3 + 10
    assert (delta(series("request_params_n_count")), delta(series("request_params_n_sum"))) == (3, 4)
    # vLLM's request_max_num_generation_tokens: per request, its longest sample (b: max(3, 3)).
    assert (delta(series("request_max_num_generation_tokens_count")),
            delta(series("request_max_num_generation_tokens_sum"))) == (3, 4 + 3 + 1)
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(series(f"request_{phase}_time_seconds_count")) == 4, phase
    assert delta(series("request_time_per_output_token_seconds_count")) == 3  # c has one token: no gap
    assert delta(series("request_prefill_time_seconds_sum")) + delta(series("request_decode_time_seconds_sum")) \
        == pytest.approx(delta(series("request_inference_time_seconds_sum")), abs=1e-6)
    # Prompt tokens as vLLM counts them (every sample's whole prompt); b's second sample shares
    # the full blocks of 16 before the prompt's last token with its first one.
    shared = (p - 1) // 16 * 16
    assert delta(series("prompt_tokens_total")) == 4 * p
    assert delta(series("prompt_tokens_cached_total")) == shared
    assert delta(series("prompt_tokens_by_source_total", source="local_cache_hit")) == shared
    assert delta(series("prompt_tokens_by_source_total", source="local_compute")) == 4 * p - shared
    # Tokens the steps computed: 4 prompts less the shared part, and one per decoded token
    # (each sample's first token comes from its prefill).
    assert delta(series("iteration_tokens_total_sum")) == 4 * p - shared + 3 + 2 * 2
    assert delta(series("generation_tokens_total")) == 11


def test_metrics_have_every_series_vllm_dashboards_query(server):
    """vLLM creates request_success_total for each of its finish reasons (vllm.v1.engine.FinishReason:
    stop, length, abort, error, repetition) and prompt_tokens_by_source_total for each source
    (local_compute, local_cache_hit, external_kv_transfer) before any request: a dashboard's rate()
    over a series that does not exist is empty, not 0. Before, "error", "repetition" and
    "external_kv_transfer" were missing."""
    scraped = _scrape(server)
    for reason in ("stop", "length", "abort", "error", "repetition"):
        assert _series("request_success_total", finished_reason=reason) in scraped, reason
    for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        assert _series("prompt_tokens_by_source_total", source=source) in scraped, source
    # fp8serve never ends a request for repetition nor loads K/V from elsewhere.
    assert scraped[_series("request_success_total", finished_reason="repetition")] == 0
    assert scraped[_series("prompt_tokens_by_source_total", source="external_kv_transfer")] == 0


def test_max_tokens_zero_is_refused_unless_echo_and_never_counted(server, client):
    """As vLLM: max_tokens 0 is a 400 naming the field (SamplingParams: "max_tokens must be at least 1"),
    except with echo on /v1/completions, where the prompt alone is scored (lm-evaluation-harness);
    chat's max_tokens and max_completion_tokens are each named. The token the engine samples to run
    a prompt-only request is in no response, and in no metric either. Before, max_tokens 0 without
    echo was a 200 with an empty text, and /metrics counted the hidden token as generated."""
    _wait_kv_free(server)
    before = _scrape(server)
    for body in ({"max_tokens": 0}, {"max_tokens": 0, "stream": True}, {"max_tokens": -1},
                 {"max_tokens": -1, "echo": True}):
        err = _assert_error(_post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", **body}), 400,
                            "max_tokens must be at least 1", param="max_tokens")
        assert "echo" in err["message"] and err["type"] == "BadRequestError", err
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for field, value in (("max_tokens", 0), ("max_completion_tokens", 0), ("max_completion_tokens", -3)):
        _assert_error(_post(server, "/v1/chat/completions", {**chat, field: value}), 400,
                      f"{field} must be at least 1, got {value}", param=field)
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert _scrape(server) == before  # nothing ran
    # Prompt-only: 200, the prompt echoed, no completion tokens, and none counted.
    r = client.completions.create(model=MODEL, prompt="score me", max_tokens=0, echo=True, logprobs=1, n=2)
    assert [c.text for c in r.choices] == ["score me"] * 2 and r.usage.completion_tokens == 0
    chunks = list(client.completions.create(model=MODEL, prompt="score me", max_tokens=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "score me"
    after = _scrape(server)

    def delta(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta(_series("generation_tokens_total")) == 0
    assert delta(_series("request_generation_tokens_sum")) == 0
    assert delta(_series("request_generation_tokens_count")) == 3
    assert delta(_series("request_params_max_tokens_sum")) == 0
    assert delta(_series("request_max_num_generation_tokens_sum")) == 0  # the hidden token is no output
    assert delta(_series("request_max_num_generation_tokens_count")) == 2  # the n = 2 request is one
    assert delta(_series("request_success_total", finished_reason="length")) == 3  # as the responses say
    assert delta(_series("prompt_tokens_total")) == 3 * r.usage.prompt_tokens
    # A request with output afterwards counts its tokens as before.
    client.completions.create(model=MODEL, prompt="then generate", max_tokens=2, extra_body={"ignore_eos": True})
    assert _scrape(server)[_series("generation_tokens_total")] - after[_series("generation_tokens_total")] == 2


def _wait_kv_free(server, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while _metric(server, "fp8serve:kv_cache_usage_perc") != 0.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(server, "fp8serve:kv_cache_usage_perc") == 0.0
    assert _metric(server, "fp8serve:num_requests_running") == 0
    assert _metric(server, "fp8serve:num_requests_waiting") == 0


def test_disconnect_mid_stream_frees_kv_blocks(server):
    """Eight streams that each want 100 tokens are dropped after their first
    chunk: they are aborted (far fewer tokens are generated) and every KV
    block is free again."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 100, "stream": True, "ignore_eos": True}
    before = _metric(server, "fp8serve:generation_tokens_total")
    start = _scrape(server)
    with httpx.Client(timeout=60, headers=headers) as http:
        streams = [http.stream("POST", server.url + "/v1/completions", json=body) for _ in range(8)]
        responses = [s.__enter__() for s in streams]
        for r in responses:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line.startswith("data: "))
        for s in streams:
            s.__exit__(None, None, None)
    _wait_kv_free(server)
    assert _metric(server, "fp8serve:generation_tokens_total") - before < 8 * 100
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "story"}], "max_tokens": 60,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=chat, headers=headers, timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    _wait_kv_free(server)
    assert httpx.get(f"{server.url}/health").status_code == 200
    # Each of the nine requests counts once, the dropped ones (at least one: fewer tokens came
    # than asked for) as "abort", vLLM's finished_reason.
    end = _scrape(server)
    reasons = {r: end[k] - start[k] for r in ("abort", "length", "stop")
               for k in [f'fp8serve:request_success_total{{finished_reason="{r}",model_name="{MODEL}"}}']}
    assert reasons["abort"] >= 1 and sum(reasons.values()) == 9, reasons
    # E2E latency too (vLLM's): before, only requests whose finish reached the client were observed.
    e2e = f'fp8serve:e2e_request_latency_seconds_count{{model_name="{MODEL}"}}'
    assert end[e2e] - start[e2e] == 9


def test_disconnect_non_streaming_aborts(server):
    """Eight non-streaming clients, 16 prompts each, give up after 0.1 s:
    their requests are aborted (not even half of the 8 x 16 x 110 tokens are
    generated) and the KV cache is empty again. The 1 MiB cache holds ~16
    such sequences at a time, so all 128 need ~8 waves of 110 decode steps:
    far longer than 0.1 s even on a fast machine. (Eight single prompts, ~1 ms
    steps of the tiny model, once all finished before the clients left.)"""
    from concurrent.futures import ThreadPoolExecutor

    prompts = 16
    body = {"model": MODEL, "prompt": ["Once upon a time"] * prompts, "max_tokens": 110, "ignore_eos": True}
    before = _metric(server, "fp8serve:generation_tokens_total")

    def post() -> bool:
        try:
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.1,
                       headers={"Authorization": f"Bearer {API_KEY}"})
        except httpx.TimeoutException:
            return True
        return False

    with ThreadPoolExecutor(8) as pool:
        timed_out = list(pool.map(lambda _: post(), range(8)))
    assert any(timed_out)
    _wait_kv_free(server)
    assert _metric(server, "fp8serve:kv_cache_usage_perc") == 0.0
    assert _metric(server, "fp8serve:generation_tokens_total") - before < 8 * prompts * 110 // 2


# ------------------------------------------------------------------ chunked prefill
def test_chunked_prefill_server_serves_prompts_longer_than_its_budget(model_dir, llm):
    """`serve --enable-chunked-prefill --max-num-batched-tokens 16 --max-num-seqs 8`: streams and
    echo logprobs over prompts of ~90 tokens (6+ chunks each, next to each other's decodes)
    equal the offline engine's, which prefills them whole."""
    from concurrent.futures import ThreadPoolExecutor

    s = ServerProcess(model_dir, "--enable-chunked-prefill", "--max-num-batched-tokens", "16", "--max-num-seqs", "8",
                      "--served-model-name", MODEL)
    try:
        prompts = [" ".join(f"w{i}x{j}" for j in range(20)) for i in range(4)]
        lens = [len(llm.get_tokenizer().encode(p)) for p in prompts]
        assert min(lens) > 16 * 4 and max(lens) + 8 <= MAX_MODEL_LEN, lens
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0, timeout=120)

        def stream(prompt: str) -> str:
            chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            return "".join(c.choices[0].text for c in chunks)

        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(stream, prompts))
        refs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert texts == [r.outputs[0].text for r in refs]
        r = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=0, echo=True, logprobs=1,
                                      temperature=0)
        ref = llm.generate(prompts[0], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
        got = r.choices[0].logprobs.token_logprobs
        assert got[0] is None and len(got) == len(ref.prompt_token_ids)
        for i in range(1, len(got)):
            assert got[i] == pytest.approx(ref.prompt_logprobs[i][ref.prompt_token_ids[i]].logprob, abs=1e-4)
    finally:
        rc, out = s.stop()
    assert rc == 0, out
    assert "Chunked prefill is enabled with max_num_batched_tokens=16" in out


# ------------------------------------------------------------------ speculative decoding
def test_speculative_decoding_server_streams_what_the_offline_engine_generates(model_dir, llm):
    """`serve --speculative-config '{"method": "ngram", ...}'`: streamed and whole completions and
    their logprobs equal the offline engine's without drafts; a verify pass that keeps drafts
    streams several tokens in one chunk; the spec_decode counters count them."""
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    s = ServerProcess(model_dir, "--speculative-config", spec, "--served-model-name", MODEL)
    try:
        prompts = [" ".join(["la la bim bam"] * 6), " ".join(f"x{i % 3}" for i in range(30))]
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0, timeout=120)
        refs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1),
                            use_tqdm=False)
        num_chunks = 0
        for prompt, ref in zip(prompts, refs):
            chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True}))
            assert "".join(c.choices[0].text for c in chunks) == ref.outputs[0].text
            num_chunks += sum(1 for c in chunks if c.choices and c.choices[0].text)
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=1,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].text == ref.outputs[0].text and r.usage.completion_tokens == 24
            want = [lp[t].logprob for t, lp in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs)]
            assert r.choices[0].logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
        drafted = _metric(s, "fp8serve:spec_decode_num_draft_tokens_total")
        accepted = _metric(s, "fp8serve:spec_decode_num_accepted_tokens_total")
        assert _metric(s, "fp8serve:spec_decode_num_drafts_total") > 0 and 0 < accepted <= drafted
        # Each request ran twice (stream, then whole) with the same drafts: half the kept ones were streamed.
        assert num_chunks <= 2 * 24 - accepted / 2
    finally:
        rc, out = s.stop()
    assert rc == 0, out
    assert "Speculative decoding: ngram, up to 4 draft tokens per step" in out


# ------------------------------------------------------------------ shutdown
def test_drain_timeout_aborts_requests_and_ends_every_response(model_dir):
    """SIGTERM with --shutdown-timeout 0 and ~7 s of queued work (60+ of 80 streams of 110 tokens
    waiting, one runs at a time): the requests still running are aborted at once, each stream ends
    with a finish_reason and `data: [DONE]` (or, arriving after the signal, a 503 error event), each
    whole response is a 200 JSON with its choice, and the process exits 0 within seconds. Before, the engine kept generating until uvicorn's own 5 s limit cancelled
    the handlers: streams cut without [DONE], bare 500s, CancelledError tracebacks."""
    from concurrent.futures import ThreadPoolExecutor

    s = ServerProcess(model_dir, "--max-num-seqs", "1", "--shutdown-timeout", "0", "--served-model-name", MODEL)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 110, "ignore_eos": True}
    first_chunk = __import__("threading").Event()

    def stream(_) -> list[str]:
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line.removeprefix("data: "))
                    first_chunk.set()
            return lines

    def whole(_) -> httpx.Response:
        return httpx.post(s.url + "/v1/completions", json=body, timeout=60)

    try:
        with ThreadPoolExecutor(84) as pool:
            streams = [pool.submit(stream, i) for i in range(80)]
            wholes = [pool.submit(whole, i) for i in range(4)]
            assert first_chunk.wait(60)
            deadline = time.monotonic() + 30
            # Requests arrive one by one (one tokenizer thread) while the first ones run: signal once 60
            # wait (~7 s of work, past uvicorn's 5 s); later arrivals may get a 503.
            while _metric(s, "fp8serve:num_requests_waiting") < 60 and time.monotonic() < deadline:
                time.sleep(0.05)
            t0 = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            out, _ = s.proc.communicate(timeout=60)  # not s.stop(): a second SIGTERM would force the exit
            rc, exit_s = s.proc.returncode, time.monotonic() - t0
            stream_lines = [f.result() for f in streams]
            responses = [f.result() for f in wholes]
    finally:
        s.stop()
    assert rc == 0 and "drain timeout" in out and "Traceback" not in out, out
    assert exit_s < 4.5, exit_s  # uvicorn's own limit (5 s) never had to cancel a handler
    reasons = []
    for lines in stream_lines:
        assert lines and lines[-1] == "[DONE]", lines[-3:]
        last = json.loads(lines[-2])
        if "error" in last:
            assert last["error"]["code"] == 503 and len(lines) == 2, lines
            continue
        reasons.append(last["choices"][0]["finish_reason"])
    for r in responses:
        assert r.status_code in (200, 503) and r.headers["content-type"] == "application/json", r.text
        if r.status_code == 200:
            reasons.append(r.json()["choices"][0]["finish_reason"])
    assert set(reasons) <= {"length", "abort"} and reasons.count("abort") >= 60, reasons


def test_chat_max_completion_tokens_wins_over_the_deprecated_max_tokens(server, client):
    """As vLLM: with max_completion_tokens sent, max_tokens (deprecated) is not used, so a stale
    max_tokens 0 next to it is no error; the over-context error names the field that was sent."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    r = _post(server, "/v1/chat/completions", {**chat, "max_completion_tokens": 2, "max_tokens": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    for field in ("max_completion_tokens", "max_tokens"):
        _assert_error(_post(server, "/v1/chat/completions", {**chat, field: MAX_MODEL_LEN}), 400,
                      f"Please reduce the prompt or {field}.", param=field)


def test_several_served_model_names(model_dir):
    """vLLM's --served-model-name A B: requests may name either and get that name back; /v1/models
    lists both; the metrics carry the first; any other name is a 404."""
    s = ServerProcess(model_dir, "--served-model-name", "main-name", "alias")
    try:
        models = httpx.get(f"{s.url}/v1/models", timeout=60).json()["data"]
        assert [m["id"] for m in models] == ["main-name", "alias"]
        assert all(m["max_model_len"] == MAX_MODEL_LEN for m in models)
        for name in ("main-name", "alias"):
            r = httpx.post(f"{s.url}/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2},
                           timeout=60)
            assert r.status_code == 200 and r.json()["model"] == name, r.text
        chat = httpx.post(f"{s.url}/v1/chat/completions", timeout=60,
                          json={"model": "alias", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.json()["model"] == "alias"
        unnamed = httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert unnamed.json()["model"] == "main-name"
        _assert_error(httpx.post(f"{s.url}/v1/completions", json={"model": "other", "prompt": "hi"}, timeout=60),
                      404, "The model `other` does not exist", param="model")
        metrics = httpx.get(f"{s.url}/metrics", timeout=60).text
        assert 'model_name="main-name"' in metrics and 'model_name="alias"' not in metrics
    finally:
        rc, out = s.stop()
    assert rc == 0, out
    assert "(model names 'main-name', 'alias')" in out
