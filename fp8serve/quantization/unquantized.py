"""Plain 16/32-bit linear layers."""

from __future__ import annotations

import torch
from torch import nn

from fp8serve.kernels import amx_linear_ops, cpu_ops, gemv_packing, onednn_linear
from fp8serve.quantization.base import LinearMethod, set_weight_loader
from fp8serve.quantization.loaders import load_output_shard


class UnquantizedLinearMethod(LinearMethod):
    def __init__(self, weight_dtype: torch.dtype | None = None) -> None:
        # The weight's storage dtype where it differs from the activations'
        # (16-bit under float32 compute: see narrow_weights.py); None: theirs.
        self.weight_dtype = weight_dtype

    def create_weights(self, layer, input_size, output_sizes, params_dtype) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=self.weight_dtype or params_dtype),
                              requires_grad=False)
        layer.register_parameter("weight", set_weight_loader(weight, load_output_shard(layer)))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if amx_linear_ops.applies(x, layer.weight, layer.weight_packed):
            # Decode at batch 8-64, bf16 on AMX (8-32 where oneDNN has a packed copy: faster past 32).
            return amx_linear_ops.amx_linear(x, layer.weight, bias)
        if cpu_ops.dense_gemv_packed_applies(x, layer.weight_gemv_packed):
            # bf16 decode at batch 13-256 on the packed copy, where the engine made one (gemv_packing.py).
            return cpu_ops.dense_gemv_packed(x, layer.weight_gemv_packed, layer.weight.shape[0], bias)
        if cpu_ops.bf16_tiled_gemm_applies(x, layer.weight_gemv_packed, layer.weight_packed):
            # float32 x on a bf16 weight's packed copy (gemv_packing.py): every batch of 3 or more rows
            # (decode batches, prefills) where the layer has no float32 copy for oneDNN (AVX2 AMD CPUs),
            # decode batches (gemv_packing.float32_rows_beside_onednn) where it has one (AVX-512).
            return cpu_ops.bf16_tiled_gemm(x, layer.weight_gemv_packed, layer.weight.shape[0], bias)
        if cpu_ops.dense_gemv_applies(x, layer.weight):
            return cpu_ops.dense_gemv(x, layer.weight, bias)  # decode at small batch: memory-bound GEMV
        # F.linear, or oneDNN where that is faster (on the packed weight where the layer has one;
        # a narrower weight without one is upcast a slice at a time).
        return onednn_linear.linear(x, layer.weight, bias, packed=layer.weight_packed)

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        # Where `apply` would run bf16_tiled_gemm or dense_gemv_packed: their gated forms, which apply
        # SiLU-and-mul to each tile as it leaves the registers instead of writing the [rows, 2d]
        # projection for the activation to read back (the same bits: dense_gemv_packed's always,
        # bf16_tiled_gemm's on AVX2 builds).
        if amx_linear_ops.applies(x, layer.weight, layer.weight_packed):
            return None
        if cpu_ops.dense_gemv_packed_applies(x, layer.weight_gemv_packed):
            n = layer.weight.shape[0]
            if n % 32 != 0:  # the gate's and the up's rows must be whole blocks of 16
                return None
            return cpu_ops.dense_gemv_packed_silu_and_mul(x, layer.weight_gemv_packed, n, bias)
        if cpu_ops.bf16_tiled_gemm_applies(x, layer.weight_gemv_packed, layer.weight_packed):
            return cpu_ops.bf16_tiled_gemm_silu_and_mul(x, layer.weight_gemv_packed, layer.weight.shape[0], bias)
        return None

    def row_breakpoints(self, layer: nn.Module, x_dtype: torch.dtype) -> tuple[int, ...]:
        # Every row bound `apply` consults, whether or not its kernel serves this layer.
        gemv_rows = cpu_ops.dense_gemv_max_rows(x_dtype, layer.weight.dtype)
        beside_onednn = gemv_packing.float32_rows_beside_onednn()
        return (1, gemv_rows + 1, amx_linear_ops.MIN_ROWS, amx_linear_ops.MAX_ROWS + 1,
                amx_linear_ops.MAX_ROWS_WITH_PACKED + 1,
                cpu_ops.GEMV_PACKED_MIN_ROWS, cpu_ops.GEMV_PACKED_MAX_ROWS + 1,
                cpu_ops.BF16_TILED_GEMM_MIN_ROWS, beside_onednn[0], beside_onednn[1] + 1,
                onednn_linear.AMX_BF16_PACKED_MAX_ROWS + 1)
