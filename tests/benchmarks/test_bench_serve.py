"""`fp8serve bench serve` against a real server, and the sweep's helpers."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from checkpoints import write_tiny_llama
from fp8serve.benchmarks.serve import benchmark, format_results
from fp8serve.benchmarks.sweep import cache_config, format_table, num_preemptions, server_command


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    model_dir = write_tiny_llama(tmp_path_factory.mktemp("bench") / "llama")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "fp8serve.entrypoints.cli", "serve", str(model_dir), "--port", str(port),
           "--dtype", "float32", "--kv-cache-memory", "1MiB", "--kv-cache-dtype", "fp8", "--enable-prefix-caching",
           "--block-size", "4"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # a cold start may compile the C++ kernels
    while True:
        assert proc.poll() is None, "server exited early"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not become healthy"
        time.sleep(0.2)
    yield url
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


def test_bench_serve_exact_lengths(server_url):
    s = asyncio.run(benchmark(server_url, None, request_rate=float("inf"), num_prompts=4, input_len=20,
                              output_len=6, seed=1))
    assert s["completed"] == 4 and s["failed"] == 0
    assert s["output_lens"] == [6] * 4
    assert s["total_input_tokens"] == 80 and s["total_output_tokens"] == 24
    assert all(len(r["itl"]) == 5 for r in s["requests"])
    assert 0 < s["ttft_ms"]["mean"] <= s["e2el_ms"]["mean"]
    text = format_results(s)
    for label in ("Successful requests:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                  "Mean TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):", "P99 E2EL (ms):"):
        assert label in text
    # A Poisson rate still sends everything.
    s = asyncio.run(benchmark(server_url, None, request_rate=20.0, num_prompts=3, input_len=8, output_len=3))
    assert s["output_lens"] == [3] * 3


def _metric(url: str, name: str) -> float:
    import re

    m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", httpx.get(f"{url}/metrics").text, re.M)
    assert m, name
    return float(m.group(1))


def test_random_prefix_len_puts_one_prefix_before_every_prompt(server_url):
    """vLLM's --random-prefix-len: every prompt starts with the same tokens, which a server with
    --enable-prefix-caching (this one, 4-token blocks) prefills once."""
    hits0 = _metric(server_url, "fp8serve:prefix_cache_hits_total")
    s = asyncio.run(benchmark(server_url, None, request_rate=float("inf"), num_prompts=3, input_len=5,
                              output_len=2, seed=2, random_prefix_len=16))
    assert s["completed"] == 3 and s["total_input_tokens"] == 3 * 21
    assert s["config"]["random_prefix_len"] == 16
    # Prompts of 21 tokens whose first 16 agree: the second and third share 4 blocks.
    assert _metric(server_url, "fp8serve:prefix_cache_hits_total") - hits0 == 2 * 16


@pytest.mark.parametrize("kwargs, message", [(dict(num_prompts=0), "--num-prompts must be >= 1, got 0"),
                                             (dict(random_prefix_len=-1), "--random-prefix-len must be >= 0"),
                                             (dict(request_rate=0.0), "--request-rate must be > 0"),
                                             (dict(request_rate=float("nan")), "--request-rate must be > 0")])
def test_bad_workload_is_rejected_before_any_request(kwargs, message):
    args = dict(request_rate=float("inf"), num_prompts=2, input_len=4, output_len=2) | kwargs
    with pytest.raises(ValueError, match=message):
        asyncio.run(benchmark("http://127.0.0.1:9", None, **args))


def test_sweep_reads_cache_config_and_formats_table(server_url):
    assert num_preemptions(server_url) == 0  # an idle server has preempted nothing
    cache = cache_config(server_url)
    # 1 MiB of FP8 K/V in 4-token blocks (2 layers x 2 kv heads x 16 dims x 2 bytes per token).
    assert cache["kv_cache_dtype"] == "fp8_e4m3" and int(cache["num_blocks"]) == 2048
    assert cache["block_size"] == "4" and cache["enable_prefix_caching"] == "True"
    table = format_table([{"model_dtype": "float32", "kv_cache_dtype": "bfloat16", "num_blocks": 256,
                           "ttft_ms": 12.34, "itl_ms": 5.0, "e2e_s": 1.25, "output_throughput": 40.0,
                           "saturated_output_throughput": 50.0, "num_preemptions": 3},
                          {"model_dtype": "float32", "kv_cache_dtype": "fp8_e4m3", "num_blocks": 512,
                           "ttft_ms": 12.34, "itl_ms": 5.0, "e2e_s": 1.25, "output_throughput": 75.0,
                           "saturated_output_throughput": 95.0, "num_preemptions": 0},
                          {"model_dtype": "float32", "kv_cache_dtype": "fp8_e4m3", "num_blocks": 512,
                           "ttft_ms": 12.34, "itl_ms": 5.0, "e2e_s": 1.25, "output_throughput": 70.0}])
    assert ("| Model dtype | KV dtype | blocks | TTFT (ms) | ITL (ms) | e2e (s) | output tok/s | vs first row "
            "| saturated tok/s | vs first row | preemptions |") in table
    assert "| float32 | bfloat16 | 256 | 12.3 | 5.0 | 1.2 | 40.0 | 1.00x | 50.0 | 1.00x | 3 |" in table
    assert "| float32 | fp8_e4m3 | 512 | 12.3 | 5.0 | 1.2 | 75.0 | 1.88x | 95.0 | 1.90x | 0 |" in table
    # A row from an older sweep.json, without the newer fields.
    assert "| float32 | fp8_e4m3 | 512 | 12.3 | 5.0 | 1.2 | 70.0 | 1.75x | - | - | - |" in table


def test_saturated_throughput_stops_at_the_last_first_token():
    """Two requests sent at t=0 and one queued behind them (first token at
    t=3): tokens up to t=3 count, the drain after it does not."""
    from fp8serve.benchmarks.serve import RequestResult, saturated_output_throughput

    def req(ttft, itl, start=0.0):
        return RequestResult(success=True, output_len=1 + len(itl), ttft=ttft, itl=itl, start_time=start)

    results = [
        req(0.5, [0.5] * 9),  # tokens at 0.5, 1.0, ... 5.0: 6 of them by t=3
        req(0.5, [1.0] * 4),  # 0.5, 1.5, 2.5, 3.5, 4.5: 3 by t=3
        req(2.0, [0.5, 0.5], start=1.0),  # first token at t=3: 1 (the ones after are the drain)
        RequestResult(success=False, error="HTTP 500"),  # failed requests do not count
    ]
    assert saturated_output_throughput(results) == (6 + 3 + 1) / 3.0
    assert saturated_output_throughput([RequestResult(success=False)]) is None


def test_sweep_passes_the_engine_flags_to_every_server():
    """--enable-prefix-caching, --enable-chunked-prefill, --max-num-batched-tokens and --speculative-config reach each
    server's command line; --max-model-len grows to hold --random-prefix-len + prompt + output."""
    from fp8serve.entrypoints.cli import build_parser

    parser = build_parser()
    workload = {"max_model_len": 512, "input_len": 128, "output_len": 32}
    plain = parser.parse_args(["bench", "sweep"])
    cmd = server_command("default", "fp8", workload, plain, 8123)
    assert cmd[cmd.index("--max-model-len") + 1] == "512" and cmd[cmd.index("--port") + 1] == "8123"
    assert "--enable-prefix-caching" not in cmd and "--enable-chunked-prefill" not in cmd
    assert "--max-num-batched-tokens" not in cmd and cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8"
    assert "--speculative-config" not in cmd
    spec = '{"method": "ngram", "num_speculative_tokens": 4}'
    args = parser.parse_args(["bench", "sweep", "--random-prefix-len", "512", "--enable-prefix-caching",
                              "--enable-chunked-prefill", "--max-num-batched-tokens", "256",
                              "--speculative-config", spec])
    cmd = server_command("/models/x", "auto", workload, args, 8124)
    assert cmd[4] == "/models/x" and cmd[cmd.index("--max-model-len") + 1] == str(512 + 128 + 32)
    assert "--enable-prefix-caching" in cmd and "--enable-chunked-prefill" in cmd
    assert cmd[cmd.index("--max-num-batched-tokens") + 1] == "256"
    # The server's own parser accepts the command line the sweep builds.
    served = parser.parse_args(cmd[3:])
    assert served.enable_prefix_caching and served.enable_chunked_prefill and served.max_num_batched_tokens == 256
    assert served.speculative_config == spec


