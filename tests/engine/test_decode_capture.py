"""Recorded decode forwards (engine/decode_capture.py): a replay must give
exactly what the eager model gives, step after step, and the engine must fall
back to eager wherever a replay could be wrong. Fresh random prompts each run
(the seed is in every failure message)."""

from __future__ import annotations

import argparse
import random

import pytest
import torch
from checkpoints import write_tiny_llama, write_tiny_mixtral

from fp8serve.attention.backends.torch_sdpa import TorchSDPABackend
from fp8serve.attention.metadata import AttentionMetadata
from fp8serve.engine import model_runner
from fp8serve.engine.decode_capture import DecodeCaptures
from fp8serve.engine.llm_engine import LLMEngine
from fp8serve.entrypoints.engine_args import add_engine_args, engine_kwargs
from fp8serve.sampling_params import SamplingParams

BLOCK_SIZE = 4  # small blocks: the decode steps below cross many block boundaries


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("capture") / "llama"))


def make_engine(model_dir: str, *, enforce_eager: bool, kv_cache_dtype: str = "auto", dtype: str = "float32",
                record_after: int = 1, first_record_after: int = 0, static_plans: bool = False,
                **kwargs) -> LLMEngine:
    """record_after = 1 and first_record_after = 0 (the engine's defaults are 4 and 64): these runs are
    short, and would otherwise stay eager; one eager step first still covers the eager-then-record path.
    static_plans = False: these tests are about the compiled (TorchScript / Python) replays, which the
    engine uses for batches above STATIC_PLAN_MAX_BATCH (tests/engine/test_static_plan.py covers the
    static plans that serve the smaller ones)."""
    engine = LLMEngine.from_args(model_dir, dtype=dtype, device="cpu", block_size=BLOCK_SIZE, kv_cache_memory=1 << 20,
                                 max_model_len=64, kv_cache_dtype=kv_cache_dtype, enforce_eager=enforce_eager,
                                 **kwargs)
    engine.model_runner.decode_captures.record_after = record_after
    engine.model_runner.decode_captures.first_record_after = first_record_after
    engine.model_runner.decode_captures.static_plans = static_plans
    return engine


def run(engine: LLMEngine, requests) -> dict[str, tuple[list[int], list[float]]]:
    """Token ids and their logprobs of every request, run to completion."""
    for i, (prompt, max_tokens) in enumerate(requests):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
    return done


def random_requests(seed: int, n: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, 512) for _ in range(rng.randint(2, 20))], rng.randint(10, 40)) for _ in range(n)]


@pytest.mark.parametrize("kv_cache_dtype,dtype", [("auto", "float32"), ("fp8", "float32"), ("fp8_e5m2", "bfloat16")])
def test_replayed_decode_equals_eager_bit_for_bit(ops, llama_dir, seed, kv_cache_dtype, dtype):
    """Requests of different lengths: the batch shrinks as they finish, so
    several batch sizes are recorded and replayed over many steps. (Needs the
    C++ kernels: the reference backend's decode builds per-step masks, which
    keep it eager.)"""
    requests = random_requests(seed, 6)
    eager = run(make_engine(llama_dir, enforce_eager=True, kv_cache_dtype=kv_cache_dtype, dtype=dtype), requests)
    engine = make_engine(llama_dir, enforce_eager=False, kv_cache_dtype=kv_cache_dtype, dtype=dtype)
    replayed = run(engine, requests)
    assert replayed == eager, f"seed={seed}"
    captures = engine.model_runner.decode_captures
    assert captures.num_replays >= 8 and len(captures.recorded_batch_sizes) >= 2, f"seed={seed}"
    # The replays ran in the TorchScript interpreter, not the Python fallback.
    assert captures.scripted_batch_sizes == captures.recorded_batch_sizes, f"seed={seed}"
    # Every size after the first two shared a compiled forward (see DecodeCaptures); the outputs above are
    # bit for bit those of eager steps all the same.
    assert captures.num_compiled <= 2, f"seed={seed} {captures.recorded_batch_sizes}"


