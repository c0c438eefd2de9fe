#!/usr/bin/env python
"""One kernel op of this tree against the same op built at a git revision,
inside whole engine decode steps (or, with --phase prefill, prefill steps).

Kernel scripts (dense_gemv.py, fp8_linear.py, attention.py --baseline-rev)
time an op alone; this one asks what the change is worth to the engine. Two
engines on one checkpoint live in one process: "this tree" with every op as
built here, "baseline" with --op taken from fp8serve/kernels/cpu/--source as
of --baseline-rev (built under another torch.ops namespace,
bench_common.build_kernel_at_rev). The baseline engine is built, warmed up and
run with the modules' `load_cpu_ops` answering that op from the baseline
build, so its eager steps call it and its recorded decode forward
(engine/decode_capture.py) replays it. The script counts the baseline ops in
that recording and stops with an error if there are none (the swap did not
take). Then rounds alternate the engines (AB BA BA AB), each generating
--tokens + 2 greedy tokens for a batch of --batch prompts (a short sentence
each, or --prompt-len tokens of the built-in calibration text, so attention
runs over a long context); a round's time is the median of its steps that
decode the whole batch (no prefill), and the table gives the median of the
rounds and whether both engines produced the same tokens.

--phase prefill times steps that prefill the whole batch of --prompt-len-token
prompts at once (max_tokens=1; prefix caching is off, so every step computes
the prompts in full): a round's time is the median of --prefills such steps,
after two untimed ones. Prefills run the module tree here (the engine's
recorded prefill forwards, engine/prefill_capture.py, are turned off in both
engines), so the proof that the swap took is the count of the baseline op's
lookups during the baseline engine's steps (none: an error). --dtype sets both engines'
compute dtype (float32 compute runs other kernels than the default bf16).

The two engines' libraries differ in more than the op: the baseline's op is
built alone, this tree's sits in the engine's library with every other op, and
two engines in one process place their memory differently. At stop 76 (Zen 4
guest) an A/A, the same source on both sides, gave 0.94-0.95x. --aa adds a
third engine served by this tree's source built alone the way the baseline is:
the table then gives that engine against this tree (the A/A, what the setup
alone is worth) and the baseline against it (like for like: both ops built
alone). Rounds rotate the engines and reverse every other pass.

    .venv/bin/python benchmarks/kernel_ab_engine.py --source dense_gemv.cpp --op dense_gemv --baseline-rev HEAD~1
    .venv/bin/python benchmarks/kernel_ab_engine.py --model DIR --source fp8_gemm.cpp --op fp8_linear \\
        --baseline-rev HEAD~1 --batch 4 --rounds 12
    .venv/bin/python benchmarks/kernel_ab_engine.py --source layer_ops.cpp --op silu_and_mul \\
        --baseline-rev HEAD~1 --phase prefill --prompt-len 512
    .venv/bin/python benchmarks/kernel_ab_engine.py --source dense_gemv_packed.cpp --op dense_gemv_packed \\
        --baseline-rev HEAD~1 --batch 16 --aa
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import random
import statistics
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    build_kernel_at_rev, build_kernel_from_tree, check_engine_args, command_line, cpu_ops_served_by, describe_machine,
    emit_table, machine_info, time_greedy_decode, token_source,
)

BASELINE_NAMESPACE = "fp8serve_base_engine"
AA_NAMESPACE = "fp8serve_alone_engine"  # --aa: this tree's source, built alone
THIS, ALONE = "this tree", "this tree, built alone"


class _OneOpFrom:
    """torch.ops.fp8serve with `op` taken from another build."""

    def __init__(self, ours, base, op: str) -> None:
        self._ours, self._base, self._op = ours, base, op
        self.lookups = 0  # of `op`, i.e. of the baseline build's op

    def __getattr__(self, name: str):
        if name == self._op:
            self.lookups += 1
            return getattr(self._base, name)
        return getattr(self._ours, name)


def recorded_ops(namespace: str) -> int:
    """Calls of torch.ops.NAMESPACE in the decode forwards recorded so far."""
    from fp8serve.engine.compiled_replay import CapturedForward

    count = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on some of torch's deprecated objects warns
        captures = [obj for obj in gc.get_objects() if isinstance(obj, CapturedForward)]
    for obj in captures:
        count += sum(1 for func, *_ in obj.calls if getattr(func, "namespace", None) == namespace)
    return count


def time_prefill(engine, prompts: list[list[int]], steps: int) -> tuple[float, list[int]]:
    """Median seconds of `steps` engine steps that each prefill every prompt (one greedy token
    each), and the tokens of the last step, in prompt order."""
    import gc
    import time

    from fp8serve import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times, tokens = [], []
    for _ in range(steps):
        ids = [engine.new_request_id() for _ in prompts]
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
        gc.collect()
        t = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t)
        if len(outs) != len(prompts) or engine.has_unfinished_requests():
            raise RuntimeError(f"the {len(prompts)} prompts did not all prefill in one step; "
                               f"lower --batch or --prompt-len")
        by_id = {o.request_id: o.outputs[0].token_ids[0] for o in outs}
        tokens = [by_id[i] for i in ids]
    return statistics.median(times), tokens


@contextlib.contextmanager
def _layout_hint(args):
    """A baseline build from before the ops took HND caches fails on the engine's default layout: say what to do."""
    try:
        yield
    except RuntimeError as e:
        if "caches must be contiguous" not in str(e):
            raise
        raise SystemExit(f"{args.source} at {args.baseline_rev} reads only NHD (token-major) KV caches, older than "
                         "the engine's HND default: run with --kv-cache-layout NHD") from e


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the built-in default model)")
    p.add_argument("--source", required=True, help="kernel source file in fp8serve/kernels/cpu, e.g. dense_gemv.cpp")
    p.add_argument("--op", required=True, help="the op of that file to swap, e.g. dense_gemv")
    p.add_argument("--baseline-rev", required=True, help="git revision of the baseline build")
    p.add_argument("--batch", type=int, default=1, help="prompts per generation (decode batch)")
    p.add_argument("--tokens", type=int, default=160,
                   help="decode steps timed per generation (each prompt gets --tokens + 2 greedy tokens)")
    p.add_argument("--rounds", type=int, default=12, help="rounds (medians; every engine runs once a round)")
    p.add_argument("--kv-cache-memory", default="512MiB", help="KV cache of each engine (e.g. 512MiB)")
    p.add_argument("--kv-cache-dtype", default="auto", help="KV cache dtype of both engines (auto, fp8, ...)")
    p.add_argument("--dtype", default="auto",
                   help="compute dtype of both engines (auto, float32, bfloat16, float16; as the engine's --dtype)")
    p.add_argument("--prompt-len", type=int, default=0,
                   help="prompts of this many tokens of the built-in calibration text (0: a short sentence each)")
    p.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                   help="time decode steps (default) or steps that prefill the whole batch")
    p.add_argument("--prefills", type=int, default=3,
                   help="--phase prefill: timed prefill steps per engine per round (median)")
    p.add_argument("--kv-cache-layout", choices=("HND", "NHD"), default=None,
                   help="KV cache memory order of both engines (FP8SERVE_KV_CACHE_LAYOUT; default: the engine's, "
                        "HND); NHD for a baseline revision from before the ops took HND caches")
    p.add_argument("--aa", action="store_true",
                   help="add an engine served by this tree's source built alone, as the baseline is: an A/A against "
                        "this tree, and the baseline against it like for like")
    p.add_argument("--output", type=Path, default=None, help="also write the table (markdown) here")
    args = p.parse_args()
    if args.kv_cache_layout:
        os.environ["FP8SERVE_KV_CACHE_LAYOUT"] = args.kv_cache_layout  # read as each engine allocates its cache
    for name in ("batch", "tokens", "rounds", "prefills"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.prompt_len < 0:
        p.error(f"--prompt-len must be >= 0, got {args.prompt_len}")
    if args.phase == "prefill" and args.prompt_len == 0:
        p.error("--phase prefill needs --prompt-len (the tokens each prompt prefills), e.g. --prompt-len 512")
    check_engine_args(p, args)

    from fp8serve import LLM, SamplingParams
    from fp8serve.kernels import cpu_ops

    ours = cpu_ops.load_cpu_ops()
    if ours is None:
        raise SystemExit("C++ CPU kernels unavailable")
    if not hasattr(ours, args.op):
        raise SystemExit(f"--op {args.op}: no such op in torch.ops.fp8serve")
    base = build_kernel_at_rev(args.baseline_rev, args.source, BASELINE_NAMESPACE)
    if not hasattr(base, args.op):
        raise SystemExit(f"--op {args.op}: {args.source} at {args.baseline_rev} does not define it")
    # Each swapped engine: its ops object and the namespace its op lives in.
    swapped = {"baseline": (_OneOpFrom(ours, base, args.op), BASELINE_NAMESPACE)}
    if args.aa:
        swapped[ALONE] = (_OneOpFrom(ours, build_kernel_from_tree(args.source, AA_NAMESPACE), args.op), AA_NAMESPACE)

    kwargs = {"kv_cache_memory": args.kv_cache_memory, "kv_cache_dtype": args.kv_cache_dtype, "dtype": args.dtype}
    if args.model:
        kwargs["model"] = args.model
    engines = {THIS: (LLM(**kwargs), contextlib.nullcontext)}
    first = engines[THIS][0].llm_engine
    if args.prompt_len:
        draw = token_source(first, "text")
        rng = random.Random(0)
        prompts = [draw(args.prompt_len, rng) for _ in range(args.batch)]
    else:
        prompts = [first.tokenize_prompt(f"Write about the history of printing, part {i}.")[1] for i in range(args.batch)]
    for name, (ops, _) in swapped.items():
        with cpu_ops_served_by(ops):
            engines[name] = (LLM(**kwargs), functools.partial(cpu_ops_served_by, ops))
    prefill = args.phase == "prefill"
    if prefill:
        for llm, _ in engines.values():
            # Recorded prefill forwards call the ops they recorded, past the lookups counted below.
            llm.llm_engine.model_runner.prefill_captures.enabled = False
        for llm, ctx in engines.values():
            with ctx(), _layout_hint(args):
                time_prefill(llm.llm_engine, prompts, 2)
        for ops, _ in swapped.values():
            ops.lookups = 0
    else:
        # Both engines replay through TorchScript: a static plan (engine/static_plan.py) calls the ops of
        # this build by name, so the baseline engine would take the compiled replay and the other a plan.
        for llm, _ in engines.values():
            llm.llm_engine.model_runner.decode_captures.static_plans = False
        # Long enough to record each engine's decode forward at this batch size (decode_capture.py).
        warm = SamplingParams(max_tokens=max(args.tokens, 80), temperature=0, ignore_eos=True)
        for llm, ctx in engines.values():
            with ctx():
                with _layout_hint(args):
                    llm.generate([{"prompt_token_ids": t} for t in prompts], warm, use_tqdm=False)
        swaps = {name: recorded_ops(namespace) for name, (_, namespace) in swapped.items()}
        for name, count in swaps.items():
            if count == 0:
                raise SystemExit(f"the {name!r} engine's recorded decode forward has no {swapped[name][1]} op: "
                                 f"{args.op} is not on its decode path, or the swap did not take")

    times: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list] = {}
    names = list(engines)
    for r in range(args.rounds):
        # Each engine leads in turn, and every other pass over the turns runs them backwards: for two
        # engines AB BA BA AB, so each side runs first and last, early and late, equally often.
        order = names[r % len(names):] + names[:r % len(names)]
        for name in (order if (r // len(names)) % 2 == 0 else order[::-1]):
            llm, ctx = engines[name]
            with ctx():
                if prefill:
                    step_s, tokens[name] = time_prefill(llm.llm_engine, prompts, args.prefills)
                else:
                    # The median of the steps that decode the whole batch (no prefill in it).
                    step_s, tokens[name] = time_greedy_decode(llm.llm_engine, prompts, args.tokens)
                times[name].append(step_s)
    if prefill:
        swaps = {name: ops.lookups for name, (ops, _) in swapped.items()}
        for name, count in swaps.items():
            if count == 0:
                raise SystemExit(f"the {name!r} engine's prefill steps never looked up {args.op}: "
                                 f"it is not on their path, or the swap did not take")
    step = {name: statistics.median(v) * 1e3 for name, v in times.items()}

    def faster(a: str, b: str) -> int:
        return sum(x < y for x, y in zip(times[a], times[b]))

    if prefill:
        workload = (f"{args.rounds} rounds (per round: the median of {args.prefills} steps that each prefill "
                    f"the whole batch, 1 greedy token per prompt); the baseline engine's timed prefill steps looked "
                    f"up its {args.op} {swaps['baseline']} times")
    else:
        workload = (f"{args.tokens + 2} greedy tokens per generation, {args.rounds} rounds (per round: the "
                    f"median of the steps that decode the whole batch); the baseline engine's recorded decode "
                    f"forward calls {swaps['baseline']} {BASELINE_NAMESPACE} ops")
    if args.aa:
        workload += f", the built-alone engine's {swaps[ALONE]} {AA_NAMESPACE} ops"
    rows = [(THIS, THIS, "baseline", ""), (args.baseline_rev, "baseline", THIS, tokens["baseline"] == tokens[THIS])]
    if args.aa:
        rows.append((ALONE, ALONE, THIS, tokens[ALONE] == tokens[THIS]))
    labels = {name: label for label, name, *_ in rows}
    lines = [
        f"# {args.op} ({args.source}) in engine {args.phase} steps: this tree vs {args.baseline_rev}",
        "",
        f"Command: `{command_line()}`",
        "",
        *describe_machine(machine_info()),
        f"- model: {args.model or 'the built-in default model'}; --dtype {args.dtype}; KV cache {args.kv_cache_dtype}; "
        f"batch {args.batch}, "
        f"prompts of {f'{args.prompt_len} tokens' if args.prompt_len else 'one short sentence'}, {workload}",
        "",
        f"| engine | ms / {args.phase} step (median) | rounds faster | same tokens as this tree |",
        "|---|---|---|---|",
        *(f"| {label} | {step[name]:.2f} | {faster(name, other)} of {args.rounds} (than {labels[other]}) | {same} |"
          for label, name, other, same in rows),
        "",
        f"speedup (baseline / this tree): {step['baseline'] / step[THIS]:.3f}x",
    ]
    if args.aa:
        lines += [
            f"A/A (this tree's source built alone / this tree, the same code): {step[ALONE] / step[THIS]:.3f}x",
            f"like for like (baseline / this tree's source built alone, both built alone): "
            f"{step['baseline'] / step[ALONE]:.3f}x, built-alone this tree faster in {faster(ALONE, 'baseline')} "
            f"of {args.rounds} rounds",
        ]
    emit_table(lines, args.output)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
