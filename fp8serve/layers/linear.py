"""Linear layers whose parameters come from a per-layer quantization method.

`MergedLinear` fuses several checkpoint projections (gate/up, q/k/v) into one
matmul; checkpoint shards land in their rows via `shard_offset`.
"""

from __future__ import annotations

import torch
from torch import nn

from fp8serve.quantization.base import QuantizationConfig, set_weight_loader
from fp8serve.quantization.loaders import load_output_shard
from fp8serve.quantization.unquantized import UnquantizedLinearMethod


class MergedLinear(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype = torch.float32,
        shard_names: tuple[str, ...] | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(output_sizes)
        self.shard_names = shard_names
        self.prefix = prefix
        self.quant_method = (
            quant_config.get_linear_method(prefix) if quant_config is not None else UnquantizedLinearMethod()
        )
        self.quant_method.create_weights(self, input_size, self.output_sizes, params_dtype)
        # oneDNN's packed copy of the weight, where the engine makes one
        # (onednn_linear.pack_weights); a buffer so that recorded decode
        # forwards know it as model state.
        self.register_buffer("weight_packed", None, persistent=False)
        # The bf16 weight packed for dense_gemv_packed (or an FP8 layer's codes
        # for fp8_gemv_packed, with their row scales), where the engine makes
        # one (gemv_packing.pack_gemv_weights).
        self.register_buffer("weight_gemv_packed", None, persistent=False)
        self.register_buffer("weight_scale_gemv_packed", None, persistent=False)
        if bias:
            b = nn.Parameter(torch.zeros(self.output_size, dtype=params_dtype), requires_grad=False)
            self.register_parameter("bias", set_weight_loader(b, load_output_shard(self)))
        else:
            self.bias = None

    def shard_index(self, shard_id: str | int) -> int:
        if isinstance(shard_id, int):
            index = shard_id
        elif self.shard_names is not None and shard_id in self.shard_names:
            index = self.shard_names.index(shard_id)
        else:
            raise KeyError(f"{self.prefix}: unknown shard {shard_id!r}")
        if not 0 <= index < len(self.output_sizes):
            raise KeyError(f"{self.prefix}: shard index {index} out of range")
        return index

    def shard_offset(self, shard_id: str | int) -> tuple[int, int]:
        index = self.shard_index(shard_id)
        return sum(self.output_sizes[:index]), self.output_sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class Linear(MergedLinear):
    def __init__(self, input_size: int, output_size: int, **kwargs) -> None:
        super().__init__(input_size, [output_size], **kwargs)


class QKVLinear(MergedLinear):
    """q, k and v projections in one matmul; shards are named 'q', 'k', 'v'."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, **kwargs) -> None:
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(
            hidden_size, [self.q_size, self.kv_size, self.kv_size], shard_names=("q", "k", "v"), **kwargs
        )
