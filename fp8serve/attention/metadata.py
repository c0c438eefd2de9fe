"""Per-step attention metadata, built once by the model runner and shared by
every layer through the forward context."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    # Where each new token's K/V is written: block_id * block_size + offset.
    slot_mapping: torch.Tensor  # [num_tokens] int64
    # Physical blocks of each sequence, padded with the null block id.
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int64
    # Context length of each sequence including this step's tokens.
    seq_lens: torch.Tensor  # [num_seqs] int64
    # Offsets of each sequence's query tokens in the flattened batch.
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    max_query_len: int
    max_seq_len: int
    num_seqs: int
    num_tokens: int
    # Id of the zeroed block that padding points at (see allocate_kv_cache).
    null_block_id: int = 0
    # Filled by the backend's metadata builder (shared by all layers).
    backend_data: object | None = None

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
