"""Architecture name (config.json `architectures`) -> model class."""

from __future__ import annotations

from torch import nn

from fp8serve.config import ModelArchConfig
from fp8serve.models.llama import LlamaForCausalLM
from fp8serve.models.mixtral import MixtralForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def get_model_class(arch: ModelArchConfig) -> type[LlamaForCausalLM]:
    return _MODELS[arch.architecture]
