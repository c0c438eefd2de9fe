"""Reference attention backend in plain PyTorch (CPU and CUDA).

Each step gathers every sequence's context from the paged cache into a padded
`[num_seqs, max_seq_len, num_kv_heads, head_size]` tensor (one index_select
per layer with indices built once per step), dequantizes it, and runs
`scaled_dot_product_attention` with a causal-and-length mask.

FP8 scales are folded: q is multiplied by k_scale and the output by v_scale,
so the cached codes are decoded with scale 1.0 and no per-element multiply.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fp8serve.attention.backends.base import AttentionBackend
from fp8serve.attention.metadata import AttentionMetadata
from fp8serve.quantization.fp8 import dequantize_fp8, quantize_fp8


@dataclass
class _StepData:
    gather_slots: torch.Tensor  # [num_seqs * max_seq_len] slot of each padded key position
    attn_mask: torch.Tensor  # [num_seqs, 1, max_query_len, max_seq_len] bool, True = attend
    pad_index: torch.Tensor | None  # [num_tokens] row of each token in [num_seqs * max_query_len]


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"

    def build_metadata(self, md: AttentionMetadata) -> None:
        device = md.slot_mapping.device
        bs = self.spec.block_size
        pos = torch.arange(md.max_seq_len, device=device)
        key_valid = pos[None, :] < md.seq_lens[:, None]
        gather_slots = md.block_tables[:, pos // bs] * bs + pos % bs  # [num_seqs, max_seq_len]
        # Positions past a sequence's length read the zeroed null block.
        gather_slots = torch.where(key_valid, gather_slots, md.null_block_id * bs)
        if md.is_decode_only:
            mask = key_valid[:, None, None, :]
            pad_index = None
        else:
            q_lens = md.query_start_loc[1:] - md.query_start_loc[:-1]
            i = torch.arange(md.max_query_len, device=device)
            q_pos = (md.seq_lens - q_lens)[:, None] + i[None, :]  # absolute position of each query row
            mask = key_valid[:, None, :] & (pos[None, None, :] <= q_pos[:, :, None])
            # Padded query rows would have no key to attend to (softmax of all
            # -inf is NaN); let them see key 0 and drop their output.
            row_valid = i[None, :] < q_lens[:, None]
            mask[:, :, 0] |= ~row_valid
            mask = mask[:, None]
            seq_of_token = torch.repeat_interleave(torch.arange(md.num_seqs, device=device), q_lens)
            pad_index = seq_of_token * md.max_query_len + (
                torch.arange(md.num_tokens, device=device) - md.query_start_loc[seq_of_token]
            )
        md.backend_data = _StepData(gather_slots.reshape(-1), mask, pad_index)

    def _store(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        fmt = self.spec.fp8
        if fmt is not None:
            return quantize_fp8(x, scale, fmt)
        return x.to(self.spec.storage_dtype)

    def _load(self, codes: torch.Tensor) -> torch.Tensor:
        fmt = self.spec.fp8
        if fmt is not None:
            return dequantize_fp8(codes, 1.0, fmt, self.compute_dtype)
        return codes.to(self.compute_dtype)

    def forward(self, query, key, value, kv_cache, metadata, *, softmax_scale, k_scale, v_scale):
        md = metadata
        step: _StepData = md.backend_data
        num_kv_heads, head_size = key.shape[1], key.shape[2]
        k_cache = kv_cache[0].view(-1, num_kv_heads, head_size)
        v_cache = kv_cache[1].view(-1, num_kv_heads, head_size)
        k_cache.index_copy_(0, md.slot_mapping, self._store(key, k_scale))
        v_cache.index_copy_(0, md.slot_mapping, self._store(value, v_scale))

        # [num_seqs, num_kv_heads, max_seq_len, head_size]
        k = self._load(k_cache.index_select(0, step.gather_slots))
        v = self._load(v_cache.index_select(0, step.gather_slots))
        k = k.view(md.num_seqs, md.max_seq_len, num_kv_heads, head_size).transpose(1, 2)
        v = v.view(md.num_seqs, md.max_seq_len, num_kv_heads, head_size).transpose(1, 2)

        num_heads = query.shape[1]
        q = query if k_scale == 1.0 else query * k_scale
        if step.pad_index is None:
            q = q.view(md.num_seqs, 1, num_heads, head_size)
        else:
            padded = q.new_zeros(md.num_seqs * md.max_query_len, num_heads, head_size)
            padded.index_copy_(0, step.pad_index, q)
            q = padded.view(md.num_seqs, md.max_query_len, num_heads, head_size)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=step.attn_mask, scale=softmax_scale, enable_gqa=True
        )  # [num_seqs, num_heads, max_query_len, head_size]
        out = out.transpose(1, 2).reshape(-1, num_heads, head_size)
        if step.pad_index is not None:
            out = out.index_select(0, step.pad_index)
        if v_scale != 1.0:
            out = out * v_scale
        return out
