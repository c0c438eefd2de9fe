"""A recorded forward compiled to a replay (engine/compiled_replay.py, over
engine/op_recorder.py): replays on new inputs equal the function, views of
constants are folded (and stay live), a view op that copies is replayed, and
an output no recorded op produced is refused. Fresh random inputs each run
(the seed is in every failure message)."""

from __future__ import annotations

import torch

from fp8serve.engine.compiled_replay import capture


def test_capture_replays_on_new_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 8, generator=g)
    x = torch.randn(3, 8, generator=g)

    def f(inp):
        h = torch.nn.functional.linear(inp, w).relu_()
        a, b = h.split([4, 4], dim=-1)
        return torch.cat([b, a], dim=-1) * 2

    out, recorded = capture(lambda: f(x), [x])
    assert not isinstance(recorded, str), recorded
    assert torch.equal(out, f(x))
    x2 = torch.randn(3, 8, generator=g)
    assert recorded.script_replay is not None and recorded.replay is recorded.script_replay
    for replay in (recorded.script_replay, recorded.python_replay):
        assert torch.equal(replay(x2), f(x2)), f"seed={seed}"
    # The only constant is w (F.linear's transpose of it is folded: a view of a constant).
    assert [t.untyped_storage().data_ptr() for t in recorded.tensor_constants] == [w.untyped_storage().data_ptr()]
    assert recorded.tensor_constants[0].stride() == w.t().stride(), "the transpose was replayed, not folded"


def test_a_tuple_output_replays_as_a_tuple(seed):
    """A forward returning several tensors (a model's trunk: hidden states and
    residual), one of them an input changed in place by a later op: both the
    Python and the TorchScript replay return the tuple, and an output that no
    recorded op produced is refused."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 8, generator=g)
    x = torch.randn(3, 8, generator=g)

    def f(inp):
        residual = inp * 1.5
        h = torch.nn.functional.linear(residual, w)
        residual.add_(h)  # in place, as the fused add + RMSNorm does
        return h.relu(), residual

    out, recorded = capture(lambda: f(x), [x])
    assert not isinstance(recorded, str), recorded
    x2 = torch.randn(3, 8, generator=g)
    want = f(x2)
    assert recorded.script_replay is not None
    for replay in (recorded.script_replay, recorded.python_replay):
        got = replay(x2)
        assert isinstance(got, tuple) and len(got) == 2, type(got)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"seed={seed}"
    _, refused = capture(lambda: (f(x)[0], w), [x])
    assert isinstance(refused, str) and "not produced by a recorded op" in refused


def test_views_of_constants_are_folded_and_stay_live(seed):
    """A view of constants only (the KV cache's unbind into K and V) is not
    replayed: its output is a constant that aliases the live tensor, so an
    in-place change between steps (a cache write) is seen by the replay."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 4, 8, generator=g)
    x = torch.randn(3, 8, generator=g)

    def f(inp):
        k, v = kv.unbind(0)
        return inp @ k.t() + v.sum()

    out, recorded = capture(lambda: f(x), [x])
    assert not isinstance(recorded, str), recorded
    assert len(recorded.tensor_constants) >= 1
    assert all(t.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr() for t in recorded.tensor_constants)
    kv.mul_(-3.0)  # the cache changes in place between steps
    x2 = torch.randn(3, 8, generator=g)
    for replay in (recorded.script_replay, recorded.python_replay):
        assert torch.equal(replay(x2), f(x2)), f"seed={seed}"


def test_a_view_op_that_copies_constants_is_replayed(seed):
    """reshape copies where strides forbid a view (at dispatch it arrives as
    a clone and a view of the copy): the copy would freeze the step's values,
    so it stays in the replay. And a view-marked op whose output does not
    share its input's storage is never folded."""
    from fp8serve.engine.op_recorder import CONST, is_constant_view

    a = torch.randn(4, 6)
    view = torch.ops.aten.view.default
    assert is_constant_view(view, [(CONST, a), (CONST, [24])], {}, a.view(24))
    assert not is_constant_view(view, [(CONST, a), (CONST, [24])], {}, a.clone().view(24))

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 6, generator=g)
    x = torch.randn(24, generator=g)

    def f(inp):
        return inp * w.t().reshape(-1)  # w.t() is a view (folded); its reshape copies

    out, recorded = capture(lambda: f(x), [x])
    assert not isinstance(recorded, str), recorded
    w.add_(1.0)
    x2 = torch.randn(24, generator=g)
    for replay in (recorded.script_replay, recorded.python_replay):
        assert torch.equal(replay(x2), f(x2)), f"seed={seed}"


