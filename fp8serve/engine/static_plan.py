"""A recorded decode forward (fp8serve/engine/op_recorder.py) turned into a
static plan: the C++ `fp8serve::DecodePlan` (kernels/cpu/decode_plan.cpp)
calling the forward's kernels on the very tensors the recording gave their
outputs, so a replay allocates nothing, makes no views and goes through
neither TorchScript nor boxed dispatch. decode_capture.py prefers it to the
compiled replay (compiled_replay.py) for small batches; a recording with an
op the plan does not know keeps the compiled replay.

What it costs: the recording's intermediate tensors stay alive with the plan
(~0.9 MiB per sequence on the default model), hence the batch-size limit in
decode_capture.py. What a caller must know: `replay` returns the same output
tensor every step, overwritten by the next replay."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fp8serve.engine.op_recorder import CONST, LIST, SLOT, OpRecorder

# Ops that only alias their first tensor argument: dropped from the plan, their
# recorded outputs (views of fixed tensors) stay valid.
_ALIASING = {"aten::view", "aten::reshape", "aten::_unsafe_view", "aten::split_with_sizes", "aten::split",
             "aten::detach", "aten::unsqueeze", "aten::squeeze", "aten::select", "aten::slice", "aten::t",
             "aten::transpose", "aten::permute", "aten::expand", "aten::unbind", "aten::flatten",
             "aten::unflatten", "aten::narrow", "aten::alias", "aten::to", "aten::_to_copy", "aten::contiguous"}
# Copies the plan makes with `copy` when the recorded output is not an alias.
_COPYING = {"aten::to", "aten::_to_copy", "aten::contiguous", "aten::reshape"}

# Kernel -> (plan step kind, the positions of its tensor arguments in the
# step's order ("out": the tensor the recording returned, for a functional
# kernel), of its int arguments, of its float arguments, and of arguments that
# must be None). Positions, not names: schemas inferred from C++ signatures
# name their arguments _0, _1, ...
_KERNELS = {
    "fp8serve::fp8_linear": ("fp8_linear", ("out", 0, 1, 2, 3), (), (), ()),
    "fp8serve::dense_gemv": ("dense_gemv", ("out", 0, 1, 2), (), (), ()),
    "fp8serve::fp8_gemv_packed": ("fp8_gemv_packed", ("out", 0, 1, 2, 4), (3,), (), ()),
    "fp8serve::amx_fp8_linear": ("amx_fp8_linear", ("out", 0, 1, 2, 3), (), (), ()),
    "fp8serve::paged_attention_decode_fused": ("attention", ("out", 0, 1, 2, 3, 4), (5,), (6, 7), ()),
    "fp8serve::rms_norm": ("rms_norm", (0, 1, 2), (), (3,), ()),
    "fp8serve::fused_add_rms_norm": ("fused_add_rms_norm", (0, 1, 2), (), (3,), ()),
    "fp8serve::silu_and_mul": ("silu_and_mul", (0, 1), (), (), ()),
    "fp8serve::rotary_embedding": ("rotary_embedding", (0, 1, 2, 3, 4), (), (), ()),
    "fp8serve::reshape_and_cache": ("reshape_and_cache", (0, 1, 2, 3, 4), (5,), (6, 7), (8, 9)),
    # padding_idx, scale_grad_by_freq and sparse change nothing in a forward.
    "aten::embedding": ("embedding", ("out", 0, 1), (), (), ()),
    # Tensor-by-tensor only (_TENSOR_OVERLOAD): per-KV-head scale folds (fp8serve/layers/attention.py).
    "aten::mul": ("mul", ("out", 0, 1), (), (), ()),
    "aten::div": ("div", ("out", 0, 1), (), (), ()),
}
# Ops whose other overloads (a Python scalar, div's rounding_mode) the plan's step does not replay.
_TENSOR_OVERLOAD = {"aten::mul", "aten::div"}
# Trailing optional tensor arguments a step may go without (a linear's bias).
_OPTIONAL_LAST = {"fp8_linear", "dense_gemv", "fp8_gemv_packed", "amx_fp8_linear"}


class Unsupported(ValueError):
    """The recording has something a static plan cannot replay (the message says what)."""


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class StaticPlan:
    """A recording as a `fp8serve::DecodePlan`. `replay(*inputs)` takes the
    inputs in the recording's order and returns the plan's output tensor."""

    def __init__(self, recorder: OpRecorder, inputs: Sequence[torch.Tensor], output: torch.Tensor) -> None:
        out_slot = recorder.slot_of.get(id(output))
        if out_slot is None:
            raise Unsupported("the forward's output was not produced by a recorded op")
        self.num_inputs = len(inputs)
        tensors = recorder.alive  # slot -> the recorded tensor (inputs first)
        plan = torch.classes.fp8serve.DecodePlan()
        kinds: dict[str, int] = {}

        def tensor_of(spec, where: str) -> tuple[torch.Tensor, int | None]:
            kind, v = spec
            if kind == SLOT:
                return tensors[v], (v if v < self.num_inputs else None)
            if kind == CONST and isinstance(v, torch.Tensor):
                return v, None
            raise Unsupported(f"{where} is not a tensor")

        for func, args, kwargs, out in recorder.calls:
            name = func._schema.name
            bound = _bind(func, args, kwargs)
            if name in _ALIASING:
                base, input_no = tensor_of(bound[func._schema.arguments[0].name], f"{name}'s first argument")
                outs = [tensors[o] for o in (out if isinstance(out, list) else [out]) if o is not None]
                if all(_storage(o) == _storage(base) for o in outs):
                    if input_no is not None:
                        # A view of a step input would go stale: inputs are rebound, not copied.
                        raise Unsupported(f"{name} of the step input {input_no}")
                    continue
                if name not in _COPYING or len(outs) != 1:
                    raise Unsupported(f"{name} copied instead of making a view")
                self._add(plan, kinds, "copy", [outs[0], base], [None, input_no], [], [])
                continue
            if name == "aten::empty":
                continue  # the recorded tensor is the buffer; every use writes it first
            spec = _KERNELS.get(name)
            if spec is None:
                raise Unsupported(f"no plan step for {name}")
            if name in _TENSOR_OVERLOAD and func._overloadname != "Tensor":
                raise Unsupported(f"no plan step for {name}.{func._overloadname}")
            kind, tensor_args, int_args, float_args, none_args = spec
            pos = [bound.get(a.name) for a in func._schema.arguments]
            for j in none_args:
                if pos[j] is not None and _value(pos[j], tensors) is not None:
                    raise Unsupported(f"{name} with argument {j} set")
            step_tensors, step_inputs = [], []
            for j in tensor_args:
                if j == "out":
                    if not isinstance(out, int):
                        raise Unsupported(f"{name} without one output tensor")
                    step_tensors.append(tensors[out])
                    step_inputs.append(None)
                    continue
                if pos[j] is None or _value(pos[j], tensors) is None:
                    if kind in _OPTIONAL_LAST and j == tensor_args[-1]:
                        continue  # no bias
                    raise Unsupported(f"{name} without argument {j}")
                t, input_no = tensor_of(pos[j], f"{name}'s argument {j}")
                step_tensors.append(t)
                step_inputs.append(input_no)
            ints = [int(_value(pos[j], tensors)) for j in int_args]
            floats = [float(_value(pos[j], tensors)) for j in float_args]
            self._add(plan, kinds, kind, step_tensors, step_inputs, ints, floats)
        plan.set_output(tensors[out_slot])
        self._plan = plan
        self.num_steps = plan.num_steps()
        self.step_kinds = kinds

    @staticmethod
    def _add(plan, kinds: dict[str, int], kind: str, step_tensors: list[torch.Tensor], step_inputs: list[int | None],
             ints: list[int], floats: list[float]) -> None:
        pairs: list[int] = []
        for j, input_no in enumerate(step_inputs):
            if input_no is not None:
                pairs += [j, input_no]
        plan.add(kind, step_tensors, ints, floats, pairs)
        kinds[kind] = kinds.get(kind, 0) + 1

    def replay(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self._plan.run(list(inputs))


def _value(spec, tensors):
    kind, v = spec
    if kind == SLOT:
        return tensors[v]
    if kind == LIST:
        return [_value(x, tensors) for x in v]
    return v


def _bind(func, args, kwargs) -> dict[str, tuple]:
    """The recorded arguments by schema name, defaults filled in."""
    bound: dict[str, tuple] = {}
    for j, a in enumerate(func._schema.arguments):
        if j < len(args):
            bound[a.name] = args[j]
        elif a.name in kwargs:
            bound[a.name] = kwargs[a.name]
        elif a.has_default_value():
            bound[a.name] = (CONST, a.default_value)
    return bound
