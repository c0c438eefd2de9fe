"""The offline `LLM` API: prompt forms, output order, chat, logprobs, stopping, seeds, and the
errors a user gets for bad input. Numbers are checked against transformers in float64."""

from __future__ import annotations

import shutil

import pytest
import torch

from checkpoints import (
    CHATML_TEMPLATE,
    DELETE,
    load_hf_model,
    make_bin_only_checkpoint,
    read_config,
    rewrite_config,
    write_tiny_llama,
)
from fp8serve.entrypoints.llm import LLM
from fp8serve.errors import ConfigError, UserError
from fp8serve.sampling_params import SamplingParams

KV_CACHE_MEMORY = 1 << 20
MAX_MODEL_LEN = 64
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("llm") / "llama")


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", kv_cache_memory=KV_CACHE_MEMORY, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    return load_hf_model(llama_dir, torch.float64)


@pytest.fixture
def copy_of(llama_dir, tmp_path):
    """A scratch copy of the tiny checkpoint whose config.json a test may break."""
    def make():
        d = tmp_path / "copy"
        shutil.copytree(llama_dir, d)
        return d
    return make


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_log_softmax(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(input_ids=torch.tensor([ids]), use_cache=False).logits[0], dim=-1)


# ---------------------------------------------------------------------------------- prompt forms
def test_outputs_come_back_in_input_order(llm):
    # The first prompt finishes last and the last first, so completion order is reversed.
    prompts = [{"prompt_token_ids": _ids(n, seed=n)} for n in (4, 9, 2, 13)]
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in (12, 8, 5, 1)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 8, 5, 1]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert len({o.request_id for o in outs}) == 4


def test_text_token_id_and_mixed_prompts_agree(llm):
    tok = llm.get_tokenizer()
    texts = ["The quick brown fox", "Once upon a time there was"]
    ids = [tok.encode(t) for t in texts]
    params = SamplingParams(max_tokens=6, **GREEDY)

    by_text = llm.generate(texts, params, use_tqdm=False)
    by_ids = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    mixed = llm.generate([texts[0], {"prompt_token_ids": ids[1]}], params, use_tqdm=False)
    single = llm.generate(texts[1], params, use_tqdm=False)

    assert [o.prompt_token_ids for o in by_text] == ids
    assert [o.prompt for o in by_text] == texts and by_ids[0].prompt is None
    assert [o.prompt_token_ids for o in mixed] == ids
    expected = [o.outputs[0].token_ids for o in by_ids]
    assert [o.outputs[0].token_ids for o in by_text] == expected
    assert [o.outputs[0].token_ids for o in mixed] == expected
    assert len(single) == 1 and single[0].outputs[0].token_ids == expected[1]
    assert by_text[0].outputs[0].text == tok.decode(expected[0])