def test_replays_at_amx_batch_sizes_equal_eager(ops, llama_dir, seed, monkeypatch):
    """bf16 decode batches of 8+ sequences run their linears on the AMX
    kernel; recorded and replayed, they give what the eager model gives."""
    from fp8serve.kernels import amx_linear_ops

    if not amx_linear_ops.is_available():
        pytest.skip("no AMX tiles here")
    calls = []
    real = amx_linear_ops.amx_linear
    monkeypatch.setattr(amx_linear_ops, "amx_linear", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    requests = random_requests(seed, 10)
    eager = run(make_engine(llama_dir, enforce_eager=True, dtype="bfloat16"), requests)
    engine = make_engine(llama_dir, enforce_eager=False, dtype="bfloat16")
    assert run(engine, requests) == eager, f"seed={seed}"
    assert any(m >= 8 for m in calls), f"seed={seed}: no linear ran on AMX"
    assert any(b >= 8 for b in engine.model_runner.decode_captures.scripted_batch_sizes), f"seed={seed}"


def test_replays_with_gemv_packed_weights_equal_eager(ops, llama_dir, seed, monkeypatch):
    """bf16 decode batches of 13+ sequences on dense_gemv_packed's packed
    copies (gemv_packing.py): the recorded decode knows them as model state
    and replays exactly what the eager model gives."""
    from fp8serve.kernels import amx_linear_ops, cpu_ops, gemv_packing

    if not bool(ops.dense_gemv_has_packed()) or amx_linear_ops.is_available():
        pytest.skip("dense_gemv_packed is not built here, or AMX serves these batches")
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "1")
    calls = []
    real = cpu_ops.dense_gemv_packed
    monkeypatch.setattr(cpu_ops, "dense_gemv_packed",
                        lambda x, p, n, b=None, **kw: calls.append(x.shape[0]) or real(x, p, n, b, **kw))
    requests = random_requests(seed, 16)
    eager = run(make_engine(llama_dir, enforce_eager=True, dtype="bfloat16"), requests)
    engine = make_engine(llama_dir, enforce_eager=False, dtype="bfloat16")
    from fp8serve.layers.linear import MergedLinear

    linears = [m for m in engine.model_runner.model.modules() if isinstance(m, MergedLinear)]
    assert linears and all(m.weight_gemv_packed is not None for m in linears)
    assert run(engine, requests) == eager, f"seed={seed}"
    assert any(m >= cpu_ops.GEMV_PACKED_MIN_ROWS for m in calls), f"seed={seed}: no linear read a packed copy"
    assert any(b >= cpu_ops.GEMV_PACKED_MIN_ROWS for b in engine.model_runner.decode_captures.scripted_batch_sizes), \
        f"seed={seed}"


def test_replays_with_bf16_tiled_gemm_equal_eager(ops, tmp_path, seed, monkeypatch):
    """A bf16 checkpoint under float32 compute: decode batches of 12+
    sequences run bf16_tiled_gemm on the weights' packed copies
    (gemv_packing.py); the recorded decode knows them as model state and
    replays exactly what the eager model gives."""
    from checkpoints import write_tiny_llama

    from fp8serve.kernels import cpu_ops, gemv_packing
    from fp8serve.layers.linear import MergedLinear

    if not cpu_ops.bf16_tiled_gemm_built():
        pytest.skip("bf16_tiled_gemm is not built here")
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "1")
    bf16_dir = str(write_tiny_llama(tmp_path / "bf16", dtype=torch.bfloat16))
    calls = []
    real = cpu_ops.bf16_tiled_gemm
    monkeypatch.setattr(cpu_ops, "bf16_tiled_gemm",
                        lambda x, p, n, b=None: calls.append(x.shape[0]) or real(x, p, n, b))
    requests = random_requests(seed, 20)
    eager = run(make_engine(bf16_dir, enforce_eager=True), requests)
    engine = make_engine(bf16_dir, enforce_eager=False)
    linears = [m for m in engine.model_runner.model.modules() if isinstance(m, MergedLinear)]
    assert linears and all(m.weight.dtype == torch.bfloat16 and m.weight_gemv_packed is not None for m in linears)
    assert run(engine, requests) == eager, f"seed={seed}"
    assert any(m == 20 for m in calls), f"seed={seed}: no decode batch of 20 ran bf16_tiled_gemm"
    captures = engine.model_runner.decode_captures
    assert any(b >= cpu_ops.BF16_TILED_GEMM_MIN_ROWS for b in captures.scripted_batch_sizes), f"seed={seed}"
    assert captures.num_replays >= 8, f"seed={seed}"


