"""Recording a forward as a flat list of op calls (fp8serve/engine/
compiled_replay.py compiles the list; decode_capture.py decides when).

One forward runs under a TorchDispatchMode that records every op (aten and
fp8serve kernels) with its arguments, each tensor argument being one of the
inputs (token ids, positions, the attention metadata's tensors), an earlier
op's output, or a constant (weights, the KV cache, RoPE tables). Views of
constants only are folded into constants (see `is_constant_view`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

CONST, SLOT, LIST = 0, 1, 2  # kinds of recorded arguments


class OpRecorder(TorchDispatchMode):
    """Records the ops dispatched inside `with recorder:`. Each entry of
    `calls` is (op, args, kwargs, out): every argument a spec (SLOT, n) for
    an input or an earlier op's output, (CONST, value), or (LIST, [specs]);
    `out` the slot numbers the op's outputs get (inputs take 0..len-1).

    Every output stays alive until the recorder goes (`alive`, slot ->
    tensor: a tensor's id names its slot only while it lives, and static
    plans call kernels on those tensors), so a recorded forward holds all its
    intermediates at once where an eager one frees each after its last use.
    With max_retained_bytes, a recording whose outputs' storages pass that
    many bytes is abandoned: it lets go of them, records nothing more (the
    forward runs on as an eager one) and sets `abandoned`. The default model's
    prefill trunk makes ~0.43 MiB of them a token (bf16): held whole at 8192
    tokens, ~3.5 GiB the machine had to map afresh, +2.0-2.7 s on a ~5.2 s
    step and 1.2 GiB more peak memory (Zen 4,
    benchmarks/results/prefill_record_budget_2026-12-07_zen4.md). Storages
    of the inputs and of constants (an op that returns the KV cache it wrote)
    are not counted."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # A recording never runs under torch.compile. Left True (torch's
        # default), __torch_dispatch__ is wrapped in dynamo's `disable`, which
        # imports torch._dynamo on the first recording of a process (~0.5 s).
        return False

    def __init__(self, inputs: Sequence[torch.Tensor], max_retained_bytes: int | None = None) -> None:
        super().__init__()
        if max_retained_bytes is not None and max_retained_bytes < 0:
            raise ValueError(f"max_retained_bytes must be >= 0 or None, got {max_retained_bytes}")
        self.slot_of: dict[int, int] = {id(t): i for i, t in enumerate(inputs)}
        self.num_slots = len(inputs)
        self.num_inputs = len(inputs)
        self.alive: list[torch.Tensor] = list(inputs)  # keeps ids unique while recording
        self.calls: list[tuple] = []
        self.max_retained_bytes = max_retained_bytes
        self.retained_bytes = 0  # of the distinct storages of the outputs kept alive
        # Storages already counted, or not this recording's to count: the inputs', and those of
        # the constants ops are given (an op that returns the KV cache it wrote holds no new memory).
        self._storages: set[int] = set()
        for t in inputs:
            self._known((CONST, t))
        self.abandoned = False

    def _known(self, spec) -> None:
        """Marks the storages of a (CONST or LIST) argument spec as not new."""
        if self.max_retained_bytes is None:
            return
        kind, v = spec
        if kind == LIST:
            for x in v:
                if x[0] != SLOT:
                    self._known(x)
        elif isinstance(v, torch.Tensor) and not v.is_mkldnn:
            self._storages.add(v.untyped_storage().data_ptr())

    def _retain(self, o: torch.Tensor) -> None:
        if self.abandoned:
            return
        self.alive.append(o)
        if self.max_retained_bytes is None or o.is_mkldnn:  # opaque: no storage to count
            return
        storage = o.untyped_storage()
        if storage.data_ptr() not in self._storages:
            self._storages.add(storage.data_ptr())
            self.retained_bytes += storage.nbytes()
            if self.retained_bytes > self.max_retained_bytes:
                self._abandon()

    def _abandon(self) -> None:
        self.abandoned = True
        del self.alive[self.num_inputs:]
        self.calls.clear()
        self.slot_of.clear()
        self._storages.clear()

    def _arg(self, a):
        if isinstance(a, torch.Tensor):
            slot = self.slot_of.get(id(a))
            return (SLOT, slot) if slot is not None else (CONST, a)
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            return (LIST, [self._arg(x) for x in a])
        return (CONST, a)

    def _out(self, o):
        if isinstance(o, torch.Tensor):
            slot = self.num_slots
            self.num_slots += 1
            self.slot_of[id(o)] = slot
            self._retain(o)
            return slot
        if isinstance(o, (list, tuple)):
            return [self._out(x) for x in o]
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.abandoned:
            return out
        spec_args = [self._arg(a) for a in args]
        spec_kwargs = {k: self._arg(v) for k, v in kwargs.items()}
        if is_constant_view(func, spec_args, spec_kwargs, out):
            # A view of constants only (the KV cache's unbind into K and V, a
            # weight's transpose) is the same view every step: it stays out of
            # the replay and its outputs are constants. ~3-8 us per layer.
            return out
        for spec in spec_args + list(spec_kwargs.values()):
            if spec[0] != SLOT:
                self._known(spec)
        out_slots = self._out(out)
        if not self.abandoned:  # this very output may have passed the budget
            self.calls.append((func, spec_args, spec_kwargs, out_slots))
        return out


def is_constant_view(func, spec_args, spec_kwargs, out) -> bool:
    """Whether `func` only made views of constant tensors: a view op, no
    argument from this step, and every output sharing an input's storage (an
    op marked as a view may still copy, as reshape does where strides forbid a
    view; a copy would freeze the values of its step)."""
    if not getattr(func, "is_view", False):
        return False
    specs = list(spec_args) + list(spec_kwargs.values())

    def constant(spec) -> bool:
        kind, v = spec
        return kind == CONST or (kind == LIST and all(constant(x) for x in v))

    if not all(constant(spec) for spec in specs):
        return False
    storages = {a.untyped_storage().data_ptr() for _, a in (x for x in specs if x[0] == CONST)
                if isinstance(a, torch.Tensor)}
    outs = out if isinstance(out, (list, tuple)) else [out]
    return bool(storages) and all(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in storages
                                  for o in outs)


def record(forward: Callable[[], torch.Tensor], inputs: Sequence[torch.Tensor],
           max_retained_bytes: int | None = None) -> tuple[torch.Tensor, OpRecorder]:
    """Runs `forward()` once while recording its ops (errors of the forward
    itself propagate); a recording past max_retained_bytes is abandoned (see
    OpRecorder) and the forward's output is still the step's."""
    recorder = OpRecorder(inputs, max_retained_bytes)
    with recorder:
        output = forward()
    return output, recorder
