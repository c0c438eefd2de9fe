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
end), not server overhead.

    .venv/bin/python benchmarks/scheduler_sim.py --num-blocks 256,512
"""

from __future__ import annotations

import argparse
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
             step_ms_per_seq: float = 0.6, prefill_ms_per_token: float = 0.3) -> SimResult:
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len),
                      BlockManager(num_blocks, block_size))
    for i in range(num_prompts):
        params = SamplingParams(max_tokens=output_len, ignore_eos=True)
        sched.add(Sequence(f"sim-{i}", list(range(input_len)), params))
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
            if len(seq.output_token_ids) >= output_len:
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
    args = p.parse_args()
    results = [simulate(int(n), args.num_prompts, args.input_len, args.output_len, args.block_size,
                        args.max_model_len, step_ms=args.step_ms, step_ms_per_seq=args.step_ms_per_seq,
                        prefill_ms_per_token=args.prefill_ms_per_token)
               for n in args.num_blocks.split(",")]
    base = results[0]
    print("| blocks | total s | output tok/s | vs first | saturated tok/s | vs first | preemptions | mean decode batch |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r.num_blocks} | {r.total_s:.1f} | {r.output_tok_s:.1f} | {r.output_tok_s / base.output_tok_s:.2f}x | "
              f"{r.saturated_tok_s:.1f} | {r.saturated_tok_s / base.saturated_tok_s:.2f}x | {r.num_preemptions} | "
              f"{r.mean_decode_batch:.1f} |")


if __name__ == "__main__":
    main()
