"""`fp8serve eval-kv`: what an FP8 KV cache configuration costs in accuracy.

The same model and text run teacher-forced through `prompt_logits` twice:
once with an unquantized KV cache (the reference), once per configuration.
Reported per configuration: mean KL(ref || cfg) per token, top-1 agreement
and perplexity (see `fp8serve.calibration.metrics`).

One engine at a time: the reference logits go to a temporary file (float32,
tokens x vocab: ~4 GB for 20k tokens of a 49k vocabulary), each
configuration's engine is built, run and freed before the next.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import logging
import tempfile
from pathlib import Path

from fp8serve.calibration.kv_config import SPEC_HELP

logger = logging.getLogger(__name__)

_DTYPE_CHOICES = ("auto", "half", "float16", "bfloat16", "float", "float32")
_COLORS = {"fp8_e4m3": "#4c72b0", "fp8_e5m2": "#dd8452"}  # anything else (16/32-bit): grey

_EPILOG = """\
configurations:
  Either list KV cache dtypes (each combined with --quantization-param-path / --calculate-kv-scales if given):
    fp8serve eval-kv MODEL --text FILE --kv-cache-dtype fp8_e4m3 fp8_e5m2
  or give each configuration as --config DTYPE[:SCALES] (repeatable), SCALES being
    default     the engine's own resolution (FP8-KV checkpoint scales, else 1.0)
    json=FILE   per-layer scales from a --quantization-param-path JSON
    calculate   --calculate-kv-scales (scales from the first prefill chunk)
    scale1      k_scale = v_scale = 1.0, ignoring any scales the checkpoint has
  The seed's four configurations in one run:
    fp8serve eval-kv MODEL --text FILE --config fp8_e4m3:scale1 --config fp8_e4m3:json=scales.json \\
        --config fp8_e4m3:calculate --config fp8_e5m2
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    from fp8serve.entrypoints.engine_args import add_quantization_arg

    p = subparsers.add_parser(
        "eval-kv",
        help="measure the accuracy cost of FP8 KV cache configurations (KL, top-1, perplexity)",
        description=(
            "Teacher-force text through the model with an unquantized KV cache (reference) and with each "
            "KV cache configuration, and report mean KL divergence per token, top-1 agreement and perplexity. "
            "With -q fp8 the reference and every configuration run with the weights quantized at load, so the "
            "numbers are the KV cache's cost on that model."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", default=None,
                   help="Hugging Face checkpoint directory (default: the built-in SmolLM2-135M-Instruct)")
    p.add_argument("--text", required=True, metavar="FILE", help='evaluation text: plain, or JSONL with "text"')
    p.add_argument("--kv-cache-dtype", nargs="+", default=None, metavar="D",
                   help="KV cache dtypes to evaluate (default: fp8_e4m3 fp8_e5m2)")
    p.add_argument("--quantization-param-path", default=None, metavar="FILE",
                   help="JSON scales applied to every --kv-cache-dtype configuration")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="--calculate-kv-scales for every --kv-cache-dtype configuration")
    p.add_argument("--config", action="append", default=None, metavar="SPEC", dest="configs",
                   help=f"a configuration, repeatable: {SPEC_HELP}")
    p.add_argument("--num-tokens", type=int, default=None, help="tokens of text to use (default: all)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per teacher-forced chunk (default 512, or the model's context if shorter)")
    p.add_argument("--dtype", default="float32", choices=_DTYPE_CHOICES,
                   help="compute dtype of reference and configurations (default float32: a clean reference)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    add_quantization_arg(p)
    p.add_argument("--kv-cache-memory", default=None, help="KV cache budget, e.g. 256MiB")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="write a bar chart of the results (matplotlib)")
    p.set_defaults(func=run)


def configs_from_args(args) -> list:
    from fp8serve.calibration.kv_config import KVConfig
    from fp8serve.errors import UserError

    if args.configs:
        if args.kv_cache_dtype or args.quantization_param_path or args.calculate_kv_scales:
            raise UserError("give configurations either as --config SPEC or as --kv-cache-dtype "
                            "(+ --quantization-param-path / --calculate-kv-scales), not both")
        return [KVConfig.parse(s) for s in args.configs]
    if args.quantization_param_path and args.calculate_kv_scales:
        raise UserError("--quantization-param-path and --calculate-kv-scales exclude each other; "
                        "use --config SPEC to evaluate both")
    return KVConfig.for_dtypes(args.kv_cache_dtype or ["fp8_e4m3", "fp8_e5m2"], args.quantization_param_path,
                               args.calculate_kv_scales)