def test_replays_with_packed_bf16_weights_equal_eager(ops, llama_dir, seed, monkeypatch):
    """bf16 linears on oneDNN's packed weights (opaque tensors, no storage):
    the recorded decode knows them as model state and replays exactly what
    the eager model gives. Every decode linear is sent there (no dense_gemv,
    no AMX), as at the batches above 32 where the engine does so."""
    from fp8serve.kernels import amx_linear_ops, cpu_ops, onednn_linear

    if not onednn_linear.packing_available():
        pytest.skip("this torch cannot pack bf16 weights for oneDNN")
    monkeypatch.setenv(onednn_linear.PACKED_WEIGHTS_ENV, "1")
    monkeypatch.setattr(cpu_ops, "dense_gemv_applies", lambda x, w: False)
    monkeypatch.setattr(amx_linear_ops, "applies", lambda x, w, packed=None: False)
    packed_calls = []
    real = onednn_linear.linear
    monkeypatch.setattr(onednn_linear, "linear",
                        lambda x, w, b=None, packed=None: packed_calls.append(packed is not None) or real(x, w, b, packed))
    requests = random_requests(seed, 6)
    eager = run(make_engine(llama_dir, enforce_eager=True, dtype="bfloat16"), requests)
    engine = make_engine(llama_dir, enforce_eager=False, dtype="bfloat16")
    from fp8serve.layers.linear import MergedLinear

    linears = [m for m in engine.model_runner.model.modules() if isinstance(m, MergedLinear)]
    assert linears and all(m.weight_packed is not None for m in linears)
    assert run(engine, requests) == eager, f"seed={seed}"
    assert packed_calls and all(packed_calls), f"seed={seed}"
    captures = engine.model_runner.decode_captures
    assert len(captures.recorded_batch_sizes) >= 2 and captures.num_replays >= 8, f"seed={seed}"
    assert captures.scripted_batch_sizes == captures.recorded_batch_sizes, f"seed={seed}"


def test_the_engine_records_a_batch_size_after_four_eager_steps(ops, llama_dir, seed):
    """The engine's default: every batch size runs 4 decode steps eagerly before it is recorded, so
    the sizes recorded are exactly those that reached a fifth step; outputs equal --enforce-eager's."""
    requests = random_requests(seed, 6)
    engine = make_engine(llama_dir, enforce_eager=False, record_after=4)
    sizes = []
    forward = engine.model_runner.decode_captures.forward

    def counting(input_ids, positions, md):
        if md.is_decode_only:
            sizes.append(md.num_seqs)
        return forward(input_ids, positions, md)

    engine.model_runner.decode_captures.forward = counting
    assert run(engine, requests) == run(make_engine(llama_dir, enforce_eager=True), requests), f"seed={seed}"
    captures = engine.model_runner.decode_captures
    assert captures.recorded_batch_sizes == sorted({n for n in sizes if sizes.count(n) >= 5}), f"seed={seed} {sizes}"
    assert captures.num_replays == sum(max(sizes.count(n) - 5, 0) for n in set(sizes)), f"seed={seed} {sizes}"
    fresh = LLMEngine.from_args(llama_dir, dtype="float32", device="cpu", kv_cache_memory=1 << 20, max_model_len=64)
    assert (fresh.model_runner.decode_captures.record_after, fresh.model_runner.decode_captures.first_record_after) \
        == (4, 64)


def test_enforce_eager_records_nothing(llama_dir, seed):
    engine = make_engine(llama_dir, enforce_eager=True)
    run(engine, random_requests(seed, 3))
    captures = engine.model_runner.decode_captures
    assert not captures.enabled and captures.num_replays == 0 and captures.recorded_batch_sizes == []


