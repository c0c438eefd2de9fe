"""`fp8serve bench serve`: online serving latency against a running server.

The workload follows vLLM's benchmark_serving random dataset: `--num-prompts`
prompts of exactly `--input-len` random token ids (sent as token-id lists so
the length is exact), after a `--random-prefix-len`-token prefix that every
prompt shares (0 by default; a system prompt, for servers with
--enable-prefix-caching), arriving as a Poisson process at `--request-rate`
(inf = all at once), each a streaming completion with temperature 0 and
`ignore_eos`, so every request generates exactly `--output-len` tokens.

`--burstiness` shapes the arrivals as vLLM's does (gamma-distributed gaps
with the same mean: 1 is Poisson, lower is burstier), `--max-concurrency`
caps the requests in flight, and `--dataset-name sharegpt --dataset-path
FILE` sends conversations' first turns as text instead, each generating its
reply's token count (`--output-len` overrides), filtered as vLLM does (the
server's /tokenize counts the tokens).

Per request: TTFT (send to first streamed chunk), ITL (gaps between chunks),
TPOT ((E2E - TTFT) / (output tokens - 1)) and E2E latency; the table gives the
mean, median and `--metric-percentiles` of `--percentile-metrics`, and with
`--goodput ttft:MS tpot:MS e2el:MS` the completed requests within every SLO
per second. `--json` holds vLLM's result keys (mean_ttft_ms, p99_itl_ms,
request_goodput, ttfts, itls, ...) next to fp8serve's own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

import numpy as np

from fp8serve.benchmarks.datasets import load_sharegpt, sharegpt_keeps, sharegpt_order
from fp8serve.errors import UserError

# Tokenized to get a pool of valid, ordinary token ids for any tokenizer.
_ID_POOL_TEXT = (
    "The quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches. "
    "Numbers like 12, 345 and 6789 appear in reports, letters, poems, recipes and code. "
    "Weather, history, science, music, travel and sport are all common topics of conversation."
)


# The latency metrics, as vLLM names them: (key, table title, short name).
METRICS = (("ttft", "Time to First Token", "TTFT"), ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
           ("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL"))
# vLLM's --goodput takes SLOs on these (ITL is per token, not per request).
GOODPUT_METRICS = ("ttft", "tpot", "e2el")

# Without --dataset-path: vLLM's random dataset at these lengths.
DEFAULT_INPUT_LEN = 512
DEFAULT_OUTPUT_LEN = 256


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


def normalize_base_url(url: str) -> str:
    """`url` without a trailing '/' or '/v1': the requests add /v1/... themselves, and an OpenAI client's base
    URL (http://host:port/v1, what vLLM users pass) would otherwise ask for /v1/v1/models."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected http(s)://host:port, e.g. http://127.0.0.1:8000, got {url!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number or out of range
    except ValueError as e:
        raise ValueError(f"expected http(s)://host:port, e.g. http://127.0.0.1:8000, got {url!r} ({e})") from None
    url = url.strip().rstrip("/")
    return url.removesuffix("/v1").rstrip("/")


def _base_url_arg(text: str) -> str:
    try:
        return normalize_base_url(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_request_rate(rate: float) -> None:
    """vLLM's semantics: requests/s of a Poisson process, > 0, or inf for all at once (0 would never send,
    and numpy's exponential rejects a negative scale only once the run has started)."""
    if math.isnan(rate) or rate <= 0:
        raise ValueError(f"must be > 0 (requests/s) or inf (all at once), got {rate:g}")


def _request_rate_arg(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or inf, got {text!r}") from None
    try:
        check_request_rate(rate)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return rate


def check_burstiness(value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"must be a finite number > 0 (1 = Poisson), got {value:g}")


def parse_burstiness(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None
    check_burstiness(value)
    return value


def parse_percentiles(text: str) -> tuple[float, ...]:
    """vLLM's --metric-percentiles: comma-separated, each in (0, 100], e.g. "50,90,99"."""
    values = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            raise ValueError(f"expected comma-separated numbers such as 50,90,99, got {text!r}") from None
        if not 0 < value <= 100:
            raise ValueError(f"each percentile must be in (0, 100], got {item.strip()}")
        values.append(value)
    return tuple(values)


def parse_metric_names(text: str) -> tuple[str, ...]:
    """vLLM's --percentile-metrics: comma-separated names of ttft, tpot, itl, e2el."""
    names = tuple(x.strip() for x in text.split(","))
    known = [m for m, _, _ in METRICS]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"expected names from {','.join(known)}, got {text!r}")
    return names


def parse_goodput(items: list[str]) -> dict[str, float]:
    """vLLM's --goodput: KEY:VALUE SLOs in milliseconds, KEY one of ttft, tpot, e2el."""
    slos = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_METRICS:
            raise ValueError(f"expected KEY:MILLISECONDS with KEY one of {', '.join(GOODPUT_METRICS)}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"{item!r}: {value!r} is not a number of milliseconds") from None
        if not (ms > 0 and math.isfinite(ms)):
            raise ValueError(f"{item!r}: the SLO must be a finite number of milliseconds > 0")
        slos[key] = ms
    return slos


def parse_args_of(parse):
    """An argparse type from a parser that raises ValueError: the message becomes argparse's."""
    def arg(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return arg


def _goodput_item(text: str) -> str:
    parse_args_of(parse_goodput)([text])
    return text


def _int_arg(minimum: int):
    """An argparse type: an integer >= `minimum`, so a bad count fails at parsing with the flag's name."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


positive_int = _int_arg(1)
non_negative_int = _int_arg(0)


def check_output_path(path: str) -> None:
    """Raise ValueError unless a file can be written at `path`: checked before the run, not after it."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{path!r} is a folder; give a file path such as {os.path.join(path, 'result.json')!r}")
    if not os.path.exists(parent):
        raise ValueError(f"folder {parent!r} of {path!r} does not exist")
    if not os.path.isdir(parent):
        raise ValueError(f"{parent!r} in {path!r} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"cannot write {path!r}: permission denied")


def output_path_arg(text: str) -> str:
    """An argparse type: a file that can be written, checked at parsing (not after a long run)."""
    try:
        check_output_path(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, type=_base_url_arg,
                   help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--request-rate", type=_request_rate_arg, default=float("inf"),
                   help="requests/s (Poisson), > 0; inf = all at once")
    p.add_argument("--num-prompts", type=positive_int, default=30)
    p.add_argument("--input-len", type=positive_int, default=None,
                   help=f"random: prompt tokens per request (default {DEFAULT_INPUT_LEN})")
    p.add_argument("--random-prefix-len", type=non_negative_int, default=0,
                   help="tokens of one random prefix put before every prompt's --input-len tokens")
    p.add_argument("--output-len", type=positive_int, default=None,
                   help=f"tokens to generate per request (random: default {DEFAULT_OUTPUT_LEN}; sharegpt: default "
                        "the reply's length)")
    p.add_argument("--sharegpt-output-len", type=positive_int, default=None,
                   help="sharegpt: tokens to generate per request instead of the reply's length (vLLM's flag)")
    p.add_argument("--dataset-name", choices=("random", "sharegpt"), default=None,
                   help="random (default without --dataset-path) or sharegpt (the default with one)")
    p.add_argument("--dataset-path", default=None, metavar="FILE", help="a ShareGPT JSON file")
    p.add_argument("--burstiness", type=parse_args_of(parse_burstiness), default=1.0,
                   help="arrival shape at --request-rate: gamma-distributed gaps, 1 = Poisson, < 1 burstier, "
                        "> 1 more even")
    p.add_argument("--max-concurrency", type=positive_int, default=None,
                   help="most requests in flight at once (default: no limit); later ones wait for a slot")
    p.add_argument("--percentile-metrics", type=parse_args_of(parse_metric_names),
                   default=("ttft", "tpot", "itl", "e2el"),
                   help="metrics the table gives percentiles of (default ttft,tpot,itl,e2el)")
    p.add_argument("--metric-percentiles", type=parse_args_of(parse_percentiles), default=(99.0,),
                   help="percentiles of each metric, e.g. 50,90,99 (default 99)")
    p.add_argument("--goodput", nargs="+", type=_goodput_item, default=None, metavar="KEY:MS",
                   help="SLOs for 'Request goodput', e.g. ttft:500 tpot:50 (KEY one of ttft, tpot, e2el; ms): "
                        "completed requests within all of them, per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--json", dest="json_out", default=None, type=output_path_arg,
                   help="write the results and per-request data here")


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="online serving benchmark against a running server")
    add_args(p)
    p.set_defaults(func=run)


def _error_text(status: int, body: str) -> str:
    """`HTTP status: message`, the OpenAI error body's message when there is one, else the whole body."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.strip()
    return f"HTTP {status}: {message}"


async def _get_json(session, url: str, headers: dict, method: str = "GET", **kwargs):
    """The JSON `url` answers, or a UserError in one line: the checks before a run."""
    import aiohttp

    try:
        async with session.request(method, url, headers=headers, **kwargs) as r:
            if r.status != 200:
                hint = " (--api-key?)" if r.status == 401 else ""
                raise UserError(f"{method} {url} failed: {_error_text(r.status, await r.text())}{hint}")
            return await r.json(content_type=None)
    except aiohttp.ClientConnectionError as e:
        reason = getattr(getattr(e, "os_error", None), "strerror", None) or str(e) or type(e).__name__
        raise UserError(f"cannot connect to {url} ({reason}): is `fp8serve serve` running there? Check "
                        f"--base-url (the server's host and --port)") from None
    except (aiohttp.ClientError, ValueError) as e:
        raise UserError(f"{method} {url} failed: {type(e).__name__}: {e}") from None


async def _served_model(session, base_url: str, headers: dict, model: str | None) -> tuple[str, int | None]:
    """`model` (default: the server's first model), checked against /v1/models, and its max_model_len
    when the server reports one (fp8serve and vLLM do)."""
    data = (await _get_json(session, f"{base_url}/v1/models", headers)).get("data") or []
    served = {m["id"]: m.get("max_model_len") for m in data if "id" in m}
    if not served:
        raise UserError(f"{base_url}/v1/models lists no models")
    if model is None:
        model = next(iter(served))
    elif model not in served:
        raise UserError(f"--model {model!r} is not served by {base_url}; it serves: {', '.join(served)}")
    return model, served[model]


async def _id_pool(session, base_url: str, headers: dict, model: str) -> list[int]:
    body = {"model": model, "prompt": _ID_POOL_TEXT, "add_special_tokens": False}
    return sorted(set((await _get_json(session, f"{base_url}/tokenize", headers, "POST", json=body))["tokens"]))


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
                result.error = _error_text(r.status, await r.text())
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


async def _num_tokens(session, base_url: str, headers: dict, model: str, text: str, add_special_tokens: bool) -> int:
    body = {"model": model, "prompt": text, "add_special_tokens": add_special_tokens}
    return (await _get_json(session, f"{base_url}/tokenize", headers, "POST", json=body))["count"]


async def _sharegpt_prompts(session, base_url: str, headers: dict, model: str, pairs: list[tuple[str, str]],
                            num_prompts: int, seed: int, output_len: int | None,
                            max_model_len: int | None) -> list[tuple[str, int, int]]:
    """(prompt text, its tokens, tokens to generate) for up to `num_prompts` conversations that pass
    vLLM's filter, counted by the server's own tokenizer (what the requests will cost)."""
    chosen = []
    for i in sharegpt_order(len(pairs), seed):
        if len(chosen) == num_prompts:
            break
        prompt, reply = pairs[i]
        n_in = await _num_tokens(session, base_url, headers, model, prompt, True)
        n_out = output_len if output_len is not None else \
            await _num_tokens(session, base_url, headers, model, reply, False)
        if sharegpt_keeps(n_in, n_out, output_len is not None, max_model_len):
            chosen.append((prompt, n_in, n_out))
    return chosen


def arrival_gaps(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds between sends: gamma-distributed with mean 1 / request_rate and shape `burstiness`
    (vLLM's; shape 1 is the exponential of a Poisson process, drawn as one so seeds keep their
    arrivals), or zeros at an infinite rate."""
    if request_rate == float("inf"):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    if burstiness == 1.0:
        return [float(x) for x in rng.exponential(1.0 / request_rate, size=num)]
    return [float(x) for x in rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)]


async def benchmark(base_url: str, model: str | None, request_rate: float, num_prompts: int,
                    input_len: int | None = None, output_len: int | None = None, seed: int = 0,
                    api_key: str | None = None, random_prefix_len: int = 0, *, burstiness: float = 1.0,
                    max_concurrency: int | None = None, dataset_path: str | None = None,
                    percentiles: tuple[float, ...] = (99.0,), percentile_metrics: tuple[str, ...] | None = None,
                    goodput: dict[str, float] | None = None) -> dict:
    """`dataset_path` given: ShareGPT conversations (input_len and random_prefix_len must be left
    unset); else random prompts of input_len (default 512) tokens. output_len: tokens per request
    (random default 256; ShareGPT default: the reply's)."""
    import aiohttp  # here, not at import: every `fp8serve` command builds this parser

    sharegpt = dataset_path is not None
    if sharegpt and (input_len is not None or random_prefix_len):
        flag = "--input-len" if input_len is not None else "--random-prefix-len"
        raise ValueError(f"{flag} is for the random dataset; ShareGPT's prompts are the conversations' first turns")
    if not sharegpt:
        input_len = DEFAULT_INPUT_LEN if input_len is None else input_len
        output_len = DEFAULT_OUTPUT_LEN if output_len is None else output_len
    for name, value in (("num_prompts", num_prompts), ("input_len", input_len), ("output_len", output_len),
                        ("max_concurrency", max_concurrency)):
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if random_prefix_len < 0:
        raise ValueError(f"--random-prefix-len must be >= 0, got {random_prefix_len}")
    for flag, check, value in (("--request-rate", check_request_rate, request_rate),
                               ("--burstiness", check_burstiness, burstiness)):
        try:
            check(value)
        except ValueError as e:
            raise ValueError(f"{flag} {e}") from None
    base_url = normalize_base_url(base_url)
    pairs = load_sharegpt(dataset_path) if sharegpt else None  # a bad file before any request

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model, max_model_len = await _served_model(session, base_url, headers, model)
        if sharegpt:
            chosen = await _sharegpt_prompts(session, base_url, headers, model, pairs, num_prompts, seed, output_len,
                                             max_model_len)
            if not chosen:
                raise UserError(f"--dataset-path {dataset_path}: none of its {len(pairs)} conversations passes the "
                                "filter (prompt and reply >= 4 tokens, prompt <= 1024, prompt + output <= 2048 and "
                                f"<= the server's max_model_len {max_model_len})")
            if len(chosen) < num_prompts:
                print(f"warning: --dataset-path {dataset_path}: {len(chosen)} conversations pass the filter, fewer "
                      f"than --num-prompts {num_prompts}", file=sys.stderr)
        else:
            # The server would refuse every request (prompt + max_tokens over its limit): say so before the run.
            total = random_prefix_len + input_len + output_len
            if max_model_len is not None and total > max_model_len:
                prefix = f"--random-prefix-len {random_prefix_len} + " if random_prefix_len else ""
                raise UserError(f"{prefix}--input-len {input_len} + --output-len {output_len} = {total} tokens is "
                                f"more than the max_model_len {max_model_len} of {model!r} at {base_url}; lower them "
                                f"or start the server with --max-model-len {total} or more")
            ids = make_prompts(await _id_pool(session, base_url, headers, model), num_prompts, input_len, seed,
                               random_prefix_len)
            chosen = [(p, len(p), output_len) for p in ids]
        url = f"{base_url}/v1/completions"
        slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def send(prompt, prompt_len: int, max_tokens: int) -> RequestResult:
            payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            if slots is None:
                return await _send(session, url, headers, payload, prompt_len, start)
            async with slots:
                return await _send(session, url, headers, payload, prompt_len, start)

        tasks = []
        gaps = arrival_gaps(len(chosen), request_rate, burstiness, seed)
        start = time.perf_counter()
        for (prompt, prompt_len, max_tokens), gap in zip(chosen, gaps):
            tasks.append(asyncio.create_task(send(prompt, prompt_len, max_tokens)))
            if gap:
                await asyncio.sleep(gap)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    summary = summarize(results, duration, dict(base_url=base_url, model=model, request_rate=request_rate,
                                                burstiness=burstiness, max_concurrency=max_concurrency,
                                                dataset_name="sharegpt" if sharegpt else "random",
                                                dataset_path=dataset_path, num_prompts=num_prompts,
                                                input_len=input_len, random_prefix_len=random_prefix_len,
                                                output_len=output_len, seed=seed),
                        percentiles, goodput)
    if percentile_metrics is not None:
        summary["percentile_metrics"] = list(percentile_metrics)
    return summary


def _label(p: float) -> str:
    """99 -> "99", 99.9 -> "99.9": vLLM's names (p99_ttft_ms, "P99.9 TTFT")."""
    return str(int(p)) if int(p) == p else str(p)


def _stats(values: list[float], scale: float, percentiles: tuple[float, ...] = (99.0,)) -> dict:
    keys = ["mean", "median", "std"] + [f"p{_label(p)}" for p in sorted({99.0, *percentiles})]
    if not values:  # no successful request (or none with 2+ tokens): no latency, not a latency of 0
        return dict.fromkeys(keys)
    a = np.asarray(values) * scale
    out = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    out.update({f"p{_label(p)}": float(np.percentile(a, p)) for p in sorted({99.0, *percentiles})})
    return out


def _tpot(r: RequestResult) -> float:
    """Seconds per output token after the first; 0 for a one-token output (as vLLM counts it)."""
    return (r.latency - r.ttft) / (r.output_len - 1) if r.output_len > 1 else 0.0


def is_good(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    """A successful request within every SLO (vLLM's goodput)."""
    values = {"ttft": r.ttft, "tpot": _tpot(r), "e2el": r.latency}
    return r.success and all(values[k] * 1000 <= ms for k, ms in slos_ms.items())


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


def summarize(results: list[RequestResult], duration: float, config: dict,
              percentiles: tuple[float, ...] = (99.0,), goodput: dict[str, float] | None = None) -> dict:
    """The run's figures, as nested dicts (ttft_ms: {mean, median, std, p99, ...}) and as vLLM's
    flat result keys (mean_ttft_ms, p99_ttft_ms, duration, request_goodput, ttfts, itls, ...) for
    scripts written against vLLM's --save-result files."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    tpots = [_tpot(r) for r in ok if r.output_len > 1]
    values = {"ttft": [r.ttft for r in ok], "tpot": tpots, "itl": [x for r in ok for x in r.itl],
              "e2el": [r.latency for r in ok]}
    stats = {f"{m}_ms": _stats(values[m], 1000, percentiles) for m, _, _ in METRICS}
    flat = {f"{k}_{m}_ms": v for m, _, _ in METRICS for k, v in stats[f"{m}_ms"].items()}
    summary = {
        "config": config,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "first_error": next((r.error for r in results if r.error), None),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "saturated_output_throughput": saturated_output_throughput(results),
        "total_token_throughput": (total_in + total_out) / duration,
        **stats,
        **flat,
        "duration": duration,
        "percentiles": [float(p) for p in percentiles],
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "requests": [asdict(r) for r in results],
    }
    if goodput:
        summary["goodput_slos_ms"] = dict(goodput)
        summary["request_goodput"] = sum(is_good(r, goodput) for r in results) / duration
    return summary


def format_results(s: dict) -> str:
    w = 40
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label, value, fmt="{:<10.2f}"):
        text = "N/A" if value is None else f"{value}" if isinstance(value, int) else fmt.format(value)
        lines.append(f"{label:<{w}}{text:<10}")

    row("Successful requests:", s["completed"])
    if s["config"].get("max_concurrency"):
        row("Maximum request concurrency:", s["config"]["max_concurrency"])
    if s["failed"]:
        row("Failed requests:", s["failed"])
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    if s.get("request_goodput") is not None:
        row("Request goodput (req/s):", s["request_goodput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total Token throughput (tok/s):", s["total_token_throughput"])
    metrics = s.get("percentile_metrics") or [m for m, _, _ in METRICS]
    percentiles = s.get("percentiles") or [99.0]
    for key, title, name in METRICS:
        if key not in metrics:
            continue
        stats = s[f"{key}_ms"]
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {name} (ms):", stats["mean"])
        row(f"Median {name} (ms):", stats["median"])
        for p in percentiles:
            row(f"P{_label(p)} {name} (ms):", stats.get(f"p{_label(p)}"))
    lines.append("=" * 50)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        if args.json_out:  # the parser checked it; a caller that built `args` itself may not have
            check_output_path(args.json_out)
        dataset = args.dataset_name or ("sharegpt" if args.dataset_path else "random")
        if dataset == "sharegpt" and not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE (a ShareGPT JSON file)")
        output_len = args.output_len
        if args.sharegpt_output_len is not None:
            if dataset != "sharegpt":
                raise ValueError("--sharegpt-output-len is for --dataset-name sharegpt; use --output-len")
            if output_len is not None and output_len != args.sharegpt_output_len:
                raise ValueError(f"--output-len {output_len} and --sharegpt-output-len {args.sharegpt_output_len} "
                                 "disagree; give one")
            output_len = args.sharegpt_output_len
        if dataset == "random" and args.dataset_path:
            print(f"warning: --dataset-path {args.dataset_path} is not read: --dataset-name random makes its own "
                  "prompts", file=sys.stderr)
        summary = asyncio.run(benchmark(args.base_url, args.model, args.request_rate, args.num_prompts,
                                        args.input_len, output_len, args.seed, args.api_key,
                                        args.random_prefix_len, burstiness=args.burstiness,
                                        max_concurrency=args.max_concurrency,
                                        dataset_path=args.dataset_path if dataset == "sharegpt" else None,
                                        percentiles=args.metric_percentiles,
                                        percentile_metrics=args.percentile_metrics,
                                        goodput=parse_goodput(args.goodput) if args.goodput else None))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_results(summary))
    if summary["failed"]:
        total = summary["completed"] + summary["failed"]
        print(f"error: {summary['failed']} of {total} requests failed; the first: {summary['first_error']}",
              file=sys.stderr)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if summary["failed"] == 0 else 1
