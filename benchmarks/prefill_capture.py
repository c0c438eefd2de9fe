#!/usr/bin/env python
"""Recorded prefill forwards (fp8serve/engine/prefill_capture.py) against the
module tree, inside whole engine prefill steps.

Two engines on one checkpoint live in one process: "replayed" as the engine
runs (prefill captures on, recording each segment at its first prefills),
"eager" with prefill captures off (decode captures stay on in both; no decode
steps run here). Before timing, the replayed engine prefills every --lengths
count and every count one below it, so each segment is recorded twice and
generalized; --random counts are drawn afterwards and never recorded, so
their replays are of a forward recorded at other counts. Then --rounds
rounds alternate the engines (ABBA), each prefilling every count once (one
prompt of that many tokens, one engine step, max_tokens=1). The table gives
each count's median step time per engine, the ratio, and whether the two
engines produced the same first token in every round; the script stops with
an error if a timed step of the replayed engine recorded instead of
replaying (the count of replays is checked).

--context N: prefix caching on in both engines, and every prompt is one
shared N-token prefix (cached by both engines before anything is timed)
followed by --lengths / --random new tokens drawn afresh for every round,
so each step computes only those and runs the backend's context kernel over
the cached prefix (a follow-up turn of a chat, or a chunk of a chunked
prefill). The script checks that every timed replay was of such a step.

    .venv/bin/python benchmarks/prefill_capture.py
    .venv/bin/python benchmarks/prefill_capture.py --dtype float32 --lengths 128,512 --random 2
    .venv/bin/python benchmarks/prefill_capture.py --context 512 --lengths 16,64,256 --random-min 8 --random-max 300
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (command_line, describe_machine, emit_table, machine_info, model_and_vocab,  # noqa: E402
                          parse_sizes, require_positive)

FIRST_ORDINARY_TOKEN_ID = 17  # SmolLM2's special tokens are 0-16


def prefill_step(engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds of one engine step that prefills `prompt`, and its greedy token."""
    from fp8serve import SamplingParams

    engine.add_request(None, {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=1,
                                                                          ignore_eos=True))
    gc.collect()
    t = time.perf_counter()
    outs = engine.step()
    dt = time.perf_counter() - t
    if len(outs) != 1 or not outs[0].finished or engine.has_unfinished_requests():
        raise RuntimeError("a prefill step did not finish its one-token request")
    return dt, outs[0].outputs[0].token_ids[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--lengths", default="128,512,1024", help="prompt token counts, recorded before timing "
                   "(default: %(default)s)")
    p.add_argument("--random", type=int, default=3, help="counts drawn in [--random-min, --random-max] after the "
                   "recordings, never recorded (default: %(default)s)")
    p.add_argument("--random-min", type=int, default=300)
    p.add_argument("--random-max", type=int, default=1000)
    p.add_argument("--context", type=int, default=0, help="tokens of a cached prefix every prompt continues "
                   "(prefix caching on; a multiple of the block size, 16); 0: fresh prompts (default)")
    p.add_argument("--rounds", type=int, default=6, help="ABBA rounds (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None, help="also write the table to this file")
    args = p.parse_args(argv)
    lengths = parse_sizes(p, "--lengths", args.lengths)
    if min(lengths) < 3:
        p.error(f"--lengths: every count must be >= 3 (it is recorded with the count one below), got {min(lengths)}")
    if args.random < 0:
        p.error(f"--random must be >= 0, got {args.random}")
    if not 1 <= args.random_min <= args.random_max:
        p.error(f"--random-min/--random-max: need 1 <= min <= max, got {args.random_min} and {args.random_max}")
    require_positive(p, args, "rounds")
    if args.context < 0 or args.context % 16:
        p.error(f"--context must be a multiple of the block size (16) >= 0, so the whole prefix is cached; "
                f"got {args.context}")
    if args.output is not None and not args.output.parent.is_dir():
        p.error(f"--output: directory {args.output.parent} does not exist")

    from fp8serve import LLM

    model, vocab = model_and_vocab(args.model)
    rng = random.Random(args.seed)
    randoms = [rng.randint(args.random_min, args.random_max) for _ in range(args.random)]
    counts = lengths + [n for n in randoms if n not in lengths]
    kwargs = dict(model=str(model), dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, device="cpu", seed=0,
                  max_model_len=args.context + max(counts) + 1,
                  max_num_batched_tokens=max(2048, args.context + max(counts) + 1), kv_cache_memory="512MiB",
                  enable_prefix_caching=args.context > 0)
    engines = {"eager": LLM(**kwargs).llm_engine, "replayed": LLM(**kwargs).llm_engine}
    engines["eager"].model_runner.prefill_captures.enabled = False
    captures = engines["replayed"].model_runner.prefill_captures
    if not captures.enabled:
        raise SystemExit("prefill captures are off for this model or machine (no C++ kernels, or a linear method "
                         "without row breakpoints): nothing to compare")
    captures.record_after = 0
    prefix = [rng.randrange(FIRST_ORDINARY_TOKEN_ID, vocab) for _ in range(args.context)]

    def draw() -> dict[int, list[int]]:
        """A prompt per count: the prefix and that many new tokens (new ones each call under --context)."""
        return {n: prefix + [rng.randrange(FIRST_ORDINARY_TOKEN_ID, vocab) for _ in range(n)] for n in counts}

    if prefix:
        for engine in engines.values():
            prefill_step(engine, prefix)  # fresh: cached from here on
    for n in lengths:  # record each segment twice: the count, then the count one below
        for engine in engines.values():
            prefill_step(engine, draw()[n])
            prefill_step(engine, draw()[n][:-1])  # new tokens: the first's would hit the prefix cache
    recorded = captures.num_recorded
    general = {part: sum(1 for k, s in captures._segments.items() if s.general and k[0] == part)
               for part in ("trunk", "head")}

    times = {name: {n: [] for n in counts} for name in engines}
    same = {n: True for n in counts}
    replays_before, context_replays_before = captures.num_replays, captures.num_context_replays
    prompts = draw()
    for r in range(args.rounds):
        if prefix:
            prompts = draw()  # the same for both engines, never cached
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        tokens: dict[str, dict[int, int]] = {name: {} for name in engines}
        for name in order:
            for n in counts:
                dt, tok = prefill_step(engines[name], prompts[n])
                times[name][n].append(dt)
                tokens[name][n] = tok
        for n in counts:
            same[n] &= tokens["eager"][n] == tokens["replayed"][n]
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    replayed = captures.num_replays - replays_before
    if replayed != args.rounds * len(counts) or captures.num_recorded != recorded:
        raise SystemExit(f"the replayed engine replayed {replayed} of {args.rounds * len(counts)} timed prefills "
                         f"and recorded {captures.num_recorded - recorded} more: the comparison is not what it claims")
    context_replayed = captures.num_context_replays - context_replays_before
    if context_replayed != (replayed if prefix else 0):
        raise SystemExit(f"{context_replayed} of {replayed} timed replays continued a cached context, expected "
                         f"{'all' if prefix else 'none'}: the comparison is not what it claims")

    lines = [f"# fp8serve recorded prefill forwards vs the module tree — "
             f"{_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')}",
             f"command: {command_line(argv)}"]
    lines += describe_machine(machine_info())
    lines += [f"model: {model}, --dtype {args.dtype}, --kv-cache-dtype {args.kv_cache_dtype}; {args.rounds} ABBA "
              f"rounds, one prefill step per count per engine per round; {recorded} recordings before timing, "
              f"trunks and heads ({general['trunk']} trunk and {general['head']} head segments generalized); "
              "every timed step of the replayed engine replayed"
              + (f"; every prompt continues a cached {args.context}-token prefix (prefix caching on in both "
                 f"engines): the counts below are the new tokens a step computes" if prefix else ""),
              "",
              f"| {'new' if prefix else 'prompt'} tokens | recorded at this count | eager ms | replayed ms "
              "| speedup (median) | by round min / max | same first token |",
              "|---|---|---|---|---|---|---|"]
    for n in counts:
        e, rp = times["eager"][n], times["replayed"][n]
        ratios = [a / b for a, b in zip(e, rp)]
        lines.append(f"| {n} | {'yes' if n in lengths else 'no'} | {1e3 * statistics.median(e):.1f} | "
                     f"{1e3 * statistics.median(rp):.1f} | {statistics.median(e) / statistics.median(rp):.3f}x | "
                     f"{min(ratios):.3f} / {max(ratios):.3f} | {same[n]} |")
    emit_table(lines, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