def test_new_kv_scales_are_recorded_again(ops, llama_dir, seed):
    """The scales are Python numbers baked into the recorded calls: changing
    them must not replay the old ones."""
    requests = random_requests(seed, 2)

    def with_scales(enforce_eager: bool):
        engine = make_engine(llama_dir, enforce_eager=enforce_eager, kv_cache_dtype="fp8")
        first = run(engine, requests)
        for layer in engine.model_runner.attn_layers:
            layer.set_kv_scales(0.37, 0.53, "test")
        return engine, first, run(engine, requests)

    _, eager_first, eager_second = with_scales(True)
    engine, first, second = with_scales(False)
    assert eager_first != eager_second, "the scales should change the outputs"
    assert (first, second) == (eager_first, eager_second), f"seed={seed}"
    keys = engine.model_runner.decode_captures._captures.keys()
    assert {key[1] for key in keys} == {(1.0, 1.0), (0.37, 0.53)}


def test_kv_observer_runs_eagerly(llama_dir, seed):
    """Calibration watches K/V through a Python hook; a replay would skip it."""
    engine = make_engine(llama_dir, enforce_eager=False)
    seen = []
    for layer in engine.model_runner.attn_layers:
        layer.kv_observer = lambda layer, k, v: seen.append(k.shape[0])
    rng = random.Random(seed)
    # Prompts of >= 5 tokens, so the observer's calls with 1-2 tokens are decode steps.
    run(engine, [([rng.randrange(3, 512) for _ in range(rng.randint(5, 20))], n) for n in (10, 20)])
    captures = engine.model_runner.decode_captures
    num_layers = len(engine.model_runner.attn_layers)
    assert captures.num_replays == 0, f"seed={seed}"
    assert sum(n <= 2 for n in seen) == 19 * num_layers, f"seed={seed}: the observer missed decode steps"


def test_reference_backend_runs_eagerly(llama_dir, seed, monkeypatch):
    """The reference backend (what runs without the C++ kernels) builds
    per-step masks and gather indices for decode (metadata.backend_data):
    nothing is recorded, and the outputs are those of --enforce-eager."""
    monkeypatch.setattr(model_runner, "select_backend", lambda spec, dtype, device: TorchSDPABackend(spec, dtype))
    requests = random_requests(seed, 3)
    engine = make_engine(llama_dir, enforce_eager=False)
    assert engine.model_runner.backend.name == TorchSDPABackend.name
    assert run(engine, requests) == run(make_engine(llama_dir, enforce_eager=True), requests), f"seed={seed}"
    assert engine.model_runner.decode_captures.num_replays == 0


def test_mixtral_is_never_recorded(tmp_path, seed):
    """Its routing picks experts in Python from the gate's values."""
    engine = make_engine(str(write_tiny_mixtral(tmp_path / "mixtral")), enforce_eager=False)
    run(engine, random_requests(seed, 2))
    assert not engine.model_runner.decode_captures.enabled
    assert engine.model_runner.decode_captures.num_replays == 0


def test_a_script_replay_that_differs_falls_back_to_python(ops, llama_dir, seed, monkeypatch):
    """The first replay is checked bit for bit; a TorchScript replay that
    fails the check is replaced by the Python one, not used."""
    from fp8serve.engine import compiled_replay

    real_script = compiled_replay._script

    def off_by_a_bit(*args):
        scripted = real_script(*args)
        return lambda *inputs: torch.nextafter(scripted(*inputs), torch.tensor(float("inf")))

    monkeypatch.setattr(compiled_replay, "_script", off_by_a_bit)
    requests = random_requests(seed, 3)
    engine = make_engine(llama_dir, enforce_eager=False)
    replayed = run(engine, requests)
    captures = engine.model_runner.decode_captures
    assert captures.num_replays >= 4 and captures.recorded_batch_sizes, f"seed={seed}"
    assert captures.scripted_batch_sizes == [], f"seed={seed}"
    assert replayed == run(make_engine(llama_dir, enforce_eager=True), requests), f"seed={seed}"


class _ReadsAGlobal(torch.nn.Module):
    supports_decode_capture = True

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4), requires_grad=False)
        self.per_step = torch.zeros(4)  # not a parameter or buffer: changes outside the inputs

    def forward(self, input_ids, positions):
        return input_ids.float() * self.weight + self.per_step


