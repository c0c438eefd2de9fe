"""`fp8serve calibrate`: per-layer FP8 KV cache scales from sample text.

Runs the model with a 16/32-bit KV cache over the text, records each layer's
amax of K (after RoPE, as stored) and V, and sets scale = margin * amax / 448.
Writes a --quantization-param-path JSON and/or a checkpoint copy that carries
the scales as tensors (loaded with no flags)."""

from __future__ import annotations

import argparse
import logging
import math

logger = logging.getLogger(__name__)

# fp8serve.config's DTYPE_CHOICES, without importing torch.
_DTYPE_CHOICES = ("auto", "half", "float16", "bfloat16", "float", "float32")


def register(subparsers: argparse._SubParsersAction) -> None:
    from fp8serve.entrypoints.engine_args import add_quantization_arg

    p = subparsers.add_parser(
        "calibrate",
        help="compute per-layer FP8 KV cache scales from sample text",
        description=(
            "Run the model over calibration text with a 16/32-bit KV cache, record every layer's "
            "absolute maximum of K (after RoPE) and V, and turn them into FP8 e4m3 scales "
            "(scale = margin * amax / 448). Writes vLLM's --quantization-param-path JSON "
            "(one scale per layer: max of K and V) and/or a copy of the checkpoint with per-layer "
            "self_attn.k_scale / v_scale tensors that fp8serve reads with no flags. With -q fp8 the model "
            "runs with its weights quantized at load, so the scales describe that model's K and V: serve it "
            "with -q fp8 too (--out-json only; for a checkpoint, see fp8serve quantize --kv-cache)."
        ),
    )
    add_calibration_args(p)
    # Not in add_calibration_args: `quantize` makes FP8 weights itself.
    add_quantization_arg(p)
    p.add_argument("--margin", type=float, default=1.0,
                   help="safety factor on the observed amax (default 1.0; e.g. 1.2 leaves 20%% headroom)")
    p.add_argument("--out-json", default=None, metavar="FILE",
                   help="write the scales as a --quantization-param-path JSON (vLLM schema)")
    p.add_argument("--out-checkpoint", default=None, metavar="DIR",
                   help="write a copy of the checkpoint with per-layer KV scale tensors (DIR must not exist)")
    p.add_argument("--kv-scale-format", default=None, choices=("both", "k_v", "kv"),
                   help="checkpoint tensor names: both = k_scale + v_scale + the seed PR's kv_scale = max(k, v) "
                        "(default); k_v = self_attn.k_scale + v_scale only (the only one for attn_head); "
                        "kv = kv_scale only")
    p.add_argument("--kv-scale-strategy", default="tensor", choices=("tensor", "attn_head"),
                   help="one scale per layer (tensor, default) or per KV head (attn_head: compressed-tensors' "
                        "kv_cache_scheme strategy, [num_kv_heads, 1, 1] tensors; --out-checkpoint only, as vLLM's "
                        "JSON holds one scale per layer)")
    p.set_defaults(func=run)


def add_calibration_args(p: argparse.ArgumentParser) -> None:
    """Flags every calibrating command shares (calibrate, quantize)."""
    p.add_argument("model", nargs="?", default=None,
                   help="Hugging Face checkpoint directory (default: the built-in SmolLM2-135M-Instruct)")
    p.add_argument("--text", default=None, metavar="FILE",
                   help='calibration text: plain text, or JSONL with a "text" field (default: a built-in sample)')
    p.add_argument("--num-tokens", type=int, default=4096, help="tokens of text to run (default 4096)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per teacher-forced chunk (default 512, or the model's context if shorter)")
    p.add_argument("--dtype", default="float32", choices=_DTYPE_CHOICES,
                   help="compute dtype while calibrating (default float32)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--kv-cache-memory", default=None, help="KV cache budget, e.g. 256MiB")


