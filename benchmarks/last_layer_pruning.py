#!/usr/bin/env python
"""Prefills that run the last decoder layer past attention on each
sequence's last token only (the model's `forward_head` with
`logits_indices`; engine/model_runner.py's `prune_last_layer`) against the
same engine running it on every token, inside whole engine prefill steps.

Two engines on one checkpoint live in one process, identical but for
`prune_last_layer` (the pruned engine prunes at every count, below the
engine's MIN_MEAN_TOKENS_TO_PRUNE too: these runs chose it); both record and replay their prefill forwards
(engine/prefill_capture.py: the trunk, and the head under a key that
includes the number of prompts). Before timing each engine prefills every --lengths count and the
count one below it, so every segment is recorded twice and generalized.
Then --rounds rounds alternate the engines (ABBA), each running, for every
count, --repeats engine steps that prefill --batch prompts of that many
tokens (fresh random ids every step, the same for both engines;
max_tokens=1); a round's time is the median of its repeats. The table
gives each count's median round time per engine, the ratio, the ratio of
the two engines' best steps (the 2-vCPU guests here see steps slowed 1.5x
by the host now and then: a best step is the least disturbed), the
share of the prefill's FLOPs the pruned engine skips (from config.json:
q, attention, o_proj and MLP of every row but the last in the last layer),
and whether both engines sampled the same first tokens in every round. The
script stops with an error if the pruned engine ran a forward of a timed
step in full, or the full engine pruned one (the prefill forwards are
counted; a step of many prompts may run several).

--context N: prefix caching on in both engines, and every prompt is one
shared N-token prefix (cached by both engines before anything is timed)
followed by the count's new tokens: the prefill of a follow-up turn.

    .venv/bin/python benchmarks/last_layer_pruning.py
    .venv/bin/python benchmarks/last_layer_pruning.py --batch 16 --lengths 512
    .venv/bin/python benchmarks/last_layer_pruning.py --context 512 --lengths 32,128
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (command_line, describe_machine, emit_table, machine_info, model_and_vocab,  # noqa: E402
                          parse_sizes, require_positive)

FIRST_ORDINARY_TOKEN_ID = 17  # SmolLM2's special tokens are 0-16
BLOCK_SIZE = 16


def skipped_flops_share(cfg: dict, new_tokens: int, context: int) -> float:
    """The share of a prefill's FLOPs (one sequence of `new_tokens` after `context` cached ones; linear
    layers, attention and the one row of logits) that the pruned last layer skips."""
    h, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    d = int(cfg.get("head_dim") or h // heads)
    inter = int(cfg["intermediate_size"])
    q, kv = heads * d, 2 * kv_heads * d
    row_linear = 2 * (h * (q + kv) + q * h + 3 * h * inter)  # one token through one layer's projections
    keys = sum(context + i for i in range(1, new_tokens + 1))  # keys the new tokens attend to, all rows
    layer_attention = 4 * q * keys
    total = layers * (new_tokens * row_linear + layer_attention) + 2 * h * int(cfg["vocab_size"])
    skipped = (new_tokens - 1) * 2 * (h * q + q * h + 3 * h * inter) + 4 * q * (keys - (context + new_tokens))
    return skipped / total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--lengths", default="32,128,512,1024", help="new tokens per prompt (default: %(default)s)")
    p.add_argument("--batch", type=int, default=1, help="prompts prefilled in one step (default: %(default)s)")
    p.add_argument("--context", type=int, default=0, help="tokens of a cached prefix every prompt continues "
                   f"(prefix caching on; a multiple of the block size, {BLOCK_SIZE}); 0: fresh prompts (default)")
    p.add_argument("--rounds", type=int, default=6, help="ABBA rounds (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="steps per count per engine per round "
                   "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None, help="also write the table to this file")
    args = p.parse_args(argv)
    counts = parse_sizes(p, "--lengths", args.lengths)
    if min(counts) < 3:
        p.error(f"--lengths: every count must be >= 3 (it is recorded with the count one below), got {min(counts)}")
    require_positive(p, args, "rounds", "batch", "repeats")
    if args.context < 0 or args.context % BLOCK_SIZE:
        p.error(f"--context must be a multiple of the block size ({BLOCK_SIZE}) >= 0, so the whole prefix is "
                f"cached; got {args.context}")
    if args.output is not None and not args.output.parent.is_dir():
        p.error(f"--output: directory {args.output.parent} does not exist")

    from fp8serve import LLM, SamplingParams

    model, vocab = model_and_vocab(args.model)
    cfg = json.loads((model / "config.json").read_text())
    rng = random.Random(args.seed)
    step_tokens = args.batch * max(counts)
    kwargs = dict(model=str(model), dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, device="cpu", seed=0,
                  max_model_len=args.context + max(counts) + 1, max_num_seqs=max(args.batch, 1),
                  max_num_batched_tokens=max(2048, step_tokens + args.context + 1),
                  kv_cache_memory=f"{max(512, 64 * args.batch)}MiB", enable_prefix_caching=args.context > 0)
    engines = {"full": LLM(**kwargs).llm_engine, "pruned": LLM(**kwargs).llm_engine}
    heads = {name: {"pruned": 0, "full": 0} for name in engines}
    for name, engine in engines.items():
        runner = engine.model_runner
        if not hasattr(runner.model, "forward_head"):
            raise SystemExit(f"{type(runner.model).__name__} has no forward_head: nothing to compare")
        runner.prune_last_layer = name == "pruned"
        runner.min_mean_tokens_to_prune = 1  # at every count: what set the engine's threshold
        captures = runner.prefill_captures
        captures.record_after = 0

        # Every prefill forward goes through here, replayed or eager: count those asked for the last rows only.
        def counting(input_ids, positions, md, logits_indices=None, _forward=captures.forward, _calls=heads[name]):
            _calls["full" if logits_indices is None else "pruned"] += 1
            return _forward(input_ids, positions, md, logits_indices)

        captures.forward = counting
    prefix = [rng.randrange(FIRST_ORDINARY_TOKEN_ID, vocab) for _ in range(args.context)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def draw(n: int) -> list[list[int]]:
        return [prefix + [rng.randrange(FIRST_ORDINARY_TOKEN_ID, vocab) for _ in range(n)]
                for _ in range(args.batch)]

    def step(engine, prompts: list[list[int]]) -> tuple[float, list[int]]:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}-{random.random()}", {"prompt_token_ids": prompt}, params)
        gc.collect()
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        if len(outs) != len(prompts) or not all(o.finished for o in outs) or engine.has_unfinished_requests():
            raise RuntimeError("a step did not prefill every prompt of the batch (raise --max-num-batched-tokens?)")
        return dt, [o.outputs[0].token_ids[0] for o in sorted(outs, key=lambda o: int(o.request_id.split("-")[0][1:]))]

    if prefix:
        for engine in engines.values():
            step(engine, [prefix])  # cached from here on
    for n in counts:  # record each segment twice: the count, then the count one below
        for engine in engines.values():
            step(engine, draw(n))
            step(engine, [s[:-1] for s in draw(n)])
    times = {name: {n: [] for n in counts} for name in engines}  # per round: the median of its repeats
    best = {name: {n: float("inf") for n in counts} for name in engines}
    same = {n: True for n in counts}
    before = {name: dict(c) for name, c in heads.items()}
    replays_before = {name: e.model_runner.prefill_captures.num_replays for name, e in engines.items()}
    head_replays_before = {name: e.model_runner.prefill_captures.num_head_replays for name, e in engines.items()}
    for r in range(args.rounds):
        # Each repeat its own prompts (with --context the second of the same ones would hit the cache).
        prompts = {n: [draw(n) for _ in range(args.repeats)] for n in counts}
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        tokens: dict[str, dict[int, list[list[int]]]] = {name: {} for name in engines}
        for name in order:
            for n in counts:
                steps, tokens[name][n] = [], []
                for batch in prompts[n]:
                    dt, got = step(engines[name], batch)
                    steps.append(dt)
                    tokens[name][n].append(got)
                times[name][n].append(statistics.median(steps))
                best[name][n] = min(best[name][n], *steps)
        for n in counts:
            same[n] &= tokens["full"][n] == tokens["pruned"][n]
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    timed = args.rounds * len(counts) * args.repeats
    if heads["pruned"]["pruned"] - before["pruned"]["pruned"] < timed or heads["pruned"]["full"] != before[
            "pruned"]["full"] or heads["full"]["pruned"] != 0:
        raise SystemExit(f"prefill forwards {heads} (before timing {before}): the pruned engine ran one of its "
                         f"{timed} timed steps in full, or the full engine pruned one: not what the table claims")
    replays = {name: e.model_runner.prefill_captures.num_replays - replays_before[name] for name, e in engines.items()}
    head_replays = {name: e.model_runner.prefill_captures.num_head_replays - head_replays_before[name]
                    for name, e in engines.items()}

    lines = [f"# fp8serve last-layer pruning in prefills — "
             f"{_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')}",
             f"command: {command_line(argv)}"]
    lines += describe_machine(machine_info())
    lines += [f"model: {model}, --dtype {args.dtype}, --kv-cache-dtype {args.kv_cache_dtype}; {args.rounds} ABBA "
              f"rounds, {args.repeats} steps of {args.batch} prompt(s) per count per engine per round (a round's "
              f"time: their median); recorded prefill "
              f"forwards replayed in {replays['full']} (full) and {replays['pruned']} (pruned) of {timed} timed "
              f"steps each, their heads in {head_replays['full']} and {head_replays['pruned']}"
              + (f"; every prompt continues a cached {args.context}-token prefix (prefix caching on): "
                 "the counts are the new tokens a step computes" if prefix else ""),
              "",
              f"| {'new' if prefix else 'prompt'} tokens | prompts/step | full ms | pruned ms | speedup (median) "
              "| by round min / max | best steps ms (full / pruned) | speedup (best) | FLOPs skipped "
              "| same first tokens |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for n in counts:
        f, pr = times["full"][n], times["pruned"][n]
        ratios = [a / b for a, b in zip(f, pr)]
        lines.append(f"| {n} | {args.batch} | {1e3 * statistics.median(f):.1f} | {1e3 * statistics.median(pr):.1f} | "
                     f"{statistics.median(f) / statistics.median(pr):.3f}x | {min(ratios):.3f} / {max(ratios):.3f} | "
                     f"{1e3 * best['full'][n]:.1f} / {1e3 * best['pruned'][n]:.1f} | "
                     f"{best['full'][n] / best['pruned'][n]:.3f}x | "
                     f"{100 * skipped_flops_share(cfg, n, args.context):.1f}% | {same[n]} |")
    emit_table(lines, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
