"""Load a Hugging Face safetensors checkpoint into a model.

One loader for every model: checkpoint names go through the model's
declarative `WeightsMapper`; each parameter's own `weight_loader` places the
tensor (fused shards, per-shard scales). KV-scale tensors are not loaded
here: `fp8serve.quantization.kv_scales` decides which scales apply (they
depend on the KV cache dtype) and the model runner sets them.

Only safetensors are read: a pickle (`.bin`, `.pt`) can run code on load.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm.auto import tqdm

from fp8serve.config import read_hf_config
from fp8serve.errors import ConfigError
from fp8serve.model_loader.weights_mapper import WeightsMapper, is_kv_scale_param

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files, from the index if there is one."""
    d = Path(model_dir)
    index = d / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{index}: cannot read 'weight_map' ({e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ConfigError(f"{index}: 'weight_map' must be an object of tensor name -> file name, "
                              f"got {type(weight_map).__name__}")
        files = [d / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"{index} lists shard(s) that do not exist: {', '.join(missing)}")
        return files
    files = sorted(d.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in d.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    if pickles:
        raise ConfigError(
            f"{d} has only pickle weights ({', '.join(pickles)}); fp8serve loads safetensors only, because "
            "unpickling can run arbitrary code. Convert the checkpoint with transformers: "
            "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, safe_serialization=True)`"
        )
    raise ConfigError(f"{d}: no *.safetensors weights found")


def _unreadable(f: Path, e: Exception) -> ConfigError:
    return ConfigError(f"{f}: not a readable safetensors file ({e}); the file is damaged or incomplete (an "
                       "interrupted download or copy?)")


def open_safetensors(f: Path):
    """safe_open, with a damaged or truncated file as a ConfigError naming it."""
    try:
        return safe_open(str(f), framework="pt")
    except (SafetensorError, OSError) as e:
        raise _unreadable(f, e) from None


def checkpoint_float_dtypes(model_dir: str | Path) -> set[str]:
    """The safetensors dtype names ("BF16", "F32", ...) of the checkpoint's
    floating-point tensors, read from the files' headers (no tensor data)."""
    dtypes = set()
    for f in safetensors_files(model_dir):
        with open_safetensors(f) as h:
            dtypes.update(h.get_slice(name).get_dtype() for name in h.keys())
    return {d for d in dtypes if d.startswith(("F", "BF"))}  # F16, F32, F8_E4M3, BF16, ...; not I*, U*, BOOL


def iterate_checkpoint(model_dir: str | Path, desc: str = "Loading weights") -> Iterator[tuple[str, Path, torch.Tensor]]:
    files = safetensors_files(model_dir)
    total = 0
    handles = []
    for f in files:
        h = open_safetensors(f)
        handles.append((f, h))
        total += len(h.keys())
    with tqdm(total=total, desc=desc, unit="tensor", leave=False, disable=total < 64) as bar:
        for f, h in handles:
            for name in h.keys():
                try:
                    tensor = h.get_tensor(name)
                except (SafetensorError, OSError) as e:
                    raise _unreadable(f, e) from None
                yield name, f, tensor
                bar.update(1)


def _checkpoint_tensor(mapper: WeightsMapper, param_name: str, shard_ids: tuple = (None,)) -> str:
    """The checkpoint tensor a parameter (or, by `shard_ids`, one shard of a fused parameter)
    loads from, as the checkpoint names it: model.layers.5.mlp.gate_up_proj.weight, shard 1 ->
    ...mlp.up_proj.weight; ...mlp.experts.0.down_proj.weight_scale ->
    ...block_sparse_moe.experts.0.w2.weight_scale. The parameter's own name where the
    rules do not say."""
    module, _, suffix = param_name.rpartition(".")
    for shard_id in shard_ids:
        ckpt = mapper.checkpoint_module(module, shard_id) if module else None
        if ckpt is not None:
            return f"{ckpt}.{suffix}"
    return param_name if shard_ids == (None,) else f"{param_name} (shard {shard_ids[-1]!r})"


def _is_float8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def _quant_configs(model: nn.Module) -> list:
    """The quantization configs the model's layers were built from (a quantized layer's
    method keeps its config), each once."""
    configs = {}
    for module in model.modules():
        config = getattr(getattr(module, "quant_method", None), "config", None)
        if config is not None:
            configs.setdefault(id(config), config)
    return list(configs.values())


def _explain(model: nn.Module, model_dir: str | Path, ckpt_name: str, dtype: torch.dtype) -> str | None:
    """Why the checkpoint's quantization config has no place for tensor `ckpt_name` (a zero
    point of an asymmetric scheme, a static scale under a dynamic one, FP8 codes of a 16-bit
    layer), naming the config field; None when nothing is known about it. The configs know
    their fields: the loader only asks them."""
    for config in _quant_configs(model):
        explain = getattr(config, "explain_checkpoint_tensor", None)
        detail = explain(ckpt_name, dtype) if explain is not None else None
        if detail is not None:
            return detail
    # No config that declares quantized weights: config.json itself says what it lacks.
    config_json = f"{model_dir}/config.json"
    try:
        hf_quant_config = read_hf_config(model_dir)[0].get("quantization_config")
    except ConfigError:
        return None
    from fp8serve.quantization.compressed_tensors import explain_without_weight_config

    return explain_without_weight_config(ckpt_name, dtype, hf_quant_config, config_json)


def load_weights(model: nn.Module, model_dir: str | Path, mapper: WeightsMapper) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, p in params.items():
        p.param_name = name  # for error messages from weight loaders
    loaded: set[str] = set()
    # Fused parameters loaded shard by shard: the shard ids each one got.
    shards_loaded: dict[str, set] = {}
    whole: set[str] = set()
    for ckpt_name, file, tensor in iterate_checkpoint(model_dir):
        for target in mapper.map(ckpt_name):
            if is_kv_scale_param(target.param_name):
                continue  # resolved by quantization.kv_scales
            param = params.get(target.param_name)
            if param is None:
                detail = _explain(model, model_dir, ckpt_name, tensor.dtype)
                if detail is not None:
                    raise ConfigError(f"{file}: tensor '{ckpt_name}' {detail}")
                raise ConfigError(
                    f"{file}: tensor '{ckpt_name}' does not match any parameter of "
                    f"{type(model).__name__} (mapped to '{target.param_name}')"
                )
            if _is_float8(tensor.dtype) and not _is_float8(param.dtype):
                # FP8 codes copied into a 16/32-bit parameter would become floats without their
                # scale: wrong weights that still run.
                detail = _explain(model, model_dir, ckpt_name, tensor.dtype) or (
                    f"holds FP8 ({tensor.dtype}) codes for '{target.param_name}' ({param.dtype} here): "
                    "config.json's quantization_config does not declare this layer FP8")
                raise ConfigError(f"{file}: tensor '{ckpt_name}' {detail}")
            if param.is_floating_point() and not tensor.is_floating_point():
                # An integer tensor would be cast to floats without a word: not a
                # checkpoint this model reads.
                raise ConfigError(f"{file}: tensor '{ckpt_name}' has dtype {tensor.dtype}; expected a floating-point "
                                  f"tensor for '{target.param_name}' ({param.dtype} here)")
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                try:
                    loader(param, tensor, target.shard_id)
                except ConfigError as e:
                    raise ConfigError(f"{file}: tensor '{ckpt_name}': {e}") from None
                if target.shard_id is None:
                    whole.add(target.param_name)
                else:
                    shards_loaded.setdefault(target.param_name, set()).add(target.shard_id)
            else:
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ConfigError(
                        f"{file}: tensor '{ckpt_name}' has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(param.shape)} for '{target.param_name}'"
                    )
                param.data.copy_(tensor.to(param.dtype))
            loaded.add(target.param_name)
    required = {
        n for n, p in params.items()
        if not is_kv_scale_param(n) and not getattr(p, "optional", False)
    }
    # A tied LM head shares the embedding Parameter: loaded under either name.
    loaded_ids = {id(params[n]) for n in loaded}
    missing = [_checkpoint_tensor(mapper, n) for n in sorted(required) if id(params[n]) not in loaded_ids]
    # A fused parameter (qkv_proj, gate_up_proj) loaded shard by shard needs
    # every shard: a missing one would leave its rows as they were allocated.
    for name, got in sorted(shards_loaded.items()):
        layer = model.get_submodule(name.rsplit(".", 1)[0])
        sizes = getattr(layer, "output_sizes", None)
        if name in whole or sizes is None or getattr(params[name], "optional", False):
            continue
        have = {layer.shard_index(s) for s in got}
        for index in range(len(sizes)):
            if index not in have:
                # A rule may name the shard by its index or by its name ('k').
                ids = (index,) + ((layer.shard_names[index],) if layer.shard_names else ())
                missing.append(_checkpoint_tensor(mapper, name, ids))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ConfigError(f"{model_dir}: checkpoint is missing tensors for {shown}")
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            try:
                method.process_weights_after_loading(module)
            except ConfigError as e:
                raise ConfigError(f"{model_dir}: {e}") from None
