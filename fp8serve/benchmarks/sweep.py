"""`fp8serve bench sweep`: the seed PR's table, one server per configuration.

For each `MODEL@KVDTYPE` configuration: start `fp8serve serve` on a free
loopback port with the same `--kv-cache-memory`, wait for /health, read the
block count from `fp8serve:cache_config_info`, run `bench serve`, stop the
server with SIGTERM. Prints Model dtype | KV dtype | blocks | TTFT | ITL |
e2e and writes the table, the raw results and a plot to `--out-dir`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from fp8serve.benchmarks.serve import benchmark, format_results, non_negative_int, positive_int
from fp8serve.config import DTYPE_CHOICES, KV_CACHE_DTYPE_CHOICES
from fp8serve.entrypoints.engine_args import add_quantization_arg, human_readable_int
from fp8serve.errors import UserError

# The seed PR's workload (QPS 1, 30 requests, 512 in / 256 out), and one that
# takes a minute or two per configuration on a two-core CPU. max_model_len is
# not a requirement of the workload (prompt + output is): it is the server
# setting of the published results (benchmarks/results/*/sweep.md), kept so
# that they can be reproduced. It leaves the block count and the requests'
# output unchanged, but the server checks it against --kv-cache-memory (one
# request of max_model_len tokens must fit) and, without chunked prefill,
# against --max-num-batched-tokens; --max-model-len overrides it.
WORKLOADS = {
    "seed": dict(request_rate=1.0, num_prompts=30, input_len=512, output_len=256, max_model_len=1024),
    "cpu": dict(request_rate=0.5, num_prompts=16, input_len=128, output_len=32, max_model_len=512),
    # Saturation (every request at once) with a KV budget as the limit: pair
    # it with --kv-cache-memory 90MiB, which holds exactly 8 requests of 512
    # tokens of the default model in 16-bit storage (256 blocks) and 16 in FP8.
    "kv-saturation": dict(request_rate=float("inf"), num_prompts=48, input_len=256, output_len=256,
                          max_model_len=512),
}
DEFAULT_CONFIGS = "default@auto,default@bfloat16,default@fp8"


def register(subparsers) -> None:
    p = subparsers.add_parser("sweep", help="the seed's table: one server per MODEL@KVDTYPE, bench serve on each")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="comma-separated MODEL@KVDTYPE; MODEL 'default' is the built-in model")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="cpu")
    p.add_argument("--kv-cache-memory", default="128MiB", help="the same budget for every configuration")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="compute dtype passed to every server")
    add_quantization_arg(p, scope="Passed to every server")
    p.add_argument("--num-prompts", type=positive_int, default=None, help="override the workload's request count")
    p.add_argument("--max-model-len", type=human_readable_int, default=None,
                   help="passed to every server (default: the workload's, that of its published results); "
                        "at least --random-prefix-len + the workload's input + output lengths")
    p.add_argument("--random-prefix-len", type=non_negative_int, default=0,
                   help="tokens of one random prefix before every prompt (bench serve's flag; pair it with "
                        "--enable-prefix-caching)")
    p.add_argument("--enable-prefix-caching", action="store_true", help="passed to every server")
    p.add_argument("--enable-chunked-prefill", action="store_true", help="passed to every server")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None, help="passed to every server")
    p.add_argument("--speculative-config", default=None, metavar="JSON", help="passed to every server")
    p.add_argument("--out-dir", default="benchmarks/results/sweep")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=_positive_float, default=600.0,
                   help="seconds to wait for each server's /health")
    p.set_defaults(func=run)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:  # also false for nan
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def log_error(log_path: Path) -> str:
    """The server log's error message: its last `error:` line (the CLI's and argparse's) or exception
    line (a traceback's last), else its last line; '' for an empty or missing log."""
    try:
        lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    for line in reversed(lines):
        if re.search(r"(^|[\s\]:])error:|^[\w.]+(Error|Exception)\b|^(ERROR|CRITICAL)\b", line, re.I):
            # "error: ..." (fp8serve's CLI) and "fp8serve serve: error: ..." (argparse): the message alone
            return re.sub(r"^(fp8serve \w+: )?error:\s*", "", line)
    return lines[-1] if lines else ""


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout: float, log_path: Path | None = None) -> None:
    """Return once the server answers /health; a UserError that quotes the server's own error message
    (which is only in its log) if it exits or does not come up in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            message = log_error(log_path) if log_path else ""
            raise UserError(f"server exited with {proc.returncode} before becoming healthy: "
                            f"{message or '(no message)'}" + (f" (log: {log_path})" if log_path else ""))
        if _get(f"{base_url}/health")[0] == 200:
            return
        time.sleep(0.5)
    message = log_error(log_path) if log_path else ""
    raise UserError(f"server not healthy after {timeout:g} s (--startup-timeout)"
                    + (f"; the log's last message: {message}" if message else "")
                    + (f" (log: {log_path})" if log_path else ""))


def cache_config(base_url: str) -> dict:
    _, text = _get(f"{base_url}/metrics")
    m = re.search(r"^fp8serve:cache_config_info\{([^}]*)\}", text, re.M)
    if not m:
        raise RuntimeError("fp8serve:cache_config_info not found in /metrics")
    return dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))


def num_preemptions(base_url: str) -> int | None:
    """The server's `fp8serve:num_preemptions_total` counter (None if absent)."""
    _, text = _get(f"{base_url}/metrics")
    m = re.search(r"^fp8serve:num_preemptions_total(?:\{[^}]*\})? (\S+)", text, re.M)
    return int(float(m.group(1))) if m else None


