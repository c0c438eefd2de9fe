"""`fp8serve scales`: which k_scale / v_scale every attention layer will use,
and where each comes from, without loading the model.

It reads config.json and, for an FP8 checkpoint, only the safetensors headers
and the scale tensors themselves, through the same model `weights_mapper` and
`resolve_kv_scales` the engine uses, so what it prints is what
`LLM(model, kv_cache_dtype=...)` would set.

`--kv-cache-dtype auto` is reported as "auto", not resolved to a compute
dtype: that depends on --dtype/--device, which this command does not take, and
with any 16-bit or float32 KV cache the scales are unused anyway.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from fp8serve.errors import UserError

logger = logging.getLogger(__name__)

# Duplicated from fp8serve.config so that registering the subcommand does not import torch.
_KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "float32")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "scales",
        help="show the FP8 KV cache scales each layer will use and where they come from",
        description=(
            "Print the k_scale and v_scale of every attention layer for a KV cache dtype, and their source: "
            "checkpoint:<tensor>, json:<file> or default. Reads config.json and the scale tensors only, "
            "never the weights."
        ),
    )
    parser.add_argument("model", nargs="?", default=None,
                        help="Hugging Face checkpoint directory (default: the built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=_KV_CACHE_DTYPE_CHOICES,
                        help="KV cache dtype, as for the engine (default: auto; fp8 = fp8_e4m3)")
    parser.add_argument("--quantization-param-path", default=None, metavar="FILE",
                        help="JSON with per-layer KV scales (vLLM schema), for 16-bit checkpoints")
    parser.add_argument("--json", action="store_true",
                        help='print {"kv_cache_dtype": ..., "layers": [{"layer", "k_scale", "v_scale", "source"}]}')
    parser.set_defaults(func=run)


def inspect_kv_scales(model: str | None, kv_cache_dtype: str = "auto", quantization_param_path: str | None = None):
    """(normalized kv cache dtype, [LayerKVScale per layer]) as the engine would resolve them."""
    from fp8serve.config import CacheConfig, ModelArchConfig, read_hf_config
    from fp8serve.model_loader.loader import safetensors_files
    from fp8serve.models.registry import get_model_class
    from fp8serve.quantization.kv_scales import resolve_kv_scales
    from fp8serve.quantization.registry import get_quantization_config

    if model is None:
        from fp8serve.default_model import ensure_default_model

        try:
            model = str(ensure_default_model())
        except FileNotFoundError as e:
            raise UserError(str(e)) from e
    # The same checks, in the same order, as engine start-up: flags, config.json,
    # quantization_config, weight files. Then only the scale tensors are read.
    cache = CacheConfig(kv_cache_dtype=kv_cache_dtype, quantization_param_path=quantization_param_path)
    hf_config, cfg_path = read_hf_config(model)
    arch = ModelArchConfig.from_dict(hf_config, cfg_path)
    get_quantization_config(arch.quantization_config, model)
    safetensors_files(model)
    mapper = get_model_class(arch).weights_mapper(arch)
    scales = resolve_kv_scales(
        model_dir=model,
        hf_config=hf_config,
        num_layers=arch.num_hidden_layers,
        kv_cache_dtype=cache.kv_cache_dtype,
        mapper=mapper,
        quantization_param_path=cache.quantization_param_path,
        logger=logger,
    )
    return cache.kv_cache_dtype, scales


def _note(kv_cache_dtype: str) -> str | None:
    if kv_cache_dtype in ("auto", "bfloat16", "float16", "float32"):
        what = "the compute dtype" if kv_cache_dtype == "auto" else kv_cache_dtype
        return (f"note: the KV cache stores {what} (not FP8), so these scales are unused; "
                "pass --kv-cache-dtype fp8 to see the scales an FP8 cache would use")
    if kv_cache_dtype == "fp8_e5m2":
        return "note: fp8_e5m2 always uses k_scale = v_scale = 1.0; calibrated scales apply to fp8_e4m3 only"
    return None


def format_table(kv_cache_dtype: str, scales) -> str:
    def cell(scale: float, per_head) -> str:  # per-KV-head scales (strategy attn_head) in head order
        return f"{scale:.6g}" if per_head is None else "[" + " ".join(f"{x:.6g}" for x in per_head) + "]"

    rows = [("layer", "k_scale", "v_scale", "source")]
    rows += [(str(s.layer), cell(s.k_scale, s.k_head_scales), cell(s.v_scale, s.v_head_scales), s.source)
             for s in scales]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"KV cache dtype: {kv_cache_dtype}"]
    for r in rows:
        lines.append(f"{r[0]:>{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}")
    return "\n".join(lines)


def _layer_json(s) -> dict:
    """k_scale/v_scale stay numbers (with per-head scales, their max); per-head scales
    add k_head_scales/v_head_scales, one per KV head."""
    doc = {"layer": s.layer, "k_scale": s.k_scale, "v_scale": s.v_scale, "source": s.source}
    if s.k_head_scales is not None:
        doc.update(k_head_scales=list(s.k_head_scales), v_head_scales=list(s.v_head_scales))
    return doc


def run(args: argparse.Namespace) -> int:
    kv_cache_dtype, scales = inspect_kv_scales(args.model, args.kv_cache_dtype, args.quantization_param_path)
    note = _note(kv_cache_dtype)
    if args.json:
        doc = {
            "kv_cache_dtype": kv_cache_dtype,
            "layers": [_layer_json(s) for s in scales],
        }
        print(json.dumps(doc, indent=2))
        if note:
            print(note, file=sys.stderr)
    else:
        print(format_table(kv_cache_dtype, scales))
        if note:
            print(note)
    return 0