def test_sweep_rejects_a_negative_prefix_before_starting_servers(tmp_path, capsys):
    from fp8serve.benchmarks.sweep import run
    from fp8serve.entrypoints.cli import build_parser, main
    from fp8serve.errors import UserError

    # At parsing, as every count flag of bench serve and sweep...
    assert _exit_code(main, ["bench", "sweep", "--random-prefix-len", "-1", "--out-dir", str(tmp_path / "o")]) == 2
    assert "argument --random-prefix-len: must be >= 0, got -1" in capsys.readouterr().err
    # ...and in run(), for arguments built without the parser.
    args = build_parser().parse_args(["bench", "sweep", "--out-dir", str(tmp_path / "o")])
    args.random_prefix_len = -1
    with pytest.raises(UserError, match="--random-prefix-len must be >= 0, got -1"):
        run(args)
    assert not (tmp_path / "o").exists()


def _exit_code(main, argv: list[str]) -> int:
    """main(argv)'s exit status, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def _bench(capsys, *argv: str) -> tuple[int, str]:
    """`fp8serve bench serve ARGV`: its exit status and stderr."""
    from fp8serve.entrypoints.cli import main

    capsys.readouterr()
    code = _exit_code(main, ["bench", "serve", *argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bench_serve_says_when_it_cannot_connect(capsys):
    port = _closed_port()
    code, err = _bench(capsys, "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1")
    assert code == 2
    assert err.startswith(f"error: cannot connect to http://127.0.0.1:{port}/v1/models (")
    assert "is `fp8serve serve` running there? Check --base-url (the server's host and --port)" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("url", ["notaurl", "127.0.0.1:8000", "ftp://127.0.0.1:8000", "http://host:port", "http://"])
def test_bench_serve_rejects_a_base_url_without_scheme_and_host(capsys, url):
    code, err = _bench(capsys, "--base-url", url)
    assert code == 2
    assert f"argument --base-url: expected http(s)://host:port, e.g. http://127.0.0.1:8000, got {url!r}" in err


def test_base_url_may_end_in_v1():
    """An OpenAI client's base URL (what vLLM's users pass) names /v1; the requests add it themselves."""
    from fp8serve.benchmarks.serve import normalize_base_url

    for url in ("http://127.0.0.1:8000", "http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1",
                "http://127.0.0.1:8000/v1/", " http://127.0.0.1:8000/v1 "):
        assert normalize_base_url(url) == "http://127.0.0.1:8000"
    assert normalize_base_url("https://example.com/proxy/v1") == "https://example.com/proxy"


def test_bench_serve_against_a_v1_base_url(server_url):
    s = asyncio.run(benchmark(f"{server_url}/v1/", None, request_rate=float("inf"), num_prompts=1, input_len=4,
                              output_len=2))
    assert s["completed"] == 1 and s["config"]["base_url"] == server_url


def test_bench_serve_names_the_served_models_for_an_unknown_model(server_url, capsys):
    served = httpx.get(f"{server_url}/v1/models").json()["data"][0]["id"]
    code, err = _bench(capsys, "--base-url", server_url, "--model", "no-such-model", "--num-prompts", "1")
    assert code == 2
    assert err == f"error: --model 'no-such-model' is not served by {server_url}; it serves: {served}\n"


@pytest.mark.parametrize("rate", ["0", "-1", "nan", "-inf"])
def test_bench_serve_rejects_a_request_rate_that_is_not_positive(capsys, rate):
    code, err = _bench(capsys, "--base-url", "http://127.0.0.1:9", f"--request-rate={rate}")  # = for -inf
    assert code == 2
    assert f"argument --request-rate: must be > 0 (requests/s) or inf (all at once), got {float(rate):g}" in err


def test_request_rate_inf_and_positive_are_accepted():
    from fp8serve.entrypoints.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["bench", "serve", "--base-url", "http://h:1"]).request_rate == float("inf")
    assert parser.parse_args(["bench", "serve", "--base-url", "http://h:1", "--request-rate", "inf"]).request_rate \
        == float("inf")
    assert parser.parse_args(["bench", "serve", "--base-url", "http://h:1", "--request-rate", "0.5"]).request_rate \
        == 0.5


@pytest.mark.parametrize("flag, value, message", [
    ("--num-prompts", "0", "must be >= 1, got 0"), ("--num-prompts", "-2", "must be >= 1, got -2"),
    ("--input-len", "0", "must be >= 1, got 0"), ("--output-len", "-1", "must be >= 1, got -1"),
    ("--random-prefix-len", "-1", "must be >= 0, got -1"), ("--num-prompts", "x", "expected an integer, got 'x'")])
def test_bench_serve_rejects_bad_counts_at_parsing(capsys, flag, value, message):
    code, err = _bench(capsys, "--base-url", "http://127.0.0.1:9", flag, value)
    assert code == 2 and f"argument {flag}: {message}" in err


@pytest.mark.parametrize("where, message", [
    ("missing/x.json", "folder '{d}/missing' of '{d}/missing/x.json' does not exist"),
    ("file/x.json", "'{d}/file' in '{d}/file/x.json' is a file, not a folder"),
    ("", "'{d}/' is a folder; give a file path such as '{d}/result.json'")])
def test_bench_serve_checks_the_json_path_before_the_run(tmp_path, capsys, where, message):
    (tmp_path / "file").write_text("")
    # Port 9 would fail the run: the path is checked first, at parsing.
    code, err = _bench(capsys, "--base-url", "http://127.0.0.1:9", "--json", f"{tmp_path}/{where}")
    assert code == 2 and f"argument --json: {message.format(d=tmp_path)}" in err


def test_bench_serve_checks_the_lengths_against_max_model_len(server_url, capsys):
    data = httpx.get(f"{server_url}/v1/models").json()["data"][0]
    limit = data["max_model_len"]
    code, err = _bench(capsys, "--base-url", server_url, "--input-len", str(limit), "--output-len", "2",
                       "--random-prefix-len", "1")
    assert code == 2
    assert err == (f"error: --random-prefix-len 1 + --input-len {limit} + --output-len 2 = {limit + 3} tokens is more "
                   f"than the max_model_len {limit} of {data['id']!r} at {server_url}; lower them or start the server "
                   f"with --max-model-len {limit + 3} or more\n")
    # Exactly the limit is fine (the server's own check: prompt + max_tokens <= max_model_len).
    s = asyncio.run(benchmark(server_url, None, request_rate=float("inf"), num_prompts=1, input_len=limit - 2,
                              output_len=2))
    assert s["completed"] == 1


def test_failed_requests_show_na_and_the_first_whole_error(capsys):
    """No successful request: no latency to report (N/A, not 0.00), and the server's whole message."""
    from fp8serve.benchmarks.serve import RequestResult, _error_text, summarize

    long = "This model's maximum context length is 256 tokens. However, your prompt has 300 tokens. " * 4
    body = '{"error": {"message": "%s", "type": "BadRequestError", "param": "prompt", "code": 400}}' % long
    assert _error_text(400, body) == f"HTTP 400: {long}"  # whole (it used to be cut at 200 characters)
    assert _error_text(502, "Bad Gateway\n") == "HTTP 502: Bad Gateway"
    s = summarize([RequestResult(error=_error_text(400, body)), RequestResult(error="HTTP 500: later")], 1.0, {})
    assert s["completed"] == 0 and s["failed"] == 2 and s["first_error"] == f"HTTP 400: {long}"
    assert s["ttft_ms"]["mean"] is None and s["e2el_ms"]["p99"] is None
    text = format_results(s)
    assert f"{'Mean TTFT (ms):':<40}N/A" in text and f"{'P99 E2EL (ms):':<40}N/A" in text
    assert "0.00" not in text.split("Time to First Token")[1]