def _decode_metadata(n: int) -> AttentionMetadata:
    z = torch.zeros(n, dtype=torch.int64)
    return AttentionMetadata(slot_mapping=z, block_tables=z.view(n, 1), seq_lens=z + 1,
                             query_start_loc=torch.arange(n + 1), max_query_len=1, max_seq_len=1, num_seqs=n,
                             num_tokens=n)


def test_tensors_outside_inputs_and_model_state_keep_the_model_eager(seed):
    model = _ReadsAGlobal()
    captures = DecodeCaptures(model, [], enabled=True, record_after=0, first_record_after=0)
    ids = torch.arange(4)
    md = _decode_metadata(4)
    assert torch.equal(captures.forward(ids, ids, md), ids.float())
    model.per_step.fill_(1.0)
    assert torch.equal(captures.forward(ids, ids, md), ids.float() + 1), "a stale replay"
    assert captures.recorded_batch_sizes == [] and captures.num_replays == 0


def test_enforce_eager_flag_reaches_the_engine():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--enforce-eager"]))["enforce_eager"] is True
    assert engine_kwargs(p.parse_args([]))["enforce_eager"] is False


class _BatchShaped(torch.nn.Module):
    """A forward with batch-sized views and an allocation whose size is
    `alloc(n)`: proportional to the batch (shareable) or not."""

    supports_decode_capture = True

    def __init__(self, seed: int, alloc) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(8, 8, generator=g), requires_grad=False)
        self.alloc = alloc

    def forward(self, input_ids, positions):
        n = input_ids.shape[0]
        x = input_ids.float().view(n, 1) * self.weight[0] + positions.float().view(n, 1)
        h = torch.nn.functional.linear(x, self.weight).view(n, 2, 4).sum(1)  # [n, 4]
        extra = torch.ones(self.alloc(n)).sum()  # a size that depends on n as alloc says
        return h * extra


def _replay_sizes(model, sizes, seed):
    """Runs each batch size three times through DecodeCaptures (recorded on
    its first step, then replays on fresh inputs) and checks every output against the eager model."""
    g = torch.Generator().manual_seed(seed)
    captures = DecodeCaptures(model, [], enabled=True, record_after=0, first_record_after=0)
    for n in sizes:
        for _ in range(3):
            ids, pos = torch.randint(0, 100, (n,), generator=g), torch.randint(0, 100, (n,), generator=g)
            got = captures.forward(ids, pos, _decode_metadata(n))
            assert torch.equal(got, model(ids, pos)), f"seed={seed} n={n}"
    assert captures.recorded_batch_sizes == sorted(set(sizes)), f"seed={seed}"
    assert captures.num_replays == 2 * len(sizes), f"seed={seed}"
    return captures


def test_batch_sizes_share_one_compiled_forward(seed):
    """Recordings that differ only in batch-sized dimensions share a compile:
    the first size compiles its own, the second a forward taking n, and every
    later size only records and checks."""
    captures = _replay_sizes(_BatchShaped(seed, alloc=lambda n: 3 * n), [3, 5, 7, 4, 1, 9], seed)
    assert captures.num_compiled == 2, f"seed={seed}"
    assert captures.scripted_batch_sizes == [1, 3, 4, 5, 7, 9], f"seed={seed}"


def test_sizes_not_proportional_to_the_batch_compile_their_own(seed):
    """n + 1 is no multiple of the batch size: nothing is shared."""
    captures = _replay_sizes(_BatchShaped(seed, alloc=lambda n: n + 1), [3, 5, 7], seed)
    assert captures.num_compiled == 3, f"seed={seed}"


def test_a_size_proportional_only_over_a_range_is_checked_at_every_size(seed):
    """2 * max(n, 4) looks proportional at 4 and 8 (8, 16); at 2 the recording
    says 8 where the shared forward would use 4: that size compiles its own,
    and its outputs stay exact."""
    captures = _replay_sizes(_BatchShaped(seed, alloc=lambda n: 2 * max(n, 4)), [4, 8, 6, 2], seed)
    assert captures.num_compiled == 3, f"seed={seed}"  # 4, then 8 (shared by 6), then 2