def evaluate(model, chunks, configs, *, dtype="float32", device="auto", kv_cache_memory=None,
             seq_len=512, quantization=None, tmp_dir=None, on_result=None) -> dict:
    """{"reference": {...}, "configs": [...]} for `configs` over token `chunks`.
    `quantization` (--quantization) applies to the reference and every configuration alike.

    `on_result(partial document)` is called after each configuration, so a
    long run leaves its finished results behind even if it is stopped."""
    import numpy as np
    import torch

    from fp8serve.calibration.kv_config import scale_summary
    from fp8serve.calibration.metrics import KLStats
    from fp8serve.calibration.runner import build_llm, iter_prompt_logits

    build = dict(seq_len=seq_len, dtype=dtype, device=device, kv_cache_memory=kv_cache_memory,
                 quantization=quantization)
    offsets = [0]
    for c in chunks:
        offsets.append(offsets[-1] + len(c))
    with tempfile.TemporaryDirectory(prefix="fp8serve-eval-kv-", dir=tmp_dir) as tmp:
        llm = build_llm(model, kv_cache_dtype="auto", **build)
        ref_kv = llm.llm_engine.model_runner.kv_cache_spec.kv_cache_dtype
        # What ran: None where -q named the checkpoint's own method (ModelConfig drops it as redundant).
        quantization = llm.llm_engine.config.model_config.quantization
        vocab = llm.llm_engine.config.model_config.arch.vocab_size
        ref_logits = np.lib.format.open_memmap(Path(tmp) / "ref.npy", mode="w+", dtype=np.float32,
                                               shape=(offsets[-1], vocab))
        for i, (_, logits) in enumerate(iter_prompt_logits(llm, chunks, f"reference ({ref_kv} KV)")):
            ref_logits[offsets[i]:offsets[i + 1]] = logits.float().cpu().numpy()
        del llm
        gc.collect()

        results = []
        ref_stats = None
        reference = {"kv_cache_dtype": ref_kv, "dtype": dtype, "quantization": quantization,
                     "num_tokens": offsets[-1]}
        for cfg in configs:
            llm = build_llm(model, **cfg.engine_kwargs(), **build)
            cfg.apply_after_load(llm)
            stats = KLStats()
            for i, (chunk, logits) in enumerate(iter_prompt_logits(llm, chunks, cfg.label)):
                ref = torch.from_numpy(np.asarray(ref_logits[offsets[i]:offsets[i + 1]]))
                stats.update(ref, logits.cpu(), chunk)
            ref_stats = stats
            results.append({
                "label": cfg.label,
                "kv_cache_dtype": llm.llm_engine.model_runner.kv_cache_spec.kv_cache_dtype,
                "scales": cfg.scales_description,
                **scale_summary(llm),
                "kld_mean": stats.kld_mean,
                "top1_agreement": stats.top1_agreement,
                "ppl": stats.ppl,
                "ppl_ref": stats.ppl_ref,
                "ppl_rel_change": stats.ppl_rel_change,
                "num_tokens": stats.num_tokens,
            })
            del llm
            gc.collect()
            reference.update(num_predicted_tokens=ref_stats.num_tokens, ppl=ref_stats.ppl_ref)
            if on_result is not None:
                on_result({"reference": dict(reference), "configs": list(results)})
    return {"reference": reference, "configs": results}


