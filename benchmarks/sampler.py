#!/usr/bin/env python
"""Random sampling on CPU: the sampler's C++ kernel (kernels/cpu/random_sampling.cpp:
a few passes per row, one uniform per draw) against its torch path (a sort per row for
top-k/top-p, softmax, one exponential variate per vocabulary entry), in one process.

  1. The sampler alone on the default model's own logits (rows of a greedy generation
     from text, through its LM head), at --batch rows and for each --params set:
     torch path vs kernel, alternating (ABBA), medians of --rounds.
  2. The penalties alone (repetition 1.1, frequency 0.2, presence 0.1 over
     --decode-context prompt tokens and 32 output tokens per row) at --batch rows:
     the dense reference (`apply_penalties_dense`) against `apply_penalties`,
     which touches only the seen tokens.
  3. Speculative decoding's rejection sampling alone (spec_decode/rejection_sampler.py)
     on --batch sequences of 4 drafts each (5 rows of the model's logits per sequence),
     temperature 0.7 / top_p 0.9: the torch path (a sort per row, the exponential race)
     against the kernel (p(draft) and the draw without the draft in its passes).
  4. Engine decode steps at --decode-batch with temperature 0.7, top_p 0.9,
     the sampler switched between rounds in the same engine (`Sampler.use_kernel`).

The table's "baseline" is the torch path (rows 1, 3 and 4) or the dense penalties (row 2).

    python benchmarks/sampler.py
    python benchmarks/sampler.py --batch 1,64 --decode-batch 1,16 --output benchmarks/results/x.md
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    add_decode_sample_args, alternate, command_line, describe_machine, emit_table, greedy_head_rows, machine_info,
    median_time, parse_decode_sample_args, parse_sizes, record_as_a_warm_engine, time_greedy_decode, token_source)

from fp8serve.kernels import cpu_ops  # noqa: E402

# name -> SamplingParams fields
PARAMS = {
    "t=1.0": {"temperature": 1.0},
    "t=0.7 top_p=0.9": {"temperature": 0.7, "top_p": 0.9},
    "t=0.7 top_k=50": {"temperature": 0.7, "top_k": 50},
    "t=0.7 top_p=0.95 min_p=0.05": {"temperature": 0.7, "top_p": 0.95, "min_p": 0.05},
    "t=0.8 top_p=0.9 repetition_penalty=1.1": {"temperature": 0.8, "top_p": 0.9, "repetition_penalty": 1.1},
}
DECODE_PARAMS = "t=0.7 top_p=0.9"


def time_sampler(logits: torch.Tensor, params: dict, rounds: int, calls: int) -> dict[str, float]:
    from fp8serve import SamplingParams
    from fp8serve.layers.sampler import Sampler, SamplingMetadata

    n = logits.shape[0]
    sp = SamplingParams(**params)
    md = SamplingMetadata.from_params([sp] * n, [[1, 2, 3]] * n, [[4, 5]] * n, None, "cpu")
    torch_path, kernel = Sampler(use_kernel=False), Sampler()
    return alternate({"torch": lambda: median_time(lambda: torch_path(logits, md), calls),
                      "kernel": lambda: median_time(lambda: kernel(logits, md), calls)}, rounds)


def time_penalties(logits: torch.Tensor, prompt_len: int, rounds: int, calls: int) -> dict[str, float]:
    from fp8serve import SamplingParams
    from fp8serve.layers.sampler import SamplingMetadata, apply_penalties, apply_penalties_dense

    n, vocab = logits.shape
    rng = random.Random(n)
    sp = SamplingParams(temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1)
    md = SamplingMetadata.from_params([sp] * n, [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(n)],
                                      [[rng.randrange(vocab) for _ in range(32)] for _ in range(n)], None, "cpu")
    if not torch.equal(apply_penalties_dense(logits.clone(), md), apply_penalties(logits.clone(), md)):
        raise RuntimeError("apply_penalties differs from apply_penalties_dense")
    x = logits.clone()

    def fresh():  # both overwrite their input
        x.copy_(logits)

    return alternate({"dense": lambda: median_time(lambda: apply_penalties_dense(x, md), calls, fresh),
                      "sparse": lambda: median_time(lambda: apply_penalties(x, md), calls, fresh)}, rounds)


def time_rejection(logits: torch.Tensor, seqs: int, rounds: int, calls: int) -> dict[str, float]:
    from fp8serve import SamplingParams
    from fp8serve.layers.sampler import SamplingMetadata
    from fp8serve.spec_decode.rejection_sampler import rejection_sample

    vocab = logits.shape[1]
    rows = logits[torch.arange(5 * seqs) % len(logits)].contiguous()
    drafts = [[int(t) for t in torch.randint(0, vocab, (4,))] for _ in range(seqs)]
    sp = SamplingParams(temperature=0.7, top_p=0.9)
    outs = [list(d[:j]) for d in drafts for j in range(5)]
    md = SamplingMetadata.from_params([sp] * len(outs), [[1, 2, 3]] * len(outs), outs, None, "cpu")
    applies = cpu_ops.sample_tokens_applies

    def torch_path():
        cpu_ops.sample_tokens_applies = lambda x: False
        try:
            rejection_sample(rows, md, drafts)
        finally:
            cpu_ops.sample_tokens_applies = applies

    return alternate({"torch": lambda: median_time(torch_path, calls),
                      "kernel": lambda: median_time(lambda: rejection_sample(rows, md, drafts), calls)}, rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the built-in default model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", default="1,16,64", help="comma-separated rows for the sampler alone")
    p.add_argument("--params", default=",".join(PARAMS), help=f"comma-separated names of {list(PARAMS)}")
    p.add_argument("--decode-batch", default="1,16", help="comma-separated batch sizes of engine decode steps "
                   "('' for none)")
    add_decode_sample_args(p, "sampler calls")
    args = parse_decode_sample_args(p)
    batches = parse_sizes(p, "--batch", args.batch)
    decode_batches = parse_sizes(p, "--decode-batch", args.decode_batch, allow_empty=True)
    names = [x.strip() for x in args.params.split(",") if x.strip()]
    unknown = [x for x in names if x not in PARAMS]
    if unknown or not names:
        p.error(f"--params: unknown {unknown}; expected names from {list(PARAMS)}")
    if cpu_ops.load_cpu_ops() is None:
        sys.exit("the C++ CPU kernels are not available: nothing to compare the torch path with")
    from fp8serve import LLM

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.decode_context + args.decode_steps + 64,
              max_num_seqs=max([64] + decode_batches), device="cpu", seed=args.seed)
    engine = llm.llm_engine
    record_as_a_warm_engine(engine)
    rng = random.Random(args.seed)
    draw = token_source(engine, "text")
    with torch.inference_mode():
        rows = engine.model_runner.model.compute_logits(
            greedy_head_rows(engine, draw, rng, args.decode_context, args.sample_steps)).float()
    lines = [f"Command: `{command_line()}`", "", *(f"- {x}" for x in describe_machine(machine_info())),
             f"- model {engine.model_runner.config.model_config.model}, {args.dtype}; the sampler alone on "
             f"{len(rows)} rows of the model's logits ({rows.shape[1]} tokens) from a greedy generation from text; "
             f"medians of {args.rounds} ABBA rounds",
             "", "| cell | rows | params | baseline ms | engine ms | baseline / engine |", "|---|---|---|---|---|---|"]
    for b in batches:
        logits = rows[torch.arange(b) % len(rows)].contiguous()
        for name in names:
            t = time_sampler(logits, PARAMS[name], args.rounds, args.calls)
            lines.append(f"| sampler alone | {b} | {name} | {1e3 * t['torch']:.3f} | {1e3 * t['kernel']:.3f} | "
                         f"{t['torch'] / t['kernel']:.1f}x |")
            print(lines[-1], file=sys.stderr, flush=True)
    for b in batches:
        logits = rows[torch.arange(b) % len(rows)].contiguous()
        t = time_penalties(logits, args.decode_context, args.rounds, args.calls)
        lines.append(f"| penalties alone (dense vs seen tokens only) | {b} | repetition 1.1, frequency 0.2, "
                     f"presence 0.1 | {1e3 * t['dense']:.3f} | {1e3 * t['sparse']:.3f} | "
                     f"{t['dense'] / t['sparse']:.1f}x |")
        print(lines[-1], file=sys.stderr, flush=True)
    for b in batches:
        t = time_rejection(rows, b, args.rounds, args.calls)
        lines.append(f"| rejection sampling alone ({b} x 4 drafts, {5 * b} rows) | {5 * b} | {DECODE_PARAMS} | "
                     f"{1e3 * t['torch']:.3f} | {1e3 * t['kernel']:.3f} | {t['torch'] / t['kernel']:.1f}x |")
        print(lines[-1], file=sys.stderr, flush=True)
    sampler = engine.model_runner.sampler
    for b in decode_batches:
        prompts = [draw(args.decode_context, rng) for _ in range(b)]

        def decode(use_kernel: bool) -> float:
            sampler.use_kernel = use_kernel
            try:
                return time_greedy_decode(engine, prompts, args.decode_steps, sampling=PARAMS[DECODE_PARAMS])[0]
            finally:
                sampler.use_kernel = True

        med = alternate({"torch": lambda: decode(False), "kernel": lambda: decode(True)}, args.rounds)
        tt, tk = med["torch"], med["kernel"]
        lines.append(f"| engine decode step, batch {b} x ~{args.decode_context} | {b} | {DECODE_PARAMS} | "
                     f"{1e3 * tt:.2f} | {1e3 * tk:.2f} | {tt / tk:.2f}x |")
        print(lines[-1], file=sys.stderr, flush=True)
    emit_table(lines, args.output)


if __name__ == "__main__":
    main()