def _checked_steps(captures: DecodeCaptures, seed: int):
    """step(n): one decode forward of batch size n on fresh inputs through `captures`, checked against
    the eager model."""
    g = torch.Generator().manual_seed(seed)

    def step(n: int) -> None:
        ids, pos = torch.randint(0, 100, (n,), generator=g), torch.randint(0, 100, (n,), generator=g)
        got = captures.forward(ids, pos, _decode_metadata(n))
        assert torch.equal(got, captures.model(ids, pos)), f"seed={seed} n={n}"

    return step


def test_a_batch_size_runs_record_after_eager_steps_before_it_is_recorded(seed):
    """record_after = 2: a size's first two steps run eagerly, the third is
    recorded, the rest replay; a size seen twice is never recorded; every
    output is the eager model's. reset() forgets the counts too."""
    captures = DecodeCaptures(_BatchShaped(seed, alloc=lambda n: 3 * n), [], enabled=True, record_after=2,
                              first_record_after=0)
    step = _checked_steps(captures, seed)

    for _ in range(2):
        step(4)
        step(3)
    assert captures.recorded_batch_sizes == [] and captures.num_replays == 0, f"seed={seed}"
    step(4)  # the third step: recorded
    assert captures.recorded_batch_sizes == [4] and captures.num_replays == 0, f"seed={seed}"
    step(4)
    step(4)
    assert captures.num_replays == 2, f"seed={seed}"
    step(3)
    assert captures.recorded_batch_sizes == [3, 4], f"seed={seed}"
    captures.reset()
    step(4)
    assert captures.recorded_batch_sizes == [], f"seed={seed}"


def test_nothing_is_recorded_before_first_record_after_eager_steps(seed, caplog):
    """first_record_after = 5: the first 5 decode steps, of any sizes, run eagerly (the first recording
    compiles, which a short run would not win back); then sizes are recorded under record_after (0
    here), including one met for the first time; reset() starts the count again."""
    captures = DecodeCaptures(_BatchShaped(seed, alloc=lambda n: 3 * n), [], enabled=True, record_after=0,
                              first_record_after=5)
    step = _checked_steps(captures, seed)

    for n in (2, 3, 2, 3, 2):
        step(n)
    assert captures.recorded_batch_sizes == [] and captures.num_compiled == 0, f"seed={seed}"
    with caplog.at_level("INFO", logger="fp8serve.engine.decode_capture"):
        step(3)  # the sixth step: recorded
    assert captures.recorded_batch_sizes == [3] and captures.num_compiled == 1, f"seed={seed}"
    assert ("recorded once per batch size (after 0 eager steps of it, and none that compiles in the engine's "
            "first 5)") in caplog.text
    step(5)  # a compiled forward exists: a new size is recorded at once
    assert captures.recorded_batch_sizes == [3, 5], f"seed={seed}"
    captures.reset()
    step(3)
    assert captures.recorded_batch_sizes == [], f"seed={seed}"


def test_the_log_line_leaves_out_an_engine_wide_wait_of_zero(seed, caplog):
    """A server's engine (first_record_after = 0) logs only the per-size rule."""
    captures = DecodeCaptures(_BatchShaped(seed, alloc=lambda n: 3 * n), [], enabled=True, record_after=1,
                              first_record_after=0)
    step = _checked_steps(captures, seed)
    with caplog.at_level("INFO", logger="fp8serve.engine.decode_capture"):
        step(2)
        step(2)
    assert captures.recorded_batch_sizes == [2], f"seed={seed}"
    assert "recorded once per batch size (after 1 eager steps of it) and replayed" in caplog.text


@pytest.mark.parametrize("name", ["record_after", "first_record_after"])
def test_recording_thresholds_must_not_be_negative(name):
    with pytest.raises(ValueError, match=f"{name} is a number of eager steps >= 0, got -1"):
        DecodeCaptures(_ReadsAGlobal(), [], enabled=True, **{name: -1})


