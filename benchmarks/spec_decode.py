#!/usr/bin/env python
"""Speculative decoding with n-gram drafts against plain decoding, side by side.

One engine per configuration in one process (same model, dtype, KV cache dtype and memory):
`off` decodes one token per step; `ngram:K:MIN-MAX` runs `--speculative-config '{"method":
"ngram", "num_speculative_tokens": K, "prompt_lookup_min": MIN, "prompt_lookup_max": MAX}'`;
`ngram:K:MIN-MAX:fixed` the same with the scheduler's draft trimming off (always up to K drafts;
see Scheduler.trim_drafts). Any configuration may end in `:rN` and/or `:fM`: its engine runs a batch
size N eager decode steps before recording its forward, and M eager steps before its first recording
(DecodeCaptures.record_after, first_record_after; off:r0:f0 records every shape at first use).

Workloads (chat prompts through the model's chat template, greedy, --output-len tokens at most),
one prompt per paragraph of the built-in calibration text:
  - quote:   "Repeat the following text exactly" + the paragraph (the output copies its prompt);
  - rewrite: "Rewrite the following text in simpler words" + the paragraph (copies some of it);
  - free:    "Write a short story about" + a topic (nothing to copy: drafts rarely match, and
             this measures what speculation costs when it does not pay).
Each workload runs as a single stream (one request at a time, the latency case) and as one
batch of all its prompts. Rounds alternate the order of the configurations (ABBA).

Reported per run: output tokens, wall time, output tok/s, forward passes (engine steps), and
for speculation the drafts proposed, verified (what the scheduler's trimming and block budget
left) and kept (acceptance = kept / verified; mean acceptance length = tokens per verify pass,
the emitted one included); per round each configuration's tok/s ratio to `off` and how many
requests generated the same tokens as `off`.

    .venv/bin/python benchmarks/spec_decode.py                      # default model, bf16, FP8 KV
    .venv/bin/python benchmarks/spec_decode.py --configs ngram:4:2-4 --workloads quote --rounds 1
    .venv/bin/python benchmarks/spec_decode.py --verify-cost        # a verify pass vs a decode step
    .venv/bin/python benchmarks/spec_decode.py --configs off:r0:f0,ngram:4:2-4:r0:f0,ngram:4:2-4 --fresh-recordings
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import torch
from bench_common import add_model_args, print_header, require_positive

TOPICS = ["a lighthouse keeper", "a lost umbrella", "the first day at a new school", "a robot that learns to cook",
          "two friends on a train", "a garden in winter"]
INSTRUCTIONS = {
    "quote": "Repeat the following text exactly, word for word:\n\n{text}",
    "rewrite": "Rewrite the following text in simpler words:\n\n{text}",
    "free": "Write a short story about {topic}.",
}


def parse_config(spec: str) -> tuple[dict | None, bool, dict]:
    """'off[:rN][:fM]' -> None; 'ngram:K:MIN-MAX[:fixed][:rN][:fM]' -> (the speculative config, whether
    drafts are trimmed, the DecodeCaptures settings given: N eager decode steps before a batch size's
    forward is recorded (record_after), M before the engine's first recording (first_record_after))."""
    m = re.fullmatch(r"(?:off|ngram:(\d+):(\d+)-(\d+)(:fixed)?)(?::r(\d+))?(?::f(\d+))?", spec)
    if not m:
        raise ValueError("a configuration is 'off' or 'ngram:K:MIN-MAX[:fixed]', optionally with ':rN' and "
                         f"':fM' (e.g. ngram:4:2-4, off:r0:f0), got {spec!r}")
    captures = {name: int(g) for name, g in (("record_after", m.group(5)), ("first_record_after", m.group(6)))
                if g is not None}
    if m.group(1) is None:
        return None, True, captures
    k, lo, hi = map(int, m.groups()[:3])
    return ({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi},
            m.group(4) is None, captures)


def prompts_for(llm, workload: str, num_prompts: int) -> list[list[int]]:
    from fp8serve.calibration.default_text import DEFAULT_CALIBRATION_TEXT

    paragraphs = [p.strip() for p in DEFAULT_CALIBRATION_TEXT.split("\n\n") if len(p.strip()) > 200]
    prompts = []
    for i in range(num_prompts):
        content = INSTRUCTIONS[workload].format(text=paragraphs[i % len(paragraphs)], topic=TOPICS[i % len(TOPICS)])
        prompts.append(llm.apply_chat_template([{"role": "user", "content": content}]))
    return prompts


def run(llm, prompts: list[list[int]], output_len: int, batched: bool) -> dict:
    from fp8serve.sampling_params import SamplingParams

    engine = llm.llm_engine
    st = engine.stats
    before = (st.num_steps, st.spec_decode_num_drafts, st.spec_decode_num_draft_tokens,
              st.spec_decode_num_accepted_tokens)
    params = SamplingParams(temperature=0, max_tokens=output_len)
    proposed = 0
    proposer = engine.proposer
    if proposer is not None:  # count the drafts proposed, before the scheduler trims some
        propose = proposer.propose

        def counting(*args, **kwargs):
            nonlocal proposed
            drafts = propose(*args, **kwargs)
            proposed += len(drafts)
            return drafts

        proposer.propose = counting
    t = time.perf_counter()
    try:
        if batched:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        else:
            outs = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0] for p in prompts]
    finally:
        if proposer is not None:
            del proposer.propose  # the class's method again
    wall = time.perf_counter() - t
    steps, drafts, drafted, accepted = (a - b for a, b in zip(
        (st.num_steps, st.spec_decode_num_drafts, st.spec_decode_num_draft_tokens,
         st.spec_decode_num_accepted_tokens), before))
    tokens = [o.outputs[0].token_ids for o in outs]
    n = sum(len(t) for t in tokens)
    return dict(wall=wall, tokens=n, tok_s=n / wall, steps=steps, drafts=drafts, proposed=proposed,
                drafted=drafted, accepted=accepted, outputs=tokens)


