#!/usr/bin/env python
"""Offline throughput: fp8serve vs Hugging Face transformers' batched `generate`.

Both systems get the SAME prompts: `--num-prompts` rows of exactly `--input-len` random token ids
(fixed seed, special tokens excluded), greedy decoding of exactly `--output-len` tokens (fp8serve:
`ignore_eos=True`; transformers: `min_new_tokens == max_new_tokens`). Each system is warmed up
first. Both run in one invocation so that they see the same (possibly noisy) machine.

transformers runs `--hf-dtype` (default float32, the issue's baseline; bfloat16 is the checkpoint's
own dtype) with `attn_implementation=--hf-attn` (default sdpa), static batches of
`--hf-batch-size`, left padding (all prompts have the same length, so no pad tokens are actually
added), and `use_cache=True`. Its "prefill" column is the time to the first logits-processor call of
each batch (forward over the prompt + first-token logits), summed over batches.

fp8serve's prefill column is the wall time of engine steps that were prefill steps, measured by
wrapping the model runner's `execute` on the instance (fp8serve itself is not modified).

Whichever system runs first tends to do better (stop 78: fp8serve 30.8-34.9 s first, 34.5-37.0 s second).
`--hf-first` swaps the order; `--rounds N` runs every system N times, reversing the order each round, and
ends with a table of each round's ratios and their medians (the JSON's `ratios_output_tok_s` is then the
median, `ratios_by_round` the rounds').

Examples:
  python benchmarks/offline_throughput.py
  python benchmarks/offline_throughput.py --configs float32:auto,float32:fp8,bfloat16:auto --hf-num-prompts 16
  python benchmarks/offline_throughput.py --skip-hf --num-prompts 16 --output-len 16
  python benchmarks/offline_throughput.py --configs bfloat16:fp8 --rounds 2   # both orders, median ratio
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
from bench_common import command_line, describe_machine, machine_info, record_as_a_warm_engine

# --------------------------------------------------------------------------- machine


# --------------------------------------------------------------------------- prompts


def make_prompts(num: int, input_len: int, seed: int, vocab_size: int, special_ids: set[int]) -> list[list[int]]:
    """`num` lists of exactly `input_len` token ids drawn uniformly from the non-special vocabulary."""
    allowed = torch.tensor([t for t in range(vocab_size) if t not in special_ids], dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, allowed.numel(), (num, input_len), generator=g)
    return allowed[idx].tolist()


# --------------------------------------------------------------------------- results


@dataclass
class Result:
    system: str
    dtype: str
    kv_dtype: str
    attn: str
    requests: int
    input_len: int
    output_len: int
    total_s: float
    prefill_s: float | None
    output_tok_s: float
    total_tok_s: float
    extrapolated: bool = False
    measured_requests: int | None = None
    notes: list[str] = field(default_factory=list)
    # How the linear weights are held ("float32", "bfloat16", "fp8"): FP8 from an FP8 checkpoint or from
    # --quantization fp8 (then `quantization` is "fp8").
    weights: str = ""
    quantization: str | None = None
    # With --rounds N: which round (1-based) produced this result, and that round's order of systems.
    round: int = 1
    order: str = ""
    # Greedy output token ids of the first few prompts (to compare systems); not printed.
    sample_outputs: list[list[int]] = field(default_factory=list, repr=False)


def _rates(total_s: float, requests: int, input_len: int, output_len: int) -> tuple[float, float]:
    out_tok = requests * output_len
    return out_tok / total_s, (out_tok + requests * input_len) / total_s


# --------------------------------------------------------------------------- fp8serve


class _StepTimer:
    """Wraps a ModelRunner instance's `execute` to time prefill and decode steps."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.orig = runner.execute
        self.reset()
        runner.execute = self  # instance attribute shadows the method

    def reset(self) -> None:
        self.prefill_s = self.decode_s = 0.0
        self.prefill_steps = self.decode_steps = 0
        self.max_decode_batch = 0

    def __call__(self, seqs, is_prefill, eos_token_id, *args):
        t = time.perf_counter()
        out = self.orig(seqs, is_prefill, eos_token_id, *args)
        dt = time.perf_counter() - t
        if is_prefill:
            self.prefill_s += dt
            self.prefill_steps += 1
        else:
            self.decode_s += dt
            self.decode_steps += 1
            self.max_decode_batch = max(self.max_decode_batch, len(seqs))
        return out


