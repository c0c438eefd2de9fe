#!/usr/bin/env python
"""Profile single fp8serve engine steps: one decode step of a big batch, one big prefill.

Drives `LLMEngine` directly (add_request + step), so the measured step includes everything one
engine step does: scheduling, metadata building, the model, the sampler, output processing and
detokenization. fp8serve is not modified: labels are added by wrapping instance methods with
`torch.profiler.record_function`, which gives an inclusive time per component.

Reports, per profiled phase:
  1. wall time of each profiled step;
  2. inclusive time per component (scheduler, _prepare, attention metadata, model forward,
     per layer type, attention backend, sampler, output processing);
  3. torch.profiler op table (self CPU time);
  4. cProfile top Python functions (tottime and cumtime).

Examples:
  python benchmarks/profile_step.py                       # decode 64 x ~600 and prefill 16 x 512
  python benchmarks/profile_step.py --phase decode --dtype float32 --kv-cache-dtype fp8
  python benchmarks/profile_step.py --phase decode --enforce-eager   # per-layer rows for decode too
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import os
import pstats
import random
import shlex
import sys
import time
from collections import defaultdict

import torch
from bench_common import record_as_a_warm_engine
from torch.profiler import ProfilerActivity, profile, record_function

# Labels of the component table, in print order.
COMPONENTS = [
    "engine.step", "scheduler.schedule", "runner.execute", "runner._prepare", "backend.build_metadata",
    "model.forward", "layer:VocabEmbedding", "layer:RMSNorm", "layer:QKVLinear", "layer:RotaryEmbedding",
    "layer:Attention", "backend.forward", "layer:Linear", "layer:MergedLinear", "layer:SiluAndMul",
    "model.compute_logits", "model.compute_greedy_tokens", "SamplingMetadata.from_params", "sampler.forward",
    "engine._process",
]


def _wrap(obj, name: str, label: str) -> None:
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapped(*a, **k):
        with record_function(label):
            return fn(*a, **k)

    setattr(obj, name, wrapped)


def instrument(llm) -> None:
    from fp8serve.layers import sampler as sampler_mod

    engine = llm.llm_engine
    runner = engine.model_runner
    _wrap(engine, "step", "engine.step")
    _wrap(engine.scheduler, "schedule", "scheduler.schedule")
    _wrap(engine, "_process", "engine._process")
    _wrap(runner, "execute", "runner.execute")
    _wrap(runner, "_prepare", "runner._prepare")
    _wrap(runner.backend, "build_metadata", "backend.build_metadata")
    _wrap(runner.backend, "forward", "backend.forward")
    _wrap(runner.model, "forward", "model.forward")
    _wrap(runner.model, "compute_logits", "model.compute_logits")
    if hasattr(runner.model, "compute_greedy_tokens"):  # plain greedy steps: the screened head, no logits
        _wrap(runner.model, "compute_greedy_tokens", "model.compute_greedy_tokens")
    _wrap(runner.sampler, "forward", "sampler.forward")
    orig = sampler_mod.SamplingMetadata.from_params
    if not getattr(orig, "_profiled", False):
        def from_params(*a, **k):
            with record_function("SamplingMetadata.from_params"):
                return orig(*a, **k)
        from_params._profiled = True
        # The model runner calls SamplingMetadata.from_params through the class, so patch it there
        # (restored by restore_sampling_metadata()).
        sampler_mod.SamplingMetadata.from_params = staticmethod(from_params)
        sampler_mod.SamplingMetadata._orig_from_params = orig
    for m in runner.model.modules():
        cls = type(m).__name__
        if cls in ("VocabEmbedding", "RMSNorm", "QKVLinear", "RotaryEmbedding", "Attention", "Linear",
                   "MergedLinear", "SiluAndMul"):
            _wrap(m, "forward", f"layer:{cls}")


def restore_sampling_metadata() -> None:
    from fp8serve.layers import sampler as sampler_mod

    orig = getattr(sampler_mod.SamplingMetadata, "_orig_from_params", None)
    if orig is not None:
        sampler_mod.SamplingMetadata.from_params = orig
        del sampler_mod.SamplingMetadata._orig_from_params


def random_prompt(n: int, rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(17, vocab) for _ in range(n)]  # ids 0..16 are SmolLM2's special tokens


def report(prof, cp: cProfile.Profile, step_times: list[float], title: str, row_limit: int, out) -> None:
    n = len(step_times)
    print(f"\n## {title}\n", file=out)
    print("step wall times (ms): " + ", ".join(f"{1000 * t:.1f}" for t in step_times)
          + f"  (mean {1000 * sum(step_times) / n:.1f})", file=out)

    # Inclusive time per labelled component (sum over the profiled steps, divided by steps).
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for evt in prof.key_averages():
        if evt.key in COMPONENTS:
            totals[evt.key] += evt.cpu_time_total
            counts[evt.key] += evt.count
    step_us = totals.get("engine.step", 0.0) or 1.0
    print("\n### Inclusive time per component (per step)\n", file=out)
    print("| component | ms / step | % of engine.step | calls / step |", file=out)
    print("|---|---|---|---|", file=out)
    for key in COMPONENTS:
        if key in totals:
            print(f"| {key} | {totals[key] / n / 1000:.1f} | {100 * totals[key] / step_us:.1f}% | "
                  f"{counts[key] / n:.0f} |", file=out)

    print(f"\n### torch.profiler: top ops by self CPU time (all {n} steps)\n", file=out)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit, max_name_column_width=48)
    print("```\n" + table + "\n```", file=out)

    s = io.StringIO()
    st = pstats.Stats(cp, stream=s)
    st.strip_dirs().sort_stats("tottime").print_stats(row_limit)
    print(f"\n### cProfile: top Python functions by tottime ({n} steps, separate run, no torch profiler)\n", file=out)
    print("```\n" + s.getvalue().strip() + "\n```", file=out)
    s = io.StringIO()
    st = pstats.Stats(cp, stream=s)
    st.strip_dirs().sort_stats("cumulative").print_stats(row_limit)
    print(f"\n### cProfile: top by cumtime\n", file=out)
    print("```\n" + s.getvalue().strip() + "\n```", file=out)


def profile_steps(engine, n_steps: int, expect_prefill: bool) -> tuple[object, list[float]]:
    """Profiles the next `n_steps` engine steps with torch.profiler."""
    times: list[float] = []

    def one() -> None:
        sched_kind = bool(engine.scheduler.waiting)
        if sched_kind != expect_prefill:
            raise RuntimeError(f"expected a {'prefill' if expect_prefill else 'decode'} step")
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)

    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        for _ in range(n_steps):
            one()
    return prof, times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--phase", choices=("decode", "prefill", "both"), default="both")
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--decode-context", type=int, default=600, help="context length at the profiled decode step")
    p.add_argument("--prefill-batch", type=int, default=16)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="decode steps per profiler (prefill: always 1)")
    p.add_argument("--row-limit", type=int, default=25)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true",
                   help="run decode steps through the module tree (per-layer rows in the component table); "
                        "by default they replay a recorded forward and only the ops show")
    p.add_argument("--out", default=None, help="also write the report (markdown) to this file")
    args = p.parse_args()

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    torch.manual_seed(0)
    rng = random.Random(0)
    from fp8serve import LLM, SamplingParams
    from fp8serve.layers import sampler as _  # noqa: F401  (import before instrumenting)

    max_tokens_batched = max(8192, args.prefill_batch * args.prefill_len)
    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
              kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(args.decode_batch, args.prefill_batch),
              max_num_batched_tokens=max_tokens_batched, enforce_eager=args.enforce_eager)
    engine = llm.llm_engine
    record_as_a_warm_engine(engine)
    runner = engine.model_runner
    vocab = runner.config.model_config.arch.vocab_size
    out_file = open(args.out, "w") if args.out else None

    class Tee:
        def write(self, s):
            sys.stdout.write(s)
            if out_file:
                out_file.write(s)

        def flush(self):
            sys.stdout.flush()

    tee = Tee()
    print("# fp8serve step profile\n", file=tee)
    print("command: " + " ".join(shlex.quote(a) for a in sys.argv), file=tee)
    print(f"dtype {runner.dtype}, kv cache {runner.kv_cache_spec.kv_cache_dtype}, backend {runner.backend.name}, "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}, loadavg {os.getloadavg()}", file=tee)

    if args.phase in ("decode", "both"):
        # Prompts so that the profiled steps run at ~decode_context tokens of context.
        # Untimed steps first: the engine records a batch size's forward on its (record_after + 1)-th step.
        warm_steps = engine.model_runner.decode_captures.record_after + 2
        plen = args.decode_context - warm_steps - 1
        sp = SamplingParams(temperature=0.0, max_tokens=warm_steps + 4 * args.steps + 4, ignore_eos=True)
        ids = [engine.add_request(None, {"prompt_token_ids": random_prompt(plen, rng, vocab)}, sp).request_id
               for _ in range(args.decode_batch)]
        while engine.scheduler.waiting:
            engine.step()  # prefills
        for _ in range(warm_steps):
            engine.step()
        instrument(llm)
        free_before = engine.block_manager.num_free_blocks
        prof, times = profile_steps(engine, args.steps, expect_prefill=False)
        # A new block lies in cache memory nothing has written yet (a fresh engine hands blocks out in
        # order): its first write faults a page in, up to ~3 ms per 2 MiB page on a Zen 2 guest, charged
        # to reshape_and_cache (~190 us a call at batch 64 against 48 us inside written blocks).
        new_blocks = free_before - engine.block_manager.num_free_blocks
        cp = cProfile.Profile()
        cp_times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            cp.enable()
            engine.step()
            cp.disable()
            cp_times.append(time.perf_counter() - t)
        # Plain timing without any profiler attached.
        plain = []
        for _ in range(args.steps):
            t = time.perf_counter()
            engine.step()
            plain.append(time.perf_counter() - t)
        ctx = engine.seqs[ids[0]].num_tokens if ids[0] in engine.seqs else None
        report(prof, cp, times, f"Decode step: batch {args.decode_batch}, context ~{args.decode_context} "
               f"(now {ctx})", args.row_limit, tee)
        if new_blocks > 0:
            print(f"WARNING: the profiled decode steps opened {new_blocks} new KV blocks: their first writes fault "
                  "fresh pages of the cache in, which a warm engine does not pay (reshape_and_cache and the "
                  "step times above include it). A --decode-context a few tokens further keeps the profiled "
                  "steps inside blocks already written.", file=tee)
        print(f"\nunprofiled decode step wall times (ms): " + ", ".join(f"{1000 * t:.1f}" for t in plain), file=tee)
        for rid in ids:
            engine.abort_request(rid)
        restore_sampling_metadata()
        # Fresh LLM for the prefill phase keeps the instrumentation simple.
        del llm, engine, runner
        llm = LLM(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                  kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(args.decode_batch, args.prefill_batch),
                  max_num_batched_tokens=max_tokens_batched, enforce_eager=args.enforce_eager)
        engine = llm.llm_engine

    if args.phase in ("prefill", "both"):
        sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

        def add_batch():
            return [engine.add_request(None, {"prompt_token_ids": random_prompt(args.prefill_len, rng, vocab)},
                                       sp).request_id for _ in range(args.prefill_batch)]

        add_batch()
        engine.step()  # warm-up prefill (finishes: max_tokens=1)
        instrument(llm)
        add_batch()
        prof, times = profile_steps(engine, 1, expect_prefill=True)
        add_batch()
        cp = cProfile.Profile()
        t = time.perf_counter()
        cp.enable()
        engine.step()
        cp.disable()
        cp_t = time.perf_counter() - t
        add_batch()
        t = time.perf_counter()
        engine.step()
        plain = time.perf_counter() - t
        report(prof, cp, times, f"Prefill step: {args.prefill_batch} x {args.prefill_len} tokens", args.row_limit, tee)
        print(f"\ncProfile'd prefill step {1000 * cp_t:.1f} ms; unprofiled prefill step {1000 * plain:.1f} ms",
              file=tee)
        restore_sampling_metadata()
    if out_file:
        out_file.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
