"""`fp8serve bench throughput` and `bench latency` on a tiny checkpoint: what they print and write
is what the engine ran (token counts checked against the outputs of the real LLM.generate calls),
and bad input is refused in one line before the weights load."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from checkpoints import read_config, write_tiny_llama
from cli_runs import run_main

from fp8serve.entrypoints.llm import LLM


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("offline") / "llama"))


def bench(kind: str, model: str, *extra: str) -> list[str]:
    return ["--log-level", "WARNING", "bench", kind, "--model", model, "--dtype", "float32",
            "--kv-cache-memory", "4MiB", *extra]


@pytest.fixture
def generate_calls(monkeypatch):
    """Every LLM.generate call's outputs: the real call, recorded."""
    calls = []
    real = LLM.generate

    def spy(self, prompts, sampling_params=None, use_tqdm=True):
        outputs = real(self, prompts, sampling_params, use_tqdm)
        calls.append(outputs)
        return outputs

    monkeypatch.setattr(LLM, "generate", spy)
    return calls


def _throughput_line(out: str) -> tuple[float, float, float]:
    m = re.search(r"^Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s$", out, re.M)
    assert m, out
    return tuple(float(x) for x in m.groups())


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_throughput_random_counts_what_ran(model_dir, tmp_path, capsys, generate_calls, kv, seed):
    out_json = tmp_path / "tp.json"
    argv = bench("throughput", model_dir, "--kv-cache-dtype", kv, "--num-prompts", "6", "--input-len", "20",
                 "--output-len", "7", "--seed", str(seed % 1000), "--output-json", str(out_json))
    rc, out, err = run_main(argv, capsys)
    assert rc == 0, err
    (outputs,) = generate_calls
    assert len(outputs) == 6
    assert all(len(o.prompt_token_ids) == 20 and len(o.outputs[0].token_ids) == 7 for o in outputs)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    r = json.loads(out_json.read_text())
    assert r["num_requests"] == 6
    assert (r["total_num_prompt_tokens"], r["total_num_output_tokens"], r["total_num_tokens"]) == (120, 42, 162)
    assert r["tokens_per_second"] == pytest.approx(162 / r["elapsed_time"])
    assert r["requests_per_second"] == pytest.approx(6 / r["elapsed_time"])
    assert r["output_tokens_per_second"] == pytest.approx(42 / r["elapsed_time"])
    assert _throughput_line(out) == pytest.approx(
        (r["requests_per_second"], r["tokens_per_second"], r["output_tokens_per_second"]), abs=0.006)
    assert "Total num prompt tokens:  120" in out and "Total num output tokens:  42" in out
    assert r["dataset_name"] == "random"
    assert r["config"]["kv_cache_dtype"] == ("fp8_e4m3" if kv == "fp8" else "float32")
    assert r["config"]["num_blocks"] > 0 and r["config"]["max_model_len"] == 256


def test_throughput_prefix_range_ratio_and_n(model_dir, tmp_path, capsys, generate_calls):
    out_json = tmp_path / "tp.json"
    argv = bench("throughput", model_dir, "--num-prompts", "12", "--input-len", "40", "--output-len", "6",
                 "--random-range-ratio", "0.5", "--random-prefix-len", "5", "--n", "2", "--output-json",
                 str(out_json))
    rc, out, err = run_main(argv, capsys)
    assert rc == 0, err
    (outputs,) = generate_calls
    prompt_lens = [len(o.prompt_token_ids) for o in outputs]
    assert all(5 + 20 <= n <= 5 + 60 for n in prompt_lens) and len(set(prompt_lens)) > 1
    assert len({tuple(o.prompt_token_ids[:5]) for o in outputs}) == 1
    assert all(len(o.outputs) == 2 and 3 <= len(o.outputs[0].token_ids) <= 9 for o in outputs)
    r = json.loads(out_json.read_text())
    assert r["total_num_prompt_tokens"] == sum(prompt_lens)
    assert r["total_num_output_tokens"] == sum(len(c.token_ids) for o in outputs for c in o.outputs)
    assert r["n"] == 2