def run_fp8serve(args, prompts: list[list[int]], dtype: str, kv_dtype: str, keep: int,
                 quantization: str | None = None) -> Result:
    from fp8serve import LLM, SamplingParams

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    kwargs = dict(dtype=dtype, kv_cache_dtype=kv_dtype, kv_cache_memory=args.kv_cache_memory,
                  max_num_seqs=args.max_num_seqs, seed=args.seed, quantization=quantization)
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len
    t_load = time.perf_counter()
    llm = LLM(model=args.model, **kwargs)
    load_s = time.perf_counter() - t_load
    runner = llm.llm_engine.model_runner
    record_as_a_warm_engine(llm.llm_engine)
    resolved_dtype = str(runner.dtype).removeprefix("torch.")
    resolved_kv = runner.kv_cache_spec.kv_cache_dtype
    # FP8 where the projections kept their one-byte codes (not widened at load).
    backends = {getattr(m, "fp8_backend", None) for m in runner.model.modules()} - {None, "dequantized"}
    # Otherwise the dtype the plain linear weights are held in: 16-bit under float32 compute where
    # narrow_weights.py keeps a 16-bit checkpoint's weights at 16 bits.
    held = {str(m.weight.dtype).removeprefix("torch.") for m in runner.model.modules()
            if hasattr(m, "quant_method") and isinstance(getattr(m, "weight", None), torch.Tensor)}
    weights = "fp8" if backends else "/".join(sorted(held)) or resolved_dtype
    timer = _StepTimer(runner)

    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    # Warm-up: a few full-length prompts, a few decode steps.
    n_warm = min(args.warmup_prompts, len(prompts))
    warm = [{"prompt_token_ids": p} for p in prompts[:n_warm]]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=min(8, args.output_len), ignore_eos=True),
                 use_tqdm=False)
    timer.reset()

    gc.collect()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    total = time.perf_counter() - t

    bad = [o.request_id for o in outs if len(o.outputs[0].token_ids) != args.output_len]
    if bad:
        raise RuntimeError(f"fp8serve: {len(bad)} requests did not produce {args.output_len} tokens")
    out_tps, tot_tps = _rates(total, len(prompts), args.input_len, args.output_len)
    notes = [
        f"load {load_s:.1f}s; steps: {timer.prefill_steps} prefill ({timer.prefill_s:.2f}s), "
        f"{timer.decode_steps} decode ({timer.decode_s:.2f}s, max batch {timer.max_decode_batch}); "
        f"engine overhead outside execute: {total - timer.prefill_s - timer.decode_s:.2f}s"
    ]
    if timer.decode_steps:
        notes.append(f"mean decode step {1000 * timer.decode_s / timer.decode_steps:.1f} ms")
    res = Result(
        system="fp8serve", dtype=resolved_dtype, kv_dtype=resolved_kv, attn=runner.backend.name,
        weights=weights, quantization=quantization,
        requests=len(prompts), input_len=args.input_len, output_len=args.output_len,
        total_s=total, prefill_s=timer.prefill_s, output_tok_s=out_tps, total_tok_s=tot_tps, notes=notes,
        sample_outputs=[list(o.outputs[0].token_ids) for o in outs[:keep]],
    )
    del llm, outs, runner, timer
    gc.collect()
    return res


# --------------------------------------------------------------------------- transformers