def test_an_output_no_op_produced_cannot_be_replayed(seed):
    """The forward's result must be an input or come out of a recorded op;
    here it is a tensor made before the recording."""
    g = torch.Generator().manual_seed(seed)
    x, made_before = torch.randn(4, generator=g), torch.randn(4, generator=g)
    out, recorded = capture(lambda: made_before, [x])
    assert out is made_before and isinstance(recorded, str) and "not produced by a recorded op" in recorded


def _recorded(fn, x, n):
    """fn(x) compiled from a recording at batch size n."""
    from fp8serve.engine.compiled_replay import CapturedForward
    from fp8serve.engine.op_recorder import record

    out, rec = record(lambda: fn(x), [x])
    return CapturedForward(rec, 1, out, batch_size=n), rec, out


def test_unify_takes_batch_sized_ints_and_same_memory_views(seed):
    """A recording at another batch size unifies where only batch-sized ints
    differ and the constants are the same tensors or views of the same
    memory (each recording makes its own view of the cache, folded as a
    constant); the code compiled with those ints as `n * k` replays exactly
    at every size that unifies. (A constant sliced by the batch size, such as
    cache[:n], is a different constant at every size: never shared.)"""
    from fp8serve.engine.compiled_replay import CapturedForward, unify
    from fp8serve.engine.op_recorder import record

    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, 8, 8, generator=g)

    def f(x):
        k, v = cache.unbind(0)  # fresh view objects on every call
        n = x.shape[0]
        return (x.view(n, 2, 4) * k[0].view(1, 2, 4)).view(n, 8) + v[0]

    x3 = torch.randn(3, 8, generator=g)
    ref, _, _ = _recorded(f, x3, 3)
    x5 = torch.randn(5, 8, generator=g)
    out5, rec5 = record(lambda: f(x5), [x5])
    scaled = unify(ref, rec5.calls, rec5.slot_of[id(out5)], 5)
    assert scaled and set(scaled.values()) == {1}, f"seed={seed}: {scaled}"
    generic = CapturedForward(rec5, 1, out5, batch_size=5, scaled=scaled)
    for n in (2, 7, 5):
        xn = torch.randn(n, 8, generator=g)
        outn, recn = record(lambda: f(xn), [xn])
        assert unify(generic, recn.calls, recn.slot_of[id(outn)], n) == scaled, f"seed={seed} n={n}"
        bound = generic.bind(n)
        x_new = torch.randn(n, 8, generator=g)
        for replay in (bound.script_replay, bound.python_replay):
            assert torch.equal(replay(x_new), f(x_new)), f"seed={seed} n={n}"


def test_unify_refuses_other_memory_and_other_floats(seed):
    from fp8serve.engine.compiled_replay import unify

    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    x = torch.randn(3, 8, generator=g)
    ref, _, _ = _recorded(lambda t: t @ w1 * 0.5, x, 3)
    _, rec, out = _recorded(lambda t: t @ w2 * 0.5, x, 3)
    assert unify(ref, rec.calls, rec.slot_of[id(out)], 3) is None, "a different weight was accepted"
    _, rec, out = _recorded(lambda t: t @ w1 * 0.25, x, 3)
    assert unify(ref, rec.calls, rec.slot_of[id(out)], 3) is None, "a different float was accepted"
    _, rec, out = _recorded(lambda t: t @ w1 * 0.5, x, 3)
    assert unify(ref, rec.calls, rec.slot_of[id(out)], 3) == {}, "the same recording did not unify"
    # A constant sliced by the batch size is another constant at every size.
    cache = torch.randn(8, 8, generator=g)
    ref, _, _ = _recorded(lambda t: t * cache[:t.shape[0]], x, 3)
    x5 = torch.randn(5, 8, generator=g)
    _, rec, out = _recorded(lambda t: t * cache[:t.shape[0]], x5, 5)
    assert unify(ref, rec.calls, rec.slot_of[id(out)], 5) is None, "a batch-sliced constant was shared"


def test_a_recording_does_not_import_dynamo():
    """The recorder opts out of dynamo's `disable` wrapper: in a fresh process,
    recording ops must not import torch._dynamo (~0.5 s on the first recording)."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from fp8serve.engine.op_recorder import record\n"
            "x = torch.randn(4)\n"
            "out, rec = record(lambda: (x * 2).relu(), [x])\n"
            "assert len(rec.calls) == 2, rec.calls\n"
            "print('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", "recording imported torch._dynamo"
