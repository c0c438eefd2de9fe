#!/usr/bin/env python
"""The kv-saturation workload replayed through `LLMEngine` alone (no server, no HTTP): where the
time of a KV-constrained run goes, per KV cache dtype, in interleaved rounds.

The issue's target ("with a --kv-cache-memory that holds 8 full-length requests in 16-bit storage,
FP8 KV gives >= 1.8x the output tok/s at saturation") is measured end to end by
`fp8serve bench sweep --workload kv-saturation` (benchmarks/results/kv_saturation.md). This script
takes the server out: the same requests (--num-prompts prompts of exactly --input-len random token
ids, --output-len tokens each, ignore_eos, greedy) are all added at once and `step()` is called
until every request has finished. Every step is timed and classified:

  - prefill step: the engine's prompt-token counter moved (first prefills, and the re-prefills of
    sequences preempted by recompute);
  - decode step: any other step (every running sequence advanced by one token).

Reported per KV dtype: total seconds, output tok/s, "saturated" tok/s (until the last request's
first token, as the sweep defines it: until then some request is still waiting for room), decode
and prefill seconds, decode steps, mean running sequences per decode step, median decode step time,
decode ms per output token, preemptions; and the FP8 / 16-bit ratios of each round, with the
workload's own bound beside them: the ratio the FP8 run would reach were its bigger decode steps
as cheap as the 16-bit run's (the prefill, the same for both caches, stays as measured).

Every configuration's engine is built once; the rounds interleave them, so each one's samples span
the same minutes of this (drifting) machine.

--admission picks the scheduler's admission policy (fp8serve/engine/scheduler.py): `reserve` (the
engine's: room kept for the running sequences' expected growth, learned afresh in every run),
`watermark` (only 1% of the blocks kept free: vLLM's policy, the engine's before stop 25), or
`both` (every KV dtype under each; ratios compare KV dtypes under the same policy).

    .venv/bin/python benchmarks/kv_saturation_engine.py                      # 90 MiB, auto vs fp8
    .venv/bin/python benchmarks/kv_saturation_engine.py --rounds 1 --num-prompts 8 --output-len 16  # smoke
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from bench_common import command_line, describe_machine, machine_info, record_as_a_warm_engine


@dataclass
class RunStats:
    kv_cache_dtype: str
    round: int
    total_s: float
    output_tokens: int
    saturated_s: float
    saturated_tokens: int
    decode_s: float
    decode_steps: int
    decode_seqs: int  # sum over decode steps of the sequences advanced
    prefill_s: float
    prefill_steps: int
    preemptions: int
    decode_step_ms: list[float] = field(default_factory=list, repr=False)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.total_s

    @property
    def saturated_tok_s(self) -> float:
        return self.saturated_tokens / self.saturated_s if self.saturated_s > 0 else float("nan")

    @property
    def mean_running(self) -> float:
        return self.decode_seqs / self.decode_steps if self.decode_steps else float("nan")

    @property
    def decode_ms_per_token(self) -> float:
        return 1e3 * self.decode_s / self.decode_seqs if self.decode_seqs else float("nan")


def make_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Ids from 17 up: no special tokens (SmolLM2's are 0-16).
    return torch.randint(17, vocab_size, (num, input_len), generator=g).tolist()


def run_once(engine, prompts: list[list[int]], output_len: int, kv: str, rnd: int) -> RunStats:
    from fp8serve import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    preempt0 = engine.scheduler.num_preemptions
    for i, p in enumerate(prompts):
        engine.add_request(f"r{rnd}-{i}", {"prompt_token_ids": p}, sp)
    gc.collect()
    seen_first: set[str] = set()
    tokens = 0
    decode_s = prefill_s = 0.0
    decode_steps = prefill_steps = decode_seqs = 0
    step_ms: list[float] = []
    sat_s, sat_tokens = 0.0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        prompt_tokens = engine.stats.prefill_tokens_total
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        firsts = [o.request_id for o in outs if o.request_id not in seen_first]
        tokens += len(outs)
        # A prefill step (first or after a preemption) counts the tokens it prefilled.
        if outs and engine.stats.prefill_tokens_total == prompt_tokens:
            decode_s += dt
            decode_steps += 1
            decode_seqs += len(outs)
            step_ms.append(1e3 * dt)
        else:
            prefill_s += dt
            prefill_steps += 1
        if firsts:
            seen_first.update(firsts)
            if len(seen_first) == len(prompts):
                sat_s, sat_tokens = time.perf_counter() - t0, tokens
    total = time.perf_counter() - t0
    if tokens != len(prompts) * output_len:
        raise RuntimeError(f"{kv}: {tokens} output tokens, expected {len(prompts) * output_len}")
    return RunStats(kv, rnd, total, tokens, sat_s, sat_tokens, decode_s, decode_steps, decode_seqs, prefill_s,
                    prefill_steps, engine.scheduler.num_preemptions - preempt0, step_ms)


TABLE_HEAD = ["round", "KV dtype", "total s", "output tok/s", "saturated tok/s", "decode s", "prefill s",
              "decode steps", "mean running", "median decode step ms", "decode ms / token", "preemptions"]


def free_batching_seconds(s: RunStats, base: RunStats) -> float:
    """The seconds run `s` would take were each of its decode steps as cheap as `base`'s mean one.

    A bigger cache lets more sequences share a decode step, which pays only while a step's cost
    grows slower than its batch. Free batching is the best case; the prefill (the same prompt
    tokens for every cache, plus any recompute) stays as measured, so the ratio it gives is this
    workload's ceiling for the bigger cache on this machine.
    """
    if not base.decode_steps:
        return float("nan")
    return s.prefill_s + s.decode_steps * base.decode_s / base.decode_steps


def table_row(s: RunStats) -> str:
    cells = [str(s.round), s.kv_cache_dtype, f"{s.total_s:.1f}", f"{s.output_tok_s:.1f}", f"{s.saturated_tok_s:.1f}",
             f"{s.decode_s:.1f}", f"{s.prefill_s:.1f}", str(s.decode_steps), f"{s.mean_running:.1f}",
             f"{statistics.median(s.decode_step_ms):.1f}" if s.decode_step_ms else "—",
             f"{s.decode_ms_per_token:.2f}", str(s.preemptions)]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: fp8serve's default model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtypes", default="auto,fp8", help="comma-separated; the first is the baseline")
    p.add_argument("--kv-cache-memory", default="90MiB")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (the engine's --device)")
    p.add_argument("--admission", default="reserve", choices=["reserve", "watermark", "both"],
                   help="scheduler admission policy (see above)")
    p.add_argument("--json", dest="json_out", default=None)
    args = p.parse_args(argv)
    if args.device != "cpu" and not args.device.startswith("cuda"):
        p.error(f"--device must be cpu or cuda[:N], got {args.device!r}")
    for name in ("rounds", "num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if len([k for k in args.kv_cache_dtypes.split(",") if k.strip()]) < 2:
        p.error(f"--kv-cache-dtypes needs a baseline and at least one more, got {args.kv_cache_dtypes!r}")

    from fp8serve import LLM
    from fp8serve.default_model import ensure_default_model

    model = args.model or str(ensure_default_model())
    kvs = [k.strip() for k in args.kv_cache_dtypes.split(",") if k.strip()]
    started = _dt.datetime.now().astimezone()
    info = machine_info()
    print(f"# fp8serve kv-saturation, engine only — {started.isoformat(timespec='seconds')}")
    print(f"command: {command_line(None if argv is None else list(argv))}")
    for line in describe_machine(info):
        print(line)
    print(f"model: {model}, --device {args.device}, --dtype {args.dtype}, --kv-cache-memory {args.kv_cache_memory}, "
          f"--max-model-len {args.max_model_len}; {args.num_prompts} prompts x {args.input_len} tokens -> {args.output_len} tokens, "
          f"all added at once; {args.rounds} interleaved rounds")

    policies = ["reserve", "watermark"] if args.admission == "both" else [args.admission]
    engines = {}  # label -> (engine, admission policy)
    for policy in policies:
        for kv in kvs:
            llm = LLM(model=model, dtype=args.dtype, kv_cache_dtype=kv, kv_cache_memory=args.kv_cache_memory,
                      max_model_len=args.max_model_len, device=args.device, seed=args.seed)
            e = llm.llm_engine
            record_as_a_warm_engine(e)
            e.scheduler.reserve_growth = policy == "reserve"
            spec = e.model_runner.kv_cache_spec
            label = kv if len(policies) == 1 else f"{kv} ({policy})"
            print(f"- {label}: {spec.kv_cache_dtype} cache, {e.block_manager.num_blocks} blocks of {spec.block_size} "
                  f"tokens, admission {policy}")
            engines[label] = (e, policy)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    # Warm-up: one short request per engine (kernel builds; 7 decode steps, so batch size 1 is recorded:
    # DecodeCaptures.record_after).
    from fp8serve import SamplingParams

    for e, _ in engines.values():
        e.add_request(None, {"prompt_token_ids": prompts[0][:32]}, SamplingParams(max_tokens=8, ignore_eos=True))
        while e.has_unfinished_requests():
            e.step()

    stats: list[RunStats] = []
    for rnd in range(1, args.rounds + 1):
        for label, (e, policy) in engines.items():
            print(f"round {rnd}: {label} ...", file=sys.stderr, flush=True)
            # Every run starts as a fresh engine would: the reservation learns within a run (the
            # warm-up request, which ran to its max_tokens, would otherwise count).
            e.scheduler.output_fractions.clear()
            e.scheduler.preemption_floor = 0.0
            s = run_once(e, prompts, args.output_len, label, rnd)
            print(f"  {s.output_tok_s:.1f} output tok/s", file=sys.stderr, flush=True)
            stats.append(s)

    print()
    print("| " + " | ".join(TABLE_HEAD) + " |")
    print("|" + "|".join("---" for _ in TABLE_HEAD) + "|")
    for s in stats:
        print(table_row(s))
    print()
    ratios = []

    def label_of(kv: str, policy: str) -> str:
        return kv if len(policies) == 1 else f"{kv} ({policy})"

    def run_of(rnd: int, label: str) -> RunStats:
        return next(s for s in stats if s.round == rnd and s.kv_cache_dtype == label)

    for rnd in range(1, args.rounds + 1):
        for policy in policies:
            b = run_of(rnd, label_of(kvs[0], policy))
            for kv in kvs[1:]:
                s = run_of(rnd, label_of(kv, policy))
                bound_s = free_batching_seconds(s, b)
                r = {"round": rnd, "kv_cache_dtype": s.kv_cache_dtype, "output": s.output_tok_s / b.output_tok_s,
                     "saturated": s.saturated_tok_s / b.saturated_tok_s,
                     "decode_per_token": b.decode_ms_per_token / s.decode_ms_per_token,
                     "free_batching_bound": b.total_s / bound_s if bound_s > 0 else float("nan")}
                ratios.append(r)
                print(f"- round {rnd}: {s.kv_cache_dtype} / {b.kv_cache_dtype}: output {r['output']:.2f}x, saturated "
                      f"{r['saturated']:.2f}x, decode cost per output token {r['decode_per_token']:.2f}x lower "
                      f"({b.decode_ms_per_token:.2f} vs {s.decode_ms_per_token:.2f} ms)")
                print(f"- round {rnd}: {s.kv_cache_dtype}: this workload's bound {r['free_batching_bound']:.2f}x: "
                      f"were its {s.decode_steps} decode steps ({s.mean_running:.1f} sequences) as cheap as "
                      f"{b.kv_cache_dtype}'s ({b.mean_running:.1f} sequences, "
                      f"{1e3 * b.decode_s / max(b.decode_steps, 1):.1f} ms mean), its run would take "
                      f"{s.prefill_s:.1f} s prefill + {bound_s - s.prefill_s:.1f} s decode against "
                      f"{b.kv_cache_dtype}'s {b.total_s:.1f} s")
        if len(policies) == 2:
            for kv in kvs:
                res, wm = run_of(rnd, label_of(kv, "reserve")), run_of(rnd, label_of(kv, "watermark"))
                print(f"- round {rnd}: {kv}: reserve / watermark admission: output {res.output_tok_s / wm.output_tok_s:.2f}x "
                      f"({wm.preemptions} -> {res.preemptions} preemptions)")
    for s in stats:
        share = 100 * s.prefill_s / s.total_s
        print(f"- round {s.round} {s.kv_cache_dtype}: prefill/recompute steps {share:.0f}% of the run "
              f"({s.prefill_steps} steps, {1e3 * s.prefill_s / max(s.prefill_steps, 1):.0f} ms each)")

    if args.json_out:
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "started": started.isoformat(timespec="seconds"), "machine": info, "args": vars(args),
            "runs": [{**asdict(s), "output_tok_s": s.output_tok_s, "saturated_tok_s": s.saturated_tok_s,
                      "mean_running": s.mean_running, "decode_ms_per_token": s.decode_ms_per_token} for s in stats],
            "ratios": ratios, "loadavg_at_end": os.getloadavg(),
        }, indent=2) + "\n")
        print(f"- wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
