"""Llama (and Llama-architecture models such as SmolLM2): composition only."""

from __future__ import annotations

import torch
from torch import nn

from fp8serve.config import ModelArchConfig
from fp8serve.layers.activation import SiluAndMul
from fp8serve.layers.attention import Attention
from fp8serve.layers.layernorm import RMSNorm
from fp8serve.layers.linear import Linear, MergedLinear, QKVLinear
from fp8serve.layers.rotary import RotaryEmbedding
from fp8serve.layers.vocab_embedding import LMHead, VocabEmbedding
from fp8serve.model_loader.weights_mapper import MappingRule, WeightsMapper, kv_scale_rules
from fp8serve.quantization.base import QuantizationConfig, vocab_weight_dtype


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg: ModelArchConfig, quant_config: QuantizationConfig | None, prefix: str, dtype,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVLinear(
            cfg.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads,
            quant_config=quant_config, prefix=f"{prefix}.qkv_proj", params_dtype=dtype,
        )
        self.o_proj = Linear(
            self.num_heads * self.head_dim, cfg.hidden_size,
            quant_config=quant_config, prefix=f"{prefix}.o_proj", params_dtype=dtype,
        )
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, prefix=f"{prefix}.attn"
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        n = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).split(
            [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1
        )
        q, k = self.rotary_emb(
            positions, q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim)
        )
        out = self.attn(q.reshape(n, -1), k.reshape(n, -1), v, logits_indices)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig, quant_config: QuantizationConfig | None, prefix: str, dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2,
            quant_config=quant_config, prefix=f"{prefix}.gate_up_proj", params_dtype=dtype,
        )
        self.down_proj = Linear(
            cfg.intermediate_size, cfg.hidden_size,
            quant_config=quant_config, prefix=f"{prefix}.down_proj", params_dtype=dtype,
        )
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act.of_projection(self.gate_up_proj, x))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelArchConfig, quant_config, prefix: str, dtype, rotary_emb: RotaryEmbedding,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, quant_config, f"{prefix}.self_attn", dtype, rotary_emb)
        self.mlp = mlp if mlp is not None else LlamaMLP(cfg, quant_config, f"{prefix}.mlp", dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
        logits_indices: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`logits_indices`: None, or the rows to go on with after attention
        (every token's K/V is still written): the last layer's, when only
        those rows reach the LM head."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, logits_indices)
        if logits_indices is not None:
            residual = residual.index_select(0, logits_indices)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelArchConfig, quant_config, dtype, layer_factory=None) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype,
                                           vocab_weight_dtype(quant_config, dtype, cfg.checkpoint_dtype))
        # One table for all layers (they share head_dim and RoPE settings).
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope, dtype)
        make_layer = layer_factory or (
            lambda i, rope: LlamaDecoderLayer(cfg, quant_config, f"model.layers.{i}", dtype, rope)
        )
        self.layers = nn.ModuleList(make_layer(i, rotary) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        return self.forward_head(positions, *self.forward_trunk(input_ids, positions), logits_indices)

    def forward_trunk(self, input_ids: torch.Tensor,
                      positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every layer but the last: (hidden_states, residual) of every token."""
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers[:-1]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        return hidden_states, residual

    def forward_head(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                     logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """The last layer and the final norm: the final hidden states of every
        token, or of the rows `logits_indices` only. Why those alone: past the
        last layer's attention (which still writes every token's K/V), rows
        are independent, and a prefill samples from each sequence's last
        token only: a 512-token prompt then skips 511 rows of the last
        layer's attention, o_proj and MLP (the llama.cpp trick)."""
        hidden_states, residual = self.layers[-1](positions, hidden_states, residual, logits_indices)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # The decode forward has no data-dependent Python, so a recorded one can
    # be replayed (engine/decode_capture.py).
    supports_decode_capture = True

    def __init__(self, cfg: ModelArchConfig, quant_config: QuantizationConfig | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.model = self._build_model(cfg, quant_config, dtype)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype, tied_to=tied,
                              weight_dtype=vocab_weight_dtype(quant_config, dtype, cfg.checkpoint_dtype))

    def _build_model(self, cfg, quant_config, dtype) -> nn.Module:
        return LlamaModel(cfg, quant_config, dtype)

    @classmethod
    def weights_mapper(cls, cfg: ModelArchConfig) -> WeightsMapper:
        rules = kv_scale_rules() + [
            MappingRule("self_attn.q_proj", ("self_attn.qkv_proj",), "q"),
            MappingRule("self_attn.k_proj", ("self_attn.qkv_proj",), "k"),
            MappingRule("self_attn.v_proj", ("self_attn.qkv_proj",), "v"),
            MappingRule("mlp.gate_proj", ("mlp.gate_up_proj",), 0),
            MappingRule("mlp.up_proj", ("mlp.gate_up_proj",), 1),
        ]
        # `self_attn.q_scale`: llm-compressor's FP8 attention quantizes queries too; here queries
        # stay in the compute dtype (as activations do on CPU), so the scale has no use.
        ignored = ("rotary_emb.inv_freq", "self_attn.q_scale") + (("lm_head",) if cfg.tie_word_embeddings else ())
        return WeightsMapper(rules, ignored=ignored)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of every token, or of the rows `logits_indices`
        only: each sequence's last token this step, the rows a prefill
        samples from (attention backends rely on it: see
        AttentionBackend.forward)."""
        return self.model(input_ids, positions, logits_indices)

    # The same forward in two parts, for recorded prefill forwards
    # (engine/prefill_capture.py): the trunk's ops depend on the token count
    # only, the head's on the number of sequences too.
    def forward_trunk(self, input_ids: torch.Tensor,
                      positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.model.forward_trunk(input_ids, positions)

    def forward_head(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                     logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.forward_head(positions, hidden_states, residual, logits_indices)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def compute_greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The argmax of compute_logits' rows without all of them, or None (see LMHead.greedy_tokens)."""
        return self.lm_head.greedy_tokens(hidden_states)
