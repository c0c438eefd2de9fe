"""Owns the model and its KV cache; turns a scheduled batch into one forward
pass and one sampling step.

Per step: flatten the batch's new tokens, build the attention metadata once
(slot_mapping, block_tables, seq_lens), run the model under the forward
context, compute logits only where they are needed, sample.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from fp8serve.attention.backends.selector import select_backend
from fp8serve.attention.forward_context import set_forward_context
from fp8serve.attention.kv_cache_spec import KVCacheSpec, kv_cache_layout_from_env
from fp8serve.attention.metadata import AttentionMetadata
from fp8serve.config import EngineConfig
from fp8serve.engine.decode_capture import DecodeCaptures
from fp8serve.engine.prefill_capture import PrefillCaptures
from fp8serve.engine.sequence import Sequence
from fp8serve.errors import ConfigError
from fp8serve.kernels import gemv_packing, onednn_linear, screened_argmax
from fp8serve.layers.attention import Attention
from fp8serve.layers.sampler import Sampler, SamplerOutput, SamplingMetadata, compute_prompt_logprobs
from fp8serve.model_loader.loader import load_weights
from fp8serve.models.registry import get_model_class
from fp8serve.quantization import narrow_weights
from fp8serve.quantization.kv_scales import resolve_kv_scales
from fp8serve.quantization.registry import get_quantization_config
from fp8serve.sampling_params import SamplingParams
from fp8serve.spec_decode.rejection_sampler import rejection_sample
from fp8serve.utils.env_switch import env_switch
from fp8serve.utils.huge_pages import pack_parameters_on_huge_pages
from fp8serve.utils.malloc_tuning import tune_malloc
from fp8serve.utils.memory import format_bytes
from fp8serve.utils import platform
from fp8serve.utils.platform import configure_cpu_threads

logger = logging.getLogger(__name__)

# New tokens per forward pass of a CPU prefill (see ModelRunner._forward).
# Measured with the default model, bf16, fp8 KV (2-vCPU Xeon): 0.28-0.29 ms
# per token at 2048-4096 tokens per pass, 0.34-0.35 at 8192, 0.31-0.34 at
# 512-1024 (too little work per matmul).
PREFILL_TOKENS_PER_FORWARD = 4096
# A prefill forward runs its last layer past attention on each prompt's last
# token only where its prompts average this many new tokens: below it the
# full rows take the decode kernels, which read each weight once whatever
# the row count, so the few rows saved cost little and the pruned layer's
# extra ops (row selections, the context form of the attention) cost as
# much. Default model, bf16, one Zen 4 process: 16 tokens 0.97-0.99x,
# 24 (after a cached prefix) 1.02-1.09x, 32 1.02-1.03x
# (benchmarks/results/last_layer_pruning_2026-12-04_zen4*.md).
MIN_MEAN_TOKENS_TO_PRUNE = 24
# FP8SERVE_KV_CACHE_PREFAULT=1 writes every page of the KV cache at start-up
# (AttentionBackend.allocate_kv_cache) instead of leaving each page to the
# first step that writes it. On the 2-vCPU Zen 4 VM a page's first write cost
# up to ~1.3 s per GiB where the host had taken back memory the guest freed
# (a fresh 2 GiB buffer after 20 s idle), so the offline 64 x 512 -> 128 run
# after 30 s idle gave 1.06-1.09x output tok/s with it, but load 3.9 s
# against 1.5 s; back to back, 0.97-1.04x
# (benchmarks/results/kv_prefault_2026-12-07_zen4.md). Off by default (auto,
# 0): the default cache is a quarter of the memory, and start-up would grow
# by seconds for pages a short job may never use.
KV_CACHE_PREFAULT_ENV = "FP8SERVE_KV_CACHE_PREFAULT"


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens 1..n-1 of one sequence (token 0 has none)."""

    logprobs: torch.Tensor  # [n - 1]
    ranks: torch.Tensor  # [n - 1]
    top_logprobs: torch.Tensor  # [n - 1, k]
    top_token_ids: torch.Tensor  # [n - 1, k]


