"""Tiny checkpoints carrying FP8 KV scales and FP8 weights, built on `checkpoints.py`.

- `add_kv_scales` writes one of the three KV-scale name families with distinct,
  known per-layer values (`expected_scales` says what each layer must end up with);
- `quantize_to_fp8_checkpoint` turns a float checkpoint into an FP8 one the way
  AutoFP8 lays it out (float8_e4m3fn weight + float32 per-tensor weight_scale,
  plus input_scale for a static activation scheme), every projection with its
  own scale, and writes the dequantized weights as a float32 reference checkpoint;
- `quantize_to_compressed_tensors_checkpoint` does the same in llm-compressor's
  compressed-tensors layout, with per-tensor or per-channel weight scales.

Quantization here uses torch's float8 cast directly, not fp8serve's code, so the
references are independent of the engine.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from checkpoints import add_tensors, load_state_dict, read_config, set_quantization_config

E4M3_MAX = 448.0

# family -> what it looks like on disk
KV_SCALE_FAMILIES = ("kv_scale", "k_v_scale", "output_scale")

FP8_QUANT_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic"}
COMPRESSED_TENSORS_KV_ONLY = {
    "quant_method": "compressed-tensors",
    "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True},
}

# Linear weights that FP8 checkpoints quantize (routers and lm_head stay 16-bit).
_QUANTIZED_LINEAR = re.compile(
    r"\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|block_sparse_moe\.experts\.\d+\.w[123])\.weight$"
)


def k_scale_of(layer: int) -> float:
    # Powers of two over 64 are exact in float32, so loaded values compare with ==.
    return (layer + 1) / 64


def v_scale_of(layer: int) -> float:
    return 0.5 + layer / 8


def expected_scales(family: str, num_layers: int) -> list[tuple[float, float, str]]:
    """(k_scale, v_scale, source) per layer for a checkpoint written by `add_kv_scales`."""
    out = []
    for i in range(num_layers):
        p = f"model.layers.{i}.self_attn"
        if family == "kv_scale":
            out.append((k_scale_of(i), k_scale_of(i), f"checkpoint:{p}.kv_scale"))
        elif family == "k_v_scale":
            out.append((k_scale_of(i), v_scale_of(i), f"checkpoint:{p}.k_scale,{p}.v_scale"))
        elif family == "output_scale":
            out.append((k_scale_of(i), v_scale_of(i), f"checkpoint:{p}.k_proj.output_scale,{p}.v_proj.output_scale"))
        else:
            raise ValueError(family)
    return out


def kv_scale_tensors(family: str, num_layers: int) -> dict[str, torch.Tensor]:
    tensors = {}
    for i in range(num_layers):
        p = f"model.layers.{i}.self_attn"
        if family == "kv_scale":
            tensors[f"{p}.kv_scale"] = torch.tensor(k_scale_of(i))
        elif family == "k_v_scale":
            tensors[f"{p}.k_scale"] = torch.tensor(k_scale_of(i))
            tensors[f"{p}.v_scale"] = torch.tensor(v_scale_of(i))
        elif family == "output_scale":
            # compressed-tensors stores shape [1]
            tensors[f"{p}.k_proj.output_scale"] = torch.tensor([k_scale_of(i)])
            tensors[f"{p}.v_proj.output_scale"] = torch.tensor([v_scale_of(i)])
        else:
            raise ValueError(family)
    return tensors


def add_kv_scales(model_dir, family: str) -> None:
    """Adds `family`'s scale tensors for every layer. `output_scale` also marks the
    checkpoint compressed-tensors with only a kv_cache_scheme (16-bit weights stay)."""
    num_layers = read_config(model_dir)["num_hidden_layers"]
    add_tensors(model_dir, kv_scale_tensors(family, num_layers))
    if family == "output_scale":
        set_quantization_config(model_dir, COMPRESSED_TENSORS_KV_ONLY)


COMPRESSED_TENSORS_KV_PER_HEAD = {
    "quant_method": "compressed-tensors",
    "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": False, "symmetric": True},
}


def add_per_head_kv_scales(model_dir, k_scales: list[list[float]], v_scales: list[list[float]]) -> None:
    """llm-compressor's per-head layout (kv_cache_scheme strategy attn_head): each layer's
    self_attn.k_scale / v_scale of shape [num_kv_heads, 1, 1]; `k_scales[layer][head]`."""
    tensors = {}
    for i, (k, v) in enumerate(zip(k_scales, v_scales)):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k, dtype=torch.float32).view(-1, 1, 1)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v, dtype=torch.float32).view(-1, 1, 1)
    add_tensors(model_dir, tensors)
    set_quantization_config(model_dir, COMPRESSED_TENSORS_KV_PER_HEAD)


def copy_checkpoint(src, dst) -> Path:
    shutil.copytree(src, dst)
    return Path(dst)


def quantize_to_fp8_checkpoint(src, out_dir, ref_dir=None, *, activation_scheme: str = "dynamic") -> dict:
    """Writes `out_dir` (FP8 weights) and, if given, `ref_dir` (the same model with
    the dequantized weights in float32). Returns {weight name: weight_scale}.

    Scales are amax / 448 times a factor cycling through 1, 1.25, ..., 2, so
    even two shards with the same amax (q/k/v, gate/up, w1/w3) get different
    scales; a factor >= 1 never saturates."""
    out_dir = copy_checkpoint(src, out_dir)
    state = load_state_dict(src)
    fp8_tensors, dequantized, scales = {}, {}, {}
    names = sorted(n for n in state if _QUANTIZED_LINEAR.search(n))
    for n, name in enumerate(names):
        w = state[name].to(torch.float32)
        scale = torch.tensor(float(w.abs().max()) / E4M3_MAX * (1.0 + 0.25 * (n % 5)), dtype=torch.float32)
        codes = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        prefix = name.removesuffix(".weight")
        fp8_tensors[name] = codes
        fp8_tensors[f"{prefix}.weight_scale"] = scale
        if activation_scheme == "static":
            # Shape [1] as llm-compressor writes it; CPU ignores the value.
            fp8_tensors[f"{prefix}.input_scale"] = torch.tensor([0.01 * (1 + n % 7)], dtype=torch.float32)
        dequantized[name] = (codes.to(torch.float64) * scale.to(torch.float64)).to(torch.float32)
        scales[name] = float(scale)
    add_tensors(out_dir, fp8_tensors)
    set_quantization_config(out_dir, {"quant_method": "fp8", "activation_scheme": activation_scheme})
    if ref_dir is not None:
        ref_dir = copy_checkpoint(src, ref_dir)
        add_tensors(ref_dir, dequantized)
    return scales


def quantize_to_compressed_tensors_checkpoint(src, out_dir, ref_dir=None, *, strategy_of, quantization_config: dict,
                                              static_input_scales: bool = False) -> dict:
    """Writes `out_dir` in llm-compressor's compressed-tensors FP8 layout and, if given,
    `ref_dir` (the dequantized weights in float32). `strategy_of(module)` says how each
    projection's checkpoint module is quantized: "tensor" (float32 `weight_scale` [1]),
    "channel" (bf16 `weight_scale` [out, 1], as llm-compressor stores it in the model's
    dtype) or None (left as it is); `quantization_config` is written as given, so a test
    can make it agree with `strategy_of` or not. Returns {weight name: scale tensor}.

    Scales are amax / 448 (per tensor or per row) times a factor cycling through
    1, 1.25, ..., 2, rounded to their stored dtype before the codes are computed."""
    out_dir = copy_checkpoint(src, out_dir)
    state = load_state_dict(src)
    fp8_tensors, dequantized, scales = {}, {}, {}
    names = sorted(n for n in state if _QUANTIZED_LINEAR.search(n))
    for n, name in enumerate(names):
        prefix = name.removesuffix(".weight")
        strategy = strategy_of(prefix)
        if strategy is None:
            continue
        w = state[name].to(torch.float32)
        factor = 1.0 + 0.25 * (n % 5)
        if strategy == "channel":
            scale = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX * factor).clamp(min=1e-8).to(torch.bfloat16)
        else:
            scale = torch.tensor([float(w.abs().max()) / E4M3_MAX * factor], dtype=torch.float32)
        codes = (w / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        fp8_tensors[name] = codes
        fp8_tensors[f"{prefix}.weight_scale"] = scale
        if static_input_scales and strategy == "tensor":
            fp8_tensors[f"{prefix}.input_scale"] = torch.tensor([0.01 * (1 + n % 7)], dtype=torch.float32)
        dequantized[name] = (codes.to(torch.float64) * scale.to(torch.float64)).to(torch.float32)
        scales[name] = scale
    add_tensors(out_dir, fp8_tensors)
    set_quantization_config(out_dir, quantization_config)
    if ref_dir is not None:
        ref_dir = copy_checkpoint(src, ref_dir)
        add_tensors(ref_dir, dequantized)
    return scales


def fp8_group(targets: list[str], weight_strategy: str, input_activations: dict | None) -> dict:
    """One compressed-tensors config group with FP8 weights, as llm-compressor writes it."""
    return {
        "targets": targets,
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": weight_strategy,
                    "dynamic": False, "group_size": None, "block_structure": None, "actorder": None,
                    "observer": "minmax", "observer_kwargs": {}},
        # A copy: tests edit the group they get.
        "input_activations": dict(input_activations) if input_activations is not None else None,
        "output_activations": None,
        "format": "float-quantized",
    }


FP8_DYNAMIC_TOKEN = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True,
                     "group_size": None, "observer": None}
FP8_STATIC_TENSOR = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False,
                     "group_size": None, "observer": "minmax"}


def compressed_tensors_config(config_groups: dict, ignore: list[str]) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": config_groups, "ignore": ignore, "kv_cache_scheme": None,
            "global_compression_ratio": None, "sparsity_config": {}}


def write_scales_json(path, model_type: str, scales: list[float]) -> str:
    """A --quantization-param-path file in vLLM's schema (one scale per layer, rank 0)."""
    doc = {
        "model_type": model_type,
        "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {str(i): s for i, s in enumerate(scales)}}},
    }
    Path(path).write_text(json.dumps(doc))
    return str(path)


def record_scale_reads(monkeypatch) -> list[str]:
    """Make `fp8serve.quantization.kv_scales` open safetensors through a spy;
    returns the list that collects every tensor name it reads."""
    from fp8serve.quantization import kv_scales

    read: list[str] = []
    real_open = kv_scales.open_safetensors

    class RecordingHandle:
        def __init__(self, *a, **kw):
            self._h = real_open(*a, **kw)

        def __enter__(self):
            self._h.__enter__()
            return self

        def __exit__(self, *exc):
            return self._h.__exit__(*exc)

        def keys(self):
            return self._h.keys()

        def get_tensor(self, name):
            read.append(name)
            return self._h.get_tensor(name)

    monkeypatch.setattr(kv_scales, "open_safetensors", RecordingHandle)
    return read