def test_bench_serve_reports_the_failures(monkeypatch, capsys):
    """run() prints the table, then one line with the count and the first error in full; exit status 1."""
    from fp8serve.benchmarks import serve
    from fp8serve.benchmarks.serve import RequestResult, summarize

    long = "x" * 300

    async def fake_benchmark(*args, **kwargs):
        ok = RequestResult(success=True, prompt_len=4, output_len=2, ttft=0.1, latency=0.2, itl=[0.1])
        return summarize([ok, RequestResult(error=f"HTTP 400: {long}"), RequestResult(error="HTTP 400: b")], 1.0, {})

    monkeypatch.setattr(serve, "benchmark", fake_benchmark)
    code, err = _bench(capsys, "--base-url", "http://127.0.0.1:9")
    assert code == 1
    assert err == f"error: 2 of 3 requests failed; the first: HTTP 400: {long}\n"


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrival_gaps_have_the_rates_mean_and_the_burstiness_shape(burstiness, seed):
    """vLLM's arrivals: gamma gaps of mean 1 / rate and shape `burstiness`, so their coefficient of
    variation is 1 / sqrt(burstiness) (1: Poisson)."""
    from fp8serve.benchmarks.serve import arrival_gaps

    gaps = np.asarray(arrival_gaps(20000, 4.0, burstiness, seed))
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(burstiness ** -0.5, rel=0.05)
    assert arrival_gaps(3, float("inf"), burstiness, seed) == [0.0, 0.0, 0.0]
    # Burstiness 1 keeps the Poisson arrivals a seed gave before the flag existed.
    rng = np.random.default_rng(seed)
    assert arrival_gaps(5, 2.0, 1.0, seed) == [rng.exponential(0.5) for _ in range(5)]


