"""`--quantization fp8` on a 16/32-bit checkpoint: FP8 weights made at load.

vLLM's dynamic FP8 (`vllm serve <model> --quantization fp8`): the checkpoint's
linear projections are loaded, then each is quantized to float8_e4m3fn with a
per-tensor scale (amax / 448), and the layer runs as an FP8 checkpoint's does
(`Fp8LinearMethod`: on CPU one byte per weight through the FP8 kernels, the
fastest decode path; see benchmarks/results/). Activations are not quantized.

Scales are taken per checkpoint tensor (q, k and v apart; gate and up apart),
where vLLM takes one per fused matmul: what `fp8serve quantize` writes, so a
model quantized here runs exactly as the checkpoint that tool makes of it
(tests compare the two), and a small projection is not scaled by its larger
neighbour's amax. The embedding, LM head and MoE router stay unquantized, as
in vLLM and AutoFP8.

Loading keeps each projection at the checkpoint's own width until it is
quantized (its bytes are what the quantizer sees), so peak memory is the
16-bit model, not a float32 copy of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from fp8serve.errors import ConfigError
from fp8serve.quantization.base import LinearMethod, QuantizationConfig, set_weight_loader
from fp8serve.quantization.fp8_linear import Fp8LinearMethod, fp8_checkpoint_vocab_dtype
from fp8serve.quantization.loaders import load_output_shard
from fp8serve.quantization.unquantized import UnquantizedLinearMethod

# safetensors dtype names -> the dtype a projection is held in until quantized.
_CHECKPOINT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def checkpoint_weight_dtype(model_dir: str | Path) -> torch.dtype:
    """The checkpoint's one float dtype, or float32 (exact for all of them) when it mixes several."""
    from fp8serve.model_loader.loader import checkpoint_float_dtypes

    dtypes = checkpoint_float_dtypes(model_dir)
    return _CHECKPOINT_DTYPES.get(next(iter(dtypes)), torch.float32) if len(dtypes) == 1 else torch.float32


class Fp8OnlineConfig(QuantizationConfig):
    name = "fp8 (quantized at load)"
    activation_scheme = "dynamic"

    def __init__(self, weight_dtype: torch.dtype, checkpoint_modules: Callable[[str], list[str]] | None = None) -> None:
        self.weight_dtype = weight_dtype
        self.checkpoint_modules = checkpoint_modules or (lambda module: [module])
        self._warned_cpu = False  # read by Fp8LinearMethod (static input scales; none here)
        self._warned_dequantized = False  # read by Fp8LinearMethod

    def is_quantized_checkpoint(self) -> bool:
        return False

    def vocab_weight_dtype(self, compute_dtype: torch.dtype, checkpoint_dtype: torch.dtype) -> torch.dtype:
        return fp8_checkpoint_vocab_dtype(compute_dtype, checkpoint_dtype)

    def get_linear_method(self, prefix: str) -> LinearMethod:
        # The router's argmax flips on small errors and it is tiny: kept as AutoFP8 and vLLM keep it.
        if any(m.endswith(("lm_head", "block_sparse_moe.gate")) for m in self.checkpoint_modules(prefix)):
            return UnquantizedLinearMethod()
        return Fp8OnlineLinearMethod(self)


class Fp8OnlineLinearMethod(Fp8LinearMethod):
    """Loads the checkpoint's projection as it is, then quantizes each shard
    per tensor and hands the codes and scales to Fp8LinearMethod."""

    def __init__(self, config: Fp8OnlineConfig) -> None:
        super().__init__(config, weight_strategy="tensor", activation_scheme="dynamic")

    def create_weights(self, layer, input_size, output_sizes, params_dtype) -> None:
        layer.compute_dtype = params_dtype
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=self.config.weight_dtype),
                              requires_grad=False)
        layer.register_parameter("weight", set_weight_loader(weight, load_output_shard(layer)))
        layer.input_scale = None

    def _checkpoint_name(self, layer, index: int) -> str:
        """Shard `index` of `layer` as the checkpoint names it (qkv_proj shard 1 -> ...k_proj.weight), for
        errors; the fused name and the shard where the mapping does not give one tensor per shard."""
        prefix = getattr(layer, "prefix", "linear")
        modules = self.config.checkpoint_modules(prefix)
        if len(modules) == len(layer.output_sizes):
            return f"{modules[index]}.weight"
        names = getattr(layer, "shard_names", None)
        which = f" (shard {names[index] if names else index})" if len(layer.output_sizes) > 1 else ""
        return f"{prefix}.weight{which}"

    def process_weights_after_loading(self, layer) -> None:
        from fp8serve.calibration.fp8_checkpoint import quantize_weight

        w = layer.weight.data
        codes, scales = [], []
        offset = 0
        for index, size in enumerate(layer.output_sizes):
            shard = w[offset:offset + size]
            amax = float(shard.abs().amax().float()) if shard.numel() else 0.0
            if not math.isfinite(amax):
                raise ConfigError(f"--quantization fp8: checkpoint tensor '{self._checkpoint_name(layer, index)}' "
                                  "holds NaN or infinite values; it cannot be quantized (the checkpoint is damaged)")
            c, s = quantize_weight(shard, "tensor")
            codes.append(c)
            scales.append(s.reshape(()))
            offset += size
        # The checkpoint-width weight is dropped here: the model's peak is that weight plus one layer's codes.
        layer.weight = nn.Parameter(torch.cat(codes), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.stack(scales), requires_grad=False)
        super().process_weights_after_loading(layer)
