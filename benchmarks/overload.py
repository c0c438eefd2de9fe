#!/usr/bin/env python
"""Overload run: far more requests than the server can hold, a KV budget small
enough to force preemption, and a fraction of clients that hang up at random.

Checks, and prints as a table:
  * every request that was not disconnected completes (HTTP 200, [DONE]) with
    exactly --output-len tokens (ignore_eos), and none hangs (--request-timeout);
  * /health stays 200 throughout (polled every 0.5 s);
  * afterwards every KV block is free and nothing runs or waits (from /metrics);
  * fp8serve:num_preemptions_total > 0 (the budget really was too small).

Starts its own server (`--base-url` to use a running one instead).

Example:
  python benchmarks/overload.py --num-requests 48 --request-rate 8 --kv-cache-memory 12MiB \\
      --kv-cache-dtype fp8 --json benchmarks/results/overload.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8serve.benchmarks.sweep import free_port, wait_healthy  # noqa: E402


def metrics(text: str) -> dict[str, float]:
    out = {}
    for name in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting", "num_preemptions_total",
                 "generation_tokens_total"):
        m = re.search(rf"^fp8serve:{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else float("nan")
    m = re.search(r'^fp8serve:cache_config_info\{.*num_blocks="(\d+)"', text, re.M)
    out["num_blocks"] = int(m.group(1)) if m else -1
    return out


async def one_request(session, url, model, prompt, output_len, disconnect_after: float | None, timeout: float):
    """('ok', tokens) | ('disconnected', tokens_seen) | ('error', message) | ('hung', tokens_seen)."""
    payload = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}}
    seen = 0
    usage = None
    done = False

    async def consume():
        nonlocal seen, usage, done
        async with session.post(url, json=payload) as r:
            if r.status != 200:
                return "error", f"HTTP {r.status}: {(await r.text())[:200]}"
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                msg = json.loads(data)
                if "error" in msg:
                    return "error", msg["error"]["message"]
                if msg.get("usage"):
                    usage = msg["usage"]["completion_tokens"]
                if msg.get("choices"):
                    seen += 1
        if not done or usage is None:
            return "error", f"stream ended without [DONE]/usage after {seen} chunks"
        return "ok", usage

    task = asyncio.ensure_future(consume())
    try:
        if disconnect_after is not None:
            finished, _ = await asyncio.wait({task}, timeout=disconnect_after)
            if not finished:
                task.cancel()  # closes the connection mid-request
                await asyncio.gather(task, return_exceptions=True)
                return "disconnected", seen
            return task.result()
        return await asyncio.wait_for(task, timeout)
    except asyncio.TimeoutError:
        return "hung", seen
    except aiohttp.ClientError as e:
        return "error", f"{type(e).__name__}: {e}"


async def drive(args, base_url: str) -> dict:
    rng = random.Random(args.seed)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async with session.get(f"{base_url}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        health_codes: list[int] = []
        stop = asyncio.Event()

        async def poll_health():
            while not stop.is_set():
                try:
                    async with session.get(f"{base_url}/health") as r:
                        health_codes.append(r.status)
                except aiohttp.ClientError:
                    health_codes.append(0)
                await asyncio.sleep(0.5)

        poller = asyncio.ensure_future(poll_health())
        tasks, plans = [], []
        start = time.perf_counter()
        for i in range(args.num_requests):
            prompt = [rng.randrange(100, 1000) for _ in range(args.input_len)]
            disconnect = rng.uniform(0.2, args.max_disconnect_s) if rng.random() < args.disconnect_fraction else None
            plans.append(disconnect)
            tasks.append(asyncio.ensure_future(one_request(session, f"{base_url}/v1/completions", model, prompt,
                                                           args.output_len, disconnect, args.request_timeout)))
            await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        # Aborts are applied between engine steps; give the loop a moment.
        final = {}
        for _ in range(100):
            async with session.get(f"{base_url}/metrics") as r:
                final = metrics(await r.text())
            if final["kv_cache_usage_perc"] == 0 and final["num_requests_running"] == 0 \
                    and final["num_requests_waiting"] == 0:
                break
            await asyncio.sleep(0.2)
        stop.set()
        await poller
        async with session.get(f"{base_url}/health") as r:
            health_codes.append(r.status)

    kept = [r for r, d in zip(results, plans) if d is None]
    cut = [r for r, d in zip(results, plans) if d is not None]
    wrong = [r for r in kept if r[0] != "ok" or r[1] != args.output_len]
    summary = {
        "num_requests": args.num_requests,
        "request_rate": args.request_rate,
        "duration_s": duration,
        "kept": len(kept),
        "kept_completed_exact": len(kept) - len(wrong),
        "kept_wrong": [list(r) for r in wrong][:10],
        "disconnect_planned": len(cut),
        "disconnected_mid_request": sum(r[0] == "disconnected" for r in cut),
        "disconnect_planned_but_finished_first": sum(r[0] == "ok" for r in cut),
        "hung": sum(r[0] == "hung" for r in results),
        "errors": sum(r[0] == "error" for r in results),
        "health_checks": len(health_codes),
        "health_non_200": sum(c != 200 for c in health_codes),
        "final_metrics": final,
    }
    summary["passed"] = (not wrong and summary["hung"] == 0 and summary["health_non_200"] == 0
                         and final["kv_cache_usage_perc"] == 0 and final["num_requests_running"] == 0
                         and final["num_requests_waiting"] == 0)
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="use a running server instead of starting one")
    p.add_argument("--model", default=None, help="checkpoint for the started server (default: built-in model)")
    p.add_argument("--kv-cache-dtype", default="fp8")
    p.add_argument("--kv-cache-memory", default="12MiB")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--request-rate", type=float, default=8.0)
    p.add_argument("--input-len", type=int, default=96)
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--disconnect-fraction", type=float, default=0.2)
    p.add_argument("--max-disconnect-s", type=float, default=20.0)
    p.add_argument("--request-timeout", type=float, default=1200.0, help="a kept request slower than this 'hung'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", default=None)
    args = p.parse_args()

    proc = None
    base_url = args.base_url
    if base_url is None:
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "fp8serve.entrypoints.cli", "serve", *([args.model] if args.model else []),
               "--kv-cache-dtype", args.kv_cache_dtype, "--kv-cache-memory", args.kv_cache_memory,
               "--max-model-len", str(args.max_model_len), "--port", str(port)]
        print("server:", " ".join(cmd), flush=True)
        log = tempfile.NamedTemporaryFile("w+", prefix="fp8serve-overload-", suffix=".log", delete=False)
        print("server log:", log.name, flush=True)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        wait_healthy(base_url, proc, 900)
    try:
        summary = asyncio.run(drive(args, base_url))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            summary_rc = proc.wait(timeout=120)
            out = Path(log.name).read_text()
            kv_line = next((ln for ln in out.splitlines() if "KV cache:" in ln), "")
    if proc is not None:
        summary["server_exit_code"] = summary_rc
        summary["server_kv_cache_line"] = kv_line.split("] ", 1)[-1]
    for k, v in summary.items():
        print(f"{k:<40}{v}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), **summary}, indent=1))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
