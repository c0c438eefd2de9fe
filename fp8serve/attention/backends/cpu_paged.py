"""CPU backend: decode steps run the C++ paged-attention kernel, which reads
each sequence's K/V straight from its blocks in the storage format (FP8
included) instead of gathering and dequantizing a padded copy. Fresh
prefills (no cached context) run the C++ causal prefill kernel over the
step's own K/V (as stored: decoded FP8 where the cache is lossy), packed
varlen, where kernels/prefill_attention_ops.py says (float32 and bf16
without AMX: every prompt; bf16 on AMX: 8+ tokens on average). Prefills that continue a
cached context (prefix caching) run the same kernel's context form over the
context read back from the cache, where the same rule holds for contexts
plus new tokens and the compute dtype is not bf16 on AMX: the rows come out
bit for bit as in a fresh prefill of the whole sequence, and 31 requests
of 32 new tokens after a shared 512-token cached prefix prefilled in 0.76 s
against 1.20 s through the padded SDPA (bf16, FP8 KV; the context read back
by `gather_cache`, one C++ pass per cache). Other prefills use the
reference path.

The decode path calls the C++ ops directly: the public wrappers in
kernels/cpu_ops.py validate every argument in Python (~100 us per layer at
batch 1, a tenth of a single-stream step over 30 layers), while the engine's
tensors are well-formed by construction and the ops still TORCH_CHECK shapes,
dtypes and block ids."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8serve.attention.backends.torch_sdpa import TorchSDPABackend
from fp8serve.attention.metadata import AttentionMetadata
from fp8serve.kernels import prefill_attention_ops
from fp8serve.kernels.cpu_ops import E4M3_DECODE_MULTIPLIER, KV_FORMATS, load_cpu_ops, reshape_and_cache


@dataclass
class _ContextStep:
    """A prefill continuing cached contexts, run by the C++ kernel's context form."""

    slots: torch.Tensor  # [sum(seq_lens)] int64: the slot of every position of every sequence, packed
    cu_seqlens_k: torch.Tensor  # [num_seqs + 1] int64: where each sequence's positions start in `slots`
    # [sum(seq_lens), num_kv_heads, head_size] in the compute dtype: every layer reads its K and V back
    # from the cache into these. Allocated here, once a step, rather than by each layer: a recorded
    # forward (engine/prefill_capture.py) then takes them as inputs, and no size that depends on the
    # contexts' lengths is baked into it.
    key_buf: torch.Tensor
    value_buf: torch.Tensor