def run_hf(args, prompts: list[list[int]], model_path: str, total_requests: int, keep: int) -> Result:
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    t_load = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.hf_dtype),
                                                 attn_implementation=args.hf_attn)
    model.eval()
    load_s = time.perf_counter() - t_load
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    class FirstCall(LogitsProcessor):
        """Records when generate first asks for logits: the prompt forward is done."""

        def __init__(self) -> None:
            self.t_first: float | None = None

        def __call__(self, input_ids, scores):
            if self.t_first is None:
                self.t_first = time.perf_counter()
            return scores

    def batch_tensors(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)  # left padding
        ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
        mask = torch.zeros((len(rows), width), dtype=torch.int64)
        for i, r in enumerate(rows):
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
        return ids, mask

    def gen(rows: list[list[int]], n_new: int) -> tuple[torch.Tensor, float, float]:
        ids, mask = batch_tensors(rows)
        fc = FirstCall()
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                do_sample=False, num_beams=1, use_cache=True, pad_token_id=pad_id,
                logits_processor=LogitsProcessorList([fc]),
            )
        dt = time.perf_counter() - t
        return out[:, ids.shape[1]:], dt, (fc.t_first - t) if fc.t_first else float("nan")

    # Warm-up: one full batch-width prompt set, few tokens.
    gen(prompts[: min(args.hf_batch_size, 4)], min(4, args.output_len))

    gc.collect()
    total = prefill = 0.0
    outputs: list[list[int]] = []
    for i in range(0, len(prompts), args.hf_batch_size):
        new, dt, pf = gen(prompts[i: i + args.hf_batch_size], args.output_len)
        if new.shape[1] != args.output_len:
            raise RuntimeError(f"transformers produced {new.shape[1]} tokens, expected {args.output_len}")
        total += dt
        prefill += pf
        outputs.extend(new.tolist())
        print(f"  [transformers] batch {i // args.hf_batch_size + 1}: {dt:.1f}s "
              f"(prefill {pf:.2f}s)", file=sys.stderr, flush=True)

    measured = len(prompts)
    extrapolated = measured < total_requests
    out_tps, tot_tps = _rates(total, measured, args.input_len, args.output_len)
    notes = [f"load {load_s:.1f}s; attn_implementation={args.hf_attn}; batch {args.hf_batch_size}, "
             f"left padding, greedy, min_new_tokens=max_new_tokens={args.output_len}"]
    if extrapolated:
        scale = total_requests / measured
        notes.append(f"EXTRAPOLATED: measured {measured} of {total_requests} requests "
                     f"({total:.1f}s); times scaled x{scale:.2f} at the measured per-token rate")
        total *= scale
        prefill *= scale
    del model
    gc.collect()
    return Result(
        system="transformers", dtype=args.hf_dtype, kv_dtype=args.hf_dtype, attn=args.hf_attn,
        requests=total_requests, input_len=args.input_len, output_len=args.output_len,
        total_s=total, prefill_s=prefill, output_tok_s=out_tps, total_tok_s=tot_tps,
        extrapolated=extrapolated, measured_requests=measured, notes=notes,
        sample_outputs=outputs[:keep],
    )


# --------------------------------------------------------------------------- report