def test_throughput_sharegpt(model_dir, tmp_path, capsys, caplog, generate_calls):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    word = " the"
    convs = [{"conversations": [{"from": "human", "value": word * (5 + i)}, {"from": "gpt", "value": word * (4 + i)}]}
             for i in range(5)]
    convs.append({"conversations": [{"from": "human", "value": "hi"}]})  # one turn: skipped
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    out_json = tmp_path / "tp.json"
    rc, out, err = run_main(bench("throughput", model_dir, "--dataset-path", str(path), "--output-json",
                                  str(out_json)), capsys)
    assert rc == 0, err
    assert "5 conversations pass the filter, fewer than --num-prompts 64" in caplog.text
    (outputs,) = generate_calls
    expected = sorted((len(tok.encode(c["conversations"][0]["value"])), len(tok.encode(c["conversations"][1]["value"],
                       add_special_tokens=False))) for c in convs[:5])
    assert sorted((len(o.prompt_token_ids), len(o.outputs[0].token_ids)) for o in outputs) == expected
    r = json.loads(out_json.read_text())
    assert r["dataset_name"] == "sharegpt" and r["num_requests"] == 5
    # --output-len overrides the replies' lengths.
    rc, _, err = run_main(bench("throughput", model_dir, "--dataset-name", "sharegpt", "--dataset-path", str(path),
                                "--output-len", "3"), capsys)
    assert rc == 0, err
    assert {len(o.outputs[0].token_ids) for o in generate_calls[1]} == {3}


@pytest.mark.parametrize("extra, message", [
    (["--dataset-name", "sharegpt"], "--dataset-name sharegpt needs --dataset-path FILE"),
    (["--dataset-path", "{missing}"], "no such file"),
    (["--dataset-path", "{bad}"], "expected a JSON list of conversations"),
    (["--dataset-path", "{good}", "--input-len", "8"], "--input-len is for --dataset-name random"),
    (["--input-len", "250", "--output-len", "7"],
     "--input-len \\+ --output-len = 257 tokens is more than the max_model_len 256 .*the model's own limit"),
    (["--input-len", "100", "--max-model-len", "64"], "raise --max-model-len 64"),
    (["--input-len", "200", "--random-range-ratio", "0.5"], "at --random-range-ratio 0.5 = 492 tokens"),
])
def test_throughput_refuses_before_loading(model_dir, tmp_path, capsys, monkeypatch, extra, message):
    (tmp_path / "bad.json").write_text('{"x": 1}')
    (tmp_path / "good.json").write_text(json.dumps([{"conversations": [{"value": "a b c d e"}, {"value": "f"}]}]))
    files = {"missing": tmp_path / "nope.json", "bad": tmp_path / "bad.json", "good": tmp_path / "good.json"}
    extra = [x.format(**files) for x in extra]

    def no_load(*a, **k):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(LLM, "from_engine_config", no_load)
    rc, out, err = run_main(bench("throughput", model_dir, *extra), capsys)
    assert rc == 2
    assert re.search(message, err), err
    assert "Traceback" not in err


@pytest.mark.parametrize("kind, flag, value, message", [
    ("throughput", "--random-range-ratio", "1", "must be in [0, 1), got 1"),
    ("throughput", "--random-range-ratio", "abc", "expected a number, got 'abc'"),
    ("throughput", "--num-prompts", "0", "must be >= 1, got 0"),
    ("throughput", "--output-json", "/no/such/dir/x.json", "folder '/no/such/dir' of '/no/such/dir/x.json' does not"),
    ("latency", "--num-iters", "0", "must be >= 1, got 0"),
    ("latency", "--num-iters-warmup", "-1", "must be >= 0, got -1"),
    ("latency", "--batch-size", "0", "must be >= 1, got 0"),
])
def test_bad_flags_are_refused_at_parsing(model_dir, capsys, kind, flag, value, message):
    rc, _, err = run_main(bench(kind, model_dir, flag, value), capsys)
    assert rc == 2
    assert f"argument {flag}: {message}" in err, err


