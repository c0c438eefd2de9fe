"""Does a huge prompt hold up the rest of the server while it is tokenized?

Starts `fp8serve serve` (a subprocess, the default model unless --model),
sends one completion request whose prompt is --prompt-chars characters (far
longer than --max-model-len, so after tokenizing it the server answers 400:
what is timed is the tokenization, not generation), and meanwhile polls
GET /health every --poll-interval seconds. Prints how long each /health call
took while the big request was in the server, against the same calls on an
idle server.

Why: the OpenAI handlers are coroutines on one event loop; tokenizing a prompt
of megabytes (seconds) on that loop stops every other request, /health
included. The server tokenizes on a worker thread (api_server.ServerState
.off_loop); this measures that it does.

    .venv/bin/python benchmarks/server_tokenize_stall.py
    .venv/bin/python benchmarks/server_tokenize_stall.py --prompt-chars 2000000 --model DIR
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from bench_common import model_and_vocab, print_header, require_positive


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_ms(url: str) -> float:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=120) as r:
        r.read()
    return (time.perf_counter() - t0) * 1e3


def _start_server(args, port: int) -> subprocess.Popen:
    model, _ = model_and_vocab(args.model)
    cmd = [sys.executable, "-m", "fp8serve.entrypoints.cli", "serve", str(model), "--port", str(port),
           "--max-model-len", str(args.max_model_len), "--kv-cache-memory", args.kv_cache_memory,
           "--dtype", args.dtype, "--disable-log-stats"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, FP8SERVE_LOGGING_LEVEL="WARNING"))
    deadline = time.monotonic() + 600  # a cold start may build the C++ kernels
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited early:\n{proc.stderr.read()}")
        try:
            _get_ms(f"http://127.0.0.1:{port}/health")
            return proc
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become healthy in 600 s")


def measure(args) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start_server(args, port)
    try:
        idle = [_get_ms(f"{url}/health") for _ in range(20)]
        body = json.dumps({"prompt": "a " * (args.prompt_chars // 2), "max_tokens": 2}).encode()
        result: dict = {}

        def big_request() -> None:
            req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                         headers={"content-type": "application/json"})
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(req, timeout=600) as r:
                    result["status"] = r.status
            except urllib.error.HTTPError as e:
                result["status"] = e.code
            result["seconds"] = time.perf_counter() - t0

        thread = threading.Thread(target=big_request)
        thread.start()
        busy = []
        while thread.is_alive():
            busy.append(_get_ms(f"{url}/health"))
            time.sleep(args.poll_interval)
        thread.join()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"idle": idle, "busy": busy, **result}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    p.add_argument("--prompt-chars", type=int, default=7_000_000,
                   help="characters of the big prompt (default 7000000; the server takes bodies up to 8 MiB)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--poll-interval", type=float, default=0.05, help="seconds between /health calls")
    args = p.parse_args(argv)
    require_positive(p, args, "prompt_chars", "max_model_len")
    if not args.poll_interval > 0:
        p.error(f"--poll-interval must be > 0, got {args.poll_interval}")
    print_header("fp8serve server: /health while a huge prompt is tokenized", argv)
    r = measure(args)
    print(f"\nbig request: {args.prompt_chars} characters, HTTP {r['status']} after {r['seconds']:.2f} s\n")
    print("| server | /health calls | median ms | max ms |")
    print("|---|---|---|---|")
    for name, calls in (("idle", r["idle"]), ("during the big request", r["busy"])):
        if calls:
            print(f"| {name} | {len(calls)} | {statistics.median(calls):.1f} | {max(calls):.1f} |")
        else:
            print(f"| {name} | 0 | - | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