def format_table(doc: dict) -> str:
    ref = doc["reference"]
    rows = [("config", "scales (k range)", "KL mean", "top-1 %", "ppl", "ppl change")]
    for r in doc["configs"]:
        k0, k1 = r["k_scale_range"]
        scales = f"{r['scale_source']} ({k0:.3g}..{k1:.3g})" if k0 != k1 else f"{r['scale_source']} ({k0:.3g})"
        rows.append((r["label"], scales, f"{r['kld_mean']:.3e}", f"{r['top1_agreement']:.2f}",
                     f"{r['ppl']:.4f}", f"{100 * r['ppl_rel_change']:+.3f}%"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    weights = f"{ref['quantization']} weights quantized at load, " if ref.get("quantization") else ""
    lines = [f"reference: {ref['dtype']} compute, {weights}{ref['kv_cache_dtype']} KV cache, ppl {ref['ppl']:.4f} "
             f"over {ref['num_predicted_tokens']} predicted tokens"]
    lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(rows[0], widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows[1:]:
        lines.append("| " + " | ".join(c.ljust(w) if i < 2 else c.rjust(w)
                                       for i, (c, w) in enumerate(zip(row, widths))) + " |")
    return "\n".join(lines)


def write_plot(doc: dict, path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from fp8serve.errors import UserError

        raise UserError("--plot needs matplotlib: pip install matplotlib") from None
    rows = doc["configs"]
    labels = [r["label"] for r in rows]
    panels = [
        ("mean KL(ref || cfg) per token (log scale, lower is better)", [r["kld_mean"] for r in rows], "{:.2e}", True),
        ("top-1 agreement with reference, % (higher is better)", [r["top1_agreement"] for r in rows], "{:.2f}", False),
        ("perplexity change vs reference, % (closer to 0 is better)",
         [100 * r["ppl_rel_change"] for r in rows], "{:+.3f}", False),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 1.2 + 0.55 * len(rows)), sharey=True)
    y = list(range(len(rows)))
    for ax, (name, values, fmt, log) in zip(axes, panels):
        plotted = [max(v, 1e-12) for v in values] if log else values
        ax.barh(y, plotted, color=[_COLORS.get(r["kv_cache_dtype"], "#999999") for r in rows])
        if log:
            ax.set_xscale("log")
        if not log and name.startswith("top-1"):
            ax.set_xlim(min(values + [99.0]) - 0.5, 100.0)
        for yi, (p, v) in enumerate(zip(plotted, values)):
            ax.annotate(fmt.format(v), (p, yi), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
        ax.set_title(name, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(y, labels)
    axes[0].invert_yaxis()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from fp8serve.calibration.runner import resolve_seq_len
    from fp8serve.calibration.text import load_text, token_chunks
    from fp8serve.calibration.writers import check_output_file
    from fp8serve.engine.tokenizer import load_tokenizer
    from fp8serve.errors import UserError

    # Everything that can be wrong with the arguments fails here, before the first engine.
    configs = configs_from_args(args)
    if args.num_tokens is not None and args.num_tokens < 2:
        raise UserError(f"--num-tokens must be >= 2 (leave it out to use all the text), got {args.num_tokens}")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            check_output_file(path, flag)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UserError("--plot needs matplotlib: pip install matplotlib")
    source = load_text(args.text)
    model = args.model
    if model is None:
        from fp8serve.default_model import ensure_default_model

        model = str(ensure_default_model())
    seq_len = resolve_seq_len(model, args.seq_len)
    # The tokenizer only, before any engine: the chunks must be the same for all runs.
    chunks = token_chunks(load_tokenizer(model), source.text, args.num_tokens or 1 << 62, seq_len)
    if not chunks:
        raise UserError(f"--text {args.text}: shorter than 2 tokens, nothing to evaluate")
    header = {"model": model, "text": source.description, "seq_len": seq_len}

    def write_json(document: dict) -> None:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=2) + "\n")

    def save_partial(partial: dict) -> None:
        if args.json:
            write_json({**header, **partial, "complete": False})

    doc = evaluate(model, chunks, configs, dtype=args.dtype, device=args.device,
                   kv_cache_memory=args.kv_cache_memory, seq_len=seq_len, quantization=args.quantization,
                   on_result=save_partial)
    doc = {**header, **doc, "complete": True}
    print(f"model: {model}\ntext: {source.description}; {doc['reference']['num_tokens']} tokens in "
          f"{len(chunks)} chunks of <= {seq_len}")
    print(format_table(doc))
    if args.json:
        write_json(doc)
        print(f"wrote {args.json}")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        ran = doc["reference"].get("quantization")
        weights = f" (--quantization {ran})" if ran else ""
        write_plot(doc, args.plot, f"{Path(model).name}{weights}: FP8 KV cache vs "
                                   f"{doc['reference']['kv_cache_dtype']} KV "
                                   f"({doc['reference']['num_predicted_tokens']} tokens)")
        print(f"wrote {args.plot}")
    return 0