def _weights_dtype(log_path: Path) -> str:
    """The server's "Loaded DIR (ARCH, WEIGHTS weights)" line's WEIGHTS: "float32", "fp8",
    "fp8 (quantized at load)" (--quantization fp8), "bfloat16 (float32 compute)", ..."""
    m = re.search(r"Loaded .*\(\w+, (.+) weights\)", log_path.read_text())
    return m.group(1) if m else "?"


def max_model_len_of(workload: dict, args) -> int:
    """--max-model-len when given, else the workload's, grown to hold the prefix, prompt and output."""
    if getattr(args, "max_model_len", None) is not None:
        return args.max_model_len
    return max(workload["max_model_len"], args.random_prefix_len + workload["input_len"] + workload["output_len"])


def parse_configs(text: str, quantization: str | None = None) -> list[tuple[str, str]]:
    """(model, KV dtype) of each comma-separated MODEL@KVDTYPE, checked before any server starts;
    `quantization` (-q, passed to every server) against each checkpoint's own quantization_config."""
    from fp8serve.config import check_quantization_flag, read_hf_config

    specs = [spec.strip() for spec in text.split(",") if spec.strip()]
    if not specs:
        raise UserError(f"--configs {text!r} names no configuration (expected comma-separated MODEL@KVDTYPE, "
                        f"e.g. {DEFAULT_CONFIGS})")
    configs = []
    for spec in specs:
        model, _, kv_dtype = spec.partition("@")
        model, kv_dtype = model.strip(), kv_dtype.strip() or "auto"
        if not model:
            raise UserError(f"--configs entry {spec!r}: no MODEL before '@' (use 'default' for the built-in model)")
        if kv_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise UserError(f"--configs entry {spec!r}: KV cache dtype {kv_dtype!r} is not one of "
                            f"{', '.join(KV_CACHE_DTYPE_CHOICES)}")
        if model != "default":
            try:
                hf_config, cfg_path = read_hf_config(model)
                if quantization is not None:
                    check_quantization_flag(quantization, hf_config.get("quantization_config"), cfg_path)
            except UserError as e:
                raise UserError(f"--configs entry {spec!r}: {e}") from None
        configs.append((model, kv_dtype))
    return configs


def check_out_dir(path: Path) -> None:
    """Raise a UserError unless `path` is, or can be made, a writable folder (checked before any server)."""
    if path.exists():
        if not path.is_dir():
            raise UserError(f"--out-dir {str(path)!r} is a file, not a folder")
        parent = path
    else:
        parent = path.absolute().parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise UserError(f"--out-dir {str(path)!r}: {str(parent)!r} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--out-dir {str(path)!r}: cannot write in {str(parent)!r} (permission denied)")


def check_server_flags(workload: dict, args) -> None:
    """What each server would reject at startup, checked once before any starts: the flags' syntax and the
    engine's own checks that need no model."""
    from fp8serve.config import SchedulerConfig, SpeculativeConfig
    from fp8serve.utils.memory import parse_size

    try:
        if parse_size(args.kv_cache_memory) < 1:
            raise ValueError("must be more than 0 bytes")
    except ValueError as e:
        raise UserError(f"--kv-cache-memory {args.kv_cache_memory!r}: {e}") from None
    SpeculativeConfig.parse(args.speculative_config)
    max_model_len = max_model_len_of(workload, args)
    need = args.random_prefix_len + workload["input_len"] + workload["output_len"]
    prefix = f"--random-prefix-len {args.random_prefix_len} + " if args.random_prefix_len else ""
    if max_model_len < need:
        raise UserError(f"--max-model-len {max_model_len} is less than the {prefix}{workload['input_len']} input + "
                        f"{workload['output_len']} output tokens of workload '{args.workload}' ({need})")
    if (args.max_num_batched_tokens is not None and not args.enable_chunked_prefill
            and args.max_num_batched_tokens < max_model_len):
        origin = ("" if args.max_model_len is not None else
                  f" (workload '{args.workload}' runs its servers with --max-model-len {max_model_len}, the setting "
                  f"of its published results; it needs {need}, so --max-model-len {need} also works)")
        raise UserError(f"--max-num-batched-tokens ({args.max_num_batched_tokens}) is smaller than --max-model-len "
                        f"({max_model_len}){origin}: without --enable-chunked-prefill a whole prompt is one "
                        f"step, so raise it, lower --max-model-len, or add --enable-chunked-prefill")
    SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_model_len,
                    enable_chunked_prefill=args.enable_chunked_prefill)


