"""Decode forwards recorded once per batch size and replayed as a flat list of
op calls: the CPU counterpart of vLLM's CUDA graphs (and of its
`--enforce-eager`, which turns them off).

Why: at small batches the module tree (nn.Module calls, attribute lookups,
dtype and path checks, ~660 op dispatches from Python) is a large part of a
decode step. Measured on a 2-vCPU Xeon, the default model's FP8 checkpoint at
batch 1 (engine steps, three alternating runs): 15.6-17.2 ms eager against
11.8-12.6 ms replayed, with bit-identical outputs.

How: one decode forward runs under a TorchDispatchMode that records every op
(aten and fp8serve kernels) with its arguments, each tensor argument being
one of the step's inputs (token ids, positions, the attention metadata's
tensors), an earlier op's output, or a constant (weights, the KV cache,
RoPE tables). A replay calls the same ops on the new step's inputs, from the
TorchScript interpreter where the recording can be scripted (see `_script`;
~2 ms less per batch-1 step than straight-line Python), else from Python.
A new batch size is recorded too, but shares an earlier size's compiled
replay where the two recordings differ only in batch-sized dimensions (which
the compiled code then takes as `n * k`): see DecodeCaptures.

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

import copy
import linecache
import logging
import time
import warnings
from collections.abc import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8serve.attention.forward_context import set_forward_context
from fp8serve.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

_CONST, _SLOT, _LIST = 0, 1, 2  # kinds of recorded arguments


class _Recorder(TorchDispatchMode):
    def __init__(self, inputs: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.slot_of: dict[int, int] = {id(t): i for i, t in enumerate(inputs)}
        self.num_slots = len(inputs)
        self.alive: list[torch.Tensor] = list(inputs)  # keeps ids unique while recording
        self.calls: list[tuple] = []

    def _arg(self, a):
        if isinstance(a, torch.Tensor):
            slot = self.slot_of.get(id(a))
            return (_SLOT, slot) if slot is not None else (_CONST, a)
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            return (_LIST, [self._arg(x) for x in a])
        return (_CONST, a)

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
        if _is_constant_view(func, spec_args, spec_kwargs, out):
            # A view of constants only (the KV cache's unbind into K and V, a
            # weight's transpose) is the same view every step: it stays out of
            # the replay and its outputs are constants. ~3-8 us per layer.
            return out
        self.calls.append((func, spec_args, spec_kwargs, self._out(out)))
        return out


def _is_constant_view(func, spec_args, spec_kwargs, out) -> bool:
    """Whether `func` only made views of constant tensors: a view op, no
    argument from this step, and every output sharing an input's storage (an
    op marked as a view may still copy, as reshape does where strides forbid a
    view; a copy would freeze the values of its step)."""
    if not getattr(func, "is_view", False):
        return False
    specs = list(spec_args) + list(spec_kwargs.values())

    def constant(spec) -> bool:
        kind, v = spec
        return kind == _CONST or (kind == _LIST and all(constant(x) for x in v))

    if not all(constant(spec) for spec in specs):
        return False
    storages = {a.untyped_storage().data_ptr() for _, a in (x for x in specs if x[0] == _CONST)
                if isinstance(a, torch.Tensor)}
    outs = out if isinstance(out, (list, tuple)) else [out]
    return bool(storages) and all(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in storages
                                  for o in outs)


class CapturedForward:
    """One recorded forward, compiled to straight-line Python: each op is one
    statement on local variables, calling the op's C++ entry directly, and
    an intermediate is released after its last use. `replay(*inputs)` takes
    the inputs in the order given at capture.

    `scaled` lists the int arguments (by `_Path`) that are k times the batch
    size: they are compiled as `n * k`, so one compiled forward serves every
    batch size whose recording differs from this one only there (`bind`)."""

    def __init__(self, recorder: _Recorder, num_inputs: int, output: torch.Tensor,
                 batch_size: int = 0, scaled: dict[_Path, int] | None = None) -> None:
        out_slot = recorder.slot_of.get(id(output))
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
            if kind == _SLOT:
                return [v]
            if kind == _LIST:
                return [s for x in v for s in used_slots(x)]
            return []

        last_use: dict[int, int] = {}
        for i, (_, args, kwargs, _) in enumerate(self.calls):
            for spec in list(args) + list(kwargs.values()):
                for slot in used_slots(spec):
                    last_use[slot] = i
        last_use[out_slot] = len(self.calls)  # returned: never released
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
        lines.append(f"    return v{out_slot}")
        self.source = "\n".join(lines)
        exec(compile(self.source, "<decode capture>", "exec"), namespace)  # noqa: S102 - generated here, from op calls
        self._python = namespace["replay"]
        self._script = _script(self.calls, num_inputs, out_slot, self.scaled)
        self._bind_replays()

    def _bind_replays(self) -> None:
        python, script, n = self._python, self._script, self.batch_size
        self.python_replay = lambda *inputs: python(*inputs, n)
        self.script_replay = None if script is None else (lambda *inputs: script(inputs, n))
        self.replay = self.script_replay or self.python_replay

    def bind(self, batch_size: int) -> "CapturedForward":
        """This compiled forward replaying at another batch size (its own
        `replay` choice, the code shared); only valid where `_unify` matched
        a recording at that size."""
        bound = copy.copy(self)
        bound.batch_size = batch_size
        bound._bind_replays()
        return bound

    def use_python_replay(self) -> None:
        self.replay = self.python_replay


# Where a constant sits in a recording: (call index, argument index or
# keyword name, then indices into nested lists).
_Path = tuple


def _prefixes(scaled: dict[_Path, int]) -> set[_Path]:
    """Every proper prefix of a scaled path: the lists that hold one."""
    return {p[:i] for p in scaled for i in range(2, len(p))}


def _expr(spec, path: _Path, constant: Callable[[object], str], scaled: dict[_Path, int] | None = None,
          prefixes: set[_Path] = frozenset()) -> str:
    """Source for a recorded argument: a slot's variable, a list, `n * k` for
    a scaled int, or `constant(value)`."""
    kind, v = spec
    if kind == _SLOT:
        return f"v{v}"
    if kind == _LIST:
        return "[" + ", ".join(_expr(x, path + (j,), constant, scaled, prefixes) for j, x in enumerate(v)) + "]"
    return _const_expr(v, path, constant, scaled or {}, prefixes)


def _const_expr(v, path: _Path, constant: Callable[[object], str], scaled: dict[_Path, int],
                prefixes: set[_Path]) -> str:
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


def _unify(ref: CapturedForward, calls: list[tuple], out_slot: int, batch_size: int) -> dict[_Path, int] | None:
    """The scaled ints under which `calls` (recorded at `batch_size`) is `ref`'s
    recording with `n = batch_size`, or None. Same ops in the same order, the
    same slots, the same tensor constants (or views of the same memory), equal other
    constants; an int may differ only as k times the batch size in both
    recordings (a shape's leading dimension). Anything else differs: a new
    compile. Every recording is unified against the actual values, so a
    size that depends on the batch in another way never shares a compile."""
    if len(calls) != len(ref.calls) or out_slot != ref.out_slot:
        return None
    scaled: dict[_Path, int] = {}

    def same(v0, v1, path: _Path) -> bool:
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

    def same_spec(s0, s1, path: _Path) -> bool:
        (kind0, v0), (kind1, v1) = s0, s1
        if kind0 != kind1:
            return False
        if kind0 == _SLOT:
            return v0 == v1
        if kind0 == _LIST:
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


def _script(calls: list[tuple], num_inputs: int, out_slot: int,
            scaled: dict[_Path, int]) -> Callable[..., torch.Tensor] | None:
    """The recording as a TorchScript function, or None where it cannot be
    scripted. Why: the Python replay still pays ~1.5-4 us of Python and
    argument conversion per op call (aten.view through its C++ entry: 1.8 us
    against 0.8 us for Tensor.view); the TorchScript interpreter runs the same
    ops from C++. Measured on the default model's FP8 checkpoint at batch 1
    (forward without the LM head, 664 ops): 7.3-8.6 ms Python, 5.4-6.1 ms
    scripted; scripting takes ~0.13-0.2 s per compiled forward (batch sizes
    share them: see DecodeCaptures). It runs with graph
    optimizations off, so the ops are exactly the recorded ones (the first
    replay's bit-for-bit check still applies). The scripted function takes
    the batch size `n` after the inputs (see CapturedForward's `scaled`)."""
    tensors: list[torch.Tensor] = []
    index: dict[int, int] = {}
    prefixes = _prefixes(scaled)

    def literal(v) -> str:
        return _literal(v, tensors, index)

    try:
        lines = ["def replay(" + "".join(f"v{i}: torch.Tensor, " for i in range(num_inputs))
                 + "c: List[torch.Tensor], n: int) -> torch.Tensor:"]
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
        lines.append(f"    return v{out_slot}")
        source = "import torch\nfrom typing import List\n\n" + "\n".join(lines) + "\n"
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


def record(forward: Callable[[], torch.Tensor], inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, _Recorder]:
    """Runs `forward()` once while recording its ops (errors of the forward
    itself propagate)."""
    recorder = _Recorder(inputs)
    with recorder:
        output = forward()
    return output, recorder


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


_MISSING = object()


class DecodeCaptures:
    """The model runner's recorded decode forwards, one per (batch size, KV
    scales). `forward(input_ids, positions, metadata)` replays the matching
    one, records it on first use, or runs the model eagerly where a replay
    would not be safe (see the module docstring).

    Compiling a recording (TorchScript ~130 ms, the Python replay ~10 ms) is
    most of what a new batch size costs; a serving batch changes size often
    (admissions, finishes, preemptions, the drain at the end: the default
    model's first step at each size took ~190 ms against ~13 ms replayed).
    So a new size is still recorded, but where its recording is an earlier
    one's with only the batch-sized dimensions changed (`_unify`), it shares
    that compiled forward; only the bit-for-bit check of its first replay runs.
    Sizes whose ops differ (another kernel above some row count) compile
    their own, which the sizes after them can share in turn."""

    def __init__(self, model: torch.nn.Module, attn_layers: Sequence[torch.nn.Module], enabled: bool) -> None:
        self.model = model
        self.attn_layers = list(attn_layers)
        self.enabled = enabled and bool(getattr(type(model), "supports_decode_capture", False))
        self._captures: dict[tuple, CapturedForward | None] = {}
        self._templates: list[CapturedForward] = []  # compiled forwards a new batch size may share
        self.share_compiled = True  # False: every batch size compiles its own (benchmarks' A/B)
        self._logged = False
        self.num_replays = 0  # decode forwards served by a replay
        self.num_compiled = 0  # recordings compiled (the rest shared a compiled forward)

    def _eager(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        with set_forward_context(md):
            return self.model(input_ids, positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        if (not self.enabled or not md.is_decode_only or md.backend_data is not None
                or any(a.kv_observer is not None or a.calculate_kv_scales for a in self.attn_layers)):
            return self._eager(input_ids, positions, md)
        key = (md.num_seqs,) + tuple((a._k_scale, a._v_scale) for a in self.attn_layers)
        inputs = (input_ids, positions, md.slot_mapping, md.block_tables, md.seq_lens)
        recorded = self._captures.get(key, _MISSING)
        if recorded is None:
            return self._eager(input_ids, positions, md)
        if recorded is not _MISSING:
            self.num_replays += 1
            return recorded.replay(*inputs)
        start = time.perf_counter()
        output, recorder = record(lambda: self._eager(input_ids, positions, md), inputs)
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
            logger.info("decode forwards are recorded once per batch size and replayed (--enforce-eager: off)")
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

    def _compile(self, recorder: _Recorder, output: torch.Tensor, num_inputs: int,
                 batch_size: int) -> tuple[CapturedForward | str, CapturedForward | None, bool]:
        """(the replay for this recording or why there is none, the compiled
        forward it unified with, whether it was compiled anew)."""
        out_slot = recorder.slot_of.get(id(output))
        if out_slot is None:
            return "the forward's output was not produced by a recorded op", None, False
        try:
            for template in self._templates if self.share_compiled else ():
                scaled = _unify(template, recorder.calls, out_slot, batch_size)
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
        self.num_compiled = 0

    @property
    def recorded_batch_sizes(self) -> list[int]:
        return sorted({key[0] for key, rec in self._captures.items() if rec is not None})

    @property
    def scripted_batch_sizes(self) -> list[int]:
        """Batch sizes whose replay runs in the TorchScript interpreter."""
        return sorted({key[0] for key, rec in self._captures.items()
                       if rec is not None and rec.replay is not rec.python_replay})

    def _problem(self, recorded: CapturedForward, output: torch.Tensor, inputs) -> str | None:
        """Why `recorded` must not be replayed, or None."""
        # Every tensor baked into the recording must outlive it: the model's
        # parameters and buffers, and the KV caches. Anything else is a
        # per-step tensor the inputs do not cover.
        # Views of them (folded at capture: see _is_constant_view) share their storage.
        # oneDNN's packed weights are opaque (no storage to compare): known by identity alone.
        state = list(self.model.parameters()) + list(self.model.buffers()) + [a.kv_cache for a in self.attn_layers]
        owned = {id(t) for t in state}
        owned_storage = {t.untyped_storage().data_ptr() for t in state if not t.is_mkldnn}
        foreign = [t for t in recorded.tensor_constants
                   if id(t) not in owned and (t.is_mkldnn or t.untyped_storage().data_ptr() not in owned_storage)]
        if foreign:
            return f"{len(foreign)} tensors of the forward are neither inputs nor model state (e.g. {tuple(foreign[0].shape)})"
        again = recorded.replay(*inputs)
        if recorded.replay is not recorded.python_replay and not _same(again, output):
            logger.info("decode batch size %d: the TorchScript replay did not reproduce the recorded output; "
                        "replaying in Python", output.shape[0])
            recorded.use_python_replay()
            again = recorded.replay(*inputs)
        if not _same(again, output):
            return "its replay did not reproduce the recorded output"
        return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
