"""Mixtral: Llama attention with a top-2 sparse MoE in place of the MLP."""

from __future__ import annotations

from fp8serve.config import ModelArchConfig
from fp8serve.layers.moe import SparseMoE
from fp8serve.model_loader.weights_mapper import MappingRule, WeightsMapper
from fp8serve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class MixtralForCausalLM(LlamaForCausalLM):
    # Routing picks experts in Python from the gate's values: a recorded
    # forward would replay the experts of the step it was recorded on.
    supports_decode_capture = False

    def _build_model(self, cfg: ModelArchConfig, quant_config, dtype) -> LlamaModel:
        def make_layer(i: int, rotary_emb) -> LlamaDecoderLayer:
            prefix = f"model.layers.{i}"
            moe = SparseMoE(
                cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok,
                quant_config, f"{prefix}.mlp", dtype,
            )
            return LlamaDecoderLayer(cfg, quant_config, prefix, dtype, rotary_emb, mlp=moe)

        return LlamaModel(cfg, quant_config, dtype, layer_factory=make_layer)

    @classmethod
    def weights_mapper(cls, cfg: ModelArchConfig) -> WeightsMapper:
        base = LlamaForCausalLM.weights_mapper(cfg)
        # Checkpoint experts are `block_sparse_moe.experts.E.w1|w3|w2`; ours
        # fuse w1 (gate) and w3 (up) and live under `mlp`.
        rules = [r for r in base.rules if not r.checkpoint.startswith("mlp.")] + [
            MappingRule("block_sparse_moe.gate", ("mlp.gate",)),
            MappingRule("block_sparse_moe.experts.*.w1", ("mlp.experts.*.gate_up_proj",), 0),
            MappingRule("block_sparse_moe.experts.*.w3", ("mlp.experts.*.gate_up_proj",), 1),
            MappingRule("block_sparse_moe.experts.*.w2", ("mlp.experts.*.down_proj",)),
        ]
        return WeightsMapper(rules, ignored=base.ignored)