def test_latency_times_the_batch(model_dir, tmp_path, capsys, generate_calls):
    out_json = tmp_path / "lat.json"
    argv = bench("latency", model_dir, "--kv-cache-dtype", "fp8", "--input-len", "9", "--output-len", "5",
                 "--batch-size", "3", "--num-iters-warmup", "2", "--num-iters", "4", "--output-json", str(out_json))
    rc, out, err = run_main(argv, capsys)
    assert rc == 0, err
    assert len(generate_calls) == 2 + 4
    for outputs in generate_calls:
        assert len(outputs) == 3
        assert all(len(o.prompt_token_ids) == 9 and len(o.outputs[0].token_ids) == 5 for o in outputs)
    # The same prompts every iteration.
    assert len({tuple(tuple(o.prompt_token_ids) for o in outs) for outs in generate_calls}) == 1
    r = json.loads(out_json.read_text())
    assert len(r["latencies"]) == 4 and all(x > 0 for x in r["latencies"])
    assert r["avg_latency"] == pytest.approx(np.mean(r["latencies"]))
    assert list(r["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert r["percentiles"]["50"] == pytest.approx(np.median(r["latencies"]))
    assert (r["batch_size"], r["input_len"], r["output_len"]) == (3, 9, 5)
    assert r["config"]["kv_cache_dtype"] == "fp8_e4m3"
    assert f"Avg latency: {r['avg_latency']} seconds" in out
    assert f"99% percentile latency: {r['percentiles']['99']} seconds" in out


def test_latency_refuses_too_long_before_loading(model_dir, capsys, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(LLM, "from_engine_config", no_load)
    rc, _, err = run_main(bench("latency", model_dir, "--input-len", "200", "--output-len", "100"), capsys)
    assert rc == 2
    assert "--input-len + --output-len = 300 tokens is more than the max_model_len 256" in err


@pytest.mark.parametrize("kind", ["throughput", "latency"])
def test_disable_detokenize(model_dir, tmp_path, capsys, generate_calls, kind):
    from transformers import AutoTokenizer

    sizes = ["--input-len", "8", "--output-len", "4"] + (
        ["--num-prompts", "3"] if kind == "throughput" else ["--batch-size", "3", "--num-iters-warmup", "0",
                                                             "--num-iters", "1"])
    for flag in ([], ["--disable-detokenize"]):
        out_json = tmp_path / f"{kind}{len(flag)}.json"
        rc, _, err = run_main(bench(kind, model_dir, *sizes, *flag, "--output-json", str(out_json)), capsys)
        assert rc == 0, err
        assert json.loads(out_json.read_text())["disable_detokenize"] is bool(flag)
    on, off = generate_calls
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    # Trailing incomplete UTF-8 characters (U+FFFD) are held back by the incremental detokenizer.
    for o in on:
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True).rstrip("\ufffd")
    assert all(o.outputs[0].text == "" and len(o.outputs[0].token_ids) == 4 for o in off)


def test_checkpoint_without_tokenizer(tmp_path, capsys, monkeypatch, generate_calls):
    """Random prompts need no tokenizer (the config's EOS is left out of them); ShareGPT text does,
    and is refused before the weights load."""
    bare = str(write_tiny_llama(tmp_path / "bare", with_tokenizer=False))
    rc, _, err = run_main(bench("throughput", bare, "--num-prompts", "2", "--input-len", "30", "--output-len", "2"),
                          capsys)
    assert rc == 0, err
    eos = read_config(bare)["eos_token_id"]
    assert all(eos not in o.prompt_token_ids and len(o.prompt_token_ids) == 30 for o in generate_calls[0])
    (tmp_path / "sg.json").write_text(json.dumps([{"conversations": [{"value": "a b c d e"}, {"value": "f g h i"}]}]))

    def no_load(*a, **k):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(LLM, "from_engine_config", no_load)
    rc, _, err = run_main(bench("throughput", bare, "--dataset-path", str(tmp_path / "sg.json")), capsys)
    assert rc == 2 and "has no tokenizer files to tokenize the ShareGPT conversations with: pass --tokenizer" in err
