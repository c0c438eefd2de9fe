"""Decode forwards recorded once per batch size and replayed as a flat list of
op calls: the CPU counterpart of vLLM's CUDA graphs (and of its
`--enforce-eager`, which turns them off).

Why: at small batches the module tree (nn.Module calls, attribute lookups,
dtype and path checks, ~660 op dispatches from Python) is a large part of a
decode step. Measured on a 2-vCPU Xeon, the default model's FP8 checkpoint at
batch 1 (engine steps, three alternating runs): 15.6-17.2 ms eager against
11.8-12.6 ms replayed, with bit-identical outputs.

How: one decode forward (a batch size's fifth: see DecodeCaptures.record_after)
runs while every op it dispatches is recorded
(fp8serve/engine/op_recorder.py); the recording is compiled to code that
calls the same ops on a new step's inputs (fp8serve/engine/compiled_replay.py:
TorchScript where it can be scripted, ~2 ms less per batch-1 step than
straight-line Python, else Python). A new batch size is recorded too, but
shares an earlier size's compiled replay where the two recordings differ only
in batch-sized dimensions (which the compiled code then takes as `n * k`):
see DecodeCaptures.

Batches of up to STATIC_PLAN_MAX_BATCH sequences replay as static plans
instead where the recording allows (fp8serve/engine/static_plan.py): the
recorded kernels called from C++ on the recording's own tensors, no
TorchScript, views or allocations; the rest as above.

What a replay assumes, and how it is enforced:
  - the forward takes the same path for every step of this batch size:
    decode-only steps on the C++ paged backend, batch size fixed per capture,
    and models whose forward has no data-dependent Python (`supports_decode_
    capture` on the model class: Llama yes, Mixtral's routing no);
  - Python numbers baked into the calls stay valid: the KV scales are part
    of the capture's key, and layers with a KV observer or pending scale
    calculation are never captured;
  - the recording is checked: its first replay must reproduce the recorded
    forward's output bit for bit, or the batch size stays eager.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import torch

from fp8serve.attention.forward_context import set_forward_context
from fp8serve.attention.metadata import AttentionMetadata
from fp8serve.engine.compiled_replay import CapturedForward, unify
from fp8serve.engine.op_recorder import OpRecorder, record
from fp8serve.engine.static_plan import StaticPlan, Unsupported
from fp8serve.kernels.cpu_ops import load_cpu_ops

logger = logging.getLogger(__name__)


_MISSING = object()

# Largest batch replayed as a static plan: the plan keeps every intermediate
# tensor of its recording (~0.9 MiB per sequence on the default model), and
# what it saves (0.7-2.0 ms a forward at batches 1-8 on the FP8 checkpoint,
# benchmarks/results/static_plan_2026-12-02_zen3.md) matters less as steps grow.
STATIC_PLAN_MAX_BATCH = 8


class DecodeCaptures:
    """The model runner's recorded decode forwards, one per (batch size, KV
    scales). `forward(input_ids, positions, metadata)` replays the matching
    one, records it (on its fifth use: see `record_after`), or runs the
    model eagerly where a replay would not be safe (see the module docstring).

    Compiling a recording (TorchScript ~130 ms, the Python replay ~10 ms) is
    most of what a new batch size costs; a serving batch changes size often
    (admissions, finishes, preemptions, the drain at the end: the default
    model's first step at each size took ~190 ms against ~13 ms replayed).
    So a new size is still recorded, but where its recording is an earlier
    one's with only the batch-sized dimensions changed (`unify`), it shares
    that compiled forward; only the bit-for-bit check of its first replay runs.
    Sizes whose ops differ (another kernel above some row count) compile
    their own, which the sizes after them can share in turn.

    Even shared, a recording costs two forwards (the eager one under the
    recorder, ~1.3-1.8x a plain eager step, and the checked replay): 2-3.5
    replayed steps, and a size that needs a compile of its own ~10-50. Many
    sizes never come back: the drain at the end of a batch, and above all
    speculative decoding, whose verify passes have as many rows as the
    batch's drafts plus one (every count up to batch x (1 + k)). An eager
    step costs only 1.05-1.4 replayed ones, so, as in renting skis before
    buying, a size runs `record_after` eager steps (default 4) before it is
    recorded: a size that lives a few steps is never recorded, and one that
    lives on pays at most ~1.5 replayed steps more, once. On the default
    model, against recording at first use: a fresh engine's batch of 24
    speculating requests ran 1.06-1.76x as fast, a drain through 16 sizes of
    1-4 steps each took 0.40-0.73x the decode time; sizes of 8 steps cost
    1.16-1.25x, and a second pass over shapes met once 0.73-1.00x
    (benchmarks/results/decode_capture_record_after_2026-12-01_zen4.md).

    The same rule for the engine's first compile (TorchScript's start-up
    included, ~0.2 s more than an eager step on the default model, against
    ~4 ms that an eager step costs more than a replay): no recording that
    compiles is made before the engine has run `first_record_after` eager
    decode steps (default 64, what `fp8serve generate` asks for by default),
    so a short run never pays for a compile it cannot win back, and a long
    one pays at most ~0.25 s more. A static plan compiles nothing (~30 ms
    more than an eager step, won back in ~5 replays): batches up to
    STATIC_PLAN_MAX_BATCH follow `record_after` alone, until a recording of
    the model makes no static plan (then that batch size and larger ones wait
    like the rest: which kernels a forward calls changes with its rows, e.g.
    bf16_tiled_gemm from 3 rows, which no plan replays, so smaller batches
    still try). Until
    stop 47 every first recording also imported torch._dynamo (~0.5 s: see
    op_recorder.py), and every recording waited."""

    def __init__(self, model: torch.nn.Module, attn_layers: Sequence[torch.nn.Module], enabled: bool,
                 record_after: int = 4, first_record_after: int = 64) -> None:
        for name, value in (("record_after", record_after), ("first_record_after", first_record_after)):
            if value < 0:
                raise ValueError(f"{name} is a number of eager steps >= 0, got {value}")
        self.model = model
        self.attn_layers = list(attn_layers)
        self.enabled = enabled and bool(getattr(type(model), "supports_decode_capture", False))
        self.record_after = record_after
        self.first_record_after = first_record_after
        self._eager_total = 0  # eager decode steps before the first compile (first_record_after)
        self._captures: dict[tuple, CapturedForward | None] = {}
        self._eager_steps: dict[tuple, int] = {}  # keys not yet recorded: eager steps run so far
        self._templates: list[CapturedForward] = []  # compiled forwards a new batch size may share
        self.share_compiled = True  # False: every batch size compiles its own (benchmarks' A/B)
        self._logged = False
        # The smallest batch size whose recording made no static plan (None: none yet).
        self._no_static_from: int | None = None
        self.num_replays = 0  # decode forwards served by a replay
        self.num_compiled = 0  # recordings compiled (the rest shared a compiled forward)
        # Batch sizes up to static_plan_max_batch replay as static plans where
        # the recording allows (see _static_plan); FP8SERVE_STATIC_PLAN=0: never.
        self.static_plans = os.environ.get("FP8SERVE_STATIC_PLAN", "1") != "0"
        self.static_plan_max_batch = STATIC_PLAN_MAX_BATCH
        self.num_static = 0  # recordings replayed as static plans

    def _eager(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        with set_forward_context(md):
            return self.model(input_ids, positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        if (not self.enabled or not md.is_decode_only or md.backend_data is not None
                or any(a.kv_observer is not None or a.calculate_kv_scales for a in self.attn_layers)):
            return self._eager(input_ids, positions, md)
        key = (md.num_seqs,) + tuple(a.scales_key() for a in self.attn_layers)
        inputs = (input_ids, positions, md.slot_mapping, md.block_tables, md.seq_lens)
        recorded = self._captures.get(key, _MISSING)
        if recorded is None:
            return self._eager(input_ids, positions, md)
        if recorded is not _MISSING:
            self.num_replays += 1
            return recorded.replay(*inputs)
        steps = self._eager_steps.get(key, 0)
        static = (self.static_plans and md.num_seqs <= self.static_plan_max_batch
                  and (self._no_static_from is None or md.num_seqs < self._no_static_from))
        if steps < self.record_after or (not static and self._compile_waits()):
            self._eager_steps[key] = steps + 1
            self._eager_total += 1
            return self._eager(input_ids, positions, md)
        start = time.perf_counter()
        output, recorder = record(lambda: self._eager(input_ids, positions, md), inputs)
        if static:
            plan = self._static_plan(recorder, inputs, output)
            if plan is not None:
                self._eager_steps.pop(key, None)
                self._captures[key] = plan
                self.num_static += 1
                return output
            # This model's recordings of this many rows and more make no static plans: those wait
            # like any compile from now on.
            self._no_static_from = min(md.num_seqs, self._no_static_from or md.num_seqs)
            if self._compile_waits():
                self._eager_steps[key] = steps + 1
                self._eager_total += 1
                return output
        self._eager_steps.pop(key, None)
        recorded, template, compiled = self._compile(recorder, output, len(inputs), md.num_seqs)
        problem = recorded if isinstance(recorded, str) else self._problem(recorded, output, inputs)
        if logger.isEnabledFor(logging.DEBUG):
            how = ("compiled" if compiled else
                   f"shares the compiled replay of batch size {template.batch_size}" if template else "not replayable")
            logger.debug("decode batch size %d recorded in %.0f ms: %s", md.num_seqs,
                         1e3 * (time.perf_counter() - start), how)
        if problem:
            logger.warning("decode batch size %d runs eagerly: %s", md.num_seqs, problem)
            self._captures[key] = None
            return output
        if not self._logged:
            wait = (f", and none that compiles in the engine's first {self.first_record_after}"
                    if self.first_record_after else "")
            logger.info("decode forwards are recorded once per batch size (after %d eager steps of it%s) and "
                        "replayed (--enforce-eager: off)", self.record_after, wait)
            self._logged = True
        self._captures[key] = recorded
        if compiled:
            self.num_compiled += 1
            # A compile that generalizes `template` (more batch-sized dimensions) takes its place.
            if template is not None:
                self._templates[self._templates.index(template)] = recorded
            else:
                self._templates.append(recorded)
        return output

    def _compile_waits(self) -> bool:
        """Whether a recording that needs a compile waits (first_record_after)."""
        return not self._templates and self._eager_total < self.first_record_after

    def _static_plan(self, recorder: OpRecorder, inputs: Sequence[torch.Tensor],
                     output: torch.Tensor) -> StaticPlan | None:
        """The recording as a static plan, checked like a compiled replay
        (its first run must reproduce the recorded output bit for bit), or None."""
        if load_cpu_ops() is None:
            return None
        try:
            plan = StaticPlan(recorder, inputs, output)
        except Unsupported as e:
            logger.debug("decode batch size %d: no static plan (%s)", output.shape[0], e)
            return None
        expected = output.clone()
        try:
            same = _same(plan.replay(*inputs), expected)
        except RuntimeError as e:  # a kernel refused the plan's tensors
            logger.info("decode batch size %d: the static plan failed (%s); using the compiled replay",
                        output.shape[0], str(e).splitlines()[0] if str(e) else type(e).__name__)
            same = False
        else:
            if not same:
                logger.info("decode batch size %d: the static plan did not reproduce the recorded output; "
                            "using the compiled replay", output.shape[0])
        if not same:
            output.copy_(expected)
            return None
        return plan

    def _compile(self, recorder: OpRecorder, output: torch.Tensor, num_inputs: int,
                 batch_size: int) -> tuple[CapturedForward | str, CapturedForward | None, bool]:
        """(the replay for this recording or why there is none, the compiled
        forward it unified with, whether it was compiled anew)."""
        out_slot = recorder.slot_of.get(id(output))
        if out_slot is None:
            return "the forward's output was not produced by a recorded op", None, False
        try:
            for template in self._templates if self.share_compiled else ():
                scaled = unify(template, recorder.calls, out_slot, batch_size)
                if scaled is None:
                    continue
                if scaled == template.scaled:
                    return template.bind(batch_size), template, False
                return CapturedForward(recorder, num_inputs, output, batch_size, scaled), template, True
            return CapturedForward(recorder, num_inputs, output, batch_size), None, True
        except ValueError as e:
            return str(e), None, False

    def reset(self) -> None:
        """Forget every recording (benchmarks: each run as a fresh engine)."""
        self._captures.clear()
        self._templates.clear()
        self._eager_steps.clear()
        self._eager_total = 0
        self._no_static_from = None
        self.num_compiled = 0
        self.num_static = 0

    @property
    def recorded_batch_sizes(self) -> list[int]:
        return sorted({key[0] for key, rec in self._captures.items() if rec is not None})

    @property
    def scripted_batch_sizes(self) -> list[int]:
        """Batch sizes whose replay runs compiled: in the TorchScript
        interpreter or as a static plan (not straight-line Python)."""
        return sorted({key[0] for key, rec in self._captures.items()
                       if rec is not None and (isinstance(rec, StaticPlan) or rec.replay is not rec.python_replay)})

    @property
    def static_batch_sizes(self) -> list[int]:
        """Batch sizes replayed as static plans."""
        return sorted({key[0] for key, rec in self._captures.items() if isinstance(rec, StaticPlan)})

    def _problem(self, recorded: CapturedForward, output: torch.Tensor, inputs) -> str | None:
        """Why `recorded` must not be replayed, or None."""
        problem = foreign_constants(self.model, self.attn_layers, recorded)
        if problem:
            return problem
        again = recorded.replay(*inputs)
        if recorded.replay is not recorded.python_replay and not _same(again, output):
            logger.info("decode batch size %d: the TorchScript replay did not reproduce the recorded output; "
                        "replaying in Python", output.shape[0])
            recorded.use_python_replay()
            again = recorded.replay(*inputs)
        if not _same(again, output):
            return "its replay did not reproduce the recorded output"
        return None


def foreign_constants(model: torch.nn.Module, attn_layers: Sequence[torch.nn.Module],
                      recorded: CapturedForward) -> str | None:
    """Why `recorded` must not be replayed on other inputs, or None: every
    tensor baked into a recording must outlive it (the model's parameters and
    buffers, and the KV caches); anything else is a per-step tensor the
    inputs do not cover."""
    # Views of them (folded at capture: see is_constant_view) share their storage.
    # oneDNN's packed weights are opaque (no storage to compare): known by identity alone.
    state = list(model.parameters()) + list(model.buffers()) + [a.kv_cache for a in attn_layers]
    owned = {id(t) for t in state}
    owned_storage = {t.untyped_storage().data_ptr() for t in state if not t.is_mkldnn}
    foreign = [t for t in recorded.tensor_constants
               if id(t) not in owned and (t.is_mkldnn or t.untyped_storage().data_ptr() not in owned_storage)]
    if foreign:
        return f"{len(foreign)} tensors of the forward are neither inputs nor model state (e.g. {tuple(foreign[0].shape)})"
    return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