def test_static_plans_do_not_wait_for_first_record_after(ops, llama_dir, seed):
    """A static plan compiles nothing: a batch size up to STATIC_PLAN_MAX_BATCH is recorded after its
    record_after eager steps even in a fresh engine's first 64 steps, where a recording that would compile
    TorchScript still waits; outputs equal --enforce-eager's either way."""
    requests = [(r[0], 16) for r in random_requests(seed, 1)]
    eager = run(make_engine(llama_dir, enforce_eager=True), requests)
    for static_plans in (True, False):
        engine = make_engine(llama_dir, enforce_eager=False, record_after=2, first_record_after=64,
                             static_plans=static_plans)
        assert run(engine, requests) == eager, f"seed={seed}"
        captures = engine.model_runner.decode_captures
        if static_plans:
            assert captures.static_batch_sizes == [1] and captures.num_replays >= 10, f"seed={seed}"
        else:
            assert captures.recorded_batch_sizes == [] and captures.num_replays == 0, f"seed={seed}"


def test_a_batch_without_a_static_plan_leaves_smaller_batches_theirs(ops, tmp_path, seed, monkeypatch):
    """Which kernels a decode forward calls changes with its rows: a bf16 checkpoint under float32
    compute with packed copies runs bf16_tiled_gemm from BF16_TILED_GEMM_MIN_ROWS rows, which no static
    plan replays. A batch of 3 that made no plan must not keep a later batch of 1 from its plan."""
    from fp8serve.kernels import cpu_ops, gemv_packing

    if not cpu_ops.bf16_tiled_gemm_built():
        pytest.skip("needs bf16_tiled_gemm (AVX2 + FMA)")
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "1")
    model_dir = str(write_tiny_llama(tmp_path / "llama", dtype=torch.bfloat16))
    assert cpu_ops.BF16_TILED_GEMM_MIN_ROWS <= 3
    rng = random.Random(seed)
    three = [([rng.randrange(3, 512) for _ in range(6)], 8) for _ in range(3)]
    one = [([rng.randrange(3, 512) for _ in range(5)], 16)]
    engine = make_engine(model_dir, enforce_eager=False, record_after=2, first_record_after=64, static_plans=True)
    eager = make_engine(model_dir, enforce_eager=True)
    assert run(engine, three) == run(eager, three), f"seed={seed}"
    captures = engine.model_runner.decode_captures
    assert captures.static_batch_sizes == [] and captures.recorded_batch_sizes == [], f"seed={seed}"
    assert run(engine, one) == run(eager, one), f"seed={seed}"
    assert captures.static_batch_sizes == [1] and captures.num_replays >= 10, f"seed={seed}"


@pytest.mark.parametrize("static_plans", [False, True])
def test_per_head_kv_scales_are_recorded_again(ops, llama_dir, seed, static_plans):
    """Per-KV-head scales are tensors baked into the recorded calls: new ones must not replay
    the old recording, and a replay (compiled, or a static plan) gives what the eager forward gives."""
    requests = random_requests(seed, 2)

    def with_scales(enforce_eager: bool):
        engine = make_engine(llama_dir, enforce_eager=enforce_eager, kv_cache_dtype="fp8", static_plans=static_plans)
        outputs = []
        for k_heads in ((0.25, 0.5), (0.5, 0.0625)):
            for layer in engine.model_runner.attn_layers:
                heads = k_heads + (k_heads[-1],) * (layer.num_kv_heads - len(k_heads))
                layer.set_kv_scales(max(heads), 0.5, "test", heads, (0.5,) * layer.num_kv_heads)
            outputs.append(run(engine, requests))
        return engine, outputs

    _, eager = with_scales(True)
    engine, replayed = with_scales(False)
    assert eager[0] != eager[1], "the scales should change the outputs"
    assert replayed == eager, f"seed={seed}"
    captures = engine.model_runner.decode_captures
    assert len({key[1] for key in captures._captures.keys()}) == 2
    # Replayed, not eager: the fold's factors are model state (buffers), its ops plan steps.
    assert None not in captures._captures.values() and captures.num_replays > 0
    assert captures.num_static == (len(captures._captures) if static_plans else 0), captures._captures
