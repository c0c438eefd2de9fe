"""Choose the quantization strategy from a checkpoint's `quantization_config`."""

from __future__ import annotations

from collections.abc import Callable

from fp8serve.errors import ConfigError
from fp8serve.quantization.base import QuantizationConfig


# `--quantization` values (vLLM's flag): weights quantized at load.
QUANTIZATION_METHODS = ("fp8",)


def get_quantization_config(hf_quant_config: dict | None, model_dir: str,
                            checkpoint_modules: Callable[[str], list[str]] | None = None,
                            quantization: str | None = None) -> QuantizationConfig | None:
    """None for a 16/32-bit checkpoint (or one whose only quantization is the
    KV cache, like compressed-tensors with just a `kv_cache_scheme`) unless
    `quantization` ("fp8", vLLM's --quantization) asks for its weights to be
    quantized at load. A checkpoint with FP8 weights already (every scheme
    read here is FP8) is read as it is.
    `checkpoint_modules`: the model's checkpoint modules of one of its layers
    (WeightsMapper.checkpoint_modules), for configs that name checkpoint modules.
    `quantization` is checked by ModelConfig, which leaves it set only for a
    checkpoint without a quantization_config (config.check_quantization_flag)."""
    config = _from_checkpoint(hf_quant_config, model_dir, checkpoint_modules)
    if config is None and quantization == "fp8":
        from fp8serve.quantization.fp8_online import Fp8OnlineConfig, checkpoint_weight_dtype

        return Fp8OnlineConfig(checkpoint_weight_dtype(model_dir), checkpoint_modules)
    return config


def _from_checkpoint(hf_quant_config: dict | None, model_dir: str,
                     checkpoint_modules: Callable[[str], list[str]] | None) -> QuantizationConfig | None:
    if not hf_quant_config:
        return None
    where = f"{model_dir}/config.json: quantization_config"
    if not isinstance(hf_quant_config, dict):
        raise ConfigError(f"{where} must be a JSON object")
    method = hf_quant_config.get("quant_method")
    if method == "fp8":
        from fp8serve.quantization.fp8_linear import Fp8Config

        return Fp8Config.from_hf(hf_quant_config, where, checkpoint_modules)
    if method == "compressed-tensors":
        if not hf_quant_config.get("config_groups"):
            return None
        from fp8serve.quantization.compressed_tensors import CompressedTensorsConfig

        return CompressedTensorsConfig.from_hf(hf_quant_config, where, checkpoint_modules)
    raise ConfigError(f"{where}.quant_method '{method}' is not supported (supported: fp8, compressed-tensors)")
