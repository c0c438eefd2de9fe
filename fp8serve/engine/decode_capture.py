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

import linecache
import logging
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
    the inputs in the order given at capture."""

    def __init__(self, recorder: _Recorder, num_inputs: int, output: torch.Tensor) -> None:
        out_slot = recorder.slot_of.get(id(output))
        if out_slot is None:
            raise ValueError("the forward's output was not produced by a recorded op")
        self.num_ops = len(recorder.calls)
        self.tensor_constants: list[torch.Tensor] = []
        namespace: dict[str, object] = {}

        def const(v) -> str:
            name = f"c{len(namespace)}"
            namespace[name] = v
            if isinstance(v, torch.Tensor):
                self.tensor_constants.append(v)
            return name

        def expr(spec) -> str:
            return _expr(spec, const)

        def used_slots(spec) -> list[int]:
            kind, v = spec
            if kind == _SLOT:
                return [v]
            if kind == _LIST:
                return [s for x in v for s in used_slots(x)]
            return []

        last_use: dict[int, int] = {}
        for i, (_, args, kwargs, _) in enumerate(recorder.calls):
            for spec in list(args) + list(kwargs.values()):
                for slot in used_slots(spec):
                    last_use[slot] = i
        last_use[out_slot] = len(recorder.calls)  # returned: never released
        lines = ["def replay(" + ", ".join(f"v{i}" for i in range(num_inputs)) + "):"]
        for i, (func, args, kwargs, out) in enumerate(recorder.calls):
            call = const(getattr(func, "_op", func)) + "(" + ", ".join(
                [expr(a) for a in args] + [f"{k}={expr(v)}" for k, v in kwargs.items()]) + ")"
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
        self.python_replay = namespace["replay"]
        self.script_replay = _script(recorder, num_inputs, out_slot)
        self.replay = self.script_replay or self.python_replay

    def use_python_replay(self) -> None:
        self.replay = self.python_replay


def _expr(spec, constant: Callable[[object], str]) -> str:
    """Source for a recorded argument: a slot's variable, a list, or `constant(value)`."""
    kind, v = spec
    if kind == _SLOT:
        return f"v{v}"
    if kind == _LIST:
        return "[" + ", ".join(_expr(x, constant) for x in v) + "]"
    return constant(v)


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


def _script(recorder: _Recorder, num_inputs: int, out_slot: int) -> Callable[..., torch.Tensor] | None:
    """The recording as a TorchScript function, or None where it cannot be
    scripted. Why: the Python replay still pays ~1.5-4 us of Python and
    argument conversion per op call (aten.view through its C++ entry: 1.8 us
    against 0.8 us for Tensor.view); the TorchScript interpreter runs the same
    ops from C++. Measured on the default model's FP8 checkpoint at batch 1
    (forward without the LM head, 664 ops): 7.3-8.6 ms Python, 5.4-6.1 ms
    scripted; scripting takes ~0.2 s once per batch size. It runs with graph
    optimizations off, so the ops are exactly the recorded ones (the first
    replay's bit-for-bit check still applies)."""
    tensors: list[torch.Tensor] = []
    index: dict[int, int] = {}

    def expr(spec) -> str:
        return _expr(spec, lambda v: _literal(v, tensors, index))

    try:
        lines = ["def replay(" + "".join(f"v{i}: torch.Tensor, " for i in range(num_inputs))
                 + "c: List[torch.Tensor]) -> torch.Tensor:"]
        for i, (func, args, kwargs, out) in enumerate(recorder.calls):
            if not isinstance(func, torch._ops.OpOverload):
                return None
            name = func._schema.name.split("::", 1)[1]
            call = f"torch.ops.{func.namespace}.{name}(" + ", ".join(
                [expr(a) for a in args] + [f"{k}={expr(v)}" for k, v in kwargs.items()]) + ")"
            if isinstance(out, int):
                lines.append(f"    v{out} = {call}")
            elif isinstance(out, list) and out:
                lines.append(f"    t{i} = {call}")
                lines += [f"    v{o} = t{i}[{j}]" for j, o in enumerate(out) if o is not None]
            else:
                lines.append(f"    {call}")
        lines.append(f"    return v{out_slot}")
        source = "import torch\nfrom typing import List\n\n" + "\n".join(lines) + "\n"
        namespace: dict[str, object] = {"__name__": f"{__name__}._scripted_{id(recorder)}"}
        # torch.jit.script reads the function's source through inspect/linecache.
        filename = f"<decode capture script {id(recorder)}>"
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

    def replay(*inputs: torch.Tensor) -> torch.Tensor:
        with torch.jit.optimized_execution(False):
            return scripted(*inputs, tensors)

    return replay


def capture(forward: Callable[[], torch.Tensor],
            inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, CapturedForward | str]:
    """Runs `forward()` once while recording; returns its output and the
    recording, or why the recording cannot be replayed (the output is valid
    either way; errors of the forward itself propagate)."""
    recorder = _Recorder(inputs)
    with recorder:
        output = forward()
    try:
        return output, CapturedForward(recorder, len(inputs), output)
    except ValueError as e:
        return output, str(e)


_MISSING = object()


class DecodeCaptures:
    """The model runner's recorded decode forwards, one per (batch size, KV
    scales). `forward(input_ids, positions, metadata)` replays the matching
    one, records it on first use, or runs the model eagerly where a replay
    would not be safe (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, attn_layers: Sequence[torch.nn.Module], enabled: bool) -> None:
        self.model = model
        self.attn_layers = list(attn_layers)
        self.enabled = enabled and bool(getattr(type(model), "supports_decode_capture", False))
        self._captures: dict[tuple, CapturedForward | None] = {}
        self._logged = False
        self.num_replays = 0  # decode forwards served by a replay

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
        output, recorded = capture(lambda: self._eager(input_ids, positions, md), inputs)
        problem = recorded if isinstance(recorded, str) else self._problem(recorded, output, inputs)
        if problem:
            logger.warning("decode batch size %d runs eagerly: %s", md.num_seqs, problem)
            self._captures[key] = None
        else:
            if not self._logged:
                logger.info("decode forwards are recorded once per batch size and replayed (--enforce-eager: off)")
                self._logged = True
            self._captures[key] = recorded
        return output

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
