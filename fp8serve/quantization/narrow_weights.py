"""A 16-bit (bf16 or fp16) checkpoint under float32 compute on CPU keeps its
weights at 16 bits.

Why: on CPUs without fast bf16 matmul `--dtype auto` computes in float32, and
upcasting the checkpoint at load doubled every byte a decode step reads. At
decode batches dense_gemv reads the 16-bit rows as they are (its float32 loop
with a shift (bf16) or an F16C conversion (fp16) more per element) at half
the bytes: the default model's (bf16) decode steps ran 1.35-1.54x as fast at
batch 1 with the same tokens on the AVX2-only Zen 3 EPYC
(benchmarks/results/narrow_weights_2026-12-02_zen3.md).

Nothing changes numerically: bf16 and fp16 convert to float32 exactly,
dense_gemv sums a 16-bit row in the same order as its float32 copy, and the
GEMMs above dense_gemv's rows (prefill, big decode batches) run on oneDNN's
packed float32 copy, which `onednn_linear.pack_weights` makes from the 16-bit
weight where it packs float32 weights at all (AMD CPUs). The exception: on
AMD CPUs without AVX-512, bf16 linears of 3 or more rows (decode batches and
prefills) run bf16_tiled_gemm on a packed bf16 copy (gemv_packing.py), faster
than oneDNN's float32 one there, which those layers then do not get;
its float32 sums run in another order, so those results equal the float32
weights' to float32 rounding, not bit for bit. Where there is no
packed copy, those GEMMs upcast the weight a slice of rows at a time per call
(exact, slower: `onednn_linear.linear`). The embedding and the LM head stay
16-bit too, as an FP8 checkpoint's do (`LMHead` handles a narrower weight);
without a packed copy the head runs dense_gemv on row slices up to 256 rows,
where the float32 head ran one GEMM: the same products summed in another
order there.

Applies only where every floating-point tensor of the checkpoint has the one
16-bit dtype (a config's `torch_dtype` is not trusted: rounding a float32
tensor would not be exact) and the C++ kernels are built.
FP8SERVE_16BIT_WEIGHTS=0 upcasts at load as before (auto and 1: where it
applies).
"""

from __future__ import annotations

from pathlib import Path

import torch

from fp8serve.kernels import cpu_ops
from fp8serve.quantization.base import LinearMethod, QuantizationConfig
from fp8serve.quantization.unquantized import UnquantizedLinearMethod
from fp8serve.utils.env_switch import env_switch

ENV = "FP8SERVE_16BIT_WEIGHTS"
# safetensors dtype names -> the storage dtype kept.
_KEPT = {"BF16": torch.bfloat16, "F16": torch.float16}


class NarrowWeightsConfig(QuantizationConfig):
    """Unquantized layers whose weights are stored in `weight_dtype` (bf16 or
    fp16) while activations are float32."""

    def __init__(self, weight_dtype: torch.dtype) -> None:
        if weight_dtype not in _KEPT.values():
            raise ValueError(f"weight_dtype must be bfloat16 or float16, got {weight_dtype}")
        self.weight_dtype = weight_dtype
        self.name = f"{str(weight_dtype).removeprefix('torch.')} (float32 compute)"

    def get_linear_method(self, prefix: str) -> LinearMethod:
        return UnquantizedLinearMethod(weight_dtype=self.weight_dtype)

    def is_quantized_checkpoint(self) -> bool:
        return False

    def vocab_weight_dtype(self, compute_dtype: torch.dtype, checkpoint_dtype: torch.dtype) -> torch.dtype:
        return self.weight_dtype


def select(model_dir: str | Path, compute_dtype: torch.dtype, device: torch.device) -> NarrowWeightsConfig | None:
    """The config for an unquantized checkpoint at `model_dir`, or None where
    its weights are stored in the compute dtype (see the module docstring)."""
    if env_switch(ENV) is False:
        return None
    if device.type != "cpu" or compute_dtype != torch.float32 or cpu_ops.load_cpu_ops() is None:
        return None
    from fp8serve.model_loader.loader import checkpoint_float_dtypes

    dtypes = checkpoint_float_dtypes(model_dir)
    kept = _KEPT.get(next(iter(dtypes))) if len(dtypes) == 1 else None
    if kept is None or cpu_ops.dense_gemv_max_rows(torch.float32, kept) == 0:
        return None
    return NarrowWeightsConfig(kept)
