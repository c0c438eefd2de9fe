"""Token embedding and the language-model head (optionally tied to it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fp8serve.kernels import cpu_ops


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tied_to: VocabEmbedding | None = None):
        super().__init__()
        if tied_to is not None:
            # Same Parameter object: the checkpoint's embedding fills both.
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Logits in float32 whatever the compute dtype: sampling and logprobs
        # need the precision.
        if cpu_ops.dense_gemv_applies(hidden_states, self.weight):
            return cpu_ops.dense_gemv(hidden_states, self.weight).float()
        return F.linear(hidden_states, self.weight).float()
