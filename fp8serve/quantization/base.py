"""Quantization as a per-layer strategy.

A `QuantizationConfig` is chosen from the checkpoint's `quantization_config`;
it hands each linear layer a `LinearMethod` that creates the layer's
parameters, post-processes them after loading and applies the layer. Linear
layers never know which scheme they run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch
from torch import nn

WeightLoader = Callable[[nn.Parameter, torch.Tensor, "str | int | None"], None]


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


class LinearMethod(ABC):
    @abstractmethod
    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        """Register the layer's parameters (each with a `weight_loader`)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn checkpoint-format parameters into the format `apply` wants."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ...

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """silu(gate) * up of a [gate, up] layer's output for x (layers.activation.SiluAndMul of
        `apply`'s result) in one kernel, where this method has one for x; None: the caller runs
        `apply` and then the activation."""
        return None

    def row_breakpoints(self, layer: nn.Module, x_dtype: torch.dtype) -> tuple[int, ...] | None:
        """Row counts r where `apply`'s ops for an [r, K] input of `x_dtype`
        may differ from its ops at r - 1 rows (a kernel taking over at a row
        threshold), or None where unknown. A recorded prefill forward replays
        at other token counts only between two of them
        (fp8serve/engine/prefill_capture.py), so an extra one costs a
        recording and a missing one gives wrong replays: a method that
        branches on rows must list every threshold it consults."""
        return None


class QuantizationConfig(ABC):
    name: str

    @abstractmethod
    def get_linear_method(self, prefix: str) -> LinearMethod:
        """The method for the linear layer at `prefix` (e.g. `model.layers.0.mlp.down_proj`)."""

    def is_quantized_checkpoint(self) -> bool:
        return True

    def vocab_weight_dtype(self, compute_dtype: torch.dtype, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """The storage dtype of the unquantized embedding / LM head."""
        return compute_dtype


def vocab_weight_dtype(quant_config: QuantizationConfig | None, compute_dtype: torch.dtype,
                       checkpoint_dtype: torch.dtype) -> torch.dtype:
    if quant_config is None:
        return compute_dtype
    return quant_config.vocab_weight_dtype(compute_dtype, checkpoint_dtype)
