"""Replay a saturation workload through the real Scheduler and BlockManager
with a step-time model instead of a model, to see what the scheduling policy
alone does to throughput at a given KV capacity.

No model runs: each prefill step costs `--prefill-ms-per-token` per token and
each decode step `--step-ms + --step-ms-per-seq * batch`; every sequence emits
one token per step it is in (a prefill emits its first token), and requests
run to `--output-len` (ignore_eos). Calibrated to the kv-saturation sweep
(benchmarks/results/kv_saturation.md), it reproduces the servers' preemption
counts exactly (32 with 256 blocks, 30 with 512), which says the gap between
the FP8 and 16-bit runs is scheduling (admission, preemption, the drain at the
end), not server overhead. (That calibration predates stop 25's growth reservation at admission:
`--policy watermark` replays the admission of then.)

--policy compares admission policies on the same workload: `reserve` (the scheduler's default:
room kept for the running sequences' expected growth, fp8serve/engine/scheduler.py) and `watermark` (1% of
the blocks only: vLLM's). --max-tokens larger than --output-len with --min-output-len below it
models outputs that stop early (EOS) under a generous max_tokens: each request's length is drawn
uniformly from [--min-output-len, --output-len] (seeded), while the scheduler only sees max_tokens.

    .venv/bin/python benchmarks/scheduler_sim.py --num-blocks 256,512
    .venv/bin/python benchmarks/scheduler_sim.py --num-blocks 256,512 --policy reserve,watermark \
        --step-ms 8 --step-ms-per-seq 0.7 --prefill-ms-per-token 0.64
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from fp8serve.config import SchedulerConfig
from fp8serve.engine.block_manager import BlockManager
from fp8serve.engine.scheduler import Scheduler
from fp8serve.engine.sequence import Sequence
from fp8serve.sampling_params import SamplingParams


@dataclass
class SimResult:
    num_blocks: int
    total_s: float
    output_tokens: int
    decode_steps: int
    num_preemptions: int
    mean_decode_batch: float
    saturated_s: float  # until the last request's first token
    saturated_tokens: int

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.total_s

    @property
    def saturated_tok_s(self) -> float:
        return self.saturated_tokens / self.saturated_s if self.saturated_s else 0.0


def simulate(num_blocks: int, num_prompts: int = 48, input_len: int = 256, output_len: int = 256,
             block_size: int = 16, max_model_len: int = 512, max_num_seqs: int = 128, step_ms: float = 55.0,
             step_ms_per_seq: float = 0.6, prefill_ms_per_token: float = 0.3, policy: str = "watermark",
             max_tokens: int | None = None, min_output_len: int | None = None, seed: int = 0) -> SimResult:
    """policy: "reserve" (the scheduler's growth reservation) or "watermark" (without it; the
    default here, which the calibration above was made with). Request i stops after its own
    length, drawn from [min_output_len, output_len] (all output_len when min_output_len is None);
    the scheduler sees max_tokens (default output_len)."""
    if policy not in ("reserve", "watermark"):
        raise ValueError(f"policy must be 'reserve' or 'watermark', got {policy!r}")
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len),
                      BlockManager(num_blocks, block_size), reserve_growth=policy == "reserve")
    rng = random.Random(seed)
    lengths: dict[str, int] = {}
    # Outputs that all run to max_tokens ignore EOS (as the engine's benchmarks ask); shorter ones model EOS stops.
    ignore_eos = min_output_len is None and (max_tokens or output_len) == output_len
    for i in range(num_prompts):
        params = SamplingParams(max_tokens=max_tokens or output_len, ignore_eos=ignore_eos)
        sched.add(Sequence(f"sim-{i}", list(range(input_len)), params))
        lengths[f"sim-{i}"] = output_len if min_output_len is None else rng.randint(min_output_len, output_len)
    t, tokens, steps, batch_sum = 0.0, 0, 0, 0
    first_token: dict[str, tuple[float, int]] = {}
    while sched.has_unfinished():
        out = sched.schedule()
        if out is None:
            raise RuntimeError(f"the scheduler is stuck with {num_blocks} blocks")
        if out.is_prefill:
            t += prefill_ms_per_token * out.num_batched_tokens / 1000
        elif out.seqs:
            t += (step_ms + step_ms_per_seq * len(out.seqs)) / 1000
            steps += 1
            batch_sum += len(out.seqs)
        for seq in out.seqs:
            seq.output_token_ids.append(0)
            seq.num_computed_tokens = seq.num_tokens - 1
            tokens += 1
            first_token.setdefault(seq.request_id, (t, tokens))
        for seq in list(sched.running):
            if len(seq.output_token_ids) >= lengths[seq.request_id]:
                # What the engine records before finishing: the reservation learns from it.
                seq.finish_reason = "length" if len(seq.output_token_ids) >= seq.sampling_params.max_tokens else "stop"
                sched.finish(seq)
    sat_t, sat_tokens = max(first_token.values())
    return SimResult(num_blocks, t, tokens, steps, sched.num_preemptions, batch_sum / max(steps, 1), sat_t, sat_tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-blocks", default="256,512", help="comma-separated KV capacities to compare")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--step-ms", type=float, default=55.0, help="decode step time at batch 0")
    p.add_argument("--step-ms-per-seq", type=float, default=0.6, help="added decode step time per sequence")
    p.add_argument("--prefill-ms-per-token", type=float, default=0.3)
    p.add_argument("--policy", default="watermark",
                   help="comma-separated admission policies: reserve, watermark (default: watermark)")
    p.add_argument("--max-tokens", type=int, default=None, help="what the scheduler sees (default --output-len)")
    p.add_argument("--min-output-len", type=int, default=None,
                   help="outputs stop early: each length uniform in [this, --output-len] (default: all --output-len)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    policies = [x.strip() for x in args.policy.split(",") if x.strip()]
    for policy in policies:
        if policy not in ("reserve", "watermark"):
            p.error(f"--policy: unknown policy {policy!r} (reserve, watermark)")
    if args.max_tokens is not None and args.max_tokens < args.output_len:
        p.error(f"--max-tokens ({args.max_tokens}) must be at least --output-len ({args.output_len})")
    if args.min_output_len is not None and not 1 <= args.min_output_len <= args.output_len:
        p.error(f"--min-output-len must be in [1, --output-len], got {args.min_output_len}")
    results = [(policy, simulate(int(n), args.num_prompts, args.input_len, args.output_len, args.block_size,
                                 args.max_model_len, step_ms=args.step_ms, step_ms_per_seq=args.step_ms_per_seq,
                                 prefill_ms_per_token=args.prefill_ms_per_token, policy=policy,
                                 max_tokens=args.max_tokens, min_output_len=args.min_output_len, seed=args.seed))
               for policy in policies for n in args.num_blocks.split(",")]
    base = results[0][1]
    print("| policy | blocks | total s | output tok/s | vs first | saturated tok/s | vs first | preemptions | "
          "mean decode batch |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for policy, r in results:
        print(f"| {policy} | {r.num_blocks} | {r.total_s:.1f} | {r.output_tok_s:.1f} | "
              f"{r.output_tok_s / base.output_tok_s:.2f}x | {r.saturated_tok_s:.1f} | "
              f"{r.saturated_tok_s / base.saturated_tok_s:.2f}x | {r.num_preemptions} | {r.mean_decode_batch:.1f} |")


if __name__ == "__main__":
    main()