def _max_overlap(requests: list[dict]) -> int:
    events = sorted([(r["start_time"], 1) for r in requests] + [(r["start_time"] + r["latency"], -1)
                                                                   for r in requests], key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def test_max_concurrency_caps_the_requests_in_flight(server_url):
    s = asyncio.run(benchmark(server_url, None, request_rate=float("inf"), num_prompts=6, input_len=6,
                              output_len=8, max_concurrency=2))
    assert s["completed"] == 6 and s["config"]["max_concurrency"] == 2
    assert _max_overlap(s["requests"]) == 2
    assert f"{'Maximum request concurrency:':<40}2" in format_results(s)
    free = asyncio.run(benchmark(server_url, None, request_rate=float("inf"), num_prompts=6, input_len=6,
                                 output_len=8))
    assert _max_overlap(free["requests"]) == 6
    assert "Maximum request concurrency" not in format_results(free)


def test_bench_serve_sharegpt(server_url, tmp_path, capsys):
    """Conversations' first turns as text, each generating its reply's length as the server's tokenizer
    counts it; vLLM's filter applied with the server's max_model_len (256 here)."""
    def count(text, special=True):
        body = {"prompt": text, "add_special_tokens": special}
        return httpx.post(f"{server_url}/tokenize", json=body).json()["count"]

    convs = [{"conversations": [{"from": "human", "value": " the" * (6 + i)},
                                {"from": "gpt", "value": " a b" * (3 + i)}]} for i in range(4)]
    convs += [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": " x" * 10}]},  # short
              {"conversations": [{"from": "human", "value": " the" * 250}, {"from": "gpt", "value": " y" * 20}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    s = asyncio.run(benchmark(server_url, None, request_rate=float("inf"), num_prompts=10, dataset_path=str(path)))
    expected = sorted((count(c["conversations"][0]["value"]), count(c["conversations"][1]["value"], False))
                      for c in convs[:4])
    assert s["completed"] == 4 and s["failed"] == 0
    assert sorted((r["prompt_len"], r["output_len"]) for r in s["requests"]) == expected
    assert s["config"]["dataset_name"] == "sharegpt"
    fixed = asyncio.run(benchmark(server_url, None, request_rate=float("inf"), num_prompts=2, output_len=3,
                                  dataset_path=str(path)))
    assert fixed["output_lens"] == [3, 3]
    # The same through the command line, with vLLM's flag for it.
    out = tmp_path / "r.json"
    code, err = _bench(capsys, "--base-url", server_url, "--dataset-path", str(path), "--sharegpt-output-len", "2",
                       "--num-prompts", "3", "--max-concurrency", "2", "--json", str(out))
    assert code == 0, err
    r = json.loads(out.read_text())
    assert r["output_lens"] == [2, 2, 2] and r["config"]["dataset_name"] == "sharegpt"
    assert r["config"]["max_concurrency"] == 2


def test_bench_serve_dataset_and_shape_errors_before_any_request(tmp_path, capsys):
    """Port 9 has no server: each error below comes before the first connection."""
    (tmp_path / "bad.json").write_text("[1, 2]")
    url = "http://127.0.0.1:9"
    cases = [(["--dataset-name", "sharegpt"], "error: --dataset-name sharegpt needs --dataset-path FILE"),
             (["--dataset-path", str(tmp_path / "bad.json")], "entry 0 has no \"conversations\" list"),
             (["--dataset-path", str(tmp_path / "nope.json")], "no such file"),
             (["--dataset-path", str(tmp_path / "bad.json"), "--input-len", "5"], "--input-len is for the random"),
             (["--burstiness", "0"], "argument --burstiness: must be a finite number > 0"),
             (["--burstiness", "inf"], "argument --burstiness: must be a finite number > 0"),
             (["--max-concurrency", "0"], "argument --max-concurrency: must be >= 1, got 0"),
             (["--sharegpt-output-len", "5"], "--sharegpt-output-len is for --dataset-name sharegpt"),
             (["--dataset-path", str(tmp_path / "bad.json"), "--output-len", "4", "--sharegpt-output-len", "5"],
              "--output-len 4 and --sharegpt-output-len 5 disagree")]
    for extra, message in cases:
        code, err = _bench(capsys, "--base-url", url, *extra)
        assert code == 2 and message in err, (extra, err)


def test_summary_has_vllms_flat_keys_percentiles_and_goodput():
    """vLLM's result fields (mean_ttft_ms, p90_tpot_ms, request_goodput, ttfts, ...) from the same
    numbers as the nested ones; goodput counts the successful requests within every SLO."""
    from fp8serve.benchmarks.serve import RequestResult, summarize

    rs = [RequestResult(success=True, prompt_len=5, output_len=3, ttft=0.1, latency=0.3, itl=[0.1, 0.1]),
          RequestResult(success=True, prompt_len=5, output_len=3, ttft=0.3, latency=0.9, itl=[0.3, 0.3]),
          RequestResult(success=True, prompt_len=5, output_len=1, ttft=0.6, latency=0.6),
          RequestResult(error="HTTP 500: x")]
    s = summarize(rs, 2.0, {}, percentiles=(50.0, 90.0, 99.9), goodput={"ttft": 400.0, "tpot": 150.0})
    assert s["mean_ttft_ms"] == pytest.approx(1000 * (0.1 + 0.3 + 0.6) / 3) == s["ttft_ms"]["mean"]
    assert s["p90_ttft_ms"] == pytest.approx(np.percentile([100, 300, 600], 90))
    assert s["p99.9_e2el_ms"] == pytest.approx(np.percentile([300, 900, 600], 99.9))
    assert s["p99_itl_ms"] == s["itl_ms"]["p99"]  # p99 always there: the sweep's table reads it
    assert s["median_tpot_ms"] == pytest.approx(200.0)  # (0.3-0.1)/2 and (0.9-0.3)/2: 100 and 300
    # Good: the first (ttft 100, tpot 100); the second's tpot is 300, the third's ttft 600; the fourth failed.
    assert s["request_goodput"] == pytest.approx(1 / 2.0)
    assert s["duration"] == 2.0 and s["input_lens"] == [5, 5, 5, 0] and s["ttfts"][:3] == [0.1, 0.3, 0.6]
    assert s["itls"][1] == [0.3, 0.3]
    text = format_results(s)
    assert f"{'Request goodput (req/s):':<40}0.50" in text
    for label in ("P50 TTFT (ms):", "P90 TPOT (ms):", "P99.9 E2EL (ms):"):
        assert label in text
    assert "P99 TTFT (ms):" not in text
    s["percentile_metrics"] = ["ttft"]
    text = format_results(s)
    assert "Mean TTFT (ms):" in text and "TPOT" not in text and "Inter-token Latency" not in text
    # A one-token output has a TPOT of 0 (vLLM's), so a TPOT SLO alone does not fail it.
    assert summarize(rs[2:3], 1.0, {}, goodput={"tpot": 1.0})["request_goodput"] == 1.0


@pytest.mark.parametrize("flag, value, message", [
    ("--goodput", "ttft", "expected KEY:MILLISECONDS with KEY one of ttft, tpot, e2el, got 'ttft'"),
    ("--goodput", "itl:50", "KEY one of ttft, tpot, e2el"),
    ("--goodput", "ttft:-5", "'ttft:-5': the SLO must be a finite number of milliseconds > 0"),
    ("--goodput", "tpot:fast", "'fast' is not a number of milliseconds"),
    ("--metric-percentiles", "50,101", "each percentile must be in (0, 100], got 101"),
    ("--metric-percentiles", "p99", "expected comma-separated numbers"),
    ("--percentile-metrics", "ttft,latency", "expected names from ttft,tpot,itl,e2el"),
])
def test_bench_serve_refuses_bad_slos_and_percentiles(capsys, flag, value, message):
    code, err = _bench(capsys, "--base-url", "http://127.0.0.1:9", flag, value)
    assert code == 2 and f"argument {flag}: " in err and message in err, err


def test_bench_serve_goodput_and_percentiles_end_to_end(server_url, tmp_path, capsys):
    from fp8serve.entrypoints.cli import main

    out = tmp_path / "r.json"
    capsys.readouterr()
    code = main(["bench", "serve", "--base-url", server_url, "--num-prompts", "3", "--input-len", "6", "--output-len",
                 "4", "--goodput", "ttft:600000", "e2el:600000", "--metric-percentiles", "50,90",
                 "--percentile-metrics", "ttft,e2el", "--json", str(out)])
    assert code == 0
    r = json.loads(out.read_text())
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # ten-minute SLOs: every request
    assert r["goodput_slos_ms"] == {"ttft": 600000.0, "e2el": 600000.0}
    assert r["p50_ttft_ms"] == pytest.approx(np.percentile(np.asarray(r["ttfts"]) * 1000, 50))
    assert r["percentiles"] == [50.0, 90.0] and r["percentile_metrics"] == ["ttft", "e2el"]
    printed = capsys.readouterr().out
    assert "P90 E2EL (ms):" in printed and "TPOT" not in printed and "Request goodput (req/s):" in printed
