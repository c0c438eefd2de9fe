"""A recorded forward (fp8serve/engine/op_recorder.py) compiled to code that
calls the same ops on new inputs: TorchScript where the recording can be
scripted, straight-line Python otherwise; and `unify`, which tells whether a
recording at another batch size can run the same compiled code with the
batch size as a parameter."""

from __future__ import annotations

import copy
import linecache
import logging
import warnings
from collections.abc import Callable, Sequence

import torch

from fp8serve.engine.op_recorder import LIST, SLOT, OpRecorder, record

logger = logging.getLogger(__name__)


class CapturedForward:
    """One recorded forward, compiled to straight-line Python: each op is one
    statement on local variables, calling the op's C++ entry directly, and
    an intermediate is released after its last use. `replay(*inputs)` takes
    the inputs in the order given at capture and returns the output (a
    tuple of tensors where the recorded forward returned one).

    `scaled` lists the int arguments (by `Path`) that are k times the batch
    size: they are compiled as `n * k`, so one compiled forward serves every
    batch size whose recording differs from this one only there (`bind`)."""

    def __init__(self, recorder: OpRecorder, num_inputs: int, output: torch.Tensor | tuple[torch.Tensor, ...],
                 batch_size: int = 0, scaled: dict[Path, int] | None = None, script: bool = True) -> None:
        out_slot = output_slots(recorder, output)
        if out_slot is None:
            raise ValueError("the forward's output was not produced by a recorded op")
        self.calls = recorder.calls
        self.num_inputs = num_inputs
        self.out_slot = out_slot
        self.batch_size = batch_size
        self.scaled = dict(scaled or {})
        self.num_ops = len(self.calls)
        self.tensor_constants: list[torch.Tensor] = []
        prefixes = _prefixes(self.scaled)
        namespace: dict[str, object] = {}

        def const(v) -> str:
            name = f"c{len(namespace)}"
            namespace[name] = v
            if isinstance(v, torch.Tensor):
                self.tensor_constants.append(v)
            return name

        def used_slots(spec) -> list[int]:
            kind, v = spec
            if kind == SLOT:
                return [v]
            if kind == LIST:
                return [s for x in v for s in used_slots(x)]
            return []

        last_use: dict[int, int] = {}
        for i, (_, args, kwargs, _) in enumerate(self.calls):
            for spec in list(args) + list(kwargs.values()):
                for slot in used_slots(spec):
                    last_use[slot] = i
        for slot in _as_tuple(out_slot):
            last_use[slot] = len(self.calls)  # returned: never released
        lines = ["def replay(" + "".join(f"v{i}, " for i in range(num_inputs)) + "n):"]
        for i, (func, args, kwargs, out) in enumerate(self.calls):
            rendered = [_expr(a, (i, j), const, self.scaled, prefixes) for j, a in enumerate(args)]
            rendered += [f"{k}={_expr(v, (i, k), const, self.scaled, prefixes)}" for k, v in kwargs.items()]
            call = const(getattr(func, "_op", func)) + "(" + ", ".join(rendered) + ")"
            if isinstance(out, int):
                target = f"v{out} = "
            elif isinstance(out, list) and out and all(o is None or isinstance(o, int) for o in out):
                target = ", ".join("_" if o is None else f"v{o}" for o in out) + (", = " if len(out) == 1 else " = ")
            elif not out:
                target = ""
            else:
                raise ValueError(f"{func} returns a nested structure, which replays do not handle")
            lines.append("    " + target + call)
            dead = [slot for slot, last in last_use.items() if last == i and slot >= num_inputs]
            if dead:
                lines.append("    del " + ", ".join(f"v{s}" for s in dead))
        lines.append(f"    return {_return_expr(out_slot)}")
        self.source = "\n".join(lines)
        exec(compile(self.source, "<decode capture>", "exec"), namespace)  # noqa: S102 - generated here, from op calls
        self._python = namespace["replay"]
        self._script = _script(self.calls, num_inputs, out_slot, self.scaled) if script else None
        self._bind_replays()

    def _bind_replays(self) -> None:
        python, script, n = self._python, self._script, self.batch_size
        self.python_replay = lambda *inputs: python(*inputs, n)
        self.script_replay = None if script is None else (lambda *inputs: script(inputs, n))
        self.replay = self.script_replay or self.python_replay

    def bind(self, batch_size: int) -> "CapturedForward":
        """This compiled forward replaying at another batch size (its own
        `replay` choice, the code shared); only valid where `unify` matched
        a recording at that size."""
        bound = copy.copy(self)
        bound.batch_size = batch_size
        bound._bind_replays()
        return bound

    def use_python_replay(self) -> None:
        self.replay = self.python_replay