def calibration_inputs(args: argparse.Namespace, need_text: bool = True):
    """(model directory, seq_len, text source, token chunks): what the shared flags decide,
    checked before any weights load or get written. Without `need_text`: (dir, seq_len, None, [])."""
    from fp8serve.calibration.runner import resolve_seq_len
    from fp8serve.calibration.text import load_text, token_chunks
    from fp8serve.engine.tokenizer import load_tokenizer
    from fp8serve.errors import UserError

    if args.num_tokens < 2:
        raise UserError(f"--num-tokens must be >= 2, got {args.num_tokens}")
    model = args.model
    if model is None:
        from fp8serve.default_model import ensure_default_model

        model = str(ensure_default_model())
    seq_len = resolve_seq_len(model, args.seq_len)
    if not need_text:
        return model, seq_len, None, []
    source = load_text(args.text)
    chunks = token_chunks(load_tokenizer(model), source.text, args.num_tokens, seq_len)
    if not chunks:
        raise UserError(f"--text {args.text}: shorter than 2 tokens, nothing to calibrate on")
    return model, seq_len, source, chunks


def format_kv_table(stats, margin: float) -> str:
    rows = [("layer", "k_amax", "v_amax", "k_scale", "v_scale", "json_scale")]
    for s in stats:
        k, v = s.k_scale(margin), s.v_scale(margin)
        rows.append((str(s.layer), f"{s.k_amax:.5g}", f"{s.v_amax:.5g}", f"{k:.6g}", f"{v:.6g}", f"{max(k, v):.6g}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    ks = [s.k_scale(margin) for s in stats]
    vs = [s.v_scale(margin) for s in stats]
    lines.append(f"k_scale {min(ks):.4g}..{max(ks):.4g}, v_scale {min(vs):.4g}..{max(vs):.4g} "
                 f"over {len(stats)} layers, {stats[0].num_tokens} tokens each, margin {margin:g}")
    return "\n".join(lines)


def format_head_table(stats, margin: float) -> str:
    """Each layer's per-KV-head scales (strategy attn_head), in head order."""
    def cells(values: list[float]) -> str:
        return " ".join(f"{x:.4g}" for x in values)

    lines = ["per-KV-head scales (what --out-checkpoint writes):"]
    lines += [f"  layer {s.layer}: k [{cells(s.k_head_scales(margin))}]  v [{cells(s.v_head_scales(margin))}]"
              for s in stats]
    return "\n".join(lines)


def is_kv_scale_tensor_fn(llm):
    """Predicate: does checkpoint tensor `name` hold a KV scale, by the model's own mapping?"""
    from fp8serve.model_loader.weights_mapper import is_kv_scale_param

    mapper = llm.llm_engine.model_runner.weights_mapper
    return lambda name: any(is_kv_scale_param(t.param_name) for t in mapper.map(name))


def check_checkpoint_quantization(model: str, quantization: str) -> None:
    """--out-checkpoint with -q METHOD on a checkpoint without a quantization_config: the copy would keep
    the 16/32-bit weights under a compressed-tensors quantization_config (writers.KV_ONLY_QUANTIZATION_CONFIG),
    which ModelConfig refuses -q with (as vLLM does), so the scales could never be served with the weights
    they were measured on. Refused before the model loads. (A checkpoint with its own quantization_config
    is ModelConfig's to check.)"""
    from fp8serve.config import read_hf_config
    from fp8serve.errors import UserError

    if read_hf_config(model)[0].get("quantization_config"):
        return
    raise UserError(f"--out-checkpoint with --quantization {quantization}: the copy would keep the 16/32-bit "
                    "weights under a compressed-tensors quantization_config, and a checkpoint with one is not served "
                    f"with --quantization; write the scales with --out-json (served with --quantization "
                    f"{quantization}), or an FP8 checkpoint with its KV scales: fp8serve quantize MODEL --out DIR "
                    "--activation-scheme dynamic --kv-cache")


def run(args: argparse.Namespace) -> int:
    from fp8serve.calibration.observers import KVAmaxObserver
    from fp8serve.calibration.runner import build_llm, run_chunks
    from fp8serve.calibration.writers import (
        check_new_directory,
        check_output_file,
        write_kv_scale_checkpoint,
        write_kv_scales_json,
    )
    from fp8serve.errors import UserError

    if not (math.isfinite(args.margin) and args.margin > 0):
        raise UserError(f"--margin must be a finite number > 0, got {args.margin}")
    per_head = args.kv_scale_strategy == "attn_head"
    if per_head and args.out_json:
        raise UserError("--out-json writes vLLM's --quantization-param-path schema, one scale per layer: it cannot "
                        "hold --kv-scale-strategy attn_head scales (use --out-checkpoint)")
    if per_head and args.kv_scale_format not in (None, "k_v"):
        raise UserError(f"--kv-scale-format {args.kv_scale_format}: per-head scales are written as "
                        "self_attn.k_scale + v_scale only (k_v); the seed PR's kv_scale is one number per layer")
    kv_scale_format = args.kv_scale_format or ("k_v" if per_head else "both")
    # The outputs are checked before the model loads and the text runs.
    if args.out_json:
        check_output_file(args.out_json, "--out-json")
    if args.out_checkpoint:
        check_new_directory(args.out_checkpoint, "--out-checkpoint")
    model, seq_len, source, chunks = calibration_inputs(args)
    if args.out_checkpoint and args.quantization:
        check_checkpoint_quantization(model, args.quantization)
    llm = build_llm(model, seq_len=seq_len, dtype=args.dtype, device=args.device,
                    kv_cache_memory=args.kv_cache_memory, quantization=args.quantization)
    engine = llm.llm_engine
    with KVAmaxObserver(engine.model_runner.attn_layers) as observer:
        num_tokens = run_chunks(llm, chunks, "Calibrating KV")
    stats = observer.stats
    model_dir = engine.config.model_config.model
    quantization = engine.config.model_config.quantization
    # The scales fit the model that ran: one with FP8 weights made at load is served with the same flag
    # (None where the flag named the checkpoint's own method: ModelConfig drops it).
    serve_flags = f"--quantization {quantization} " if quantization else ""
    weights = f"weights: quantized to {quantization} at load ({serve_flags.strip()}), " if quantization else ""
    print(f"model: {model_dir}\ntext: {source.description}, {num_tokens} tokens in {len(chunks)} chunks "
          f"of <= {seq_len}\ncompute dtype: {engine.config.model_config.dtype_name}, {weights}KV cache: "
          f"{engine.model_runner.kv_cache_spec.kv_cache_dtype} (unquantized while calibrating)")
    print(format_kv_table(stats, args.margin))

    if per_head:
        print(format_head_table(stats, args.margin))
        k_scales = [s.k_head_scales(args.margin) for s in stats]
        v_scales = [s.v_head_scales(args.margin) for s in stats]
    else:
        k_scales = [s.k_scale(args.margin) for s in stats]
        v_scales = [s.v_scale(args.margin) for s in stats]
    if args.out_json:
        model_type = engine.config.model_config.hf_config.get("model_type", "llama")
        path = write_kv_scales_json(args.out_json, model_type, k_scales, v_scales)
        print(f"wrote {path}  (use: {serve_flags}--kv-cache-dtype fp8 --quantization-param-path {path})")
    if args.out_checkpoint:
        path = write_kv_scale_checkpoint(model_dir, args.out_checkpoint, k_scales, v_scales,
                                         kv_scale_format=kv_scale_format,
                                         is_kv_scale_tensor=is_kv_scale_tensor_fn(llm))
        print(f"wrote {path}  (use: --kv-cache-dtype fp8; check with: fp8serve scales {path} "
              "--kv-cache-dtype fp8)")
    if not (args.out_json or args.out_checkpoint):
        print("nothing written: pass --out-json FILE and/or --out-checkpoint DIR to keep the scales")
    return 0
