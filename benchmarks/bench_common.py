"""Helpers the benchmark scripts share: timing, the machine description
every results file starts with, the exact command line, and prompt tokens.

Scripts import it as a sibling (`python benchmarks/X.py` puts benchmarks/
first on sys.path; tests/benchmark_scripts.py does the same)."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import random
import shlex
import sys
import time
from pathlib import Path

import torch

# CPU features the results files report (present or not).
REPORTED_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def best_time(fn, min_time: float, repeats: int, warmup: int = 3) -> float:
    """Seconds per call: best of `repeats` timed loops of about min_time/repeats each."""
    for _ in range(warmup):
        fn()
    t = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t, 1e-7)
    inner = max(1, int(min_time / repeats / once))
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t) / inner)
    return best


@contextlib.contextmanager
def cpu_ops_served_by(ops):
    """Inside, every imported fp8serve module's `load_cpu_ops` returns `ops` (an object standing in
    for torch.ops.fp8serve: another build's op, timed ops). The engine looks its ops up at call time,
    so this reaches every C++ op call of an engine built before or inside the block."""
    from fp8serve.kernels import cpu_ops

    real = cpu_ops.load_cpu_ops
    modules = [m for name, m in list(sys.modules.items())
               if name.startswith("fp8serve") and getattr(m, "load_cpu_ops", None) is real]
    for m in modules:
        m.load_cpu_ops = lambda: ops
    try:
        yield
    finally:
        for m in modules:
            m.load_cpu_ops = real


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed (interpreter relative to the working directory)."""
    exe = os.path.relpath(sys.executable) if sys.executable else "python"
    args = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    return " ".join(shlex.quote(a) for a in [exe, *args])


def require_positive(parser, args, *names: str) -> None:
    """parser.error unless every option in `names` (argparse dest names) is >= 1."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def check_engine_args(parser, args) -> None:
    """parser.error unless --dtype, --kv-cache-dtype and --kv-cache-memory are values the engine takes."""
    from fp8serve.config import DTYPE_CHOICES, KV_CACHE_DTYPE_CHOICES
    from fp8serve.utils.memory import parse_size

    if args.dtype not in DTYPE_CHOICES:
        parser.error(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {args.dtype!r}")
    if args.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
        parser.error(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, "
                     f"got {args.kv_cache_dtype!r}")
    try:
        parse_size(args.kv_cache_memory)
    except ValueError as e:
        parser.error(f"--kv-cache-memory: {e}")


def model_and_vocab(model: str | None) -> tuple[Path, int]:
    """The checkpoint directory of a --model option (None: the built-in default model) and its
    config.json's vocab_size."""
    import json

    from fp8serve.default_model import ensure_default_model

    path = Path(model) if model else Path(ensure_default_model())
    return path, int(json.loads((path / "config.json").read_text())["vocab_size"])


def print_header(title: str, argv: list[str] | None) -> None:
    """The title, the command as typed and the machine: the head of every results file."""
    print(f"# {title}\n")
    print(f"command: `{command_line(argv)}`\n")
    for line in describe_machine(machine_info()):
        print(line)


def machine_info() -> dict:
    """CPU model and features, memory, software versions, whether the C++
    kernels built, and the load average before the run."""
    from fp8serve.utils.platform import cpu_flags

    cpu = platform.processor() or "unknown"
    mem_gib = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
        with open("/proc/meminfo") as f:
            mem_gib = next((round(int(ln.split()[1]) / 2**20, 1) for ln in f if ln.startswith("MemTotal:")), None)
    except OSError:
        pass
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    try:
        from fp8serve.kernels.cpu_ops import load_cpu_ops

        kernels = load_cpu_ops() is not None
    except Exception:  # noqa: BLE001 - reported, not fatal
        kernels = False
    flags = cpu_flags()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "gpu": gpu,
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "flags": {f: f in flags for f in REPORTED_FLAGS},
        "mem_gib": mem_gib,
        "torch": torch.__version__,
        "transformers": tf_version,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "cpu_kernels": kernels,
        "loadavg_at_start": os.getloadavg(),
    }