def output_slots(recorder: OpRecorder, output) -> int | tuple[int, ...] | None:
    """The slot of a recorded forward's output, or a tuple of them where the
    forward returns a tuple of tensors; None where any is not a recorded op's."""
    if isinstance(output, tuple):
        slots = tuple(recorder.slot_of.get(id(o)) for o in output)
        return None if not slots or None in slots else slots
    return recorder.slot_of.get(id(output))


def _as_tuple(out_slot: int | tuple[int, ...]) -> tuple[int, ...]:
    return out_slot if isinstance(out_slot, tuple) else (out_slot,)


def _return_expr(out_slot: int | tuple[int, ...]) -> str:
    if isinstance(out_slot, tuple):
        return "(" + ", ".join(f"v{s}" for s in out_slot) + ("," if len(out_slot) == 1 else "") + ")"
    return f"v{out_slot}"


# Where a constant sits in a recording: (call index, argument index or
# keyword name, then indices into nested lists).
Path = tuple


def _prefixes(scaled: dict[Path, int]) -> set[Path]:
    """Every proper prefix of a scaled path: the lists that hold one."""
    return {p[:i] for p in scaled for i in range(2, len(p))}


def _expr(spec, path: Path, constant: Callable[[object], str], scaled: dict[Path, int] | None = None,
          prefixes: set[Path] = frozenset()) -> str:
    """Source for a recorded argument: a slot's variable, a list, `n * k` for
    a scaled int, or `constant(value)`."""
    kind, v = spec
    if kind == SLOT:
        return f"v{v}"
    if kind == LIST:
        return "[" + ", ".join(_expr(x, path + (j,), constant, scaled, prefixes) for j, x in enumerate(v)) + "]"
    return _const_expr(v, path, constant, scaled or {}, prefixes)


def _const_expr(v, path: Path, constant: Callable[[object], str], scaled: dict[Path, int],
                prefixes: set[Path]) -> str:
    if path in scaled:
        return f"(n * {scaled[path]})"
    if path in prefixes and isinstance(v, (list, tuple)):
        return "[" + ", ".join(_const_expr(x, path + (j,), constant, scaled, prefixes) for j, x in enumerate(v)) + "]"
    return constant(v)


def _same_constant_tensor(a, b) -> bool:
    """Whether two recorded constants are the same tensor, or the same view of
    the same memory: each recording makes its own view objects of the KV
    cache (the unbind into K and V, folded as constants)."""
    if a is b:
        return True
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or type(a) is not type(b):
        return False
    if a.is_mkldnn or b.is_mkldnn:  # opaque: identity only
        return False
    return (a.dtype == b.dtype and a.device == b.device and a.shape == b.shape and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def unify(ref: CapturedForward, calls: list[tuple], out_slot: int | tuple[int, ...],
          batch_size: int) -> dict[Path, int] | None:
    """The scaled ints under which `calls` (recorded at `batch_size`) is `ref`'s
    recording with `n = batch_size`, or None. Same ops in the same order, the
    same slots, the same tensor constants (or views of the same memory), equal other
    constants; an int may differ only as k times the batch size in both
    recordings (a shape's leading dimension). Anything else differs: a new
    compile. Every recording is unified against the actual values, so a
    size that depends on the batch in another way never shares a compile."""
    if len(calls) != len(ref.calls) or out_slot != ref.out_slot:
        return None
    scaled: dict[Path, int] = {}

    def same(v0, v1, path: Path) -> bool:
        if isinstance(v0, torch.Tensor) or isinstance(v1, torch.Tensor):
            return _same_constant_tensor(v0, v1)
        if type(v0) is not type(v1):
            return False
        if isinstance(v0, (list, tuple)):
            return len(v0) == len(v1) and all(same(a, b, path + (j,)) for j, (a, b) in enumerate(zip(v0, v1)))
        if type(v0) is int:
            k = ref.scaled.get(path)
            if k is None and v0 != v1 and ref.batch_size > 0 and v0 % ref.batch_size == 0:
                k = v0 // ref.batch_size  # differs: proportional to the batch size?
            if k is None:
                return v0 == v1
            if v1 != k * batch_size:
                return False
            scaled[path] = k
            return True
        if isinstance(v0, float):
            return repr(v0) == repr(v1)  # NaN equal to NaN, -0.0 not to 0.0
        return v0 == v1

    def same_spec(s0, s1, path: Path) -> bool:
        (kind0, v0), (kind1, v1) = s0, s1
        if kind0 != kind1:
            return False
        if kind0 == SLOT:
            return v0 == v1
        if kind0 == LIST:
            return len(v0) == len(v1) and all(same_spec(a, b, path + (j,)) for j, (a, b) in enumerate(zip(v0, v1)))
        return same(v0, v1, path)

    for i, ((f0, a0, k0, o0), (f1, a1, k1, o1)) in enumerate(zip(ref.calls, calls)):
        if f0 is not f1 or o0 != o1 or len(a0) != len(a1) or list(k0) != list(k1):
            return None
        if not all(same_spec(s0, s1, (i, j)) for j, (s0, s1) in enumerate(zip(a0, a1))):
            return None
        if not all(same_spec(k0[name], k1[name], (i, name)) for name in k0):
            return None
    return scaled


def _literal(v, tensors: list[torch.Tensor], index: dict[int, int]) -> str:
    """TorchScript source for a recorded constant argument."""
    if isinstance(v, torch.Tensor):
        if id(v) not in index:
            index[id(v)] = len(tensors)
            tensors.append(v)
        return f"c[{index[id(v)]}]"
    if v is None or isinstance(v, (bool, int, str)):
        return repr(v)
    if isinstance(v, float):
        return repr(v) if v == v and abs(v) != float("inf") else f'float("{v}")'
    if isinstance(v, (torch.dtype, torch.memory_format, torch.layout)):
        return str(v)
    if isinstance(v, torch.device):
        return f'torch.device("{v}")'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_literal(x, tensors, index) for x in v) + "]"
    raise TypeError(f"no TorchScript literal for {type(v).__name__}")


