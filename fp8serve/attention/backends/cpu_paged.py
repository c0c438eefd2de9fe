"""CPU backend: decode steps run the C++ paged-attention kernel, which reads
each sequence's K/V straight from its blocks in the storage format (FP8
included) instead of gathering and dequantizing a padded copy. Fresh
prefills (no cached context) in float32 with prompts of 64+ tokens on
average run the C++ causal prefill kernel over the step's own K/V (as
stored: decoded FP8 where the cache is lossy), packed varlen; other
prefills use the reference path (compute-bound, the gather is a small part),
whose SDPA is faster in bf16 (AMX) and for short prompts.

The decode path calls the C++ ops directly: the public wrappers in
kernels/cpu_ops.py validate every argument in Python (~100 us per layer at
batch 1, a tenth of a single-stream step over 30 layers), while the engine's
tensors are well-formed by construction and the ops still TORCH_CHECK shapes,
dtypes and block ids."""

from __future__ import annotations

from fp8serve.attention.backends.torch_sdpa import TorchSDPABackend
from fp8serve.attention.metadata import AttentionMetadata
from fp8serve.kernels import prefill_attention_ops
from fp8serve.kernels.cpu_ops import E4M3_DECODE_MULTIPLIER, KV_FORMATS, load_cpu_ops, reshape_and_cache


class CpuPagedBackend(TorchSDPABackend):
    name = "cpu_paged"

    def build_metadata(self, md: AttentionMetadata) -> None:
        if md.is_decode_only:
            md.backend_data = None  # the kernel walks block_tables itself
        else:
            super().build_metadata(md)

    def write_kv_cache(self, key, value, kv_cache, slot_mapping, k_scale, v_scale, return_decoded=False):
        """One C++ pass: quantize/convert, scatter, and (for a fresh prefill
        over a lossy cache) the decoded values to attend to."""
        if self.spec.fp8 is None:
            k_scale = v_scale = 1.0  # a 16/32-bit cache stores values as they are (as _store does)
        return reshape_and_cache(key, value, kv_cache[0], kv_cache[1], slot_mapping, self.spec.kv_cache_dtype,
                                 k_scale, v_scale, return_decoded=return_decoded)

    def forward(self, query, key, value, kv_cache, metadata, *, softmax_scale, k_scale, v_scale):
        md = metadata
        if not md.is_decode_only:
            if md.backend_data.gather_slots is None and prefill_attention_ops.applies(
                    self.compute_dtype, md.num_tokens, md.num_seqs, self.spec.head_size):
                return self._fresh_prefill_kernel(query, key, value, kv_cache, md, softmax_scale, k_scale, v_scale)
            return super().forward(query, key, value, kv_cache, metadata,
                                   softmax_scale=softmax_scale, k_scale=k_scale, v_scale=v_scale)
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

    def _fresh_prefill_kernel(self, query, key, value, kv_cache, md, softmax_scale, k_scale, v_scale):
        """Write the cache, then attend to the K/V as stored (the decoded codes
        where the cache is lossy, so prefill sees what decode will read), with
        k_scale folded into the softmax scale and v_scale into the output."""
        lossy = self.spec.storage_dtype != self.compute_dtype
        decoded = self.write_kv_cache(key, value, kv_cache, md.slot_mapping, k_scale, v_scale, return_decoded=lossy)
        k, v = decoded if lossy else (key, value)
        return prefill_attention_ops.prefill_attention(query, k, v, md.query_start_loc,
                                                       softmax_scale * k_scale, v_scale)