def test_chat_uses_the_chat_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Hello! How are you today?"}]
    outs = llm.chat(messages, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    # ChatML with the default system turn, rendered by hand rather than by the same call.
    rendered = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                "<|im_start|>user\nHello! How are you today?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.chat_template == CHATML_TEMPLATE
    assert outs[0].prompt_token_ids == tok.encode(rendered)
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"]) if hasattr(expected, "keys") else list(expected)
    assert outs[0].prompt_token_ids == expected
    assert outs[0].prompt_token_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")

    # A list of conversations gives one output each, in order.
    other = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    two = llm.chat([messages, other], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    assert two[0].prompt_token_ids == expected
    assert two[1].prompt_token_ids == tok.encode(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


# ------------------------------------------------------------------------------------ logprobs
def test_prompt_logprobs_match_transformers(llm, hf_model):
    prompt = _ids(11, seed=4)
    k = 3
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=k, **GREEDY),
                       use_tqdm=False)[0]
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    ref = _hf_log_softmax(hf_model, prompt)  # row i predicts token i + 1
    for i, entry in enumerate(plp[1:], start=1):
        assert isinstance(entry, dict) and prompt[i] in entry
        assert k <= len(entry) <= k + 1  # the top k, plus the prompt token if it is not among them
        for token, lp in entry.items():
            assert abs(lp.logprob - ref[i - 1, token].item()) <= 1e-3, (i, token)
        # The top-k listed are the reference's top k (their logprobs, so float ties cannot matter).
        top_ref = ref[i - 1].topk(k).values
        top_ours = sorted((lp.logprob for t, lp in entry.items() if lp.rank <= k), reverse=True)[:k]
        assert torch.allclose(torch.tensor(top_ours, dtype=torch.float64), top_ref, atol=1e-3)
        assert entry[prompt[i]].rank == int((ref[i - 1] > ref[i - 1, prompt[i]]).sum()) + 1


def test_prompt_logprobs_of_a_one_token_prompt(llm):
    """One entry per prompt token for every prompt length: [None] for a
    one-token prompt (its only token has no context), also per sample of n > 1
    (a randomized run of engine features at stop 50 got None)."""
    for n in (1, 2):
        out = llm.generate({"prompt_token_ids": [7]}, SamplingParams(max_tokens=2, prompt_logprobs=2, n=n, **GREEDY),
                           use_tqdm=False)[0]
        assert out.prompt_logprobs == [None] and len(out.outputs) == n
    out = llm.generate({"prompt_token_ids": [7]}, SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)[0]
    assert out.prompt_logprobs is None  # not asked for


def test_logprobs_per_generated_token(llm, hf_model):
    prompt = _ids(6, seed=5)
    n = 4
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=7, logprobs=n, **GREEDY),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 7
    ref = _hf_log_softmax(hf_model, prompt + out.token_ids[:-1])[len(prompt) - 1:]
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        assert n <= len(entry) <= n + 1
        for t, lp in entry.items():
            assert abs(lp.logprob - ref[step, t].item()) <= 1e-3
        assert sorted(lp.rank for lp in entry.values()) == list(range(1, len(entry) + 1))
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))

    # logprobs=0: only the sampled token; no logprobs asked: None.
    zero = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=3, logprobs=0, **GREEDY),
                        use_tqdm=False)[0].outputs[0]
    assert [list(e) for e in zero.logprobs] == [[t] for t in zero.token_ids]
    none = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)[0]
    assert none.outputs[0].logprobs is None and none.prompt_logprobs is None