def server_command(model: str, kv_dtype: str, workload: dict, args, port: int) -> list[str]:
    """The `fp8serve serve` command line of one configuration: the sweep's shared flags, and a
    --max-model-len that holds the workload's prefix, prompt and output."""
    cmd = [sys.executable, "-m", "fp8serve.entrypoints.cli", "serve"]
    if model != "default":
        cmd.append(model)
    max_model_len = max_model_len_of(workload, args)
    cmd += ["--kv-cache-dtype", kv_dtype, "--kv-cache-memory", args.kv_cache_memory, "--dtype", args.dtype,
            "--max-model-len", str(max_model_len), "--port", str(port), "--seed", str(args.seed)]
    if args.quantization is not None:
        cmd += ["--quantization", args.quantization]
    if args.enable_prefix_caching:
        cmd.append("--enable-prefix-caching")
    if args.enable_chunked_prefill:
        cmd.append("--enable-chunked-prefill")
    if args.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.speculative_config is not None:
        cmd += ["--speculative-config", args.speculative_config]
    return cmd


def run_config(model: str, kv_dtype: str, workload: dict, args, out_dir: Path, index: int) -> dict:
    spec = f"{model}@{kv_dtype}"
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = server_command(model, kv_dtype, workload, args, port)
    log_path = out_dir / f"server_{index}_{kv_dtype}.log"
    print(f"[{spec}] starting: {' '.join(cmd)}", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        try:
            wait_healthy(base_url, proc, args.startup_timeout, log_path)
        except UserError as e:
            raise UserError(f"[{spec}] {e}") from None
        cache = cache_config(base_url)
        summary = asyncio.run(benchmark(
            base_url, None, workload["request_rate"], workload["num_prompts"], workload["input_len"],
            workload["output_len"], seed=args.seed, random_prefix_len=args.random_prefix_len))
        preemptions = num_preemptions(base_url)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    print(format_results(summary), flush=True)
    with open(out_dir / f"bench_{index}_{kv_dtype}.json", "w") as f:
        json.dump(summary, f, indent=1)
    return {
        "config": spec,
        "model": model,
        "model_dtype": _weights_dtype(log_path),
        "kv_cache_dtype": cache["kv_cache_dtype"],
        "num_blocks": int(cache["num_blocks"]),
        "block_size": int(cache["block_size"]),
        "ttft_ms": summary["ttft_ms"]["mean"],
        "itl_ms": summary["itl_ms"]["mean"],
        "tpot_ms": summary["tpot_ms"]["mean"],
        "e2e_s": None if summary["e2el_ms"]["mean"] is None else summary["e2el_ms"]["mean"] / 1000,
        "output_throughput": summary["output_throughput"],
        "saturated_output_throughput": summary.get("saturated_output_throughput"),
        "duration_s": summary["duration_s"],
        "num_preemptions": preemptions,
        "completed": summary["completed"],
        "failed": summary["failed"],
        "server_exit_code": rc,
    }


def model_label(model: str | None) -> str:
    """A checkpoint directory by its last path component ("default" stays), which is what tells rows apart."""
    return "-" if not model else Path(model.rstrip("/")).name or model


def format_table(rows: list[dict]) -> str:
    """The seed's columns, then output tok/s over the whole run and at
    saturation (until the last request's first token, see
    serve.saturated_output_throughput), each with its ratio to the first row
    (rows without them, from older sweep.json files, show -). A Model column
    leads when the rows span more than one model: dtypes alone would not say which row is which."""
    models = [r.get("model") for r in rows]
    with_model = len(set(models)) > 1
    lines = [("| Model " if with_model else "") + "| Model dtype | KV dtype | blocks | TTFT (ms) | ITL (ms) | e2e (s) "
             "| output tok/s | vs first row | saturated tok/s | vs first row | preemptions |",
             ("|---" if with_model else "") + "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cells(r: dict, key: str) -> str:
        value, base = r.get(key), rows[0].get(key)
        ratio = f"{value / base:.2f}x" if value and base else "-"
        return f"{f'{value:.1f}' if value else '-'} | {ratio}"

    def num(value) -> str:  # None: no request succeeded, so no latency (not a latency of 0)
        return "-" if value is None else f"{value:.1f}"

    for r, model in zip(rows, models):
        pre = r.get("num_preemptions")
        lead = f"| {model_label(model)} " if with_model else ""
        lines.append(f"{lead}| {r['model_dtype']} | {r['kv_cache_dtype']} | {r['num_blocks']} | {num(r['ttft_ms'])} | "
                     f"{num(r['itl_ms'])} | {num(r['e2e_s'])} | {cells(r, 'output_throughput')} | "
                     f"{cells(r, 'saturated_output_throughput')} | {'-' if pre is None else pre} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model_dtype']}\nKV {r['kv_cache_dtype']}" for r in rows]
    if len({r.get("model") for r in rows}) > 1:
        labels = [f"{model_label(r.get('model'))}\n{label}" for r, label in zip(rows, labels)]
    panels = [("num_blocks", "KV cache blocks"), ("ttft_ms", "mean TTFT (ms)"), ("itl_ms", "mean ITL (ms)"),
              ("e2e_s", "mean e2e (s)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, (key, name) in zip(axes, panels):
        ax.bar(range(len(rows)), [float("nan") if r[key] is None else r[key] for r in rows], color="tab:blue")
        ax.set_xticks(range(len(rows)), labels, fontsize=8)
        ax.set_title(name)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    workload = dict(WORKLOADS[args.workload])
    if args.num_prompts is not None:
        workload["num_prompts"] = args.num_prompts
    # The parser checks these; a caller that built `args` itself may not have.
    if args.random_prefix_len < 0:
        raise UserError(f"--random-prefix-len must be >= 0, got {args.random_prefix_len}")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        raise UserError(f"--max-num-batched-tokens must be >= 1, got {args.max_num_batched_tokens}")
    # Everything that can be checked is, before the first server starts (each takes a while).
    configs = parse_configs(args.configs, args.quantization)
    check_server_flags(workload, args)
    out_dir = Path(args.out_dir)
    check_out_dir(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out-dir {args.out_dir!r}: cannot create it ({e.strerror})") from None
    max_model_len = max_model_len_of(workload, args)
    prefix = f"{args.random_prefix_len} shared prefix + " if args.random_prefix_len else ""
    engine_flags = f", --quantization {args.quantization}" if args.quantization is not None else ""
    engine_flags += "".join(f", --{name.replace('_', '-')}"
                            for name in ("enable_prefix_caching", "enable_chunked_prefill") if getattr(args, name))
    if args.max_num_batched_tokens is not None:
        engine_flags += f", --max-num-batched-tokens {args.max_num_batched_tokens}"
    if args.speculative_config is not None:
        engine_flags += f", --speculative-config '{args.speculative_config}'"
    desc = (f"workload '{args.workload}': QPS {workload['request_rate']}, {workload['num_prompts']} requests, "
            f"{prefix}{workload['input_len']} in / {workload['output_len']} out (ignore_eos, temperature 0), "
            f"--kv-cache-memory {args.kv_cache_memory}, --max-model-len {max_model_len}{engine_flags}")
    print(desc, flush=True)
    rows = [run_config(model, kv_dtype, workload, args, out_dir, i) for i, (model, kv_dtype) in enumerate(configs)]
    table = format_table(rows)
    print(desc)
    print(table)
    (out_dir / "sweep.md").write_text(f"{desc}\n\n{table}\n")
    with open(out_dir / "sweep.json", "w") as f:
        json.dump({"workload": args.workload, **workload, "max_model_len": max_model_len,
                   "kv_cache_memory": args.kv_cache_memory, "quantization": args.quantization,
                   "random_prefix_len": args.random_prefix_len, "enable_prefix_caching": args.enable_prefix_caching,
                   "enable_chunked_prefill": args.enable_chunked_prefill,
                   "max_num_batched_tokens": args.max_num_batched_tokens,
                   "speculative_config": args.speculative_config, "rows": rows}, f, indent=1)
    plot(rows, out_dir / "sweep.png", desc)
    print(f"wrote {out_dir}/sweep.md, sweep.json, sweep.png")
    return 0 if all(r["failed"] == 0 for r in rows) else 1