def match_rate(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """(fraction of rows identical, mean fraction of leading tokens that agree)."""
    n = min(len(a), len(b))
    if n == 0:
        return float("nan"), float("nan")
    same = prefix = 0.0
    for x, y in zip(a[:n], b[:n]):
        same += x == y
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefix += k / max(len(x), 1)
    return same / n, prefix / n


def _weights_label(r: Result) -> str:
    weights = r.weights or r.dtype
    return f"{weights} (-q {r.quantization})" if r.quantization else weights


def _label(r: Result) -> str:
    return f"{r.system} {r.dtype}/{r.kv_dtype}" + (f" -q {r.quantization}" if r.quantization else "")


def format_table(results: list[Result], baseline: Result | None) -> str:
    head = ["system", "dtype", "weights", "kv dtype", "attn", "requests", "input len", "output len", "total s",
            "prefill s", "output tok/s", "total tok/s", "vs transformers (out tok/s)"]
    rows = []
    for r in results:
        ratio = "—"
        if baseline is not None and r is not baseline:
            ratio = f"{r.output_tok_s / baseline.output_tok_s:.2f}x"
        elif r is baseline:
            ratio = "1.00x"
        star = "*" if r.extrapolated else ""
        rows.append([
            r.system + star, r.dtype, _weights_label(r), r.kv_dtype, r.attn, str(r.requests), str(r.input_len),
            str(r.output_len),
            f"{r.total_s:.1f}{star}", "—" if r.prefill_s is None else f"{r.prefill_s:.1f}{star}",
            f"{r.output_tok_s:.1f}", f"{r.total_tok_s:.1f}", ratio,
        ])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    if any(r.extrapolated for r in results):
        lines.append("")
        lines.append("\\* transformers " + "; ".join(
            n for r in results if r.extrapolated for n in r.notes if n.startswith("EXTRAPOLATED")))
    return "\n".join(lines)


def _config_key(r: Result) -> str:
    return f"{r.system}:{r.dtype}:{r.kv_dtype}" + (f":{r.quantization}" if r.quantization else "")


def ratios_by_config(results: list[Result], baseline: Result | None) -> dict[str, float] | None:
    """Output tok/s of each fp8serve run over transformers' in the same round (None without transformers)."""
    if baseline is None:
        return None
    return {_config_key(r): r.output_tok_s / baseline.output_tok_s for r in results if r is not baseline}


def median_ratios(by_round: list[dict[str, float] | None]) -> dict[str, float] | None:
    """Per configuration, the median of its per-round ratios."""
    if not by_round or any(r is None for r in by_round):
        return None
    return {key: statistics.median(r[key] for r in by_round) for key in by_round[0]}


def format_round_summary(rounds: list[tuple[str, list[Result], Result | None]],
                         by_round: list[dict[str, float] | None], ratios: dict[str, float] | None) -> str:
    """One row per round: its order, each system's output tok/s and each ratio; then the medians."""
    keys = list(ratios or {})
    labels = {_config_key(r): _label(r) for _, ordered, _ in rounds for r in ordered}
    head = ["round", "order", "transformers out tok/s"]
    for key in keys:
        head += [f"{labels[key]} out tok/s", f"{labels[key]} vs transformers"]
    lines = ["Rounds (output tok/s; each ratio against transformers in the same round):", "",
             "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for rnd, ((order, ordered, hf_result), ratio) in enumerate(zip(rounds, by_round), 1):
        tok_s = {_config_key(r): r.output_tok_s for r in ordered}
        row = [str(rnd), order, f"{hf_result.output_tok_s:.1f}" if hf_result else "—"]
        for key in keys:
            row += [f"{tok_s[key]:.1f}", f"{ratio[key]:.2f}x"]
        lines.append("| " + " | ".join(row) + " |")
    med = ["median", "—", f"{statistics.median(h.output_tok_s for _, _, h in rounds if h):.1f}"]
    for key in keys:
        med += [f"{statistics.median(r.output_tok_s for _, o, _ in rounds for r in o if _config_key(r) == key):.1f}",
                f"{ratios[key]:.2f}x"]
    lines.append("| " + " | ".join(med) + " |")
    return "\n".join(lines)


def _progress(r: Result) -> None:
    """One line per finished system, so that an interrupted run still leaves its numbers."""
    print(f"  done: {_label(r)}: total {r.total_s:.1f}s, prefill "
          f"{r.prefill_s if r.prefill_s is None else round(r.prefill_s, 1)}s, {r.output_tok_s:.1f} output tok/s"
          f"{' (extrapolated)' if r.extrapolated else ''}; " + "; ".join(r.notes), file=sys.stderr, flush=True)


def parse_configs(args) -> list[tuple[str, str, str | None]]:
    """(dtype, kv_cache_dtype, quantization) per fp8serve run: DTYPE:KV_DTYPE[:QUANTIZATION] items."""
    if args.configs:
        out = []
        for item in args.configs.split(","):
            item = item.strip()
            if not item:
                continue
            parts = item.split(":")
            if len(parts) > 3:
                raise SystemExit(f"--configs: {item!r} has {len(parts)} fields, "
                                 "expected DTYPE:KV_DTYPE[:QUANTIZATION]")
            dtype, kv, quant = (parts + ["", "", ""])[:3]
            out.append((dtype or "auto", kv or "auto", quant or None))
        return out
    return [(args.dtype, args.kv_cache_dtype, args.quantization)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: fp8serve's default model)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", help="fp8serve compute dtype (when --configs is not given)")
    p.add_argument("--kv-cache-dtype", default="auto", help="fp8serve KV dtype (when --configs is not given)")
    p.add_argument("--quantization", "-q", default=None,
                   help="fp8serve --quantization (when --configs is not given): fp8 quantizes the weights at load")
    p.add_argument("--configs", default=None,
                   help="comma-separated fp8serve DTYPE:KV_DTYPE[:QUANTIZATION] configs, e.g. "
                        "float32:auto,float32:fp8,bfloat16:auto,bfloat16:fp8:fp8 (the last: FP8 weights by -q fp8)")
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--warmup-prompts", type=int, default=4)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--hf-num-prompts", type=int, default=None,
                   help="run transformers on only the first N prompts and extrapolate its time (marked in the output)")
    p.add_argument("--hf-attn", default="sdpa", choices=("sdpa", "eager"))
    p.add_argument("--hf-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="transformers' compute dtype (float32: the issue's baseline)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--hf-first", action="store_true", help="run transformers before fp8serve")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every system this many times, the order reversed each round (the first as "
                        "--hf-first says); the summary gives each ratio per round and their median")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: os.cpu_count())")
    p.add_argument("--json", dest="json_out", default=None, help="write results as JSON to this path")
    args = p.parse_args(argv)

    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.rounds > 1 and args.skip_hf:
        p.error("--rounds > 1 alternates fp8serve and transformers; it needs transformers (drop --skip-hf)")

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    if args.model is None:
        from fp8serve.default_model import ensure_default_model

        args.model = str(ensure_default_model())

    cmd = command_line(None if argv is None else list(argv))
    info = machine_info()
    started = _dt.datetime.now().astimezone()
    print(f"# fp8serve offline throughput — {started.isoformat(timespec='seconds')}")
    print(f"command: {cmd}")
    for line in describe_machine(info):
        print(line)
    print(f"model: {args.model}")
    print(f"workload: {args.num_prompts} prompts x {args.input_len} random token ids (seed {args.seed}, special "
          f"tokens excluded) -> exactly {args.output_len} greedy output tokens each", flush=True)

    from transformers import AutoTokenizer
    from transformers.utils import logging as tf_logging

    tf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(args.model)
    with open(os.path.join(args.model, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    special = set(tok.all_special_ids) | {int(i) for i in getattr(tok, "added_tokens_decoder", {})}
    prompts = make_prompts(args.num_prompts, args.input_len, args.seed, vocab_size, special)

    keep = 8  # outputs compared across systems
    configs = parse_configs(args)
    rounds: list[tuple[str, list[Result], Result | None]] = []  # (order, results, transformers result)
    for rnd in range(1, args.rounds + 1):
        # Reversed each round: in stop 78's runs the side that ran first did better.
        hf_first = args.hf_first != (rnd % 2 == 0)
        order = "fp8serve only" if args.skip_hf else "transformers first" if hf_first else "fp8serve first"
        if args.rounds > 1:
            print(f"round {rnd}/{args.rounds} ({order}) ...", file=sys.stderr, flush=True)
        results: list[Result] = []
        hf_result: Result | None = None

        def do_hf() -> Result:
            n = min(args.hf_num_prompts or args.num_prompts, args.num_prompts)
            print(f"running transformers on {n} prompts ...", file=sys.stderr, flush=True)
            r = run_hf(args, prompts[:n], args.model, args.num_prompts, keep)
            _progress(r)
            return r

        if not args.skip_hf and hf_first:
            hf_result = do_hf()
        for dtype, kv, quant in configs:
            print(f"running fp8serve dtype={dtype} kv_cache_dtype={kv} quantization={quant} ...", file=sys.stderr,
                  flush=True)
            results.append(run_fp8serve(args, prompts, dtype, kv, keep, quant))
            _progress(results[-1])
        if not args.skip_hf and not hf_first:
            hf_result = do_hf()
        # Baseline row first.
        ordered = ([hf_result] if hf_result else []) + results
        for r in ordered:
            r.round, r.order = rnd, order
        rounds.append((order, ordered, hf_result))

    for rnd, (order, ordered, hf_result) in enumerate(rounds, 1):
        print()
        if args.rounds > 1:
            print(f"Round {rnd} of {args.rounds} ({order}):")
            print()
        print(format_table(ordered, hf_result))
        print()
        for r in ordered:
            print(f"- {_label(r)}: " + "; ".join(r.notes))
        if hf_result is not None:
            for r in ordered:
                if r is hf_result:
                    continue
                same, prefix = match_rate(r.sample_outputs, hf_result.sample_outputs)
                print(f"- greedy agreement {_label(r)} vs transformers on the first "
                      f"{min(keep, len(hf_result.sample_outputs))} prompts: {same:.0%} identical rows, "
                      f"{prefix:.0%} mean matching prefix")
    by_round = [ratios_by_config(ordered, hf_result) for _, ordered, hf_result in rounds]
    ratios = median_ratios(by_round)
    if args.rounds > 1:
        print()
        print(format_round_summary(rounds, by_round, ratios))
        print()
    try:
        print(f"- loadavg at end: {os.getloadavg()}")
    except OSError:
        pass

    if args.json_out:
        payload = {
            "started": started.isoformat(timespec="seconds"),
            "command": cmd,
            "machine": info,
            "args": vars(args),
            "results": [{k: v for k, v in asdict(r).items() if k != "sample_outputs"}
                        for _, ordered, _ in rounds for r in ordered],
            # The median over rounds of each round's ratio (with one round, that round's ratio).
            "ratios_output_tok_s": ratios,
            "ratios_by_round": by_round if ratios is not None else None,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump(payload, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