# ------------------------------------------------------------------------------------- stopping
@pytest.fixture(scope="module")
def baseline(llm):
    """A greedy continuation long enough to pick stop strings and tokens from."""
    prompt = llm.get_tokenizer().encode("The weather was cold and rainy, so we")
    out = llm.generate(prompt, SamplingParams(max_tokens=20, **GREEDY), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 20
    return prompt, out


def test_max_tokens_finishes_with_length(baseline):
    _, out = baseline
    assert out.finish_reason == "length" and out.stop_reason is None


def test_stop_token_ids(llm, baseline):
    prompt, base = baseline
    # The first token at index >= 3 that did not occur earlier in the output.
    i = next(j for j in range(3, len(base.token_ids)) if base.token_ids[j] not in base.token_ids[:j])
    stop_token = base.token_ids[i]
    out = llm.generate(prompt, SamplingParams(max_tokens=20, stop_token_ids=[stop_token], **GREEDY),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token
    assert out.token_ids == base.token_ids[: i + 1]
    # As vLLM: the stop token's text is left out of the output, unless asked for.
    tok = llm.get_tokenizer()
    assert out.text == tok.decode(base.token_ids[:i], skip_special_tokens=True)
    assert tok.decode(base.token_ids[: i + 1], skip_special_tokens=True) != out.text, "pick a token with text"
    kept = llm.generate(prompt, SamplingParams(max_tokens=20, stop_token_ids=[stop_token],
                                               include_stop_str_in_output=True, **GREEDY),
                        use_tqdm=False)[0].outputs[0]
    assert kept.token_ids == out.token_ids
    assert kept.text == tok.decode(base.token_ids[: i + 1], skip_special_tokens=True)


def test_eos_text_is_left_out_even_when_special_tokens_are_kept(llm, baseline):
    """An EOS the model samples ends the output; its text (e.g. "</s>") is not part of it
    with skip_special_tokens=False either, as in vLLM, unless include_stop_str_in_output."""
    prompt, base = baseline
    eos = llm.llm_engine.eos_token_ids[0]
    # Bias the EOS in so that greedy picks it at the first step.
    params = dict(max_tokens=5, temperature=0.0, logit_bias={eos: 100}, skip_special_tokens=False)
    out = llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.stop_reason is None
    assert out.text == ""
    kept = llm.generate(prompt, SamplingParams(include_stop_str_in_output=True, **params),
                        use_tqdm=False)[0].outputs[0]
    assert kept.token_ids == [eos]
    assert kept.text == llm.get_tokenizer().decode([eos], skip_special_tokens=False) != ""


def test_stop_strings(llm, baseline):
    prompt, base = baseline
    text = base.text
    start = len(text) // 2
    stop = text[start: start + 3]
    assert stop.strip() and text.find(stop) == start, "pick a stop string that occurs once"
    out = llm.generate(prompt, SamplingParams(max_tokens=20, stop=[stop, "never appears"], **GREEDY),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:start]
    assert len(out.token_ids) < len(base.token_ids) and out.token_ids == base.token_ids[: len(out.token_ids)]
    kept = llm.generate(prompt, SamplingParams(max_tokens=20, stop=stop, include_stop_str_in_output=True, **GREEDY),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: start + len(stop)]


# ---------------------------------------------------------------------------------------- seeds
def test_seed_makes_sampling_reproducible(llm):
    prompt = {"prompt_token_ids": _ids(5, seed=6)}
    other = {"prompt_token_ids": _ids(9, seed=7)}

    def sample(seed, batch):
        params = SamplingParams(temperature=1.0, max_tokens=16, seed=seed, ignore_eos=True)
        return llm.generate(batch, params, use_tqdm=False)[0].outputs[0].token_ids

    first = sample(123, [prompt])
    assert sample(123, [prompt]) == first
    assert sample(123, [prompt, other]) == first  # the batch's other rows do not matter
    assert sample(124, [prompt]) != first
    # Not a greedy run in disguise.
    greedy = llm.generate(prompt, SamplingParams(max_tokens=16, **GREEDY), use_tqdm=False)[0]
    assert first != greedy.outputs[0].token_ids


# --------------------------------------------------------------------------------------- errors
def test_missing_model_path():
    with pytest.raises(ConfigError, match="/no/such/model/dir.*does not exist"):
        LLM("/no/such/model/dir", dtype="float32")


def test_config_without_hidden_size(copy_of):
    d = copy_of()
    rewrite_config(d, hidden_size=DELETE)
    with pytest.raises(ConfigError, match=r"config\.json.*'hidden_size' is missing"):
        LLM(str(d), dtype="float32")


def test_unsupported_architecture(copy_of):
    d = copy_of()
    rewrite_config(d, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ConfigError, match="GPT2LMHeadModel.*not supported.*LlamaForCausalLM"):
        LLM(str(d), dtype="float32")


def test_bin_only_checkpoint(tmp_path):
    d = make_bin_only_checkpoint(tmp_path / "bin")
    # The factory writes config.json with `config.save_pretrained`, which leaves out `architectures`
    # (only `model.save_pretrained` fills it in); without it the weights are never looked at.
    if not read_config(d).get("architectures"):
        rewrite_config(d, architectures=["LlamaForCausalLM"])
    with pytest.raises(ConfigError, match=r"pytorch_model\.bin.*safetensors"):
        LLM(str(d), dtype="float32", kv_cache_memory=KV_CACHE_MEMORY)


def test_prompt_longer_than_max_model_len(llm):
    too_long = {"prompt_token_ids": _ids(MAX_MODEL_LEN + 1, seed=8)}
    ok = {"prompt_token_ids": _ids(4, seed=9)}
    with pytest.raises(UserError, match=f"{MAX_MODEL_LEN + 1} tokens.*max-model-len {MAX_MODEL_LEN}"):
        llm.generate([ok, too_long], SamplingParams(max_tokens=2), use_tqdm=False)
    # Nothing was queued: the engine is idle and still serves the next call.
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate(ok, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_text_that_is_not_unicode_is_the_callers_error(llm):
    """A lone UTF-16 surrogate (what JSON's "\\ud83d" decodes to) cannot be
    encoded: the prompt or message naming it, before anything is queued."""
    ok = {"prompt_token_ids": _ids(4, seed=10)}
    with pytest.raises(UserError, match=r"prompt is not valid Unicode text: a lone UTF-16 surrogate at character 3"):
        llm.generate([ok, "abc\ud83d"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(UserError, match=r"messages\[1\]\.content is not valid Unicode"):
        llm.chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\udfff"}], use_tqdm=False)
    # Characters past the BMP are fine (in JSON, the surrogate pair "\\ud83d\\ude00" decodes to this one).
    assert llm.generate("\U0001f600", SamplingParams(max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1), "temperature must be non-negative, got -1"),
    (dict(top_p=0), r"top_p must be in \(0, 1\], got 0"),
    (dict(top_k=-2), "top_k .* got -2"),
    (dict(max_tokens=0), "max_tokens must be at least 1, got 0"),
    (dict(logprobs=-1), "logprobs must be a non-negative int or None, got -1"),
])
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_count_must_match_prompts(llm):
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate([[5], [6], [7]], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_bad_sampling_params_leave_nothing_queued(llm):
    """One bad SamplingParams in a batch fails the call before any request is queued (before:
    the ones ahead of it stayed in the engine and ran, unseen, inside the next call)."""
    ok = SamplingParams(max_tokens=None, ignore_eos=True)
    with pytest.raises(ValueError, match=r"prompt 1: logit_bias: token id\(s\) \[1000000\] out of range"):
        llm.generate([[5], [6], [7]], [ok, SamplingParams(logit_bias={10**6: 1.0}), ok], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    changed = SamplingParams(max_tokens=3)
    changed.n = 0
    with pytest.raises(ValueError, match="prompt 1: n must be an int"):
        llm.generate([[5], [6]], [ok, changed], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests() and not llm.llm_engine.parents
    for bad in ({"max_tokens": 3}, [{"max_tokens": 3}], [SamplingParams(), None]):
        with pytest.raises(ValueError, match=r"sampling_params(\[\d\])? must be a SamplingParams"):
            llm.generate([[5]] * (2 if isinstance(bad, list) and len(bad) == 2 else 1), bad, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([[5]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4


def test_prompt_errors_are_value_errors_naming_the_prompt(llm):
    """As vLLM raises ValueError for these (and the batch position is named)."""
    with pytest.raises(ValueError, match="prompt 1: prompt token id -1 is out of range"):
        llm.generate([[5], [-1]], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt_token_ids must be a list of Python ints, got a list holding "
                                         r"Tensor .*\.tolist\(\)"):
        llm.generate({"prompt_token_ids": list(torch.tensor([5, 6]))}, use_tqdm=False)
    with pytest.raises(ValueError, match="'prompt' must be a string, got NoneType"):
        llm.generate({"prompt": None}, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("messages, words", [
    ({"role": "user", "content": "Hi"}, "messages must be a conversation"),
    ("Hi", "messages must be a conversation"),
    ([], "messages must be a conversation"),
    ([{"content": "Hi"}], r"messages\[0\]\.role must be a non-empty string"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\.content must be a string or a list of content parts"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], r"part type 'image_url' is not supported"),
    ([[{"role": "user", "content": "ok"}], [{"role": "user", "content": [{"type": "text", "text": None}]}]],
     r"messages\[1\]\[0\]\.content\[0\]\.text must be a string"),
])
def test_malformed_chat_messages_name_the_message(llm, messages, words):
    with pytest.raises(ValueError, match=words):
        llm.chat(messages, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_chat_text_parts_and_template_errors(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                          {"type": "text", "text": "of France?"}]}]
    plain = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert llm.chat(parts, params, use_tqdm=False)[0].outputs[0].token_ids == \
        llm.chat(plain, params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="chat template failed on messages: TemplateSyntaxError"):
        llm.chat(plain, params, use_tqdm=False, chat_template="{% for %}")


def test_kv_cache_too_small_for_one_request(llama_dir):
    # One 64-token request needs 4 blocks of 8 KiB (2 kv heads x 16 dims x 2 layers x K/V x fp32).
    with pytest.raises(ConfigError) as info:
        LLM(str(llama_dir), dtype="float32", kv_cache_memory=3 * 8192, max_model_len=64)
    message = str(info.value)
    assert "holds 3 blocks" in message and "needs 4 blocks" in message
    assert "raise --kv-cache-memory" in message and "lower --max-model-len" in message
    # The advice is right: the size it names is enough.
    LLM(str(llama_dir), dtype="float32", kv_cache_memory=4 * 8192, max_model_len=64)


# ---------------------------------------------------------------------------- the default model
def test_default_model_knows_the_capital_of_france():
    llm = LLM()
    out = llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=8),
                       use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text, out.text


def test_cpu_prefill_in_token_groups_matches_transformers(llm, hf_model, monkeypatch):
    """A prefill bigger than PREFILL_TOKENS_PER_FORWARD runs as several forward
    passes over groups of whole sequences (one prompt longer than the limit
    is a group of its own): prompt logprobs and greedy outputs equal
    transformers' and the one-pass run's."""
    from fp8serve.engine import model_runner

    prompts = [_ids(n, seed=40 + n) for n in (9, 14, 5, 21, 3)]
    sp = SamplingParams(max_tokens=4, prompt_logprobs=1, **GREEDY)
    one_pass = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    groups = []
    real = model_runner.ModelRunner._prefill_groups
    monkeypatch.setattr(model_runner, "PREFILL_TOKENS_PER_FORWARD", 16)
    monkeypatch.setattr(model_runner.ModelRunner, "_prefill_groups",
                        lambda self, *args: groups.append(g := real(self, *args)) or g)
    grouped = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    # All five prompts are one scheduled prefill step; 9+14, 14+5 and 5+21 exceed 16.
    assert [[s.num_prompt_tokens for s in g] for g, _ in groups[0]] == [[9], [14], [5], [21], [3]]
    assert [n for _, n in groups[0]] == [[9], [14], [5], [21], [3]]
    for a, b, p in zip(one_pass, grouped, prompts):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        ref = _hf_log_softmax(hf_model, p)
        for i, (ea, eb) in enumerate(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]), start=1):
            assert abs(eb[p[i]].logprob - ref[i - 1, p[i]].item()) <= 1e-3
            assert abs(ea[p[i]].logprob - eb[p[i]].logprob) <= 1e-4


def test_n_samples_per_prompt_in_input_order(llm):
    """SamplingParams(n=3): each RequestOutput holds three completions (index 0-2); with a seed
    they are reproducible and, sampled at temperature 1, not all the same."""
    sp = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    prompts = [_ids(7, seed=1), _ids(12, seed=2)]
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for out, p in zip(first, prompts):
        assert out.prompt_token_ids == p and [c.index for c in out.outputs] == [0, 1, 2]
        assert all(len(c.token_ids) == 6 for c in out.outputs)
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert [[c.token_ids for c in o.outputs] for o in first] == [[c.token_ids for c in o.outputs] for o in again]


def test_max_logprobs_bounds_requests(llm, llama_dir):
    """vLLM's max_logprobs (--max-logprobs): 20 by default, any count up to the vocabulary (-1) when
    raised; a request over it is refused when added, naming the flag, and leaves nothing queued."""
    with pytest.raises(ValueError, match=r"logprobs: requested 21 per position, more than max_logprobs 20 "
                                         r"\(set by --max-logprobs\)"):
        llm.generate([5, 6, 7], SamplingParams(max_tokens=2, logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs: requested 21"):
        llm.generate([5, 6, 7], SamplingParams(max_tokens=2, prompt_logprobs=21), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()

    wide = LLM(str(llama_dir), dtype="float32", kv_cache_memory=KV_CACHE_MEMORY, max_model_len=MAX_MODEL_LEN,
               max_logprobs=30)
    out = wide.generate([5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0, logprobs=25, prompt_logprobs=30),
                        use_tqdm=False)[0]
    c = out.outputs[0]
    for token, entry in zip(c.token_ids, c.logprobs):
        ranked = sorted((lp.rank, lp.logprob) for lp in entry.values())
        assert [r for r, _ in ranked][:25] == list(range(1, 26))  # the top 25, and the sampled token (rank 1 here)
        assert all(a[1] >= b[1] for a, b in zip(ranked, ranked[1:]))
        assert entry[token].rank == 1
    # Per prompt position the top 30, and the prompt's own token where it is not among them.
    assert len(out.prompt_logprobs) == 4 and out.prompt_logprobs[0] is None
    assert all(len(d) in (30, 31) and tok in d for d, tok in zip(out.prompt_logprobs[1:], [6, 7, 8]))
    with pytest.raises(ValueError, match="logprobs: requested 31 per position, more than max_logprobs 30"):
        wide.generate([5], SamplingParams(logprobs=31), use_tqdm=False)

    # -1: the whole vocabulary (512).
    whole = LLM(str(llama_dir), dtype="float32", kv_cache_memory=KV_CACHE_MEMORY, max_model_len=MAX_MODEL_LEN,
                max_logprobs=-1)
    assert whole.llm_engine.config.model_config.max_logprobs == 512
    entry = whole.generate([5, 6], SamplingParams(max_tokens=1, logprobs=512), use_tqdm=False)[0].outputs[0].logprobs[0]
    assert len(entry) == 512
    total = torch.logsumexp(torch.tensor([lp.logprob for lp in entry.values()], dtype=torch.float64), 0)
    assert abs(float(total)) < 1e-4  # the whole distribution


@pytest.mark.parametrize("value", [-2, "5", True, 2.5])
def test_max_logprobs_must_be_a_count(llama_dir, value):
    with pytest.raises(ConfigError, match=f"--max-logprobs must be an integer >= 0, or -1 .* got {value!r}"):
        LLM(str(llama_dir), dtype="float32", kv_cache_memory=KV_CACHE_MEMORY, max_logprobs=value)


def test_continue_final_message_and_chat_template_kwargs(llm):
    """vLLM's chat options: continue_final_message leaves the last (assistant) message open, with no
    end-of-turn marker or new turn after it; chat_template_kwargs are extra template variables."""
    tok = llm.get_tokenizer()
    conv = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "The answer is"}]
    open_ids = llm.apply_chat_template(conv, continue_final_message=True)
    assert tok.decode(open_ids).endswith("<|im_start|>assistant\nThe answer is")
    closed = tok.decode(llm.apply_chat_template(conv))
    assert closed.endswith("The answer is<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(llm.apply_chat_template(conv, add_generation_prompt=False)).endswith("The answer is<|im_end|>\n")
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt cannot both be true"):
        llm.apply_chat_template(conv, add_generation_prompt=True, continue_final_message=True)
    # LLM.chat generates from the open message.
    out = llm.chat(conv, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False,
                   continue_final_message=True)[0]
    assert out.prompt_token_ids == open_ids and len(out.outputs[0].token_ids) == 3

    template = "{% for m in messages %}{{ greeting }}, {{ m['content'] }}|{% endfor %}"
    ids = llm.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template,
                                  chat_template_kwargs={"greeting": "HELLO"})
    assert tok.decode(ids) == "HELLO, hi|"
    with pytest.raises(ValueError, match="chat_template_kwargs may not set add_generation_prompt, tokenize: use"):
        llm.apply_chat_template(conv, chat_template_kwargs={"tokenize": False, "add_generation_prompt": False})
    with pytest.raises(ValueError, match="chat_template_kwargs must be an object of template variables, got list"):
        llm.apply_chat_template(conv, chat_template_kwargs=["greeting"])


def test_truncate_prompt_tokens_keeps_the_prompts_end(llm):
    """vLLM's truncate_prompt_tokens: a prompt longer than max_model_len (64) runs on its last k
    tokens, exactly as those tokens alone would; the text is dropped only when tokens were cut."""
    long = [3 + (i * 7) % 500 for i in range(MAX_MODEL_LEN + 16)]
    greedy = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
    with pytest.raises(ValueError, match="more than --max-model-len 64"):
        llm.generate(long, SamplingParams(**greedy), use_tqdm=False)
    cut = llm.generate(long, SamplingParams(**greedy, truncate_prompt_tokens=10), use_tqdm=False)[0]
    alone = llm.generate(long[-10:], SamplingParams(**greedy), use_tqdm=False)[0]
    assert cut.prompt_token_ids == long[-10:]
    assert cut.outputs[0].token_ids == alone.outputs[0].token_ids
    whole = llm.generate(long, SamplingParams(**greedy, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert whole.prompt_token_ids == long[-MAX_MODEL_LEN:] and len(whole.prompt_token_ids) == MAX_MODEL_LEN
    text = "The quick brown fox"
    kept = llm.generate(text, SamplingParams(**greedy, truncate_prompt_tokens=MAX_MODEL_LEN), use_tqdm=False)[0]
    assert kept.prompt == text
    short = llm.generate(text, SamplingParams(**greedy, truncate_prompt_tokens=2), use_tqdm=False)[0]
    assert short.prompt is None and len(short.prompt_token_ids) == 2
    with pytest.raises(ValueError, match="truncate_prompt_tokens 65 is more than max_model_len 64"):
        llm.generate(long, SamplingParams(**greedy, truncate_prompt_tokens=65), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
