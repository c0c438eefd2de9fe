"""Top-k mixture of experts (Mixtral), each expert a gated MLP built from the
same linear layers as the dense model, so quantization applies per expert."""

from __future__ import annotations

import torch
from torch import nn

from fp8serve.layers.activation import SiluAndMul
from fp8serve.layers.linear import Linear, MergedLinear
from fp8serve.quantization.base import QuantizationConfig


class Expert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, quant_config, prefix: str, dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(
            hidden_size, [intermediate_size] * 2, quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj", params_dtype=dtype,
        )
        self.down_proj = Linear(
            intermediate_size, hidden_size, quant_config=quant_config, prefix=f"{prefix}.down_proj", params_dtype=dtype
        )
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act.of_projection(self.gate_up_proj, x))


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        quant_config: QuantizationConfig | None,
        prefix: str,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = Linear(hidden_size, num_experts, quant_config=quant_config, prefix=f"{prefix}.gate", params_dtype=dtype)
        self.experts = nn.ModuleList(
            Expert(hidden_size, intermediate_size, quant_config, f"{prefix}.experts.{e}", dtype) for e in range(num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden_size]
        router_logits = self.gate(x)
        weights = torch.softmax(router_logits.float(), dim=-1)
        topk_weights, topk_ids = torch.topk(weights, self.top_k, dim=-1)  # [num_tokens, top_k]
        topk_weights = (topk_weights / topk_weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        # One pass per expert over the tokens routed to it (not per token).
        for e, expert in enumerate(self.experts):
            token_ids, slot = torch.nonzero(topk_ids == e, as_tuple=True)
            if token_ids.numel() == 0:
                continue
            y = expert(x.index_select(0, token_ids)) * topk_weights[token_ids, slot].unsqueeze(-1)
            out.index_add_(0, token_ids, y)
        return out
