#!/usr/bin/env python
"""Where the engine's weight copies live, and what it is worth to decode steps.

The packed GEMV layouts (kernels/gemv_packing.py: the bf16 weights' `weight_gemv_packed`, an FP8
checkpoint's packed codes) and the greedy LM head's int8 screen (kernels/screened_argmax.py) are
copies made once after loading. The engine puts them on 2 MiB pages (utils/huge_pages.HugePageArena:
one buffer for the packed copies, one for the screen's codes). This script builds one engine, then
makes a second set of the same copies the way the packed ones were made before the arenas, one
buffer per tensor with its own MADV_HUGEPAGE advice (the screen's codes had none), at the same
point of the process, and reports how much of each set Linux backed with huge pages
(AnonHugePages in /proc/self/smaps). Then greedy decode steps at each --batch-sizes alternate
between the two sets (every copy pointed at one set's storage with `Tensor.set_`, so the recorded
decode forwards read it too), in ABBA rounds: the median step of each round, the median of the
rounds, and whether both sets produced the same tokens (they hold the same bits).

    .venv/bin/python benchmarks/weight_pages.py
    .venv/bin/python benchmarks/weight_pages.py --batch-sizes 1,16 --model DIR_OF_AN_FP8_CHECKPOINT
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    add_model_args, command_line, describe_machine, emit_table, machine_info, parse_sizes, require_positive,
    time_greedy_decode,
)


def huge_page_bytes(tensors: list[torch.Tensor], smaps: str = "/proc/self/smaps") -> tuple[int, int]:
    """(bytes of the tensors, AnonHugePages bytes of the memory mappings holding them). A mapping
    holding several tensors counts once; it may hold other data too, so the second figure is an
    upper bound on the tensors' huge pages (it is 0 when none are)."""
    maps = []
    with open(smaps) as f:
        text = f.read()
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", block)
        huge = re.search(r"AnonHugePages:\s+(\d+) kB", block)
        if span:
            maps.append((int(span.group(1), 16), int(span.group(2), 16), int(huge.group(1)) * 1024 if huge else 0))
    holding = {}
    for t in tensors:
        for start, end, huge in maps:
            if start <= t.data_ptr() < end:
                holding[start] = huge
    return sum(t.numel() * t.element_size() for t in tensors), sum(holding.values())


def copies_made_at_load(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weight copies the engine made after loading: the packed GEMV layouts (each once: a tied
    head shares its embedding's) and the greedy LM head's int8 screen codes."""
    seen: dict[int, torch.Tensor] = {}
    for m in model.modules():
        screen = getattr(m, "greedy_screen", None)
        for t in (getattr(m, "weight_gemv_packed", None), getattr(screen, "codes", None)):
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen[id(t)] = t
    return list(seen.values())


def copies_one_buffer_each(packed: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same bits in one buffer per tensor, advised before the first write: how
    gemv_packing made its copies before the arena."""
    from fp8serve.utils.huge_pages import advise_huge_pages

    out = []
    for t in packed:
        c = torch.empty(t.shape, dtype=t.dtype)
        advise_huge_pages(c, "weight")
        c.copy_(t)
        out.append(c)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--batch-sizes", default="16,64", help="decode batches (comma list)")
    p.add_argument("--tokens", type=int, default=48, help="decode steps timed per generation")
    p.add_argument("--rounds", type=int, default=8, help="ABBA rounds (medians)")
    p.add_argument("--output", type=Path, default=None, help="also write the results (markdown) here")
    args = p.parse_args(argv)
    require_positive(p, args, "tokens", "rounds")
    batches = parse_sizes(p, "--batch-sizes", args.batch_sizes)

    from fp8serve import LLM

    kwargs = {"dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, "kv_cache_memory": args.kv_cache_memory}
    if args.model:
        kwargs["model"] = args.model
    engine = LLM(**kwargs).llm_engine
    packed = copies_made_at_load(engine.model_runner.model)
    if not packed:
        raise SystemExit("the engine made no packed weight copies and no greedy screen here (gemv_packing."
                         "packing_applies is false on this machine, or --dtype is not one they serve): nothing to "
                         "compare")
    arena_views = [(t.untyped_storage(), t.storage_offset(), t.size(), t.stride()) for t in packed]
    each = copies_one_buffer_each(packed)
    each_views = [(t.untyped_storage(), t.storage_offset(), t.size(), t.stride()) for t in each]
    sides = {"arenas (the engine's)": arena_views, "one buffer each (before)": each_views}
    pages = {"arenas (the engine's)": huge_page_bytes(packed), "one buffer each (before)": huge_page_bytes(each)}

    def use(views) -> None:
        for t, (storage, offset, size, stride) in zip(packed, views):
            t.set_(storage, offset, size, stride)

    lines = ["# Weight copies made at load: arenas on 2 MiB pages vs one buffer each\n",
             f"command: `{command_line(argv)}`\n", *describe_machine(machine_info()),
             f"- engine: {args.model or 'the built-in default model'}, --dtype {args.dtype}, KV cache "
             f"{args.kv_cache_dtype}; {len(packed)} copies; {args.tokens} greedy decode steps per "
             f"generation, {args.rounds} ABBA rounds (medians)", ""]
    lines += ["| copies | MiB | MiB on huge pages (their mappings) |", "|---|---|---|"]
    for name, (nbytes, huge) in pages.items():
        lines.append(f"| {name} | {nbytes / 2**20:.0f} | {huge / 2**20:.0f} |")
    lines += ["", "| batch | arenas ms / step | one buffer each ms / step | speedup | rounds arenas faster "
              "| same tokens |", "|---|---|---|---|---|---|"]
    names = list(sides)
    for batch in batches:
        prompts = [engine.tokenize_prompt(f"Write about the history of printing, part {i}.")[1] for i in range(batch)]
        use(arena_views)
        time_greedy_decode(engine, prompts, max(args.tokens, 80))  # records this batch's decode forward
        times: dict[str, list[float]] = {n: [] for n in names}
        tokens: dict[str, list] = {}
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                use(sides[name])
                step_s, tokens[name] = time_greedy_decode(engine, prompts, args.tokens)
                times[name].append(step_s)
        use(arena_views)
        a, b = (statistics.median(times[n]) * 1e3 for n in names)
        wins = sum(x < y for x, y in zip(times[names[0]], times[names[1]]))
        lines.append(f"| {batch} | {a:.2f} | {b:.2f} | {b / a:.3f}x | {wins} of {args.rounds} | "
                     f"{tokens[names[0]] == tokens[names[1]]} |")
    emit_table(lines, args.output)


if __name__ == "__main__":
    main()
