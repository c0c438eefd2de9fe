"""Weight loaders shared by linear methods: copy a checkpoint tensor into the
right rows (fused shard) or slot (per-shard scale) of a parameter."""

from __future__ import annotations

import torch
from torch import nn

from fp8serve.errors import ConfigError


def _check_shape(param_name: str, expected: tuple[int, ...], got: torch.Tensor) -> None:
    if tuple(got.shape) != tuple(expected):
        raise ConfigError(
            f"checkpoint tensor for '{param_name}' has shape {tuple(got.shape)}, expected {tuple(expected)}"
        )


def load_output_shard(layer: nn.Module):
    """Loader for `[out, ...]` tensors: a fused layer takes each shard's rows."""

    def loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            target = param.data
        else:
            offset, size = layer.shard_offset(shard_id)
            target = param.data.narrow(0, offset, size)
        _check_shape(getattr(param, "param_name", "weight"), tuple(target.shape), loaded)
        target.copy_(loaded.to(target.dtype) if loaded.dtype != target.dtype else loaded)

    return loader


def load_per_shard_scalar(layer: nn.Module):
    """Loader for per-tensor scales of a fused layer: one slot per shard."""

    def loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.numel() != 1:
            raise ConfigError(
                f"checkpoint scale for '{getattr(param, 'param_name', 'scale')}' must be a scalar, "
                f"got shape {tuple(loaded.shape)}"
            )
        index = 0 if shard_id is None else layer.shard_index(shard_id)
        param.data[index] = loaded.reshape(()).to(param.dtype)

    return loader


def load_fp8_output_shard(layer: nn.Module):
    """`load_output_shard` for float8_e4m3fn weights: a 16/32-bit tensor where FP8 codes are
    expected (a checkpoint whose config claims more than its files hold) would be cast to
    FP8 without its scale, and run as silently wrong weights."""
    shard_loader = load_output_shard(layer)

    def loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.dtype != torch.float8_e4m3fn:
            raise ConfigError(
                f"checkpoint tensor for '{getattr(param, 'param_name', 'weight')}' is {loaded.dtype}, expected "
                "torch.float8_e4m3fn codes: config.json's quantization_config says this layer is FP8"
            )
        shard_loader(param, loaded, shard_id)

    return loader


def load_row_scales(layer: nn.Module):
    """Loader for per-channel scales (`[out, 1]` or `[out]`, any float dtype): a fused
    layer takes each shard's rows."""

    def loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        offset, size = (0, param.shape[0]) if shard_id is None else layer.shard_offset(shard_id)
        name = getattr(param, "param_name", "weight_scale")
        if tuple(loaded.shape) not in ((size, 1), (size,)):
            raise ConfigError(f"checkpoint scale for '{name}' has shape {tuple(loaded.shape)}, expected ({size}, 1) "
                              "(one per output channel)")
        if not loaded.is_floating_point():
            raise ConfigError(f"checkpoint scale for '{name}' is {loaded.dtype}, expected a float tensor")
        param.data.narrow(0, offset, size).copy_(loaded.reshape(size).to(param.dtype))

    return loader