def cpu_busy_by_others(seconds: float = 1.0, stat_path: str = "/proc/stat") -> float | None:
    """How many CPUs other processes kept busy over the next `seconds` (the machine's busy time from
    /proc/stat less this process's own CPU time, in CPUs), or None where /proc/stat cannot be read.
    Why: the load average trails by minutes, so it still counts a job that has just ended."""
    def snapshot():
        with open(stat_path) as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields) - idle, time.process_time()

    try:
        busy0, own0 = snapshot()
        t0 = time.monotonic()
        time.sleep(seconds)
        busy1, own1 = snapshot()
        elapsed = time.monotonic() - t0
    except (OSError, ValueError, IndexError):
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return busy_cpus(busy1 - busy0, hz, own1 - own0, elapsed)


def busy_cpus(busy_ticks: int, hz: int, own_seconds: float, elapsed: float) -> float:
    """CPUs busy with other work: busy clock ticks of the whole machine less this process's CPU seconds,
    over `elapsed` seconds (never below 0)."""
    return max(0.0, (busy_ticks / hz - own_seconds) / elapsed) if elapsed > 0 else 0.0


def describe_machine(info: dict) -> list[str]:
    """The results files' machine and software lines."""
    flags = " ".join(f"{k}={'yes' if v else 'no'}" for k, v in info["flags"].items())
    tf = f" | transformers {info['transformers']}" if info.get("transformers") else ""
    gpu = f" | GPU: {info['gpu']}" if info.get("gpu") else ""
    return [
        f"machine: {info['cpu_model']} | {info['cpu_count']} CPUs | {info['mem_gib']} GiB{gpu} | flags: {flags}",
        f"software: torch {info['torch']}{tf} | python {info['python']} | torch threads {info['torch_threads']} | "
        f"fp8serve C++ kernels {'yes' if info['cpu_kernels'] else 'no'} | loadavg at start {info['loadavg_at_start']}",
    ]


# (namespace, source) -> what was built into it in this process: a commit, or "working tree"
# with a digest of its files. Kept on `sys`, not here: a script loaded twice (tests load them
# afresh) gets a new copy of this module, but torch's op registrations live as long as the process.
_BUILT_AT_REV: dict[tuple[str, str], str] = sys.__dict__.setdefault("_fp8serve_kernels_built_at_rev", {})

_KERNEL_SOURCES = "fp8serve/kernels/cpu"


def build_kernel_at_rev(rev: str, source: str, namespace: str) -> object:
    """The ops of one kernel source file (fp8serve/kernels/cpu/SOURCE, with
    the headers beside it) as of git revision `rev`, built with the engine's
    flags and registered under torch.ops.NAMESPACE instead of fp8serve, so a
    benchmark can time them side by side with this tree's. Built once per
    process: an op can be registered once only (a second registration aborts
    the process), so asking again for the same source in the same namespace
    returns the first build if it is of the same commit, and is an error if
    not. Other sources may share a namespace (their ops differ)."""
    import subprocess

    repo = Path(__file__).resolve().parent.parent
    resolved = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=repo, capture_output=True,
                              text=True)
    if resolved.returncode != 0:
        raise SystemExit(f"--baseline-rev {rev}: git cannot list {_KERNEL_SOURCES} there ({resolved.stderr.strip()})")
    commit = resolved.stdout.strip()
    if (namespace, source) in _BUILT_AT_REV:
        return _built_before(namespace, source, commit, rev)
    listing = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{_KERNEL_SOURCES}"], cwd=repo,
                             capture_output=True, text=True)
    if listing.returncode != 0:
        raise SystemExit(f"--baseline-rev {rev}: git cannot list {_KERNEL_SOURCES} there ({listing.stderr.strip()})")
    names = listing.stdout.split()
    if source not in names:
        raise SystemExit(f"{_KERNEL_SOURCES}/{source} does not exist at {rev}")
    texts = {name: subprocess.run(["git", "show", f"{rev}:{_KERNEL_SOURCES}/{name}"], cwd=repo, check=True,
                                  capture_output=True, text=True).stdout
             for name in names if name.endswith(".h") or name == source}
    _build_alone(texts, source, namespace, f"{_KERNEL_SOURCES}/{source} at {rev}")
    _BUILT_AT_REV[(namespace, source)] = commit
    return getattr(torch.ops, namespace)