def _script(calls: list[tuple], num_inputs: int, out_slot: int | tuple[int, ...],
            scaled: dict[Path, int]) -> Callable[..., torch.Tensor] | None:
    """The recording as a TorchScript function, or None where it cannot be
    scripted. Why: the Python replay still pays ~1.5-4 us of Python and
    argument conversion per op call (aten.view through its C++ entry: 1.8 us
    against 0.8 us for Tensor.view); the TorchScript interpreter runs the same
    ops from C++. Measured on the default model's FP8 checkpoint at batch 1
    (forward without the LM head, 664 ops): 7.3-8.6 ms Python, 5.4-6.1 ms
    scripted; scripting takes ~0.13-0.2 s per compiled forward (batch sizes
    share them: see decode_capture.py). It runs with graph
    optimizations off, so the ops are exactly the recorded ones (the first
    replay's bit-for-bit check still applies). The scripted function takes
    the batch size `n` after the inputs (see CapturedForward's `scaled`)."""
    tensors: list[torch.Tensor] = []
    index: dict[int, int] = {}
    prefixes = _prefixes(scaled)

    def literal(v) -> str:
        return _literal(v, tensors, index)

    returns = ("Tuple[" + ", ".join(["torch.Tensor"] * len(out_slot)) + "]" if isinstance(out_slot, tuple)
               else "torch.Tensor")
    try:
        lines = ["def replay(" + "".join(f"v{i}: torch.Tensor, " for i in range(num_inputs))
                 + f"c: List[torch.Tensor], n: int) -> {returns}:"]
        for i, (func, args, kwargs, out) in enumerate(calls):
            if not isinstance(func, torch._ops.OpOverload):
                return None
            name = func._schema.name.split("::", 1)[1]
            rendered = [_expr(a, (i, j), literal, scaled, prefixes) for j, a in enumerate(args)]
            rendered += [f"{k}={_expr(v, (i, k), literal, scaled, prefixes)}" for k, v in kwargs.items()]
            call = f"torch.ops.{func.namespace}.{name}(" + ", ".join(rendered) + ")"
            if isinstance(out, int):
                lines.append(f"    v{out} = {call}")
            elif isinstance(out, list) and out:
                lines.append(f"    t{i} = {call}")
                lines += [f"    v{o} = t{i}[{j}]" for j, o in enumerate(out) if o is not None]
            else:
                lines.append(f"    {call}")
        lines.append(f"    return {_return_expr(out_slot)}")
        source = "import torch\nfrom typing import List, Tuple\n\n" + "\n".join(lines) + "\n"
        namespace: dict[str, object] = {"__name__": f"{__name__}._scripted_{id(calls)}"}
        # torch.jit.script reads the function's source through inspect/linecache.
        filename = f"<decode capture script {id(calls)}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        try:
            exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - generated here, from op calls
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # TorchScript's deprecation notices
                scripted = torch.jit.script(namespace["replay"])
        finally:
            linecache.cache.pop(filename, None)
    except Exception as e:  # noqa: BLE001 - any failure keeps the Python replay
        logger.debug("decode replay stays in Python: %s: %s", type(e).__name__, e)
        return None

    def replay(inputs: tuple[torch.Tensor, ...], n: int) -> torch.Tensor:
        with torch.jit.optimized_execution(False):
            return scripted(*inputs, tensors, n)

    return replay


def capture(forward: Callable[[], torch.Tensor],
            inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, CapturedForward | str]:
    """Runs `forward()` once while recording; returns its output and the
    compiled recording, or why the recording cannot be replayed (the output
    is valid either way)."""
    output, recorder = record(forward, inputs)
    try:
        return output, CapturedForward(recorder, len(inputs), output)
    except ValueError as e:
        return output, str(e)