def verify_cost(llm, batch_sizes: list[int], drafts: list[int], context: int, repeats: int = 15) -> None:
    """Median time of one verify pass (ModelRunner.execute on sequences carrying drafts) against a
    plain decode step of the same sequences: batch size x drafts per sequence, `context` tokens
    each. The drafts are fixed tokens: what is timed is the pass, not whether they are kept."""
    import statistics

    from fp8serve.engine.sequence import Sequence
    from fp8serve.sampling_params import SamplingParams

    engine = llm.llm_engine
    runner, bm = engine.model_runner, engine.block_manager

    def median_ms(fn) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return 1e3 * statistics.median(times)

    print("| sequences | drafts each | verify rows | pass ms | decode step ms | ratio |")
    print("|---|---|---|---|---|---|")
    for batch in batch_sizes:
        seqs = [Sequence(f"cost-{i}", [100 + (7 * i + j) % 5000 for j in range(context)],
                         SamplingParams(temperature=0, max_tokens=max(drafts) + 2)) for i in range(batch)]
        for s in seqs:
            bm.allocate(s)
        runner.execute(seqs, True, None)  # prefill the contexts
        for s in seqs:
            s.num_computed_tokens = s.num_tokens - 1
            bm.append_slot(s, max(drafts))
        try:
            for k in drafts:
                def verify():
                    for s in seqs:
                        s.spec_token_ids = [5] * k
                    runner.execute(seqs, False, None)

                def decode():
                    for s in seqs:
                        s.spec_token_ids = []
                    runner.execute(seqs, False, None)

                verify(), decode()  # first use of a row count records its decode forward
                v, d = median_ms(verify), median_ms(decode)
                print(f"| {batch} | {k} | {batch * (k + 1)} | {v:.1f} | {d:.1f} | {v / d:.2f} |", flush=True)
        finally:
            for s in seqs:
                s.spec_token_ids = []
                bm.free(s)
    print()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--configs", default="ngram:4:2-4,ngram:8:2-4,ngram:4:5-5",
                    help="comma-separated ngram:K:MIN-MAX configurations, run next to 'off'")
    ap.add_argument("--workloads", default="quote,rewrite,free")
    ap.add_argument("--modes", default="single,batch", help="single (one request at a time) and/or batch")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fresh-recordings", action="store_true",
                    help="forget the recorded decode forwards before every measured run (a new server's "
                         "recording costs) instead of keeping the warm-up's")
    ap.add_argument("--verify-cost", action="store_true",
                    help="only time verify passes against decode steps (batch 1, 6, 16 x 1, 4, 8 drafts, "
                         "256-token contexts)")
    args = ap.parse_args(argv)
    require_positive(ap, args, "num_prompts", "output_len", "rounds")
    try:
        configs = {"off": (None, True, {})} | {c.strip(): parse_config(c.strip())
                                                 for c in args.configs.split(",") if c.strip()}
    except ValueError as e:
        ap.error(f"--configs: {e}")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in workloads if w not in INSTRUCTIONS]
    if bad or not workloads:
        ap.error(f"--workloads takes {', '.join(INSTRUCTIONS)}, got {args.workloads!r}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("single", "batch") for m in modes):
        ap.error(f"--modes takes single and/or batch, got {args.modes!r}")

    from fp8serve import LLM

    if args.verify_cost:
        print_header("Speculative decoding: what a verify pass costs against a decode step", argv)
        llm = LLM(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, seed=args.seed,
                  kv_cache_memory=args.kv_cache_memory)
        print()
        verify_cost(llm, [1, 6, 16], [1, 4, 8], context=256)
        return 0

    print_header("Speculative decoding (n-gram drafts) vs plain decoding", argv)
    llms = {}
    for label, (spec, trim, capture_settings) in configs.items():
        llms[label] = LLM(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, seed=args.seed,
                          kv_cache_memory=args.kv_cache_memory, speculative_config=spec)
        if not trim:
            llms[label].llm_engine.scheduler.spec_free_rows = None
        for name, value in capture_settings.items():
            setattr(llms[label].llm_engine.model_runner.decode_captures, name, value)
    first = next(iter(llms.values()))
    prompts = {w: prompts_for(first, w, args.num_prompts) for w in workloads}
    lens = {w: sum(len(p) for p in ps) / len(ps) for w, ps in prompts.items()}
    print(f"- {args.num_prompts} prompts per workload (mean prompt tokens: "
          + ", ".join(f"{w} {n:.0f}" for w, n in lens.items())
          + f"), greedy, at most {args.output_len} output tokens; torch threads {torch.get_num_threads()}\n")
    # Warm-up, one unreported pass of every measured run: kernel builds, first allocations, and
    # the decode recordings of every batch size and verify row count the runs reach (a recording
    # costs ~0.05-0.7 s here), all recorded at first use for this pass (record_after and
    # first_record_after 0): the measured runs are the steady state of an engine that has met
    # these shapes. A speculating engine decodes plainly only in steps without drafts, so it
    # would otherwise record sizes at other times than `off` does. --fresh-recordings forgets the
    # recordings before every measured run instead: what a new engine pays for the shapes it
    # meets, under its record_after and first_record_after.
    for llm in llms.values():
        captures = llm.llm_engine.model_runner.decode_captures
        settings = (captures.record_after, captures.first_record_after)
        captures.record_after = captures.first_record_after = 0
        for workload in workloads:
            for mode in modes:
                run(llm, prompts[workload], args.output_len, mode == "batch")
        captures.record_after, captures.first_record_after = settings

    head = ["round", "workload", "mode", "config", "tokens", "wall s", "output tok/s", "steps", "proposed",
            "verified", "kept", "acceptance", "tokens per verify"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    labels = list(llms)
    summary = []
    for rnd in range(1, args.rounds + 1):
        for workload in workloads:
            for mode in modes:
                res = {}
                for label in (labels if rnd % 2 else labels[::-1]):
                    if args.fresh_recordings:
                        llms[label].llm_engine.model_runner.decode_captures.reset()
                    r = res[label] = run(llms[label], prompts[workload], args.output_len, mode == "batch")
                    acc = f"{100 * r['accepted'] / r['drafted']:.0f}%" if r["drafted"] else "-"
                    per = f"{1 + r['accepted'] / r['drafts']:.2f}" if r["drafts"] else "-"
                    print(f"| {rnd} | {workload} | {mode} | {label} | {r['tokens']} | {r['wall']:.2f} | "
                          f"{r['tok_s']:.1f} | {r['steps']} | {r['proposed']} | {r['drafted']} | {r['accepted']} | "
                          f"{acc} | {per} |",
                          flush=True)
                off = res["off"]
                for label in labels[1:]:
                    r = res[label]
                    same = sum(a == b for a, b in zip(off["outputs"], r["outputs"]))
                    summary.append(f"round {rnd}, {workload}, {mode}, {label} / off: output tok/s "
                                   f"{r['tok_s'] / off['tok_s']:.2f}x; {same}/{len(r['outputs'])} requests "
                                   f"generated the same tokens")
    print()
    for line in summary:
        print("- " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