@dataclass
class ModelRunnerOutput:
    # One row per sampled sequence: every row of the step, or with chunked
    # prefill only those of `sampled_rows` (None when no chunk reached its end).
    sampler_output: SamplerOutput | None
    prompt_logprobs: dict[int, PromptLogprobs]  # row -> logprobs of this step's positions, for rows that asked
    sampled_rows: list[int] | None = None  # None: every row was sampled
    # Speculative decoding: how many of sampler_output's tokens (consecutive)
    # each sampled row emitted, its kept drafts and one more; None: one each.
    num_sampled_tokens: list[int] | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc, cc = config.model_config, config.cache_config
        self.device = mc.torch_device
        self.dtype = mc.torch_dtype
        if self.device.type == "cpu":
            configure_cpu_threads()  # before loading: packing the weights uses the threads too
            tune_malloc()  # large activations reuse freed memory: see malloc_tuning.py
        torch.manual_seed(mc.seed)
        arch = mc.arch

        t0 = time.perf_counter()
        model_cls = get_model_class(arch)
        self.weights_mapper = model_cls.weights_mapper(arch)
        quant_config = get_quantization_config(arch.quantization_config, mc.model,
                                               self.weights_mapper.checkpoint_modules, mc.quantization)
        if quant_config is None:
            quant_config = narrow_weights.select(mc.model, self.dtype, self.device)  # None: compute-dtype weights
        with torch.device(self.device):
            self.model = model_cls(arch, quant_config, self.dtype)
        load_weights(self.model, mc.model, self.weights_mapper)
        self.model.eval()
        if self.device.type == "cpu":
            pack_parameters_on_huge_pages(self.model)  # decode reads every weight once per step
            # Packed copies where they pay and fit: gemv_packing.py's first, since a layer
            # that gets one under float32 compute needs no float32 copy from oneDNN.
            gemv_packing.pack_gemv_weights(self.model, self.dtype)
            onednn_linear.pack_weights(
                self.model, self.dtype,
                widen=(quant_config.weight_dtype,) if isinstance(quant_config, narrow_weights.NarrowWeightsConfig) else ())
            screened_argmax.attach_screens(self.model, self.dtype)  # greedy steps: see screened_argmax.py
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        logger.info(
            "Loaded %s (%s, %s weights) in %.1f s",
            mc.model, arch.architecture, quant_config.name if quant_config else mc.dtype_name,
            time.perf_counter() - t0,
        )

        kv_dtype = cc.storage_dtype_name(self.dtype)
        self.kv_cache_spec = KVCacheSpec(
            kv_cache_dtype=kv_dtype,
            block_size=cc.block_size,
            num_kv_heads=arch.num_key_value_heads,
            head_size=arch.head_dim,
            num_layers=len(self.attn_layers),
            kv_layout=kv_cache_layout_from_env(),
        )
        self._apply_kv_scales()
        self.backend = select_backend(self.kv_cache_spec, self.dtype, self.device)
        self.num_blocks = self._allocate_kv_cache()
        cc.num_blocks = self.num_blocks
        self.sampler = Sampler()
        self._decode_query_start_loc: dict[int, torch.Tensor] = {}  # arange(n + 1) per decode batch size
        # (params of each row, metadata) of the last step whose metadata can be reused.
        self._static_sampling: tuple[list[SamplingParams], SamplingMetadata] | None = None
        self._scales_pending_log = any(layer.calculate_kv_scales for layer in self.attn_layers)
        # CPU only: there the module tree costs ~4 ms of a decode step (a quarter
        # at batch 1; see decode_capture.py for the measurements).
        self.decode_captures = DecodeCaptures(self.model, self.attn_layers,
                                              enabled=not mc.enforce_eager and self.device.type == "cpu")
        # Fresh prefills replayed at any token count between the kernels' row thresholds.
        self.prefill_captures = PrefillCaptures(self.model, self.attn_layers, self.backend, self.dtype,
                                                enabled=not mc.enforce_eager and self.device.type == "cpu")
        # Prefills without prompt logprobs run the last layer past attention on each sequence's last
        # token only (the model's forward_head). An attribute so that benchmarks can measure it.
        self.prune_last_layer = hasattr(self.model, "forward_head")
        self.min_mean_tokens_to_prune = MIN_MEAN_TOKENS_TO_PRUNE

    # ------------------------------------------------------------------ setup
    def _apply_kv_scales(self) -> None:
        mc, cc = self.config.model_config, self.config.cache_config
        scales = resolve_kv_scales(
            model_dir=mc.model,
            hf_config=mc.hf_config,
            num_layers=len(self.attn_layers),
            kv_cache_dtype=self.kv_cache_spec.kv_cache_dtype,
            mapper=self.weights_mapper,
            quantization_param_path=cc.quantization_param_path,
            tp_size=self.config.parallel_config.tensor_parallel_size,
            logger=logger,
        )
        for layer, s in zip(self.attn_layers, scales):
            layer.set_kv_scales(s.k_scale, s.v_scale, s.source, s.k_head_scales, s.v_head_scales)
        if cc.calculate_kv_scales and self.kv_cache_spec.kv_cache_dtype == "fp8_e5m2":
            # The seed's rule: e5m2 has the range to go unscaled; scale 1.0.
            logger.info("--calculate-kv-scales is ignored with fp8_e5m2 (scale 1.0)")
        elif cc.calculate_kv_scales and self.kv_cache_spec.fp8 is not None:
            if any(s.source != "default" for s in scales):
                logger.info("--calculate-kv-scales: scales were supplied, so they are used as given")
            else:
                for layer in self.attn_layers:
                    layer.calculate_kv_scales = True
                logger.info("--calculate-kv-scales: scales will be computed from the first prefill batch")

    def _allocate_kv_cache(self) -> int:
        mc, cc = self.config.model_config, self.config.cache_config
        spec = self.kv_cache_spec
        budget = cc.kv_cache_memory or self.config.default_kv_cache_memory()
        num_blocks = budget // spec.bytes_per_block
        blocks_per_request = -(-mc.max_model_len // spec.block_size)
        if num_blocks < blocks_per_request:
            need = blocks_per_request * spec.bytes_per_block
            # Only the remedies that apply: fp8 when the cache is not FP8 yet, a
            # smaller --block-size when one block alone exceeds the budget.
            remedies = [f"raise --kv-cache-memory to at least {format_bytes(need)}", "lower --max-model-len"]
            if num_blocks == 0 and spec.block_size > 16:
                remedies.append("lower --block-size")
            if spec.fp8 is None:
                remedies.append("use --kv-cache-dtype fp8")
            raise ConfigError(
                f"KV cache of {format_bytes(budget)} holds {num_blocks} blocks of {spec.block_size} tokens "
                f"({num_blocks * spec.block_size} tokens), but one request of --max-model-len "
                f"{mc.max_model_len} needs {blocks_per_request} blocks: "
                + ", ".join(remedies[:-1]) + f", or {remedies[-1]}"
            )
        if self.device.type == "cpu":
            # A budget beyond the memory there is fails in the allocator (or
            # later, in the OOM killer); say so before trying.
            avail = platform.available_memory_bytes()
            if num_blocks * spec.bytes_per_block > avail:
                raise ConfigError(
                    f"--kv-cache-memory {format_bytes(budget)} is more than the {format_bytes(avail)} of memory "
                    f"available on this machine; give at most that (the default takes a quarter of it)")
        prefault = env_switch(KV_CACHE_PREFAULT_ENV) is True
        t0 = time.perf_counter()
        caches = [self.backend.allocate_kv_cache(num_blocks, self.device, prefault=prefault)
                  for _ in self.attn_layers]
        if prefault:
            logger.info("KV cache: every page written at start-up in %.1f s (%s=1), not by the first requests' "
                        "steps", time.perf_counter() - t0, KV_CACHE_PREFAULT_ENV)
        for layer, cache in zip(self.attn_layers, caches):
            layer.bind(self.backend, cache)
        self.kv_caches = caches
        logger.info(
            "KV cache: %s, %d blocks x %d tokens, %d bytes per block, %d tokens, %s; "
            "maximum concurrency for %d tokens per request: %.2fx",
            spec.kv_cache_dtype, num_blocks, spec.block_size, spec.bytes_per_block,
            num_blocks * spec.block_size, format_bytes(num_blocks * spec.bytes_per_block),
            mc.max_model_len, num_blocks / blocks_per_request,
        )
        return num_blocks

    # ------------------------------------------------------------------- step
    def _prepare(self, seqs: list[Sequence], is_prefill: bool, num_new_tokens: list[int] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """`num_new_tokens`: how many uncomputed tokens of each sequence this
        pass computes (chunked prefill); default all of them."""
        if not is_prefill:
            return self._prepare_decode(seqs)
        bs = self.kv_cache_spec.block_size
        dev = self.device
        max_blocks = max(len(s.block_table) for s in seqs)
        block_tables = torch.tensor(
            [s.block_table + [self.num_blocks] * (max_blocks - len(s.block_table)) for s in seqs], dtype=torch.int64
        )
        if num_new_tokens is None:
            num_new_tokens = [s.num_tokens - s.num_computed_tokens for s in seqs]
        # Context length of each sequence once this pass's tokens are in.
        seq_lens_list = [s.num_computed_tokens + n for s, n in zip(seqs, num_new_tokens)]
        seq_lens = torch.tensor(seq_lens_list, dtype=torch.int64)
        token_ids, q_lens = [], []
        for s, end in zip(seqs, seq_lens_list):
            new = s.token_ids[s.num_computed_tokens:end]
            token_ids.extend(new)
            q_lens.append(len(new))
        q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
        query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int64)
        torch.cumsum(q_lens_t, 0, out=query_start_loc[1:])
        seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), q_lens_t)
        positions = (seq_lens - q_lens_t)[seq_of_token] + (
            torch.arange(len(token_ids)) - query_start_loc[seq_of_token]
        )
        input_ids = torch.tensor(token_ids, dtype=torch.int64)
        max_query_len = max(q_lens)
        slot_mapping = block_tables[seq_of_token, positions // bs] * bs + positions % bs
        md = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            block_tables=block_tables.to(dev),
            seq_lens=seq_lens.to(dev),
            query_start_loc=query_start_loc.to(dev),
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens_list),
            num_seqs=len(seqs),
            num_tokens=int(input_ids.shape[0]),
            null_block_id=self.num_blocks,
        )
        self.backend.build_metadata(md)
        return input_ids.to(dev), positions.to(dev), md

    def _prepare_decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """`_prepare` for one new token per sequence, from Python ints and two
        tensor constructions. Why: a decode step runs right after streaming
        the weights through the caches, where each small torch op costs tens
        of microseconds; the general path's ~15 ops took 0.3-0.4 ms of a
        25 ms float32 batch-1 step on a 2-vCPU Xeon (46 us when hot)."""
        bs = self.kv_cache_spec.block_size
        null = self.num_blocks
        max_blocks = max(len(s.block_table) for s in seqs)
        ids, pos, slots, lens, rows = [], [], [], [], []
        for s in seqs:
            num_tokens, table = s.num_tokens, s.block_table
            p = num_tokens - 1
            ids.append(s.last_token_id)
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            lens.append(num_tokens)
            rows.append(table + [null] * (max_blocks - len(table)))
        return self._decode_form(ids, pos, slots, lens, rows)

    def _decode_form(self, ids: list[int], pos: list[int], slots: list[int], lens: list[int],
                     rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Inputs and metadata of a pass of one query per row (a decode step,
        or a verify pass in decode form): token id, position, slot, context
        length and padded block table of each row."""
        n = len(ids)
        # Four contiguous rows of one tensor: token ids, positions, slots, lengths.
        per_row = torch.tensor([ids, pos, slots, lens], dtype=torch.int64, device=self.device)
        input_ids, positions, slot_mapping, seq_lens = per_row.unbind(0)
        query_start_loc = self._decode_query_start_loc.get(n)
        if query_start_loc is None:
            query_start_loc = self._decode_query_start_loc[n] = torch.arange(n + 1, dtype=torch.int64,
                                                                              device=self.device)
        md = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=torch.tensor(rows, dtype=torch.int64, device=self.device),
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            max_query_len=1,
            max_seq_len=max(lens),
            num_seqs=n,
            num_tokens=n,
            null_block_id=self.num_blocks,
        )
        self.backend.build_metadata(md)
        return input_ids, positions, md

    @torch.inference_mode()
    def prompt_logits(self, seq: Sequence) -> torch.Tensor:
        """Logits at every position of `seq` ([num_tokens, vocab] float32) from
        one prefill through the paged cache (blocks already allocated)."""
        input_ids, positions, md = self._prepare([seq], is_prefill=True)
        with set_forward_context(md):
            hidden = self.model(input_ids, positions)
        return self.model.compute_logits(hidden)

    def _prefill_groups(self, seqs: list[Sequence], num_new_tokens: list[int]) -> list[tuple[list[Sequence], list[int]]]:
        """Consecutive groups (sequences, their new tokens) of at most
        PREFILL_TOKENS_PER_FORWARD new tokens each (a longer prompt is a group
        of its own). Sequences with a cached prefix never share a group with
        fresh ones: a group with any cached context attends over the paged
        cache, a fresh group runs the faster kernel over its own K/V (the
        scheduler puts the fresh ones first)."""
        groups: list[tuple[list[Sequence], list[int]]] = [([], [])]
        tokens = 0
        for s, n in zip(seqs, num_new_tokens):
            last = groups[-1][0]
            if last and (tokens + n > PREFILL_TOKENS_PER_FORWARD
                         or (s.num_computed_tokens > 0) != (last[-1].num_computed_tokens > 0)):
                groups.append(([], []))
                tokens = 0
            groups[-1][0].append(s)
            groups[-1][1].append(n)
            tokens += n
        return groups

    def _forward(self, seqs: list[Sequence], is_prefill: bool, num_new_tokens: list[int],
                 last_rows_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states of every new token ([num_tokens, hidden_size]) and
        query_start_loc ([num_seqs + 1]) for `seqs`; or, for a decode step or
        with `last_rows_only` (a prefill), those of each sequence's last new
        token ([num_seqs, hidden_size]) and None (a forward whose prompts
        average MIN_MEAN_TOKENS_TO_PRUNE new tokens runs its last layer on
        those rows only, a shorter one on every row). On CPU a big prefill runs
        as several forward passes over groups of sequences: the result is the
        same (attention never crosses sequences), and activations of ~4k
        tokens stay in cache where 8k tokens' went to DRAM and page faults."""
        if not is_prefill:  # one forward, one token per sequence
            input_ids, positions, md = self._prepare(seqs, is_prefill)
            return self.decode_captures.forward(input_ids, positions, md), None
        groups = (self._prefill_groups(seqs, num_new_tokens) if self.device.type == "cpu"
                  else [(seqs, num_new_tokens)])
        hiddens, starts, offset = [], [torch.zeros(1, dtype=torch.int64, device=self.device)], 0
        for group, group_new_tokens in groups:
            input_ids, positions, md = self._prepare(group, is_prefill, group_new_tokens)
            prune = last_rows_only and md.num_tokens >= self.min_mean_tokens_to_prune * md.num_seqs
            logits_indices = md.query_start_loc[1:] - 1 if prune else None
            hiddens.append(self.prefill_captures.forward(input_ids, positions, md, logits_indices))
            if last_rows_only and not prune:  # every row computed, the last ones asked for
                hiddens[-1] = hiddens[-1].index_select(0, md.query_start_loc[1:] - 1)
            starts.append(md.query_start_loc[1:] + offset)
            offset += md.num_tokens
        hidden = hiddens[0] if len(hiddens) == 1 else torch.cat(hiddens)
        return hidden, None if last_rows_only else torch.cat(starts)

    def _sampling_metadata(self, seqs: list[Sequence], eos_token_id: int | None) -> SamplingMetadata:
        """The step's SamplingMetadata; the previous step's when the rows carry
        the same SamplingParams objects in the same order and nothing in it
        depends on the step (`depends_on_step`). Why: building it costs four
        small tensors and per-row Python, 0.55 ms of a 31 ms float32 batch-1
        decode step on a 2-vCPU Xeon, for metadata that steady greedy or
        unseeded batches repeat step after step. Rows with min_tokens are never
        reused: their bans depend on how many tokens each row has, and one
        SamplingParams object may serve a new and an old request alike."""
        params = [s.sampling_params for s in seqs]
        last = self._static_sampling
        if last is not None and len(last[0]) == len(params) and all(a is b for a, b in zip(last[0], params)):
            return last[1]
        md = SamplingMetadata.from_params(
            params,
            [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
            eos_token_id,
            self.device,
        )
        reusable = not md.depends_on_step and all(p.min_tokens == 0 for p in params)
        self._static_sampling = (params, md) if reusable else None
        return md

    @torch.inference_mode()
    def execute(self, seqs: list[Sequence], is_prefill: bool, eos_token_id: int | None,
                num_new_tokens: list[int] | None = None) -> ModelRunnerOutput:
        """One forward pass and sampling. `num_new_tokens` (chunked prefill):
        how many uncomputed tokens of each sequence to compute; only the rows
        whose chunk reaches the sequence's last token are sampled. A decode
        step where any sequence carries drafts is a verify pass."""
        if not is_prefill and any(s.spec_token_ids for s in seqs):
            return self._execute_verify(seqs, eos_token_id)
        sampled_rows = None
        if num_new_tokens is None:
            num_new_tokens = [s.num_tokens - s.num_computed_tokens for s in seqs] if is_prefill else [1] * len(seqs)
        else:
            sampled_rows = [r for r, (s, n) in enumerate(zip(seqs, num_new_tokens))
                            if s.num_computed_tokens + n == s.num_tokens]
        wants_prompt_logprobs = is_prefill and any(
            self._prompt_logprobs_count(s, n) > 0 for s, n in zip(seqs, num_new_tokens))
        # [num_tokens, hidden_size], or one row per sequence (query_start_loc None)
        hidden, query_start_loc = self._forward(seqs, is_prefill, num_new_tokens,
                                                last_rows_only=self.prune_last_layer and not wants_prompt_logprobs)
        if self._scales_pending_log:
            self._scales_pending_log = False
            for i, layer in enumerate(self.attn_layers):
                logger.info("calculated KV scales: layer %d k_scale=%.6g v_scale=%.6g", i, layer._k_scale, layer._v_scale)

        prompt_logprobs: dict[int, PromptLogprobs] = {}
        if wants_prompt_logprobs:
            for row, (s, n) in enumerate(zip(seqs, num_new_tokens)):
                count = self._prompt_logprobs_count(s, n)
                if count <= 0:
                    continue
                k, first = s.sampling_params.prompt_logprobs, s.num_computed_tokens
                start = int(query_start_loc[row])
                h = hidden[start: start + count]
                targets = torch.tensor(s.prompt_token_ids[first + 1: first + 1 + count], device=self.device)
                lp, rk, top, top_ids = compute_prompt_logprobs(self.model.compute_logits(h), targets, k)
                prompt_logprobs[row] = PromptLogprobs(lp.cpu(), rk.cpu(), top.cpu(), top_ids.cpu())

        if sampled_rows is not None and len(sampled_rows) < len(seqs):
            if not sampled_rows:
                return ModelRunnerOutput(None, prompt_logprobs, sampled_rows)
            rows = torch.tensor(sampled_rows, dtype=torch.int64, device=hidden.device)
            last_hidden = hidden.index_select(0, rows if query_start_loc is None else query_start_loc[rows + 1] - 1)
            sample_seqs = [seqs[r] for r in sampled_rows]
        else:
            last_hidden = hidden if query_start_loc is None else hidden.index_select(0, query_start_loc[1:] - 1)
            sample_seqs = seqs
        sampling = self._sampling_metadata(sample_seqs, eos_token_id)
        tokens = self._plain_greedy_tokens(last_hidden, sampling)
        if tokens is not None:
            out = SamplerOutput(tokens, None, None, None, None)
        else:
            logits = self.model.compute_logits(last_hidden)  # [num_sampled, vocab]
            out = self.sampler(logits, sampling)
        return ModelRunnerOutput(out, prompt_logprobs, sampled_rows)

    @staticmethod
    def _prompt_logprobs_count(s: Sequence, num_new_tokens: int) -> int:
        """How many of this step's positions of `s` score a prompt token that
        asked for prompt logprobs (0 if it did not ask, or has them already:
        a resumed sequence, preempted earlier). The logits at position p score
        prompt token p + 1, for p < num_prompt_tokens - 1."""
        if s.sampling_params.prompt_logprobs is None or s.prompt_logprobs is not None or s.num_prompt_tokens < 2:
            return 0
        first = s.num_computed_tokens
        return min(first + num_new_tokens, s.num_prompt_tokens - 1) - first

    def _plain_greedy_tokens(self, hidden: torch.Tensor, sampling: SamplingMetadata) -> torch.Tensor | None:
        """The sampled tokens of a step whose rows all want the plain argmax
        and no logprobs, from the model's screened greedy head
        (kernels/screened_argmax.py: the same tokens, without reading the
        whole head); None where that does not serve: sample from logits."""
        if not sampling.plain_greedy or sampling.max_num_logprobs is not None:
            return None
        compute = getattr(self.model, "compute_greedy_tokens", None)
        return compute(hidden) if compute is not None else None

    def _prepare_verify(self, seqs: list[Sequence],
                        drafts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """A verify pass in decode form: every position (a sequence's last
        token, then its drafts) is a decode query of its own, whose context
        ends at that position, over its sequence's block table. Valid because
        each layer writes all the pass's K/V before any attention reads the
        cache, so the query at a draft sees the drafts before it. Why: the
        pass then runs the paged decode kernel and the recorded decode
        forwards (one token per row), where the general prefill path (every
        context gathered out of the cache, modules run eagerly) took 23-30 ms
        a step against 14 for six sequences, one with 4 drafts, and 16-18 ms
        against 12 for one sequence with 4 (bf16, FP8 KV, 250-token contexts;
        a decode step 10-12 ms); and each row attends exactly as a decode
        step would."""
        bs = self.kv_cache_spec.block_size
        null = self.num_blocks
        max_blocks = max(len(s.block_table) for s in seqs)
        ids, pos, slots, lens, rows = [], [], [], [], []
        for s, d in zip(seqs, drafts):
            table = s.block_table
            row = table + [null] * (max_blocks - len(table))
            first = s.num_tokens - 1
            for j, token in enumerate([s.last_token_id] + d):
                p = first + j
                ids.append(token)
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
                lens.append(p + 1)
                rows.append(row)
        return self._decode_form(ids, pos, slots, lens, rows)

    def _execute_verify(self, seqs: list[Sequence], eos_token_id: int | None) -> ModelRunnerOutput:
        """Speculative decoding's step: each sequence's last token and drafts
        in one forward pass (in decode form, see _prepare_verify), logits at
        every one of those positions, then rejection_sample. The K/V written
        for a rejected draft's slot is overwritten when the sequence gets there."""
        drafts = [list(s.spec_token_ids) for s in seqs]
        input_ids, positions, md = self._prepare_verify(seqs, drafts)
        hidden = self.decode_captures.forward(input_ids, positions, md)
        logits = self.model.compute_logits(hidden)  # [sum(1 + k), vocab]
        # One sampling row per position, as if the drafts before it were generated.
        params, prompts, outputs = [], [], []
        for s, d in zip(seqs, drafts):
            for j in range(len(d) + 1):
                params.append(s.sampling_params)
                prompts.append(s.prompt_token_ids)
                outputs.append(s.output_token_ids + d[:j] if j else s.output_token_ids)
        smd = SamplingMetadata.from_params(params, prompts, outputs, eos_token_id, self.device)
        result = rejection_sample(logits, smd, drafts)
        counts = [len(t) for t in result.token_ids]
        emitted_rows, row = [], 0
        for d, n in zip(drafts, counts):
            emitted_rows.extend(range(row, row + n))
            row += len(d) + 1
        sampled = torch.tensor([t for ts in result.token_ids for t in ts], dtype=torch.int64)
        if smd.max_num_logprobs is None:
            out = SamplerOutput(sampled, None, None, None, None)
        else:
            index = torch.tensor(emitted_rows, dtype=torch.int64, device=logits.device)
            lp, rk, top, top_ids = compute_prompt_logprobs(logits.index_select(0, index),
                                                           result.row_token_ids.index_select(0, index),
                                                           smd.max_num_logprobs)
            out = SamplerOutput(sampled, lp, rk, top, top_ids)
        return ModelRunnerOutput(out, {}, None, num_sampled_tokens=counts)
