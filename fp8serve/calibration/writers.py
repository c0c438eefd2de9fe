"""Write calibrated KV scales where the engine reads them.

Two destinations, matching the two rules in `fp8serve.quantization.kv_scales`:
- a `--quantization-param-path` JSON in vLLM's schema (one scale per layer:
  the schema has no separate K and V, so each layer gets max(k, v), which
  saturates neither);
- a copy of the checkpoint with scalar float32 scale tensors per layer and a
  `quantization_config` that makes it an FP8-KV checkpoint, so the engine
  reads them with no flag. The weight files are copied byte for byte (only a
  file holding old KV-scale tensors is rewritten without them); the scales go
  into one extra `kv_scales.safetensors` listed in the index.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fp8serve.config import read_hf_config
from fp8serve.errors import UserError
from fp8serve.utils.paths import file_in_the_way

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
KV_SCALES_FILE = "kv_scales.safetensors"

# How per-layer scale tensors are named on disk:
#   k_v:  self_attn.k_scale + self_attn.v_scale (AutoFP8 / vLLM >= 0.6; keeps K and V apart)
#   kv:   self_attn.kv_scale = max(k, v) (the seed PR's single tensor)
#   both: all three, for engines that read only kv_scale; readers that know
#         k_scale/v_scale (fp8serve included) prefer them.
KV_SCALE_FORMATS = ("both", "k_v", "kv")

# A 16-bit-weight checkpoint whose only quantization is the KV cache, as
# llm-compressor marks it; `is_fp8_checkpoint` accepts it.
KV_ONLY_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True},
}

_SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                            "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def kv_scales_json_doc(model_type: str, layer_scales: Sequence[float]) -> dict:
    """vLLM's --quantization-param-path document, tensor-parallel rank 0 only."""
    return {
        "model_type": model_type,
        "kv_cache": {
            "dtype": "float8_e4m3fn",
            "scaling_factor": {"0": {str(i): float(s) for i, s in enumerate(layer_scales)}},
        },
    }


def check_output_file(path: str | Path, flag: str) -> None:
    """Before any work: `path` can be written as a file (it is not a
    directory, and no existing part of its folder is a file). Missing
    folders are fine: the writer makes them."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a directory; expected a file path")
    blocking = file_in_the_way(path)
    if blocking is not None:
        raise UserError(f"{flag} {path}: {blocking} is a file, not a directory")


def check_new_directory(path: str | Path, flag: str) -> None:
    """Before any work: `path` does not exist yet and can be created (no
    existing part of its folder is a file)."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        raise UserError(f"{flag} {path} already exists; choose a new directory")
    blocking = file_in_the_way(path)
    if blocking is not None:
        raise UserError(f"{flag} {path}: {blocking} is a file, not a directory")


def write_kv_scales_json(path: str | Path, model_type: str, k_scales: Sequence[float],
                         v_scales: Sequence[float]) -> Path:
    path = Path(path)
    check_output_file(path, "--out-json")
    per_layer = [max(k, v) for k, v in zip(k_scales, v_scales, strict=True)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(kv_scales_json_doc(model_type, per_layer), indent=2) + "\n")
    return path


def kv_scale_tensors(attn_prefixes: Sequence[str], k_scales: Sequence, v_scales: Sequence,
                     kv_scale_format: str = "both") -> dict[str, torch.Tensor]:
    """Float32 scale tensors per layer; `attn_prefixes[i]` is layer i's checkpoint
    prefix, e.g. `model.layers.3.self_attn`. A layer's scale is a number (a scalar
    tensor), or a list with one per KV head (strategy attn_head: shape
    [num_kv_heads, 1, 1], llm-compressor's layout; k_scale + v_scale only)."""
    if kv_scale_format not in KV_SCALE_FORMATS:
        raise ValueError(f"kv_scale_format must be one of {KV_SCALE_FORMATS}, got {kv_scale_format!r}")
    out = {}
    for prefix, k, v in zip(attn_prefixes, k_scales, v_scales, strict=True):
        per_head = isinstance(k, (list, tuple))
        if per_head and kv_scale_format != "k_v":
            raise ValueError("per-head KV scales are written as self_attn.k_scale + v_scale only (k_v)")
        shape = (-1, 1, 1) if per_head else ()
        if kv_scale_format in ("k_v", "both"):
            out[f"{prefix}.k_scale"] = torch.tensor(k, dtype=torch.float32).reshape(shape)
            out[f"{prefix}.v_scale"] = torch.tensor(v, dtype=torch.float32).reshape(shape)
        if kv_scale_format in ("kv", "both"):
            out[f"{prefix}.kv_scale"] = torch.tensor(max(k, v), dtype=torch.float32)
    return out


_K_PROJ = re.compile(r"^(.*\blayers\.)(\d+)(\.self_attn)\.k_proj\.weight$")


