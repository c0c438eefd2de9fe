"""A bf16 checkpoint under float32 compute on CPU keeps its weights in bf16.

Why: on CPUs without fast bf16 matmul `--dtype auto` computes in float32, and
upcasting the checkpoint at load doubled every byte a decode step reads. At
decode batches dense_gemv reads the bf16 rows as they are (its float32 loop
with one shift more per element) at half the bytes; the default model's
batch-1 decode step ran 1.5-1.6x as fast with the same tokens on the
AVX2-only Zen 3 EPYC (benchmarks/results/bf16_weights_2026-12-02_zen3.md).

Nothing changes numerically: bf16 -> float32 is exact, dense_gemv sums a bf16
row in the same order as its float32 copy, and the GEMMs above dense_gemv's
rows (prefill, big decode batches) run on oneDNN's packed float32 copy, which
`onednn_linear.pack_weights` makes from the bf16 weight where it packs
float32 weights at all (AMD CPUs). Where there is no packed copy, those GEMMs
upcast the weight a slice of rows at a time per call (exact, slower:
`onednn_linear.linear`). The embedding and the LM head stay bf16 too, as an
FP8 checkpoint's do (`LMHead` handles a narrower weight); without a packed
copy the head runs dense_gemv on row slices up to 256 rows, where the float32
head ran one GEMM: the same products summed in another order there.

Applies only where every floating-point tensor of the checkpoint is bf16 (a
config's `torch_dtype` is not trusted: rounding a float32 tensor would not be
exact) and the C++ kernels are built. FP8SERVE_BF16_WEIGHTS=0 upcasts at load
as before (auto and 1: where it applies).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from fp8serve.kernels import cpu_ops
from fp8serve.quantization.base import LinearMethod, QuantizationConfig
from fp8serve.quantization.unquantized import UnquantizedLinearMethod
from fp8serve.utils.env_switch import env_switch

logger = logging.getLogger(__name__)

ENV = "FP8SERVE_BF16_WEIGHTS"


class Bf16WeightsConfig(QuantizationConfig):
    """Unquantized layers whose weights are stored in bf16 while activations
    are float32."""

    name = "bfloat16 (float32 compute)"

    def get_linear_method(self, prefix: str) -> LinearMethod:
        return UnquantizedLinearMethod(weight_dtype=torch.bfloat16)

    def is_quantized_checkpoint(self) -> bool:
        return False

    def vocab_weight_dtype(self, compute_dtype: torch.dtype, checkpoint_dtype: torch.dtype) -> torch.dtype:
        return torch.bfloat16


def select(model_dir: str | Path, compute_dtype: torch.dtype, device: torch.device) -> Bf16WeightsConfig | None:
    """The config for an unquantized checkpoint at `model_dir`, or None where
    its weights are stored in the compute dtype (see the module docstring)."""
    if env_switch(ENV) is False:
        return None
    if device.type != "cpu" or compute_dtype != torch.float32:
        return None
    if cpu_ops.load_cpu_ops() is None or cpu_ops.dense_gemv_max_rows(torch.float32, torch.bfloat16) == 0:
        return None
    from fp8serve.model_loader.loader import checkpoint_float_dtypes

    if checkpoint_float_dtypes(model_dir) != {"BF16"}:
        return None
    return Bf16WeightsConfig()
