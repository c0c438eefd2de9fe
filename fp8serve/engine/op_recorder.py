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
    `out` the slot numbers the op's outputs get (inputs take 0..len-1)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # A recording never runs under torch.compile. Left True (torch's
        # default), __torch_dispatch__ is wrapped in dynamo's `disable`, which
        # imports torch._dynamo on the first recording of a process (~0.5 s).
        return False

    def __init__(self, inputs: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.slot_of: dict[int, int] = {id(t): i for i, t in enumerate(inputs)}
        self.num_slots = len(inputs)
        self.alive: list[torch.Tensor] = list(inputs)  # keeps ids unique while recording
        self.calls: list[tuple] = []

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
            self.alive.append(o)
            return slot
        if isinstance(o, (list, tuple)):
            return [self._out(x) for x in o]
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        spec_args = [self._arg(a) for a in args]
        spec_kwargs = {k: self._arg(v) for k, v in kwargs.items()}
        if is_constant_view(func, spec_args, spec_kwargs, out):
            # A view of constants only (the KV cache's unbind into K and V, a
            # weight's transpose) is the same view every step: it stays out of
            # the replay and its outputs are constants. ~3-8 us per layer.
            return out
        self.calls.append((func, spec_args, spec_kwargs, self._out(out)))
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


def record(forward: Callable[[], torch.Tensor], inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, OpRecorder]:
    """Runs `forward()` once while recording its ops (errors of the forward
    itself propagate)."""
    recorder = OpRecorder(inputs)
    with recorder:
        output = forward()
    return output, recorder
