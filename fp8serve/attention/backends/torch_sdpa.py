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
from fp8serve.attention.kv_cache_spec import read_slots, write_slots
from fp8serve.attention.metadata import AttentionMetadata
from fp8serve.quantization.fp8 import dequantize_fp8, quantize_fp8


@dataclass
class _StepData:
    # Both None for a fresh prefill (causal attention over the new K/V).
    gather_slots: torch.Tensor | None  # [num_seqs * max_seq_len] slot of each padded key position
    attn_mask: torch.Tensor | None  # [num_seqs, 1, max_query_len, max_seq_len] bool, True = attend
    pad_index: torch.Tensor | None  # [num_tokens] row of each token in [num_seqs * max_query_len]
    # Every sequence has max_query_len new tokens: padding is a view, not a copy.
    uniform: bool = False


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"

    def _fresh_prefill(self, md: AttentionMetadata) -> bool:
        """A prefill with no cached context attends to its own K/V with a
        plain causal mask: no gather, no mask tensor. Where the cache round
        trip is lossy (FP8, narrower storage) it attends to the stored
        values read back (`write_kv_cache(..., return_decoded=True)`), so
        prefill still sees exactly what decode will read."""
        return (
            not md.is_decode_only
            and md.max_seq_len == md.max_query_len
            and bool((md.seq_lens == md.query_start_loc[1:] - md.query_start_loc[:-1]).all())
        )

    def build_metadata(self, md: AttentionMetadata) -> None:
        device = md.slot_mapping.device
        bs = self.spec.block_size
        pad_index = None
        if not md.is_decode_only:
            q_lens = md.query_start_loc[1:] - md.query_start_loc[:-1]
            seq_of_token = torch.repeat_interleave(torch.arange(md.num_seqs, device=device), q_lens)
            pad_index = seq_of_token * md.max_query_len + (
                torch.arange(md.num_tokens, device=device) - md.query_start_loc[seq_of_token]
            )
        if self._fresh_prefill(md):
            uniform = md.num_tokens == md.num_seqs * md.max_query_len
            md.backend_data = _StepData(None, None, pad_index, uniform)
            return
        pos = torch.arange(md.max_seq_len, device=device)
        key_valid = pos[None, :] < md.seq_lens[:, None]
        gather_slots = md.block_tables[:, pos // bs] * bs + pos % bs  # [num_seqs, max_seq_len]
        # Positions past a sequence's length read the zeroed null block.
        gather_slots = torch.where(key_valid, gather_slots, md.null_block_id * bs)
        if md.is_decode_only:
            mask = key_valid[:, None, None, :]
        else:
            i = torch.arange(md.max_query_len, device=device)
            q_pos = (md.seq_lens - q_lens)[:, None] + i[None, :]  # absolute position of each query row
            mask = key_valid[:, None, :] & (pos[None, None, :] <= q_pos[:, :, None])
            # Padded query rows would have no key to attend to (softmax of all
            # -inf is NaN); let them see key 0 and drop their output.
            row_valid = i[None, :] < q_lens[:, None]
            mask[:, :, 0] |= ~row_valid
            mask = mask[:, None]
        md.backend_data = _StepData(gather_slots.reshape(-1), mask, pad_index)

    @staticmethod
    def _pad(x: torch.Tensor, md: AttentionMetadata, step: _StepData) -> torch.Tensor:
        """[num_tokens, heads, head_size] -> [num_seqs, max_query_len, heads, head_size]."""
        if step.pad_index is None:
            return x.view(md.num_seqs, 1, x.shape[1], x.shape[2])
        if step.uniform:
            return x.reshape(md.num_seqs, md.max_query_len, x.shape[1], x.shape[2])
        padded = x.new_zeros(md.num_seqs * md.max_query_len, x.shape[1], x.shape[2])
        padded.index_copy_(0, step.pad_index, x)
        return padded.view(md.num_seqs, md.max_query_len, x.shape[1], x.shape[2])

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

    def write_kv_cache(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        k_scale: float,
        v_scale: float,
        return_decoded: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Quantize (or convert) this step's K/V to the storage format and
        scatter them into their slots. With `return_decoded`, also return the
        stored values as a read of the cache decodes them (scale 1, compute
        dtype)."""
        k_codes, v_codes = self._store(key, k_scale), self._store(value, v_scale)
        write_slots(kv_cache[0], slot_mapping, k_codes)
        write_slots(kv_cache[1], slot_mapping, v_codes)
        return (self._load(k_codes), self._load(v_codes)) if return_decoded else None

    def forward(self, query, key, value, kv_cache, metadata, *, softmax_scale, k_scale, v_scale,
                logits_indices=None):
        md = metadata
        step: _StepData = md.backend_data
        num_kv_heads, head_size = key.shape[1], key.shape[2]
        fresh = step.gather_slots is None
        lossy = self.spec.storage_dtype != self.compute_dtype
        decoded = self.write_kv_cache(key, value, kv_cache, md.slot_mapping, k_scale, v_scale,
                                      return_decoded=fresh and lossy)

        num_heads = query.shape[1]
        if fresh:
            k, v = decoded if lossy else (key, value)
            k = self._pad(k, md, step)
            v = self._pad(v, md, step)
        else:
            # [num_seqs, max_seq_len, num_kv_heads, head_size]
            k = self._load(read_slots(kv_cache[0], step.gather_slots))
            v = self._load(read_slots(kv_cache[1], step.gather_slots))
            k = k.view(md.num_seqs, md.max_seq_len, num_kv_heads, head_size)
            v = v.view(md.num_seqs, md.max_seq_len, num_kv_heads, head_size)
        k, v = k.transpose(1, 2), v.transpose(1, 2)

        q = query if k_scale == 1.0 else query * k_scale
        q = self._pad(q, md, step)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=step.attn_mask, scale=softmax_scale, enable_gqa=True,
            is_causal=step.attn_mask is None,
        )  # [num_seqs, num_heads, max_query_len, head_size]
        out = out.transpose(1, 2).reshape(-1, num_heads, head_size)
        # The reference computes every row and keeps the ones asked for (any rows).
        if step.pad_index is not None and not step.uniform:
            rows = step.pad_index if logits_indices is None else step.pad_index.index_select(0, logits_indices)
            out = out.index_select(0, rows)
        elif logits_indices is not None:
            out = out.index_select(0, logits_indices)
        if v_scale != 1.0:
            out = out * v_scale
        return out
