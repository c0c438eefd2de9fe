"""Write an FP8-weight checkpoint that `fp8serve.quantization` loads: each
linear projection's weight as float8_e4m3fn with a float32 `weight_scale`,
and for the static activation scheme a float32 `input_scale` per projection.

Per-tensor weight scales go in AutoFP8's layout (`quant_method: fp8`);
per-channel ones (`weight_scale` [out, 1], one per output row: a row with
small weights keeps its precision instead of sharing the tensor's largest
value) in llm-compressor's compressed-tensors layout, the format vLLM reads
them from (AutoFP8's has no per-channel form).

Embeddings, norms, lm_head and the MoE router stay in the checkpoint's own
dtype: they are a small share of the bytes and the most sensitive to error
(a router's argmax flips on small changes; lm_head sets every logit).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from fp8serve.calibration.observers import MIN_SCALE, scale_from_amax
from fp8serve.calibration.writers import copy_side_files, fp8_kv_quantization_config, save_safetensors
from fp8serve.config import read_hf_config
from fp8serve.quantization.fp8 import FP8_E4M3, quantize_fp8
# The loader's list: a strategy written here must be one Fp8LinearMethod loads.
from fp8serve.quantization.fp8_linear import WEIGHT_STRATEGIES

logger = logging.getLogger(__name__)

# The projections AutoFP8 / llm-compressor quantize, by their last dotted name
# component. Mixtral's router is `block_sparse_moe.gate` (not `gate_proj`), so
# it never matches.
QUANTIZED_PROJECTIONS = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"}
)
MODEL_FILE = "model.safetensors"


def is_quantized_linear(name: str) -> bool:
    if not name.endswith(".weight"):
        return False
    module = name.removesuffix(".weight")
    return module.rsplit(".", 1)[-1] in QUANTIZED_PROJECTIONS and not module.endswith("lm_head")


def quantize_weight(weight: torch.Tensor, strategy: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale = amax / 448): per tensor (a scalar)
    or per output row ([out, 1]), so the largest weight of each maps to e4m3's
    largest value and nothing saturates."""
    w = weight.to(torch.float32)
    if strategy == "channel":
        amax = w.abs().amax(dim=1, keepdim=True) if w.numel() else torch.zeros(w.shape[0], 1)
        scale = (amax / FP8_E4M3.max_finite).clamp(min=MIN_SCALE)
        return quantize_fp8(w, scale, FP8_E4M3).view(torch.float8_e4m3fn), scale
    if strategy != "tensor":
        raise ValueError(f"weight strategy must be one of {WEIGHT_STRATEGIES}, got {strategy!r}")
    scale = scale_from_amax(float(w.abs().amax()) if w.numel() else 0.0)
    codes = quantize_fp8(w, scale, FP8_E4M3).view(torch.float8_e4m3fn)
    return codes, torch.tensor(scale, dtype=torch.float32)


def fp8_quantization_config(activation_scheme: str, weight_strategy: str = "tensor") -> dict:
    if weight_strategy == "tensor":
        return {"quant_method": "fp8", "activation_scheme": activation_scheme, "ignored_layers": ["lm_head"]}
    # llm-compressor's FP8_DYNAMIC (dynamic per-token activations) or, static, per-tensor input scales.
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": activation_scheme == "dynamic",
                   "strategy": "token" if activation_scheme == "dynamic" else "tensor"}
    group = {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "channel"},
        "input_activations": activations,
        "output_activations": None,
        "format": "float-quantized",
    }
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ["lm_head", "re:.*block_sparse_moe.gate$"],
            "kv_cache_scheme": None}


def write_fp8_checkpoint(src: str | Path, dst: str | Path, *, activation_scheme: str, weight_strategy: str = "tensor",
                         extra_tensors: dict[str, torch.Tensor] | None = None, kv_cache: bool = False) -> list[str]:
    """Write `src` (16/32-bit) to `dst` with FP8 weights, plus `extra_tensors`
    (input scales, KV scales) if given; `kv_cache`: the config marks the KV
    scale tensors as an FP8 KV cache's. Returns the quantized weight names."""
    from fp8serve.model_loader.loader import iterate_checkpoint

    src, dst = Path(src), Path(dst)
    hf_config = read_hf_config(src)[0]  # an older checkpoint's compression_config read as its quantization_config
    if hf_config.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({hf_config['quantization_config'].get('quant_method')})")
    copy_side_files(src, dst)
    tensors: dict[str, torch.Tensor] = {}
    quantized = []
    for name, _, tensor in iterate_checkpoint(src, desc="Quantizing weights"):
        if is_quantized_linear(name):
            codes, scale = quantize_weight(tensor, weight_strategy)
            tensors[name] = codes
            tensors[name.removesuffix(".weight") + ".weight_scale"] = scale
            quantized.append(name)
        else:
            tensors[name] = tensor
    if not quantized:
        raise ValueError(f"{src}: no linear projection weights found to quantize")
    overlap = set(tensors) & set(extra_tensors or {})
    if overlap:
        raise ValueError(f"extra tensors would overwrite checkpoint tensors: {sorted(overlap)[:3]}")
    tensors.update(extra_tensors or {})
    with tqdm(total=1, desc=f"Writing {MODEL_FILE}", leave=False, disable=len(tensors) < 64) as bar:
        save_safetensors(tensors, dst / MODEL_FILE)
        bar.update(1)
    hf_config["quantization_config"] = fp8_quantization_config(activation_scheme, weight_strategy)
    if kv_cache:
        hf_config["quantization_config"] = fp8_kv_quantization_config(hf_config)
    (dst / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    logger.info("wrote %s: %d FP8 projections, %d other tensors", dst, len(quantized), len(tensors) - 2 * len(quantized))
    return quantized


def input_scales(weight_names: Iterable[str], module_of: dict[str, str], amax: dict[str, float | None],
                 margin: float = 1.0) -> tuple[dict[str, torch.Tensor], list[str]]:
    """`<proj>.input_scale` tensors from observed input amax per engine module.

    `module_of[weight name]` is the engine module that runs it (q/k/v share
    one fused module and so one input). A module that saw no token (a Mixtral
    expert nothing was routed to) takes the largest amax among modules of the
    same layer and projection, e.g. the other experts' w2; returns those
    weight names too, so the caller can say so."""
    tensors, borrowed = {}, []
    amax_of = {}
    for w in weight_names:
        a = amax.get(module_of[w])
        if a is None:
            peers = [amax.get(module_of[p]) for p in weight_names if _peer_key(p) == _peer_key(w)]
            peers = [x for x in peers if x is not None]
            if not peers:
                peers = [x for x in amax.values() if x is not None]
            a = max(peers)
            borrowed.append(w)
        amax_of[w] = a
    for w, a in amax_of.items():
        tensors[w.removesuffix(".weight") + ".input_scale"] = torch.tensor(scale_from_amax(a, margin),
                                                                        dtype=torch.float32)
    return tensors, borrowed


def _peer_key(weight_name: str) -> str:
    # `...layers.3.block_sparse_moe.experts.5.w2.weight` -> `...layers.3.block_sparse_moe.experts.*.w2.weight`
    parts = weight_name.split(".")
    return ".".join("*" if i > 0 and parts[i - 1] == "experts" else p for i, p in enumerate(parts))
