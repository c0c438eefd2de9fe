"""The engine loop: requests in, one scheduled step at a time, outputs out.

Not thread-safe by design: the offline `LLM` drives it directly, the server
from a single background loop.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from dataclasses import dataclass

import torch

from fp8serve.config import EngineConfig
from fp8serve.engine.block_manager import BlockManager
from fp8serve.engine.detokenizer import IncrementalDetokenizer
from fp8serve.engine.model_runner import ModelRunner, ModelRunnerOutput, PromptLogprobs
from fp8serve.engine.request_stats import IterationStats, StatLogger, report
from fp8serve.engine.scheduler import Scheduler
from fp8serve.engine.sequence import ParentRequest, Sequence
from fp8serve.engine.tokenizer import check_text, eos_token_ids, load_tokenizer
from fp8serve.errors import InvalidParameterError, UserError
from fp8serve.outputs import CompletionOutput, Logprob, RequestOutput
from fp8serve.sampling_params import SamplingParams, check_max_logprobs, truncate_prompt
from fp8serve.spec_decode.ngram_proposer import NgramProposer

logger = logging.getLogger(__name__)

PromptInput = str | list[int] | dict


@dataclass
class EngineStats:
    # As vLLM counts them: each sequence's prompt length once, when its first
    # token comes (a sample of an n > 1 request is a sequence; prefix-cached
    # tokens count).
    prompt_tokens_total: int = 0
    # The part of those found in the prefix cache (vLLM's prompt_tokens_cached).
    prompt_tokens_cached_total: int = 0
    # Prompt tokens the model computed: cached ones left out, a preempted
    # sequence's recomputation included (what prefill cost).
    prefill_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_steps: int = 0
    # Speculative decoding (vLLM's spec_decode_* counters): verify passes of a
    # sequence with drafts, the drafts checked, and those kept.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model_config
        self.tokenizer = load_tokenizer(mc.tokenizer or mc.model)
        self.eos_token_ids = eos_token_ids(mc.model, mc.hf_config, self.tokenizer)
        self.model_runner = ModelRunner(config)
        cc = config.cache_config
        self.block_manager = BlockManager(self.model_runner.num_blocks, cc.block_size,
                                          enable_prefix_caching=cc.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config, self.block_manager)
        sc = config.scheduler_config
        if sc.enable_chunked_prefill:
            logger.info("Chunked prefill is enabled with max_num_batched_tokens=%d (prompts run in chunks next to "
                        "the running requests' decodes)", sc.max_num_batched_tokens)
        if cc.enable_prefix_caching:
            logger.info("Prefix caching: on (full blocks of %d tokens are shared between requests with the same "
                        "prefix)", cc.block_size)
        spec = config.speculative_config
        self.proposer = None
        if spec is not None:
            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_speculative_tokens)
            logger.info("Speculative decoding: %s, up to %d draft tokens per step from earlier occurrences of the "
                        "last %d-%d tokens", spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min,
                        spec.prompt_lookup_max)
        if mc.default_sampling_params:
            source = {"auto": "the model's generation config", "vllm": "--override-generation-config"}.get(
                mc.generation_config, f"{mc.generation_config}/generation_config.json")
            if mc.override_generation_config and mc.generation_config != "vllm":
                source += " and --override-generation-config"
            logger.info("Default sampling parameters from %s: %s (for requests that leave them unset, as vLLM; "
                        "--generation-config vllm: the engine's own)", source, mc.default_sampling_params)
        self.seqs: dict[str, Sequence] = {}
        self.parents: dict[str, ParentRequest] = {}  # requests for n > 1 samples, by request id
        self.stats = EngineStats()
        # Called with each step's IterationStats (and an abort's), on the thread
        # that steps the engine: the server's Prometheus metrics.
        self.stat_loggers: list[StatLogger] = []
        self._iteration: IterationStats | None = None
        self._ids = itertools.count()

    @classmethod
    def from_args(cls, model: str | None = None, **kwargs) -> "LLMEngine":
        return cls(EngineConfig.create(model, **kwargs))

    # ------------------------------------------------------------- requests
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text, token ids, or
        `{"prompt": ...}` / `{"prompt_token_ids": [...]}` (vLLM's forms)."""
        text: str | None = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                # An already-tokenized prompt may carry its text for outputs.
                ids = prompt["prompt_token_ids"]
                text = prompt.get("prompt") if isinstance(prompt.get("prompt"), str) else None
            elif "prompt" in prompt:
                if not isinstance(prompt["prompt"], str):
                    raise InvalidParameterError(f"a prompt dict's 'prompt' must be a string, got "
                                                f"{type(prompt['prompt']).__name__}", "prompt")
                return self.tokenize_prompt(prompt["prompt"])
            else:
                raise InvalidParameterError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise UserError(f"{self.config.model_config.model} has no tokenizer files: pass prompt_token_ids "
                                "instead of text, or a directory holding them as tokenizer=DIR (--tokenizer DIR)")
            check_text(prompt, "prompt")
            text = prompt
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = prompt
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidParameterError(f"prompt_token_ids must be a list of Python ints, got "
                                        f"{_describe(ids)} (convert tensors and arrays with .tolist())", "prompt")
        return text, list(ids)

    def prompt_for(self, prompt: PromptInput, params: SamplingParams) -> tuple[str | None, list[int]]:
        """tokenize_prompt, then params.truncate_prompt_tokens (the text is dropped when the
        tokens were cut: it would no longer be the prompt's)."""
        text, ids = self.tokenize_prompt(prompt)
        kept = truncate_prompt(ids, params.truncate_prompt_tokens, self.config.model_config.max_model_len)
        return (text if len(kept) == len(ids) else None), kept

    def validate_prompt(self, token_ids: list[int]) -> None:
        mc = self.config.model_config
        # InvalidParameterError is a ValueError too, as vLLM raises for these.
        if not token_ids:
            raise InvalidParameterError("the prompt is empty (0 tokens)", "prompt")
        vocab = mc.arch.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidParameterError(f"prompt token id {bad} is out of range for a vocabulary of {vocab}", "prompt")
        if len(token_ids) > mc.max_model_len:
            raise InvalidParameterError(
                f"the prompt has {len(token_ids)} tokens, more than --max-model-len {mc.max_model_len}", "prompt"
            )

    def validate_params(self, params: SamplingParams) -> None:
        """Logprob counts within --max-logprobs, and token ids in the sampling parameters in the
        vocabulary: the sampler indexes the logits with them (a bad one would fail the whole step's batch)."""
        mc = self.config.model_config
        check_max_logprobs(params, mc.max_logprobs)
        vocab = mc.arch.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
            bad = sorted(t for t in ids if not 0 <= t < vocab)
            if bad:
                raise InvalidParameterError(f"{name}: token id(s) {bad[:8]} out of range for a vocabulary of {vocab}",
                                            name)

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> Sequence | ParentRequest:
        """Queue a request; its Sequence, or for `params.n > 1` the ParentRequest
        of its n sequences (both have `request_id`)."""
        # The request keeps its own copy, as vLLM's clone() does: a caller
        # changing or reusing the object afterwards does not reach a running
        # request, and per-row metadata cached on the object's identity (the
        # model runner's reused SamplingMetadata) cannot go stale.
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidParameterError(f"sampling params must be a SamplingParams, got {type(params).__name__}",
                                        "sampling_params")
        params = copy.deepcopy(params) if params is not None else SamplingParams()
        # Checked again here: fields may have been changed since construction
        # (n = 0 would fail inside a step, taking the batch).
        params.validate()
        text, ids = self.prompt_for(prompt, params)
        self.validate_prompt(ids)
        self.validate_params(params)
        request_id = request_id if request_id is not None else self.new_request_id()
        if request_id in self.seqs or request_id in self.parents:
            raise UserError(f"request id '{request_id}' is already in use")
        if params.n == 1:
            return self._add_sequence(request_id, ids, params, text, arrival_time)
        # Parallel sampling as in vLLM: one sequence per sample, id "{i}_{request_id}",
        # sample i seeded with seed + i, so seeded samples differ and stay reproducible.
        # With prefix caching they share the prompt's full blocks.
        child_ids = [f"{i}_{request_id}" for i in range(params.n)]
        taken = [c for c in child_ids if c in self.seqs or c in self.parents]
        if taken:
            raise UserError(f"request id '{taken[0]}' (sample of '{request_id}') is already in use")
        parent = ParentRequest(request_id, [])
        for i, child_id in enumerate(child_ids):
            child = copy.deepcopy(params)
            child.n = 1
            if params.seed is not None:
                child.seed = params.seed + i
            seq = self._add_sequence(child_id, ids, child, text, arrival_time)
            seq.parent, seq.index = parent, i
            parent.children.append(seq)
        self.parents[request_id] = parent
        return parent

    def _add_sequence(self, request_id: str, ids: list[int], params: SamplingParams, text: str | None,
                      arrival_time: float | None) -> Sequence:
        seq = Sequence(request_id, ids, params, prompt=text)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        if params.logprobs is not None:
            seq.logprobs = []
        if params.prompt_logprobs is not None and len(ids) == 1:
            # One entry per prompt token, as for longer prompts: the first has
            # no logprob, and there is nothing else to compute.
            seq.prompt_logprobs = [None]
        if self.tokenizer is not None and params.detokenize:
            seq.detokenizer = IncrementalDetokenizer.from_params(self.tokenizer, ids, params)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str, finish_reason: str = "abort") -> bool:
        """Stop a request (every sample of an n > 1 one) and free its KV blocks;
        False if it is unknown or done. `finish_reason` "error": an engine
        failure ended it (vLLM's FinishReason.ERROR), not its caller."""
        if finish_reason not in ("abort", "error"):
            raise ValueError(f"finish_reason must be 'abort' or 'error', got {finish_reason!r}")
        parent = self.parents.pop(request_id, None)
        if parent is not None:
            aborted = [self._abort_sequence(c.request_id, finish_reason) for c in parent.children]
            return any(aborted)
        return self._abort_sequence(request_id, finish_reason)

    def get_request(self, request_id: str) -> Sequence | ParentRequest | None:
        """The running or waiting request with this id (for make_output), or None."""
        return self.parents.get(request_id) or self.seqs.get(request_id)

    def _abort_sequence(self, request_id: str, finish_reason: str) -> bool:
        seq = self.seqs.pop(request_id, None)
        if seq is None or seq.is_finished:
            return False
        seq.finish_reason = finish_reason
        self._finish(seq)
        return True

    def _finish(self, seq: Sequence) -> None:
        """Release a sequence that just got its finish_reason; its stats go
        to the current step's report (or to an abort's own)."""
        self.scheduler.finish(seq)
        if not self.stat_loggers:
            return
        if self._iteration is not None:
            self._iteration.record_finish(seq)
        else:
            stats = IterationStats()
            stats.record_finish(seq)
            report(self.stat_loggers, stats)

    def reset_prefix_cache(self) -> None:
        """Forget the prefix cache: later requests share nothing computed before (benchmarks)."""
        self.block_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits at every position of one prompt, [n, vocab]
        float32, through the engine's KV cache dtype and scales: the prefill
        writes K/V to the cache first and every position attends to the
        stored (for FP8: quantized) K/V of itself and all earlier positions,
        exactly what decode sees. Used by accuracy tools (eval-kv)."""
        if self.has_unfinished_requests():
            raise RuntimeError("prompt_logits() needs an idle engine")
        self.validate_prompt(token_ids)
        seq = Sequence("prompt-logits", list(token_ids), SamplingParams(max_tokens=1))
        if not self.block_manager.can_allocate(seq):
            raise UserError(f"a {len(token_ids)}-token prompt does not fit in the KV cache")
        self.block_manager.allocate(seq)
        try:
            return self.model_runner.prompt_logits(seq)
        finally:
            self.block_manager.free(seq)

    # ----------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; outputs for every request that advanced."""
        sched = self.scheduler.schedule()
        if sched is None or not (sched.seqs or sched.decode_seqs):
            return []
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        try:
            # Chunked prefill: the running sequences' decodes and the prefill
            # chunks of the same step run as two forward passes (the decode one
            # through the recorded decode path and the paged decode kernel).
            decode_out = (self.model_runner.execute(sched.decode_seqs, False, eos)
                          if sched.decode_seqs else None)
            out = (self.model_runner.execute(sched.seqs, sched.is_prefill, eos, sched.num_new_tokens)
                   if sched.seqs else None)
        except BaseException:
            # Blocks registered for prefix caching when this step was scheduled
            # may hold K/V it never wrote (an interrupted LLM.generate aborts
            # its requests and the engine lives on): forget them all.
            self.block_manager.reset_prefix_cache()
            raise
        self.stats.num_steps += 1
        self.stats.prefill_tokens_total += sched.num_prefill_tokens
        self._iteration = IterationStats(num_batched_tokens=sched.num_batched_tokens) if self.stat_loggers else None
        try:
            advanced = self._process(sched.decode_seqs, decode_out) if decode_out is not None else []
            if out is not None:
                advanced += self._process(sched.seqs, out, sched.num_new_tokens)
        finally:
            iteration, self._iteration = self._iteration, None
        if iteration is not None:
            report(self.stat_loggers, iteration)
        if self.proposer is not None:
            self._propose_drafts(advanced)
        return self._outputs(advanced)

    def _outputs(self, advanced: list[Sequence]) -> list[RequestOutput]:
        """One output per request that advanced: the samples of an n > 1 request
        are reported together, once per step, with every sample's state."""
        outputs, seen = [], set()
        for seq in advanced:
            owner = seq.parent or seq
            if id(owner) in seen:
                continue
            seen.add(id(owner))
            outputs.append(self.make_output(owner))
            if seq.parent is not None and owner.is_finished:
                self.parents.pop(owner.request_id, None)
        return outputs

    def _process(self, seqs: list[Sequence], out: ModelRunnerOutput,
                 num_new_tokens: list[int] | None = None) -> list[Sequence]:
        """Apply one forward pass's results; the sequences that got a token.
        With `num_new_tokens` (chunked prefill) a sequence whose chunk ends
        before its last token only advances: nothing was sampled for it and it
        has no output yet."""
        advanced = []
        sampled = seqs
        if num_new_tokens is not None:
            sampled = [seqs[r] for r in out.sampled_rows]
            done = set(out.sampled_rows)
            for row, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
                if row in out.prompt_logprobs:
                    seq.prompt_logprob_parts.append(out.prompt_logprobs[row])
                if row in done:
                    continue
                seq.num_computed_tokens += n
                if self.block_manager.enable_prefix_caching:
                    self.block_manager.cache_computed_blocks(seq)
        if not sampled:
            return advanced
        so = out.sampler_output
        token_ids = so.sampled_token_ids.tolist()
        want_lp = so.logprobs is not None
        if want_lp:
            lps, ranks = so.logprobs.tolist(), so.ranks.tolist()
            top_lps, top_ids = so.top_logprobs.tolist(), so.top_token_ids.tolist()
        now = time.monotonic()
        mc = self.config.model_config
        cache_blocks = self.block_manager.enable_prefix_caching
        rows = out.sampled_rows if num_new_tokens is not None else range(len(seqs))
        counts = out.num_sampled_tokens
        i = 0  # into the sampler output's tokens
        num_generated = 0
        for row, seq in enumerate(sampled):
            if num_new_tokens is not None:
                self._finish_prompt_logprobs(seq)
            elif rows[row] in out.prompt_logprobs:
                seq.prompt_logprobs = self._prompt_logprobs(seq, out.prompt_logprobs[rows[row]])
            count = counts[row] if counts is not None else 1
            if seq.spec_token_ids:
                st = self.stats
                st.spec_decode_num_drafts += 1
                st.spec_decode_num_draft_tokens += len(seq.spec_token_ids)
                st.spec_decode_num_accepted_tokens += count - 1
                seq.spec_draft_limit = max(1, 2 * (count - 1))
                seq.spec_token_ids = []
            for j in range(i, i + count):
                token = token_ids[j]
                seq.output_token_ids.append(token)
                num_generated += 1
                if want_lp:
                    seq.cumulative_logprob += lps[j]
                    if seq.logprobs is not None:
                        k = seq.sampling_params.logprobs
                        entry = {token: Logprob(lps[j], ranks[j], self._decode_one(token, seq))}
                        for r, (tid, lp) in enumerate(zip(top_ids[j][:k], top_lps[j][:k]), start=1):
                            if tid not in entry:
                                entry[tid] = Logprob(lp, r, self._decode_one(tid, seq))
                        seq.logprobs.append(entry)
                stop_token = self._stops_on_token(seq, token)
                # As vLLM: the text of a stop token (EOS, stop_token_ids) is left
                # out of the output unless include_stop_str_in_output.
                if seq.detokenizer is not None and (not stop_token
                                                    or seq.sampling_params.include_stop_str_in_output):
                    seq.detokenizer.append(token)
                self._check_stop(seq, token, stop_token, mc.max_model_len)
                if seq.finish_reason is not None:
                    break  # a stop drops the kept drafts after it
            i += count
            # The K/V of every token but the newest are in the cache (a verify
            # pass computed those of the kept drafts too).
            seq.num_computed_tokens = seq.num_tokens - 1
            if seq.first_token_time is None:
                seq.first_token_time = now
                self.stats.prompt_tokens_total += seq.num_prompt_tokens
                self.stats.prompt_tokens_cached_total += min(seq.num_cached_tokens, seq.num_prompt_tokens)
            seq.last_token_time = now
            if cache_blocks:  # before a finish frees them
                self.block_manager.cache_computed_blocks(seq)
            if seq.finish_reason is not None:
                self._finish(seq)
                self.seqs.pop(seq.request_id, None)
            advanced.append(seq)
        self.stats.generation_tokens_total += num_generated
        if self._iteration is not None:
            self._iteration.num_generation_tokens += num_generated
        return advanced

    def _propose_drafts(self, seqs: list[Sequence]) -> None:
        """Speculative decoding: drafts for the next step of each running
        sequence, no more than it may still generate less the token the step
        emits anyway (max_tokens, the model length); none while at least
        `disable_by_batch_size` requests are running or waiting. The scheduler
        may cut them (Scheduler.trim_drafts)."""
        limit = self.config.speculative_config.disable_by_batch_size
        if limit is not None and self.scheduler.num_running + self.scheduler.num_waiting >= limit:
            return
        max_model_len = self.config.model_config.max_model_len
        for seq in seqs:
            if seq.finish_reason is not None:
                continue
            room = max_model_len - seq.num_tokens - 1
            max_tokens = seq.sampling_params.max_tokens
            if max_tokens is not None:
                room = min(room, max_tokens - len(seq.output_token_ids) - 1)
            if room > 0:
                seq.spec_token_ids = self.proposer.propose(seq.token_ids, room)

    def _stops_on_token(self, seq: Sequence, token: int) -> bool:
        """Whether `token`, just appended to seq's output, ends it: EOS (unless
        ignore_eos) or one of stop_token_ids, once min_tokens are out."""
        p = seq.sampling_params
        if len(seq.output_token_ids) < p.min_tokens:
            return False
        return (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids

    def _check_stop(self, seq: Sequence, token: int, stop_token: bool, max_model_len: int) -> None:
        """`stop_token`: _stops_on_token(seq, token), computed once by the caller."""
        p = seq.sampling_params
        n_out = len(seq.output_token_ids)
        if seq.detokenizer is not None and seq.detokenizer.is_stopped:
            seq.finish_reason, seq.stop_reason = "stop", seq.detokenizer.stop_reason
        elif stop_token:
            # EOS has no stop_reason (vLLM: None); a stop_token_ids entry is its own.
            is_eos = not p.ignore_eos and token in self.eos_token_ids
            seq.finish_reason, seq.stop_reason = "stop", None if is_eos else token
        elif p.max_tokens is not None and n_out >= p.max_tokens:
            seq.finish_reason = "length"
        elif seq.num_tokens >= max_model_len:
            seq.finish_reason = "length"

    def _decode_one(self, token_id: int, seq: Sequence) -> str | None:
        if self.tokenizer is None or not seq.sampling_params.detokenize:
            return None
        return self.tokenizer.decode([token_id])

    def _finish_prompt_logprobs(self, seq: Sequence) -> None:
        """Chunked prefill: once the chunks hold every prompt position's
        logprobs, join them into the sequence's prompt_logprobs."""
        parts = seq.prompt_logprob_parts
        if not parts or seq.prompt_logprobs is not None:
            return
        if sum(p.logprobs.shape[0] for p in parts) < seq.num_prompt_tokens - 1:
            return
        joined = PromptLogprobs(*(torch.cat([getattr(p, f) for p in parts])
                                  for f in ("logprobs", "ranks", "top_logprobs", "top_token_ids")))
        parts.clear()
        seq.prompt_logprobs = self._prompt_logprobs(seq, joined)

    def _prompt_logprobs(self, seq: Sequence, plp) -> list[dict | None]:
        k = seq.sampling_params.prompt_logprobs
        result: list[dict | None] = [None]
        lps, ranks = plp.logprobs.tolist(), plp.ranks.tolist()
        tops, top_ids = plp.top_logprobs.tolist(), plp.top_token_ids.tolist()
        for i, tok in enumerate(seq.prompt_token_ids[1:]):
            entry = {tok: Logprob(lps[i], ranks[i], self._decode_one(tok, seq))}
            for r, (tid, lp) in enumerate(zip(top_ids[i][:k], tops[i][:k]), start=1):
                if tid not in entry:
                    entry[tid] = Logprob(lp, r, self._decode_one(tid, seq))
            result.append(entry)
        return result

    def make_output(self, request: Sequence | ParentRequest) -> RequestOutput:
        """The request's output so far; a sample of an n > 1 request gives its parent's."""
        if isinstance(request, Sequence) and request.parent is not None:
            request = request.parent
        if isinstance(request, ParentRequest):
            first = request.children[0]
            prompt_logprobs = next((c.prompt_logprobs for c in request.children if c.prompt_logprobs is not None),
                                   None)
            return RequestOutput(
                request_id=request.request_id,
                prompt=first.prompt,
                prompt_token_ids=first.prompt_token_ids,
                prompt_logprobs=prompt_logprobs,
                outputs=[self._completion(c) for c in request.children],
                finished=request.is_finished,
            )
        seq = request
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            prompt_logprobs=seq.prompt_logprobs,
            outputs=[self._completion(seq)],
            finished=seq.finish_reason is not None,
        )

    def _completion(self, seq: Sequence) -> CompletionOutput:
        text = seq.detokenizer.text if seq.detokenizer is not None else ""
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            logprobs=seq.logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )


def _describe(value) -> str:
    """A short name of what a prompt's token ids were given as."""
    if isinstance(value, (list, tuple)):
        odd = next((t for t in value if not (isinstance(t, int) and not isinstance(t, bool))), None)
        return f"a {type(value).__name__} holding {type(odd).__name__} {odd!r}"
    return type(value).__name__