def build_kernel_from_tree(source: str, namespace: str) -> object:
    """build_kernel_at_rev for the files as they are in this working tree: the
    same source the engine's library holds, built alone as a baseline is. Timed
    against this tree's library it is an A/A (the same code in two builds);
    timed against build_kernel_at_rev's build it compares like with like."""
    import hashlib

    csrc = Path(__file__).resolve().parent.parent / _KERNEL_SOURCES
    if not (csrc / source).is_file():
        raise SystemExit(f"{_KERNEL_SOURCES}/{source} does not exist in this working tree")
    texts = {p.name: p.read_text() for p in sorted(csrc.iterdir()) if p.suffix == ".h" or p.name == source}
    digest = hashlib.sha256("".join(f"{n}\0{t}\0" for n, t in texts.items()).encode()).hexdigest()
    built = f"working tree {digest[:12]}"
    if (namespace, source) in _BUILT_AT_REV:
        return _built_before(namespace, source, built, "the working tree")
    _build_alone(texts, source, namespace, f"{_KERNEL_SOURCES}/{source} in the working tree")
    _BUILT_AT_REV[(namespace, source)] = built
    return getattr(torch.ops, namespace)


def _built_before(namespace: str, source: str, built: str, asked: str) -> object:
    if _BUILT_AT_REV[(namespace, source)] != built:
        raise SystemExit(f"torch.ops.{namespace} already holds {source} at {_BUILT_AT_REV[(namespace, source)][:12]}; "
                         f"one process builds a source into a namespace once ({asked} is another)")
    return getattr(torch.ops, namespace)


