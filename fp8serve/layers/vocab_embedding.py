"""Token embedding and the language-model head (optionally tied to it).

The weight may be stored narrower than the compute dtype (an FP8
checkpoint's 16-bit head under float32 compute, see
`QuantizationConfig.vocab_weight_dtype`): the embedding converts the rows it
reads, and the head multiplies in the compute dtype without materializing a
full-width copy of the weight."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fp8serve.kernels import amx_linear_ops, cpu_ops, gemv_packing, onednn_linear, screened_argmax

# Up to this many activation rows, a narrower head runs dense_gemv on slices
# of the rows (each reading the bf16 weight as it is) instead of upcasting
# slices of the vocabulary for F.linear. The default model's FP8 checkpoint
# (a 49152 x 576 bf16 head, float32 activations, cold, AVX2-only Zen 3 EPYC):
# 1.4-2.7x as fast at 64-256 rows, even at 512
# (benchmarks/results/lm_head_2026-12-02_zen3.md).
_GEMV_SLICES_MAX_ROWS = 256


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 weight_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dtype = dtype
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=weight_dtype or dtype),
                                   requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(input_ids, self.weight)
        return rows if rows.dtype == self.dtype else rows.to(self.dtype)


class LMHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tied_to: VocabEmbedding | None = None,
                 weight_dtype: torch.dtype | None = None):
        super().__init__()
        if tied_to is not None:
            # Same Parameter object: the checkpoint's embedding fills both.
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=weight_dtype or dtype),
                                       requires_grad=False)
        # oneDNN's and dense_gemv's packed copies of the weight (see MergedLinear).
        self.register_buffer("weight_packed", None, persistent=False)
        self.register_buffer("weight_gemv_packed", None, persistent=False)
        # The int8 screen of the exact greedy head (kernels/screened_argmax.py),
        # set by the model runner where it serves.
        self.greedy_screen: screened_argmax.GreedyScreen | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Logits in float32 whatever the compute dtype: sampling and logprobs
        # need the precision.
        if amx_linear_ops.applies(hidden_states, self.weight):
            return amx_linear_ops.amx_linear(hidden_states, self.weight, float_out=True)
        if cpu_ops.dense_gemv_packed_applies(hidden_states, self.weight_gemv_packed, cpu_ops.LM_HEAD_PACKED_MIN_ROWS):
            return cpu_ops.dense_gemv_packed(hidden_states, self.weight_gemv_packed, self.weight.shape[0],
                                             float_out=True)
        if cpu_ops.bf16_tiled_gemm_applies(hidden_states, self.weight_gemv_packed, self.weight_packed):
            # A bf16 head under float32 compute (gemv_packing.py; rows: cpu_ops.bf16_tiled_gemm_rows).
            return cpu_ops.bf16_tiled_gemm(hidden_states, self.weight_gemv_packed, self.weight.shape[0])
        if cpu_ops.dense_gemv_applies(hidden_states, self.weight):
            return cpu_ops.dense_gemv(hidden_states, self.weight).float()
        if self.weight.dtype == hidden_states.dtype or (self.weight_packed is not None
                                                        and self.weight_packed.dtype == hidden_states.dtype):
            # (A 16-bit head has a float32 packed copy where the engine keeps a
            # 16-bit checkpoint's weights at 16 bits, quantization/narrow_weights.py,
            # and gave it no bf16 copy for bf16_tiled_gemm.)
            return onednn_linear.linear(hidden_states, self.weight, packed=self.weight_packed).float()
        # A narrower stored weight (a bf16 head, float32 activations), more
        # rows than one dense_gemv call takes: slices of the rows through it,
        # or, for many rows, upcast a slice of the vocabulary at a time
        # (exact, onednn_linear.linear), never the whole table.
        rows = cpu_ops.dense_gemv_max_rows(hidden_states.dtype, self.weight.dtype)
        if rows and hidden_states.shape[0] <= _GEMV_SLICES_MAX_ROWS and cpu_ops.dense_gemv_applies(
                hidden_states[:rows], self.weight):
            return torch.cat([cpu_ops.dense_gemv(hidden_states[i:i + rows], self.weight).float()
                              for i in range(0, hidden_states.shape[0], rows)])
        return onednn_linear.linear(hidden_states, self.weight).float()

    def logits_of_rows(self, hidden_states: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """For the screen: a function giving `forward`'s logits of some
        vocabulary rows, bit for bit (the path `forward` takes for these
        activations, on those rows alone), or None where that path is not one
        whose arithmetic per row is independent of the other rows."""
        if amx_linear_ops.applies(hidden_states, self.weight):
            return None
        if cpu_ops.dense_gemv_packed_applies(hidden_states, self.weight_gemv_packed, cpu_ops.LM_HEAD_PACKED_MIN_ROWS):
            # Each output lane of the packed kernel sums its own row along k in
            # one fixed order: packing the gathered rows gives the same sums.
            return lambda rows: cpu_ops.dense_gemv_packed(
                hidden_states, gemv_packing.pack_gemv_weight(self.weight.index_select(0, rows), huge_pages=False),
                rows.numel(), float_out=True)
        if cpu_ops.bf16_tiled_gemm_applies(hidden_states, self.weight_gemv_packed, self.weight_packed):
            # Likewise: each output sums its own weight row along k in one order.
            return lambda rows: cpu_ops.bf16_tiled_gemm(
                hidden_states, gemv_packing.pack_gemv_weight(self.weight.index_select(0, rows), huge_pages=False),
                rows.numel())
        if cpu_ops.dense_gemv_applies(hidden_states, self.weight):
            return lambda rows: cpu_ops.dense_gemv(hidden_states, self.weight.index_select(0, rows)).float()
        return None

    def greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """int64 [num_rows]: the token greedy sampling of `forward`'s logits
        picks for each row (first index of the largest), found through the
        screen without computing every logit; None where the screen does not
        serve this call (no screen, other rows or dtypes, a path whose logits
        of a few rows cannot be had alone, non-finite activations): compute
        the logits then."""
        if (self.greedy_screen is None or hidden_states.dim() != 2
                or not 1 <= hidden_states.shape[0] <= screened_argmax.engine_rows(self.weight.dtype,
                                                                                  hidden_states.dtype)):
            return None
        candidate_logits = self.logits_of_rows(hidden_states)
        if candidate_logits is None:
            return None
        return screened_argmax.greedy_tokens(hidden_states, self.weight, self.greedy_screen, candidate_logits)