class CpuPagedBackend(TorchSDPABackend):
    name = "cpu_paged"

    def build_metadata(self, md: AttentionMetadata) -> None:
        if md.is_decode_only:
            md.backend_data = None  # the kernel walks block_tables itself
        elif not self._fresh_prefill(md) and prefill_attention_ops.applies_with_context(
                self.compute_dtype, int(md.seq_lens.sum()), md.num_seqs, self.spec.head_size):
            md.backend_data = self._context_step(md)
        else:
            super().build_metadata(md)

    def runs_fresh_prefill_kernel(self, md: AttentionMetadata) -> bool:
        data = md.backend_data  # a prefill's: _ContextStep, or the reference path's step data
        return (not md.is_decode_only and data is not None and not isinstance(data, _ContextStep)
                and data.gather_slots is None
                and prefill_attention_ops.applies(self.compute_dtype, md.num_tokens, md.num_seqs, self.spec.head_size))

    def prefill_capture_inputs(self, md: AttentionMetadata) -> tuple[torch.Tensor, ...] | None:
        data = md.backend_data
        if not md.is_decode_only and isinstance(data, _ContextStep):
            return data.slots, data.cu_seqlens_k, data.key_buf, data.value_buf
        return super().prefill_capture_inputs(md)

    def _context_step(self, md: AttentionMetadata) -> _ContextStep:
        bs = self.spec.block_size
        seq_lens = md.seq_lens
        cu_k = torch.zeros(md.num_seqs + 1, dtype=torch.int64)
        torch.cumsum(seq_lens, 0, out=cu_k[1:])
        seq_of_key = torch.repeat_interleave(torch.arange(md.num_seqs), seq_lens)
        pos = torch.arange(int(cu_k[-1])) - cu_k[seq_of_key]
        slots = md.block_tables[seq_of_key, pos // bs] * bs + pos % bs
        key_buf = torch.empty(slots.shape[0], self.spec.num_kv_heads, self.spec.head_size, dtype=self.compute_dtype)
        return _ContextStep(slots, cu_k, key_buf, torch.empty_like(key_buf))

    def write_kv_cache(self, key, value, kv_cache, slot_mapping, k_scale, v_scale, return_decoded=False):
        """One C++ pass: quantize/convert, scatter, and (for a fresh prefill
        over a lossy cache) the decoded values to attend to."""
        if self.spec.fp8 is None:
            k_scale = v_scale = 1.0  # a 16/32-bit cache stores values as they are (as _store does)
        return reshape_and_cache(key, value, kv_cache[0], kv_cache[1], slot_mapping, self.spec.kv_cache_dtype,
                                 k_scale, v_scale, return_decoded=return_decoded)

    def forward(self, query, key, value, kv_cache, metadata, *, softmax_scale, k_scale, v_scale,
                logits_indices=None):
        md = metadata
        if not md.is_decode_only:
            if isinstance(md.backend_data, _ContextStep):
                return self._context_prefill_kernel(query, key, value, kv_cache, md, softmax_scale, k_scale, v_scale,
                                                    logits_indices)
            if self.runs_fresh_prefill_kernel(md):
                return self._fresh_prefill_kernel(query, key, value, kv_cache, md, softmax_scale, k_scale, v_scale,
                                                  logits_indices)
            return super().forward(query, key, value, kv_cache, metadata, softmax_scale=softmax_scale,
                                   k_scale=k_scale, v_scale=v_scale, logits_indices=logits_indices)
        # A decode step's rows are each sequence's last token already: logits_indices changes nothing.
        ops = load_cpu_ops()
        kv_format = KV_FORMATS[self.spec.kv_cache_dtype]
        # A 16/32-bit cache stores values as they are (as _store does); the
        # scales still apply to the attention below, as in the reference.
        ws = (float(k_scale), float(v_scale)) if self.spec.fp8 is not None else (1.0, 1.0)
        k_cache, v_cache = kv_cache.unbind(0)  # one ATen call, not four selects
        ops.reshape_and_cache(key, value, k_cache, v_cache, md.slot_mapping, kv_format, *ws, None, None)
        # Fold every constant into q and the output (see paged_attention.cpp);
        # the op scales q and converts to and from the compute dtype itself.
        decode_mult = E4M3_DECODE_MULTIPLIER if self.spec.kv_cache_dtype == "fp8_e4m3" else 1.0
        return ops.paged_attention_decode_fused(query, k_cache, v_cache, md.block_tables, md.seq_lens,
                                                kv_format, float(softmax_scale * k_scale * decode_mult),
                                                float(v_scale * decode_mult))

    def _fresh_prefill_kernel(self, query, key, value, kv_cache, md, softmax_scale, k_scale, v_scale,
                              logits_indices=None):
        """Write the cache, then attend to the K/V as stored (the decoded codes
        where the cache is lossy, so prefill sees what decode will read), with
        k_scale folded into the softmax scale and v_scale into the output."""
        lossy = self.spec.storage_dtype != self.compute_dtype
        decoded = self.write_kv_cache(key, value, kv_cache, md.slot_mapping, k_scale, v_scale, return_decoded=lossy)
        k, v = decoded if lossy else (key, value)
        if logits_indices is not None:
            # Each sequence's last token attends to all its keys: the context form with one query per sequence.
            return self._last_rows(query, k, v, md, md.query_start_loc, softmax_scale * k_scale, v_scale,
                                   logits_indices)
        return prefill_attention_ops.prefill_attention(query, k, v, md.query_start_loc,
                                                       softmax_scale * k_scale, v_scale)

    @staticmethod
    def _last_rows(query, k, v, md, cu_seqlens_k, scale, out_scale, logits_indices):
        """The attention output of each sequence's last token only
        ([num_seqs, num_heads, head_size]): the context form of the prefill
        kernel with one query per sequence, which takes the same keys in the
        same order as the full form takes for that row (the rows come out bit
        for bit as the full kernel's, tests/attention/backends)."""
        if logits_indices.shape[0] != md.num_seqs:
            raise ValueError(f"logits_indices must hold each sequence's last token: {md.num_seqs} rows, "
                             f"got {logits_indices.shape[0]}")
        cu_seqlens_q = torch.arange(md.num_seqs + 1, dtype=torch.int64, device=query.device)
        return load_cpu_ops().prefill_attention_with_context(
            query.index_select(0, logits_indices), k, v, cu_seqlens_q, cu_seqlens_k, float(scale), float(out_scale),
            prefill_attention_ops.BEST_PATH)

    def _context_prefill_kernel(self, query, key, value, kv_cache, md, softmax_scale, k_scale, v_scale,
                                logits_indices=None):
        """Write the new K/V, then attend each sequence's new tokens to every
        position it has, read back from the cache as stored (decoded at scale
        1): the values a fresh prefill of the whole sequence attends to, in
        the same kernel, so the outputs are the same bit for bit."""
        self.write_kv_cache(key, value, kv_cache, md.slot_mapping, k_scale, v_scale)
        step: _ContextStep = md.backend_data
        # One C++ pass per cache (gather + decode): index_select of the codes
        # and a table lookup per element took 124 of 993 ms of a 31 x 32-token
        # prefill over 512 cached tokens.
        ops, fmt = load_cpu_ops(), KV_FORMATS[self.spec.kv_cache_dtype]
        k_cache, v_cache = kv_cache.unbind(0)
        k, v = step.key_buf, step.value_buf  # each layer overwrites the previous one's
        ops.gather_cache(k_cache, step.slots, fmt, k)
        ops.gather_cache(v_cache, step.slots, fmt, v)
        if logits_indices is not None:
            return self._last_rows(query, k, v, md, step.cu_seqlens_k, softmax_scale * k_scale, v_scale,
                                   logits_indices)
        # The op itself, as decode does (see the module docstring): the wrapper's checks of cu_seqlens_k
        # are tensor ops a recorded forward would replay every step; the op checks the same.
        return ops.prefill_attention_with_context(query, k, v, md.query_start_loc, step.cu_seqlens_k,
                                                  float(softmax_scale * k_scale), float(v_scale),
                                                  prefill_attention_ops.BEST_PATH)