def attention_prefixes(tensor_names: Sequence[str], num_layers: int) -> list[str]:
    """Checkpoint prefix of each layer's attention block, found from its
    k_proj weight (so the scales sit next to the weights whatever the model's
    top-level prefix is)."""
    found = {}
    for name in tensor_names:
        m = _K_PROJ.match(name)
        if m:
            found[int(m.group(2))] = f"{m.group(1)}{m.group(2)}{m.group(3)}"
    missing = [i for i in range(num_layers) if i not in found]
    if missing:
        raise UserError(f"no '...layers.N.self_attn.k_proj.weight' tensor for layers {missing[:5]}: "
                        "cannot tell where the KV scales go")
    return [found[i] for i in range(num_layers)]


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy everything but weights (config, tokenizer, chat template,
    generation config, ...). Returns the names copied."""
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf") or p.name == INDEX_FILE:
            continue
        shutil.copy2(p, dst / p.name)
        copied.append(p.name)
    return copied


def safetensors_size(file: Path) -> tuple[list[str], int]:
    """Tensor names and total bytes, from the header only."""
    with safe_open(str(file), framework="pt") as f:
        names = list(f.keys())
        total = 0
        for n in names:
            s = f.get_slice(n)
            numel = 1
            for d in s.get_shape():
                numel *= d
            total += numel * _SAFETENSORS_DTYPE_BYTES.get(s.get_dtype(), 4)
    return names, total


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path), metadata={"format": "pt"})
    # save_file writes through a private temporary file (mode 0600); the
    # checkpoint's other files follow the umask, and so should this one.
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def write_index(dst: Path, weight_map: dict[str, str]) -> None:
    total = sum(safetensors_size(dst / f)[1] for f in sorted(set(weight_map.values())))
    doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / INDEX_FILE).write_text(json.dumps(doc, indent=2) + "\n")


def fp8_kv_quantization_config(hf_config: dict, strategy: str = "tensor") -> dict:
    """The source's quantization_config, made to mark an FP8 KV cache with one scale per
    layer (strategy "tensor") or per KV head ("attn_head": only compressed-tensors says so)."""
    qc = hf_config.get("quantization_config")
    scheme = {**KV_ONLY_QUANTIZATION_CONFIG["kv_cache_scheme"], "strategy": strategy}
    if not qc:
        return {**KV_ONLY_QUANTIZATION_CONFIG, "kv_cache_scheme": scheme}
    method = qc.get("quant_method")
    if method == "fp8":
        if strategy != "tensor":
            raise UserError("quantization_config.quant_method 'fp8' (AutoFP8) has no kv_cache_scheme to mark "
                            "per-head KV scales with; use --kv-scale-strategy tensor for this checkpoint")
        return dict(qc)  # FP8-weight checkpoints carry KV scales as they are
    if method == "compressed-tensors":
        return {**qc, "kv_cache_scheme": {**(qc.get("kv_cache_scheme") or scheme), "strategy": strategy}}
    raise UserError(f"quantization_config.quant_method '{method}': cannot mark it as an FP8 KV checkpoint")


def write_kv_scale_checkpoint(src: str | Path, dst: str | Path, k_scales: Sequence,
                              v_scales: Sequence, *, kv_scale_format: str = "both",
                              is_kv_scale_tensor=None) -> Path:
    """Copy checkpoint `src` to `dst` with per-layer KV scale tensors added (per KV
    head where each layer's scales are lists: kv_cache_scheme strategy attn_head).

    `is_kv_scale_tensor(name)` says which existing tensors are KV scales
    (dropped: two scales for one layer are an error). `dst` must not exist."""
    from fp8serve.model_loader.loader import safetensors_files

    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise UserError(f"--out-checkpoint {dst} already exists; choose a new directory")
    hf_config = read_hf_config(src)[0]  # an older checkpoint's compression_config becomes its quantization_config
    strategy = "attn_head" if k_scales and isinstance(k_scales[0], (list, tuple)) else "tensor"
    # Refused before anything is written.
    quantization_config = fp8_kv_quantization_config(hf_config, strategy)
    num_layers = len(k_scales)
    files = safetensors_files(src)
    tmp = dst.with_name(f".{dst.name}.partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    copy_side_files(src, tmp)

    weight_map: dict[str, str] = {}
    all_names: list[str] = []
    for f in files:
        names = list(safetensors_size(f)[0])
        old = [n for n in names if is_kv_scale_tensor is not None and is_kv_scale_tensor(n)]
        if old:
            logger.info("%s: replacing %d existing KV-scale tensors", f.name, len(old))
            with safe_open(str(f), framework="pt") as h:
                kept = {n: h.get_tensor(n) for n in names if n not in old}
            save_safetensors(kept, tmp / f.name)
            names = list(kept)
        else:
            shutil.copy2(f, tmp / f.name)
        all_names += names
        weight_map.update({n: f.name for n in names})
    if KV_SCALES_FILE in {f.name for f in files}:
        raise UserError(f"{src} already has a file named {KV_SCALES_FILE}")
    scales = kv_scale_tensors(attention_prefixes(all_names, num_layers), k_scales, v_scales, kv_scale_format)
    save_safetensors(scales, tmp / KV_SCALES_FILE)
    weight_map.update({n: KV_SCALES_FILE for n in scales})
    write_index(tmp, weight_map)

    hf_config["quantization_config"] = quantization_config
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    tmp.rename(dst)
    return dst