def _build_alone(texts: dict[str, str], source: str, namespace: str, what: str) -> None:
    """Builds `source` (with the headers among `texts`) into a library of its own, its ops
    registered under torch.ops.NAMESPACE."""
    import shutil
    import tempfile

    from torch.utils.cpp_extension import load

    tmp = Path(tempfile.mkdtemp(prefix="fp8serve_baseline_"))
    try:
        for name, text in texts.items():
            if name == source:
                # Registered under `namespace`: literally, or (fp8_gemm.cpp) through the
                # FP8SERVE_GEMM_NS macro its tests already use, defined below. Anything else
                # would register fp8serve's ops a second time, which aborts the process.
                text = text.replace("TORCH_LIBRARY_FRAGMENT(fp8serve, m)", f"TORCH_LIBRARY_FRAGMENT({namespace}, m)")
                if (f"TORCH_LIBRARY_FRAGMENT({namespace}, m)" not in text
                        and "TORCH_LIBRARY_FRAGMENT(FP8SERVE_GEMM_NS, m)" not in text):
                    raise SystemExit(f"{what}: no TORCH_LIBRARY_FRAGMENT this script can move to another namespace")
            (tmp / name).write_text(text)
        # The engine's flags (fp8serve/kernels/cpu_ops.py), its target included: with
        # FP8SERVE_CPU_MARCH=x86-64-v3 both builds run their AVX2 paths.
        from fp8serve.kernels.cpu_ops import _march

        load(name=f"{namespace}_{Path(source).stem}", sources=[str(tmp / source)],
             extra_cflags=["-O3", f"-march={_march()}", "-fopenmp-simd", "-ffp-contract=off", "-fopenmp",
                           f"-DFP8SERVE_GEMM_NS={namespace}"],
             extra_ldflags=["-fopenmp"], build_directory=str(tmp), is_python_module=False, verbose=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the library stays mapped


def ops_side_by_side(ops, name: str, source: str, baseline_rev: str | None) -> dict:
    """{"this tree": ops.NAME}, and first {"baseline": the same op built from
    fp8serve/kernels/cpu/SOURCE at `baseline_rev`} when one is given: the
    variants a kernel script times in alternating rounds."""
    fns = {"this tree": getattr(ops, name)}
    if baseline_rev:
        fns = {"baseline": getattr(build_kernel_at_rev(baseline_rev, source, "fp8serve_base"), name), **fns}
    return fns


def alternate(measures: dict, rounds: int) -> dict[str, float]:
    """Runs each zero-argument `measures[name]()` (which returns seconds)
    once per round, the order reversed every other round (ABBA: a slow
    stretch of a shared machine, or state that builds up, weighs on every
    side alike); returns each side's median over the rounds."""
    import statistics

    res: dict[str, list[float]] = {k: [] for k in measures}
    keys = list(measures)
    for r in range(rounds):
        for side in (keys if r % 2 == 0 else keys[::-1]):
            res[side].append(measures[side]())
    return {k: statistics.median(v) for k, v in res.items()}


def add_decode_sample_args(parser, what: str) -> None:
    """The options of the scripts that time something on a greedy generation's
    rows and then in engine decode steps (lm_head.py, sampler.py); parse with
    `parse_decode_sample_args`. `what`: what one timed call is, for --calls."""


    parser.add_argument("--decode-context", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=12)
    parser.add_argument("--sample-steps", type=int, default=64, help="decode steps whose rows are recorded")
    parser.add_argument("--calls", type=int, default=3, help=f"{what} per round (median)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="also write the table (markdown) here")


def parse_decode_sample_args(parser):
    args = parser.parse_args()
    require_positive(parser, args, "decode_context", "decode_steps", "sample_steps", "calls", "rounds")
    return args


def median_time(fn, calls: int, setup=None) -> float:
    """Median seconds of `calls` runs of fn(); `setup()` (untimed) before each,
    e.g. a read that evicts the caches, or a fresh copy of an input fn overwrites."""
    import statistics

    times = []
    for _ in range(calls):
        if setup is not None:
            setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def parse_sizes(parser, flag: str, text: str, allow_empty: bool = False) -> list[int]:
    """`--flag 1,16,64` -> [1, 16, 64] (sizes >= 1), or parser.error naming the flag."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"{flag}: expected comma-separated integers, got {text!r}")
    if (not sizes and not allow_empty) or any(x < 1 for x in sizes):
        parser.error(f"{flag}: expected sizes >= 1, got {text!r}")
    return sizes


def parse_cells(parser, flag: str, text: str) -> list[tuple[int, int]]:
    """`--flag 1x512,4x256` -> [(1, 512), (4, 256)] (sequences x tokens, each >= 1; empty: none), or
    parser.error naming the flag."""
    cells = []
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        try:
            seqs, tokens = (int(x) for x in part.lower().split("x"))
        except ValueError:
            parser.error(f"{flag}: expected comma-separated SEQSxTOKENS like 1x512,4x256, got {part!r}")
        if seqs < 1 or tokens < 1:
            parser.error(f"{flag}: sequences and tokens must be >= 1, got {part!r}")
        cells.append((seqs, tokens))
    return cells


def greedy_head_rows(engine, draw, rng: random.Random, prompt_len: int, steps: int):
    """The LM head's input rows ([n, hidden] float32) of a greedy generation
    from `draw(prompt_len, rng)`: one per sampling step (the prefill's last
    row, then one per decode step), recorded where the model runner asks the
    model for a greedy step's tokens."""
    import torch

    from fp8serve import SamplingParams

    model = engine.model_runner.model
    rows: list = []
    real = model.compute_greedy_tokens

    def record(hidden):
        rows.extend(hidden.detach().float().clone())
        return real(hidden)

    model.compute_greedy_tokens = record
    try:
        engine.add_request(None, {"prompt_token_ids": draw(prompt_len, rng)},
                           SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        del model.compute_greedy_tokens
    return torch.stack(rows)


def time_greedy_decode(engine, prompts: list[list[int]], steps: int,
                       sampling: dict | None = None) -> tuple[float, list[list[int]]]:
    """Adds one greedy request per prompt (steps + 2 new tokens each) and steps the engine until
    they finish: the median seconds of the steps that decode the whole batch (once every request
    has its first token, before any finishes), and each request's tokens, in prompt order.
    `sampling`: SamplingParams fields instead of greedy (e.g. {"temperature": 0.7, "top_p": 0.9})."""
    import gc
    import statistics
    import time

    from fp8serve import SamplingParams

    sp = SamplingParams(**{"temperature": 0.0, **(sampling or {})}, max_tokens=steps + 2, ignore_eos=True)
    ids = [engine.new_request_id() for _ in prompts]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
    started: set[str] = set()
    times, tokens = [], {}
    while engine.has_unfinished_requests():
        all_decoding = len(started) == len(prompts)
        gc.collect()
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        if all_decoding and any(not o.finished for o in outs):
            times.append(dt)
        for o in outs:
            if o.outputs and o.outputs[0].token_ids:
                started.add(o.request_id)
            if o.finished:
                tokens[o.request_id] = list(o.outputs[0].token_ids)
    if not times:
        raise RuntimeError("no step decoded the whole batch")
    return statistics.median(times), [tokens[i] for i in ids]


def add_side_by_side_args(parser, batch_sizes: str) -> None:
    """The decode-timing flags of the scripts that run `decode_side_by_side`."""
    parser.add_argument("--batch-sizes", default=batch_sizes)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per generation")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="also write the report (markdown) here")


def parse_side_by_side_args(parser, argv: list[str] | None):
    """(args, batch sizes) with add_side_by_side_args' flags checked."""
    args = parser.parse_args(argv)
    require_positive(parser, args, "prompt_len", "steps", "rounds")
    return args, parse_sizes(parser, "--batch-sizes", args.batch_sizes)


def decode_side_by_side(engines: dict, prompts: dict[int, list[list[int]]], steps: int,
                        rounds: int) -> tuple[dict[int, dict[str, float]], dict[tuple[str, int], list]]:
    """Each engine's greedy decode step time per batch size, the engines alternating (`alternate`):
    ({batch: {engine name: median seconds}}, {(engine name, batch): each request's tokens})."""
    tokens: dict[tuple[str, int], list] = {}

    def measure(name, b):
        def run():
            step_s, toks = time_greedy_decode(engines[name], prompts[b], steps)
            tokens[(name, b)] = toks
            return step_s
        return run

    step = {b: alternate({name: measure(name, b) for name in engines}, rounds) for b in prompts}
    return step, tokens


def token_source(engine, kind: str):
    """draw(n, rng): n prompt tokens. "text": a window of the built-in calibration text (English
    prose, dialogue, lists, code), so greedy continuations are not the near-ties of random ids;
    "random": uniform token ids."""
    vocab = engine.model_runner.config.model_config.arch.vocab_size
    if kind == "random" or engine.tokenizer is None:
        return lambda n, rng: [rng.randrange(10, vocab) for _ in range(n)]
    from fp8serve.calibration.default_text import DEFAULT_CALIBRATION_TEXT

    ids = engine.tokenizer.encode(DEFAULT_CALIBRATION_TEXT, add_special_tokens=False)

    def draw(n: int, rng: random.Random) -> list[int]:
        start = rng.randrange(len(ids))
        return [ids[(start + i) % len(ids)] for i in range(n)]

    return draw


def record_as_a_warm_engine(engine) -> None:
    """For benchmarks of steady-state steps: the engine records decode forwards as one that has
    already compiled its first recording would (DecodeCaptures.first_record_after = 0; a batch size
    is still recorded after record_after eager steps), instead of running its first 64 decode steps
    eagerly as a fresh engine does (fp8serve/engine/decode_capture.py)."""
    engine.model_runner.decode_captures.first_record_after = 0


def add_model_args(parser, dtype: str = "bfloat16") -> None:
    """--model, --dtype, --kv-cache-dtype and --kv-cache-memory of the engine benchmarks."""
    parser.add_argument("--model", default=None, help="default: the built-in model")
    parser.add_argument("--dtype", default=dtype)
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--kv-cache-memory", default="1GiB")


@contextlib.contextmanager
def narrow_weights(keep: bool):
    """Engines built inside keep a 16-bit checkpoint's weights at 16 bits under float32 compute
    (keep, the engine's default: fp8serve/quantization/narrow_weights.py) or upcast them to float32
    at load (FP8SERVE_16BIT_WEIGHTS=0), whatever the environment says."""
    from fp8serve.quantization.narrow_weights import ENV

    before = os.environ.get(ENV)
    os.environ[ENV] = "auto" if keep else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


def emit_table(lines: list[str], output) -> None:
    """Prints the results file's lines and, when `output` (a Path or None) is given, writes them there."""
    print("\n".join(lines), flush=True)
    if output:
        output.write_text("\n".join(lines) + "\n")
