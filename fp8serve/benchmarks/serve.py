"""`fp8serve bench serve`: online serving latency against a running server.

The workload follows vLLM's benchmark_serving random dataset: `--num-prompts`
prompts of exactly `--input-len` random token ids (sent as token-id lists so
the length is exact), after a `--random-prefix-len`-token prefix that every
prompt shares (0 by default; a system prompt, for servers with
--enable-prefix-caching), arriving as a Poisson process at `--request-rate`
(inf = all at once), each a streaming completion with temperature 0 and
`ignore_eos`, so every request generates exactly `--output-len` tokens.

Per request: TTFT (send to first streamed chunk), ITL (gaps between chunks),
TPOT ((E2E - TTFT) / (output tokens - 1)) and E2E latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

# Tokenized to get a pool of valid, ordinary token ids for any tokenizer.
_ID_POOL_TEXT = (
    "The quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches. "
    "Numbers like 12, 345 and 6789 appear in reports, letters, poems, recipes and code. "
    "Weather, history, science, music, travel and sport are all common topics of conversation."
)


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    start_time: float = 0.0  # when it was sent, seconds after the benchmark started
    itl: list[float] = field(default_factory=list)
    error: str = ""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    p.add_argument("--num-prompts", type=int, default=30)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--random-prefix-len", type=int, default=0,
                   help="tokens of one random prefix put before every prompt's --input-len tokens")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--json", dest="json_out", default=None, help="write the results and per-request data here")


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="online serving benchmark against a running server")
    add_args(p)
    p.set_defaults(func=run)


async def _first_model(session, base_url: str) -> str:
    async with session.get(f"{base_url}/v1/models") as r:
        r.raise_for_status()
        return (await r.json())["data"][0]["id"]


async def _id_pool(session, base_url: str, model: str) -> list[int]:
    async with session.post(f"{base_url}/tokenize", json={"model": model, "prompt": _ID_POOL_TEXT,
                                                          "add_special_tokens": False}) as r:
        r.raise_for_status()
        return sorted(set((await r.json())["tokens"]))


def make_prompts(pool: list[int], num_prompts: int, input_len: int, seed: int, prefix_len: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.choice(pool) for _ in range(prefix_len)]
    return [prefix + [rng.choice(pool) for _ in range(input_len)] for _ in range(num_prompts)]


async def _send(session, url: str, headers: dict, payload: dict, prompt_len: int, t0: float) -> RequestResult:
    import aiohttp

    start = time.perf_counter()
    result = RequestResult(prompt_len=prompt_len, start_time=start - t0)
    last = start
    try:
        async with session.post(url, json=payload, headers=headers) as r:
            if r.status != 200:
                result.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return result
            buffer = b""
            async for data in r.content.iter_any():
                buffer += data
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    line = event.decode().removeprefix("data: ").strip()
                    if not line or line == "[DONE]":
                        continue
                    msg = json.loads(line)
                    if "error" in msg:
                        result.error = msg["error"]["message"]
                        return result
                    now = time.perf_counter()
                    if msg.get("usage"):
                        result.output_len = msg["usage"]["completion_tokens"]
                    if msg.get("choices"):
                        if result.ttft == 0.0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
        result.latency = time.perf_counter() - start
        result.success = result.error == ""
    except aiohttp.ClientError as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def benchmark(base_url: str, model: str | None, request_rate: float, num_prompts: int, input_len: int,
                    output_len: int, seed: int = 0, api_key: str | None = None, random_prefix_len: int = 0) -> dict:
    import aiohttp  # here, not at import: every `fp8serve` command builds this parser

    for name, value in (("num_prompts", num_prompts), ("input_len", input_len), ("output_len", output_len)):
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if random_prefix_len < 0:
        raise ValueError(f"--random-prefix-len must be >= 0, got {random_prefix_len}")

    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = model or await _first_model(session, base_url)
        prompts = make_prompts(await _id_pool(session, base_url, model), num_prompts, input_len, seed,
                               random_prefix_len)
        url = f"{base_url}/v1/completions"
        rng = np.random.default_rng(seed)
        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            payload = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            tasks.append(asyncio.create_task(_send(session, url, headers, payload, len(prompt), start)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, dict(base_url=base_url, model=model, request_rate=request_rate,
                                             num_prompts=num_prompts, input_len=input_len,
                                             random_prefix_len=random_prefix_len, output_len=output_len,
                                             seed=seed))


def _stats(values: list[float], scale: float) -> dict:
    if not values:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}
    a = np.asarray(values) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std()),
            "p99": float(np.percentile(a, 99))}


def saturated_output_throughput(results: list[RequestResult]) -> float | None:
    """Output tok/s from the start until the last request's first token.

    Until then some request is still waiting for room, so every step runs
    at the concurrency the KV cache allows: this is the rate at saturation.
    After it the run drains, with fewer requests left than the cache holds,
    and a larger cache drains for a larger share of a short run (48 requests
    are three waves of 16 but six of 8). Each streamed chunk is one token.
    None when no request produced a token."""
    ok = [r for r in results if r.success and r.ttft > 0]
    if not ok:
        return None
    t_end = max(r.start_time + r.ttft for r in ok)
    tokens = 0
    for r in ok:
        t = r.start_time + r.ttft
        tokens += t <= t_end
        for gap in r.itl:
            t += gap
            if t > t_end:
                break
            tokens += 1
    return tokens / t_end if t_end > 0 else None


def summarize(results: list[RequestResult], duration: float, config: dict) -> dict:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    return {
        "config": config,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "saturated_output_throughput": saturated_output_throughput(results),
        "total_token_throughput": (total_in + total_out) / duration,
        "ttft_ms": _stats([r.ttft for r in ok], 1000),
        "tpot_ms": _stats(tpots, 1000),
        "itl_ms": _stats([x for r in ok for x in r.itl], 1000),
        "e2el_ms": _stats([r.latency for r in ok], 1000),
        "output_lens": [r.output_len for r in results],
        "requests": [asdict(r) for r in results],
    }


def format_results(s: dict) -> str:
    w = 40
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label, value, fmt="{:<10.2f}"):
        lines.append(f"{label:<{w}}" + (fmt.format(value) if not isinstance(value, int) else f"{value:<10}"))

    row("Successful requests:", s["completed"])
    if s["failed"]:
        row("Failed requests:", s["failed"])
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total Token throughput (tok/s):", s["total_token_throughput"])
    for key, title, name in (("ttft_ms", "Time to First Token", "TTFT"),
                             ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                             ("itl_ms", "Inter-token Latency", "ITL"),
                             ("e2el_ms", "End-to-end Latency", "E2EL")):
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {name} (ms):", s[key]["mean"])
        row(f"Median {name} (ms):", s[key]["median"])
        row(f"P99 {name} (ms):", s[key]["p99"])
    lines.append("=" * 50)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        summary = asyncio.run(benchmark(args.base_url, args.model, args.request_rate, args.num_prompts,
                                        args.input_len, args.output_len, args.seed, args.api_key,
                                        args.random_prefix_len))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_results(summary))
    if summary["errors"]:
        print("errors:", *summary["errors"], sep="\n  ", file=sys.stderr)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if summary["failed"] == 0 else 1
