"""Prefill forwards recorded once and replayed at any token count between
two row thresholds of the model's kernels: the CPU counterpart of vLLM's
prefill forwards compiled with the token count as a symbolic size. Fresh
prefills, and prefills that continue cached contexts (prefix-cache hits,
later chunks of a chunked prefill), each with their own recordings.

Why: a prefill's forward spends time outside its kernels too (the module
tree, the layers' checks, ~630 op dispatches from Python), and after each
kernel that streamed megabytes that Python runs out of cache. Measured on
the default model, bf16, AMD EPYC Zen 4 (one process, bit-identical
outputs): the forward alone 84.3 -> 74.7 ms at 128 tokens, 335 -> 322 ms at
512, 684 -> 670 ms at 1024 (Python replay); whole engine steps alternated
with an eager engine 1.04-1.10x as fast at 128-1024 tokens, counts never
recorded included (benchmarks/results/prefill_capture_2026-12-04_zen4.md).

How: as for decode (decode_capture.py), one forward runs under the op
recorder and becomes straight-line Python (compiled_replay.CapturedForward).
The model's trunk (every layer but the last; outputs: hidden states and
residual) and its head (the last layer and the final norm) are recorded
apart: a prefill runs the head past attention on each sequence's last
token only (the model's forward_head with `logits_indices`), so the
head's row counts follow the number of prompts as well as the token
count, and its recordings are keyed by that number (a step with prompt
logprobs, every row through the head, under a key of its own). A trunk
replay whose head has no recording yet runs the head eagerly: one
layer's module tree, ~0.3-0.4 ms of Python on the default model (Zen 4),
which a single-prompt chat then pays only until its head is recorded.
A recording at one token count replays that count; a second recording at
another count in the same segment (below) is unified with the first
(`unify`: the same ops, every int that differs is k times the token count
in both), and the forward compiled from it takes the token count as `n`
and serves every count in the segment without recording again. That one
is compiled with TorchScript too (Python where it cannot be scripted): in
engine steps on the same Zen 4, 1.02-1.13x the Python replay at 128-1024
tokens, for ~0.2 s a compile, which only a segment's lasting forward pays.

What makes that safe: the forward's ops depend on the token count only
through Python that picks a kernel by row count (each linear layer's
`LinearMethod.apply`) or the attention route (the backend's
`prefill_capture_inputs`, asked every step). Every linear method lists
the row counts where its choice may change (`row_breakpoints`); the
segments lie between them, so within one every choice is the same one. A
method that cannot list them (None) keeps prefills eager. Token ids,
positions, slots and query_start_loc are the replay's inputs, plus, for a
prefill over cached contexts, what the backend's context kernel reads (the
contexts' slots, cu_seqlens_k, and the K/V buffers it gathers the cache
into, allocated with the step's metadata): no size that depends on the
contexts' lengths or the number of prompts is left in the recording, so
those need no symbol. Nothing else of the step may be baked in
(`foreign_constants`, checked at recording). Measured, default model on
the same Zen 4, 24-512 new tokens over a cached 512-token prefix: 1.03-1.16x
as fast as eager (bf16), 1.05-1.21x with an FP8 cache
(benchmarks/results/prefill_capture_context_2026-12-04_zen4.md).
Unlike decode, a replay is not run once more against the recorded output
at run time (that would cost a whole prefill forward per recording);
tests/engine/test_prefill_capture.py compares every replay, TorchScript
included, with the eager forward of the same step bit for bit.

What it costs: a recording runs the forward under the recorder (~20-60 ms
more than an eager forward at 512 tokens) and compiles it (~20 ms in
Python; TorchScript adds ~0.2 s at the second), so a segment runs
`record_after` eager prefills before it is recorded: a range of prompt
lengths met once or twice never pays for it. A recording holds every
intermediate of the forward until it ends, so one that passes
MAX_RECORD_BYTES of them is abandoned (the step runs on eagerly) and its
segment records only smaller prefills from then on.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fp8serve.attention.forward_context import set_forward_context
from fp8serve.attention.metadata import AttentionMetadata
from fp8serve.engine.compiled_replay import CapturedForward, output_slots, unify
from fp8serve.engine.decode_capture import foreign_constants
from fp8serve.engine.op_recorder import record

logger = logging.getLogger(__name__)

# What a recording may hold of the forward's intermediates (a recorded forward
# keeps them all until it ends: op_recorder.OpRecorder) before it gives up and
# the step runs on eagerly. The default model's trunk makes ~0.43 MiB of them
# a token (bf16: 219 MiB at 512 tokens, 427 MiB at 1000), so this records
# prefills of up to ~1200 tokens; a larger model, fewer. Above that the Python
# a replay saves is noise next to the step (16 x 512 tokens on a Zen 4: replays
# 4.9-5.35 s, eager steps 4.9-5.2 s), while holding them cost +2.0-2.7 s at the
# recording (benchmarks/results/prefill_record_budget_2026-12-07_zen4.md).
MAX_RECORD_BYTES = 512 << 20


@dataclass
class _Segment:
    """The recording of one (segment, KV scales) key."""

    forward: CapturedForward | None = None  # recorded at forward.batch_size tokens
    general: bool = False  # forward takes any token count of the segment
    eager_steps: int = 0  # eager prefills since the last recording
    exact_only: bool = False  # a second recording did not unify: replay forward.batch_size only
    disabled: str | None = None  # why this key stays eager
    record_below: int | None = None  # token counts from here up passed the recording budget


class PrefillCaptures:
    """The model runner's recorded prefill forwards. `forward(input_ids,
    positions, md)` replays the one for the step's segment, records one, or
    runs the model eagerly (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, attn_layers: Sequence[torch.nn.Module], backend,
                 compute_dtype: torch.dtype, enabled: bool, record_after: int = 2) -> None:
        if record_after < 0:
            raise ValueError(f"record_after must be >= 0, got {record_after}")
        # Bytes of intermediates a recording may hold (None: no limit; tests and benchmarks set it).
        self.max_record_bytes: int | None = MAX_RECORD_BYTES
        self.model = model
        self.attn_layers = list(attn_layers)
        self.backend = backend
        self.compute_dtype = compute_dtype
        self.record_after = record_after
        self.enabled = (enabled and bool(getattr(type(model), "supports_decode_capture", False))
                        and hasattr(model, "forward_trunk"))
        self._breakpoints: list[int] | None = None
        if self.enabled:
            self._breakpoints = self._row_breakpoints()
            if self._breakpoints is None:
                self.enabled = False
        self._segments: dict[tuple, _Segment] = {}
        self._logged = False
        self.num_replays = 0  # prefill forwards served by a replay
        self.num_context_replays = 0  # those of prefills continuing cached contexts
        self.num_head_replays = 0  # prefill heads (last layer, final norm) served by a replay
        self.num_recorded = 0  # recordings made (trunks and heads)

    def reset(self) -> None:
        """Forget every recording and ask the linear methods for their row
        breakpoints again (benchmarks that switch a kernel path mid-process)."""
        self._segments.clear()
        self.num_recorded = 0
        if self.enabled:
            self._breakpoints = self._row_breakpoints()
            self.enabled = self._breakpoints is not None

    def _row_breakpoints(self) -> list[int] | None:
        points: set[int] = set()
        for module in self.model.modules():
            method = getattr(module, "quant_method", None)
            if method is None:
                continue
            found = method.row_breakpoints(module, self.compute_dtype)
            if found is None:
                logger.debug("prefill forwards stay eager: %s lists no row breakpoints", type(method).__name__)
                return None
            points.update(found)
        points.add(2)  # one row: size-1 dimensions make more views contiguous
        return sorted(points)

    def segment_of(self, num_tokens: int) -> int:
        """The segment a prefill of `num_tokens` tokens falls in."""
        return bisect.bisect_right(self._breakpoints or [], num_tokens)

    def _eager(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
               logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        with set_forward_context(md):
            return self.model(input_ids, positions, logits_indices)

    def _trunk(self, input_ids: torch.Tensor, positions: torch.Tensor,
               md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        with set_forward_context(md):
            return self.model.forward_trunk(input_ids, positions)

    def _head(self, positions: torch.Tensor, trunk: tuple[torch.Tensor, torch.Tensor], md: AttentionMetadata,
              logits_indices: torch.Tensor | None) -> torch.Tensor:
        with set_forward_context(md):
            return self.model.forward_head(positions, *trunk, logits_indices)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """The step's final hidden states: of every token, or of the rows
        `logits_indices` (each sequence's last token, see the model's
        `forward`). The model's trunk (every layer but the last) and its head
        (the last layer, the final norm) are recorded apart: the head's ops
        depend on the number of sequences too (its rows past attention), so
        its recordings are keyed by it as well, and a head whose key has no
        recording yet runs eagerly after a replayed trunk."""
        extra = self.backend.prefill_capture_inputs(md) if self.enabled else None
        if extra is None or any(a.kv_observer is not None or a.calculate_kv_scales for a in self.attn_layers):
            return self._eager(input_ids, positions, md, logits_indices)
        n = md.num_tokens
        # Fresh prefills and those continuing cached contexts (extra inputs) run different ops.
        key = (len(extra), self.segment_of(n)) + tuple(a.scales_key() for a in self.attn_layers)
        inputs = (input_ids, positions, md.slot_mapping, md.query_start_loc) + tuple(extra)
        trunk, how = self._serve(("trunk",) + key, n, inputs, lambda: self._trunk(input_ids, positions, md))
        if how == "eager":
            return self._eager(input_ids, positions, md, logits_indices)
        if how == "replayed":
            self.num_replays += 1
            self.num_context_replays += bool(extra)
        if trunk[1] is None:  # a one-layer model: no residual yet
            return self._head(positions, trunk, md, logits_indices)
        pruned = logits_indices is not None
        head_inputs = (positions, trunk[0], trunk[1], md.slot_mapping, md.query_start_loc) + (
            (logits_indices,) if pruned else ()) + tuple(extra)
        head_key = ("head", md.num_seqs if pruned else None) + key
        out, how = self._serve(head_key, n, head_inputs, lambda: self._head(positions, trunk, md, logits_indices))
        if how == "eager":
            return self._head(positions, trunk, md, logits_indices)
        self.num_head_replays += how == "replayed"
        return out

    def _serve(self, key: tuple, n: int, inputs: tuple[torch.Tensor, ...], run) -> tuple[object, str]:
        """`run()`'s output for this step from the recording under `key`:
        (output, "replayed"), or (output, "recorded") where this step was
        recorded, (output, "unrecorded") where its recording passed the
        budget (max_record_bytes) and was abandoned, or (None, "eager") where
        the caller runs it eagerly."""
        seg = self._segments.get(key)
        if seg is None:
            seg = self._segments[key] = _Segment()
        fwd = seg.forward
        if fwd is not None and (seg.general or fwd.batch_size == n):
            return (fwd if fwd.batch_size == n else fwd.bind(n)).replay(*inputs), "replayed"
        if seg.disabled or (fwd is not None and seg.exact_only):
            return None, "eager"
        if seg.eager_steps < self.record_after:
            seg.eager_steps += 1
            return None, "eager"
        if seg.record_below is not None and n >= seg.record_below:
            return None, "eager"  # too large to record; a smaller prefill may still be
        output, recorder = record(run, inputs, self.max_record_bytes)
        if recorder.abandoned:
            seg.record_below = n if seg.record_below is None else min(seg.record_below, n)
            logger.debug("prefill %s of %d tokens not recorded: its intermediates passed %d bytes", key[0], n,
                         self.max_record_bytes)
            return output, "unrecorded"
        seg.eager_steps = 0
        self.num_recorded += 1
        out_slot = output_slots(recorder, output)
        what = f"prefill {key[0]}s"
        if out_slot is None:
            seg.disabled = "the outputs were not produced by recorded ops"
            return output, "recorded"
        if fwd is None:
            try:
                fwd = CapturedForward(recorder, len(inputs), output, n, script=False)
            except ValueError as e:
                seg.disabled = str(e)
            else:
                seg.disabled = foreign_constants(self.model, self.attn_layers, fwd)
            if seg.disabled:
                logger.warning("%s of %d tokens run eagerly: %s", what, n, seg.disabled)
                return output, "recorded"
            seg.forward = fwd
        else:
            scaled = unify(fwd, recorder.calls, out_slot, n)
            if scaled is None:
                # A row threshold no `row_breakpoints` lists, or a size not proportional to the
                # token count: keep replaying the first count only.
                logger.info("%s of %d and %d tokens differ beyond their token count: only %d tokens replay in "
                            "that range", what, fwd.batch_size, n, fwd.batch_size)
                seg.exact_only = True
                return output, "recorded"
            seg.forward = CapturedForward(recorder, len(inputs), output, n, scaled)
            seg.general = True
        if not self._logged:
            logger.info("prefill forwards are recorded and replayed at any token count between the kernels' "
                        "row thresholds (--enforce-eager: off)")
            self._logged = True
        return output, "recorded"
