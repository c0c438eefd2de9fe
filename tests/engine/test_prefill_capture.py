"""Recorded prefill forwards (engine/prefill_capture.py): every replay, at
whatever token count it serves, must give exactly what the eager model gives
for the same step; the segments must hold every row threshold of the linear
layers' kernel choices; and prefills the recording cannot cover stay eager.
Fresh random prompts each run (the seed is in every failure message)."""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import write_tiny_llama
from kv_scale_checkpoints import quantize_to_fp8_checkpoint

from fp8serve.engine.llm_engine import LLMEngine
from fp8serve.engine.op_recorder import OpRecorder
from fp8serve.engine.prefill_capture import PrefillCaptures
from fp8serve.kernels import prefill_attention_ops
from fp8serve.layers.linear import Linear, MergedLinear
from fp8serve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    # head_size 64: the bf16 prefill kernel's dot-product path, as on the default model.
    return str(write_tiny_llama(tmp_path_factory.mktemp("prefill_capture") / "llama", hidden_size=256, num_heads=4,
                                num_kv_heads=2, intermediate_size=384, max_position_embeddings=1024))


@pytest.fixture(scope="module")
def fp8_dir(llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("prefill_capture_fp8") / "llama-fp8"
    quantize_to_fp8_checkpoint(llama_dir, out)
    return str(out)


def make_engine(model_dir: str, *, dtype: str, enforce_eager: bool = False, kv_cache_dtype: str = "auto",
                record_after: int = 0) -> LLMEngine:
    engine = LLMEngine.from_args(model_dir, dtype=dtype, device="cpu", block_size=16, kv_cache_memory=16 << 20,
                                 max_model_len=1024, max_num_batched_tokens=4096, kv_cache_dtype=kv_cache_dtype,
                                 enforce_eager=enforce_eager)
    captures = engine.model_runner.prefill_captures
    captures.record_after = record_after
    return engine


def checked(engine: LLMEngine) -> list[tuple[int, bool]]:
    """Wraps the engine's prefill captures so that every replayed prefill is
    run again eagerly on the same inputs (the cache writes are the same
    values) and compared bit for bit; returns the list of (tokens, equal)."""
    captures = engine.model_runner.prefill_captures
    forward, results = captures.forward, []

    def checking(input_ids, positions, md, logits_indices=None):
        before = captures.num_replays
        out = forward(input_ids, positions, md, logits_indices)
        if captures.num_replays > before:
            out = out.clone()
            results.append((md.num_tokens, torch.equal(out, captures._eager(input_ids, positions, md,
                                                                            logits_indices))))
        return out

    captures.forward = checking
    return results


def prefill(engine: LLMEngine, prompts: list[list[int]]) -> list[int]:
    """One greedy token per prompt, all prompts added before one engine step."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{len(p)}-{i}-{random.random()}", {"prompt_token_ids": p}, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o.outputs[0].token_ids[0] for o in engine.step() if o.finished]
    return outs


def prompts_of(rng: random.Random, lengths: list[int]) -> list[list[int]]:
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("dtype,kv_cache_dtype,lengths", [
    ("bfloat16", "auto", [40, 300, 47, 257, 129, 620, 999, 300]),
    ("bfloat16", "fp8", [70, 333, 517, 129, 800, 300]),
    ("float32", "auto", [70, 333, 517, 129, 800, 300]),
])
def test_prefill_replays_equal_eager_at_other_token_counts(ops, llama_dir, seed, dtype, kv_cache_dtype, lengths):
    rng = random.Random(seed)
    engine = make_engine(llama_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    results = checked(engine)
    # Two recordings per segment, then replays at counts never recorded.
    for n in lengths + [rng.randint(8, 1000) for _ in range(6)]:
        prefill(engine, prompts_of(rng, [n]))
    captures = engine.model_runner.prefill_captures
    assert results and all(same for _, same in results), f"seed={seed}: {results}"
    assert any(s.general for s in captures._segments.values()), f"seed={seed}"
    # A segment's lasting forward replays from TorchScript: those are the replays checked above.
    assert all(s.forward.replay is not s.forward.python_replay for s in captures._segments.values() if s.general), \
        f"seed={seed}"
    replayed_counts = {n for n, _ in results}
    assert replayed_counts - set(lengths[:2]), f"seed={seed}: no replay at a count that was not recorded"


def test_prefill_replays_of_several_prompts_equal_eager(ops, llama_dir, seed):
    """Steps of 1-4 fresh prompts share one recording (cu_seqlens is an input)."""
    rng = random.Random(seed)
    engine = make_engine(llama_dir, dtype="bfloat16")
    results = checked(engine)
    # Until 6 replays: the 20-800 tokens of a step span 3-5 segments (the row
    # breakpoints differ between CPUs), 2 recordings each, so 40 steps leave at
    # least 30 replays; 12 steps were not always enough where a segment got 1-2.
    for _ in range(40):
        if len(results) >= 6:
            break
        prefill(engine, prompts_of(rng, [rng.randint(20, 200) for _ in range(rng.randint(1, 4))]))
    assert len(results) >= 6 and all(same for _, same in results), f"seed={seed}: {results}"


def test_fp8_checkpoint_prefill_replays_equal_eager(ops, fp8_dir, seed):
    rng = random.Random(seed)
    for dtype in ("bfloat16", "float32"):
        engine = make_engine(fp8_dir, dtype=dtype)
        results = checked(engine)
        for n in [300, 517, 129, 800, 70, 1000]:
            prefill(engine, prompts_of(rng, [n]))
        assert results and all(same for _, same in results), f"seed={seed} {dtype}: {results}"


def test_tokens_match_enforce_eager(ops, llama_dir, seed):
    rng = random.Random(seed)
    prompts = prompts_of(rng, [rng.randint(10, 600) for _ in range(8)])
    eager = make_engine(llama_dir, dtype="bfloat16", enforce_eager=True)
    assert not eager.model_runner.prefill_captures.enabled
    expected = [prefill(eager, [p]) for p in prompts]
    engine = make_engine(llama_dir, dtype="bfloat16")
    assert [prefill(engine, [p]) for p in prompts] == expected, f"seed={seed}"
    assert engine.model_runner.prefill_captures.num_replays > 0, f"seed={seed}"


def _linear_ops(layer, rows: int, dtype: torch.dtype) -> tuple:
    x = torch.randn(rows, layer.input_size if hasattr(layer, "input_size") else layer.weight.shape[1], dtype=dtype)
    rec = OpRecorder([x])
    with torch.inference_mode(), rec:
        layer(x)
    return tuple(f._schema.name for f, *_ in rec.calls)


@pytest.mark.parametrize("checkpoint,dtype", [("llama", "bfloat16"), ("llama", "float32"), ("fp8", "bfloat16"),
                                              ("fp8", "float32")])
def test_linear_ops_change_only_at_declared_row_breakpoints(ops, llama_dir, fp8_dir, checkpoint, dtype):
    """The guarantee replays rest on: the ops a linear layer runs for r rows
    are the same for every r between two of its method's row breakpoints
    (swept over 1-600 rows, on this machine's kernels)."""
    engine = make_engine(llama_dir if checkpoint == "llama" else fp8_dir, dtype=dtype)
    compute = getattr(torch, dtype)
    layers = [m for m in engine.model_runner.model.modules() if isinstance(m, (Linear, MergedLinear))][:2]
    assert layers
    for layer in layers:
        points = sorted(set(layer.quant_method.row_breakpoints(layer, compute)) | {2})
        seen: dict[int, tuple] = {}
        for rows in range(1, 601):
            segment = sum(1 for p in points if p <= rows)
            names = _linear_ops(layer, rows, compute)
            if segment in seen:
                assert names == seen[segment], (f"{type(layer.quant_method).__name__}: {rows} rows ran {names}, "
                                                f"earlier rows of its segment {seen[segment]} (breakpoints {points})")
            seen[segment] = names


def _prefix_caching_engine(model_dir: str, **kwargs) -> LLMEngine:
    engine = LLMEngine.from_args(model_dir, dtype=kwargs.pop("dtype", "bfloat16"), device="cpu", block_size=16,
                                 kv_cache_memory=16 << 20, max_model_len=1024, enable_prefix_caching=True, **kwargs)
    engine.model_runner.prefill_captures.record_after = 0
    return engine


@pytest.mark.parametrize("checkpoint,dtype,kv_cache_dtype", [
    ("llama", "bfloat16", "auto"), ("llama", "bfloat16", "fp8"), ("llama", "float32", "auto"),
    ("fp8", "bfloat16", "fp8"), ("fp8", "float32", "auto"),
])
def test_context_prefill_replays_equal_eager(ops, llama_dir, fp8_dir, seed, checkpoint, dtype, kv_cache_dtype):
    """Prefills that continue a cached prefix (the backend's context kernel,
    its K/V read back from the cache) are recorded apart from fresh ones and
    replayed at other token counts, other context lengths and other numbers
    of prompts: every replay equals the eager forward of its step, and the
    tokens equal an --enforce-eager engine's."""
    rng = random.Random(seed)
    shared = prompts_of(rng, [rng.randint(40, 400) for _ in range(3)])  # cached prefixes, not whole blocks
    steps = [[shared[rng.randrange(3)] + prompts_of(rng, [rng.randint(5, 150)])[0]
              for _ in range(rng.randint(1, 3))] for _ in range(14)]
    model_dir = llama_dir if checkpoint == "llama" else fp8_dir
    engine = _prefix_caching_engine(model_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    results = checked(engine)
    tokens = [prefill(engine, prompts) for prompts in steps]
    captures = engine.model_runner.prefill_captures
    context_segments = [s for k, s in captures._segments.items() if k[0] == "trunk" and k[1] > 0]
    if prefill_attention_ops.applies_with_context(getattr(torch, dtype), 512, 1):
        assert any(s.general for s in context_segments), f"seed={seed}: no context forward took other token counts"
        assert captures.num_context_replays > 0, f"seed={seed}"
    else:  # bf16 on AMX: context prefills take SDPA, which no recording covers
        assert captures.num_context_replays == 0 and not context_segments, f"seed={seed}"
    assert all(same for _, same in results), f"seed={seed}: {results}"
    eager = _prefix_caching_engine(model_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype, enforce_eager=True)
    assert [prefill(eager, prompts) for prompts in steps] == tokens, f"seed={seed}"
    assert eager.model_runner.prefill_captures.num_recorded == 0


def test_chunked_prefill_replays_equal_eager(ops, llama_dir, seed):
    """A long prompt prefilled in chunks: the first chunk is fresh, the rest
    continue the context the earlier chunks cached. float32: the context
    kernel takes those chunks on every CPU (bf16 on AMX takes SDPA)."""
    rng = random.Random(seed)
    prompts = prompts_of(rng, [rng.randint(200, 900) for _ in range(6)])

    def run(enforce_eager: bool) -> tuple[list, LLMEngine, list]:
        engine = LLMEngine.from_args(llama_dir, dtype="float32", device="cpu", block_size=16,
                                     kv_cache_memory=16 << 20, max_model_len=1024, enable_chunked_prefill=True,
                                     max_num_batched_tokens=96, max_num_seqs=8, enforce_eager=enforce_eager)
        engine.model_runner.prefill_captures.record_after = 0
        results = checked(engine)
        return [prefill(engine, [p]) for p in prompts], engine, results

    tokens, engine, results = run(False)
    assert engine.model_runner.prefill_captures.num_context_replays > 0, f"seed={seed}"
    assert results and all(same for _, same in results), f"seed={seed}: {results}"
    assert run(True)[0] == tokens, f"seed={seed}"


def test_a_segment_records_after_its_eager_prefills(ops, llama_dir, seed):
    rng = random.Random(seed)
    engine = make_engine(llama_dir, dtype="bfloat16", record_after=2)
    captures = engine.model_runner.prefill_captures
    counts = [300, 301, 302, 303, 304, 305]
    for n in counts:
        prefill(engine, prompts_of(rng, [n]))
    # 300, 301 eager; 302 recorded; 303, 304 eager (another count); 305 recorded and unified. The head
    # counts its own eager steps from the first replayed or recorded trunk: 302 and 305 eager.
    assert captures.num_recorded == 2 and captures.num_replays == 0, f"seed={seed}"
    prefill(engine, prompts_of(rng, [310]))
    assert captures.num_replays == 1 and captures.num_recorded == 3, f"seed={seed}"  # the head recorded at 310
    assert captures.num_head_replays == 0, f"seed={seed}"
    with pytest.raises(ValueError, match="record_after"):
        PrefillCaptures(engine.model_runner.model, [], engine.model_runner.backend, torch.bfloat16, True,
                        record_after=-1)


def test_a_recording_past_the_byte_budget_is_abandoned_and_smaller_prefills_still_record(ops, llama_dir, seed):
    """A recording holds all of the forward's intermediates: past max_record_bytes it gives up,
    the step's tokens are the eager engine's, and its segment records only smaller counts."""
    rng = random.Random(seed)
    engine = make_engine(llama_dir, dtype="bfloat16")
    captures = engine.model_runner.prefill_captures
    big = 300
    small = next(n for n in range(big - 1, 2, -1) if captures.segment_of(n) == captures.segment_of(big))
    prompts = prompts_of(rng, [big, big, small])
    eager = make_engine(llama_dir, dtype="bfloat16", enforce_eager=True)
    expected = [prefill(eager, [p]) for p in prompts]

    captures.max_record_bytes = 0  # every recording passes it
    assert prefill(engine, [prompts[0]]) == expected[0], f"seed={seed}"
    assert captures.num_recorded == 0 and captures.num_replays == 0, f"seed={seed}"
    trunks = [seg for key, seg in captures._segments.items() if key[0] == "trunk"]
    assert [seg.record_below for seg in trunks] == [big] and trunks[0].forward is None, f"seed={seed}"

    captures.max_record_bytes = None  # no limit now: the segment still skips counts >= big ...
    assert prefill(engine, [prompts[1]]) == expected[1], f"seed={seed}"
    assert captures.num_recorded == 0 and trunks[0].forward is None, f"seed={seed}"
    # ... and records a smaller one, straight away (its eager prefills were spent on the big one).
    assert prefill(engine, [prompts[2]]) == expected[2], f"seed={seed}"
    assert trunks[0].forward is not None and trunks[0].forward.batch_size == small, f"seed={seed}"


def test_reset_forgets_recordings_and_keeps_a_disabled_capture_off(ops, llama_dir, seed):
    rng = random.Random(seed)
    engine = make_engine(llama_dir, dtype="bfloat16")
    captures = engine.model_runner.prefill_captures
    prefill(engine, prompts_of(rng, [300]))
    assert captures.num_recorded == 2  # the trunk and the head
    prefill(engine, prompts_of(rng, [300]))
    assert captures.num_replays == 1 and captures.num_head_replays == 1, f"seed={seed}"
    captures.reset()
    assert captures.num_recorded == 0 and captures.enabled
    prefill(engine, prompts_of(rng, [300]))  # recorded again, not replayed
    assert captures.num_recorded == 2 and captures.num_replays == 1, f"seed={seed}"
    captures.enabled = False
    captures.reset()
    assert not captures.enabled


def test_heads_are_recorded_per_number_of_prompts(ops, llama_dir, seed):
    """The head (last layer, final norm) runs past attention on each prompt's last token: its
    recordings are keyed by the number of prompts too, unified across token counts like the trunk's;
    steps with prompt logprobs run it on every row, under a key of their own. Every replay, heads
    included, equals the eager forward of its step."""
    rng = random.Random(seed)
    engine = make_engine(llama_dir, dtype="bfloat16")
    captures = engine.model_runner.prefill_captures
    results = checked(engine)
    for n in (300, 301):  # trunk and head recorded at 300, again at 301 and unified
        prefill(engine, prompts_of(rng, [n]))
    assert captures.num_recorded == 4 and captures.num_head_replays == 0, f"seed={seed}"
    prefill(engine, prompts_of(rng, [310]))
    assert captures.num_replays == 1 and captures.num_head_replays == 1, f"seed={seed}"
    prefill(engine, prompts_of(rng, [150, 160]))  # two prompts, 310 tokens: the trunk replays, a new head
    assert captures.num_replays == 2 and captures.num_head_replays == 1 and captures.num_recorded == 5
    prefill(engine, prompts_of(rng, [100, 212]))  # recorded again at 312 and unified
    assert captures.num_head_replays == 1 and captures.num_recorded == 6, f"seed={seed}"
    prefill(engine, prompts_of(rng, [50, 270]))
    assert captures.num_head_replays == 2, f"seed={seed}"
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    engine.add_request("logprobs", {"prompt_token_ids": prompts_of(rng, [305])[0]}, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert captures.num_replays == 5 and captures.num_recorded == 7, f"seed={seed}: every row's head recorded"
    heads = {k[1] for k in captures._segments if k[0] == "head"}
    assert heads == {1, 2, None}, heads
    assert len(results) == 5 and all(same for _, same in results), f"seed={seed}: {results}"
