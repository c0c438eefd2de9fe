"""16-bit checkpoints under float32 compute keep 16-bit weights
(fp8serve/quantization/narrow_weights.py): when that applies, and that the
engine's results are those of the float32-weight engine bit for bit on every
path (prefill GEMMs, dense_gemv decode rows, decode batches above them, the
LM head) except bf16_tiled_gemm's rows (equal to float32 rounding there), and
match transformers in float64."""

from __future__ import annotations

import pytest
import torch

from checkpoints import add_tensors, hf_logits, read_tensor, write_tiny_llama

from fp8serve import LLM, SamplingParams
from fp8serve.errors import ConfigError
from fp8serve.kernels import cpu_ops, gemv_packing, onednn_linear
from fp8serve.quantization import narrow_weights
from fp8serve.quantization.narrow_weights import NarrowWeightsConfig

needs_kernels = pytest.mark.skipif(cpu_ops.load_cpu_ops() is None, reason="C++ CPU kernels not built")
CPU = torch.device("cpu")
TOP = 5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("narrow_weights")
    kw = dict(hidden_size=96, intermediate_size=160, vocab_size=600, num_heads=6, num_kv_heads=2)
    return {
        "bf16": write_tiny_llama(root / "bf16", dtype=torch.bfloat16, **kw),
        "bf16_tied": write_tiny_llama(root / "bf16_tied", dtype=torch.bfloat16, tie_word_embeddings=True, seed=1, **kw),
        "fp16": write_tiny_llama(root / "fp16", dtype=torch.float16, seed=2, **kw),
        "float32": write_tiny_llama(root / "float32", dtype=torch.float32, **kw),
    }


@needs_kernels
def test_select(checkpoints, monkeypatch, tmp_path):
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        config = narrow_weights.select(checkpoints[name], torch.float32, CPU)
        assert isinstance(config, NarrowWeightsConfig) and config.weight_dtype == dtype
        assert config.vocab_weight_dtype(torch.float32, dtype) == dtype
        assert config.get_linear_method("model.layers.0.mlp.down_proj").weight_dtype == dtype
    assert narrow_weights.select(checkpoints["float32"], torch.float32, CPU) is None
    assert narrow_weights.select(checkpoints["bf16"], torch.bfloat16, CPU) is None  # bf16 compute: nothing to keep
    monkeypatch.setenv(narrow_weights.ENV, "0")
    assert narrow_weights.select(checkpoints["bf16"], torch.float32, CPU) is None
    monkeypatch.setenv(narrow_weights.ENV, "1")
    assert isinstance(narrow_weights.select(checkpoints["bf16"], torch.float32, CPU), NarrowWeightsConfig)
    monkeypatch.setenv(narrow_weights.ENV, "half")
    with pytest.raises(ConfigError, match=rf"{narrow_weights.ENV}='half': expected auto, 1 or 0"):
        narrow_weights.select(checkpoints["bf16"], torch.float32, CPU)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        NarrowWeightsConfig(torch.float32)


@needs_kernels
@pytest.mark.parametrize("other", [torch.float32, torch.float16])
def test_a_bf16_checkpoint_with_another_dtypes_tensor_keeps_float32_weights(checkpoints, tmp_path, other):
    """The config's torch_dtype says bf16, but one tensor is float32 (storing
    it in bf16 would round it) or fp16 (two 16-bit formats): nothing is kept
    at 16 bits."""
    import shutil

    mixed = tmp_path / "mixed"
    shutil.copytree(checkpoints["bf16"], mixed)
    name = "model.layers.0.mlp.down_proj.weight"
    add_tensors(mixed, {name: read_tensor(mixed, name).to(other)})
    assert narrow_weights.select(mixed, torch.float32, CPU) is None


def _run(model_dir, prompts, max_tokens: int) -> list:
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="8MiB", max_num_seqs=64)
    # Decode steps 6-8 replay a recorded forward (the recording reads the bf16 weights too).
    llm.llm_engine.model_runner.decode_captures.first_record_after = 0
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    runner = llm.llm_engine.model_runner
    if max_tokens > 6:
        assert runner.decode_captures.num_replays > 0
    weight = runner.model.model.layers[0].mlp.gate_up_proj.weight
    head = runner.model.lm_head.weight
    results = [(o.outputs[0].token_ids,
                [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs],
                [{t: lp.logprob for t, lp in pos.items()} for pos in o.prompt_logprobs[1:]]) for o in outs]
    return results, weight.dtype, head.dtype


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 600, (int(torch.randint(5, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@needs_kernels
@pytest.mark.parametrize("name", ["bf16", "bf16_tied", "fp16"])
@pytest.mark.parametrize("packed", ["1", "0"], ids=["packed", "unpacked"])
# 1 sequence decodes on dense_gemv's rows; 3 on bf16_tiled_gemm where tiled (a
# 3-row tile), on dense_gemv otherwise; 40 above them (oneDNN, or bf16_tiled_gemm).
@pytest.mark.parametrize("num_seqs", [1, 3, 40])
# tiled: the bf16 weights' packed copy for bf16_tiled_gemm (decode batches and
# prompts of 3 or more rows), whose sums run in another order than oneDNN's.
@pytest.mark.parametrize("tiled", ["0", "1"], ids=["gemm", "tiled"])
def test_same_results_as_float32_weights(checkpoints, monkeypatch, seed, name, packed, num_seqs, tiled):
    if tiled == "1" and not cpu_ops.bf16_tiled_gemm_built():
        pytest.skip("bf16_tiled_gemm is not built here")
    monkeypatch.setenv(onednn_linear.PACKED_WEIGHTS_ENV, packed)
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, tiled)
    prompts = _prompts(num_seqs, seed)
    monkeypatch.setenv(narrow_weights.ENV, "0")
    widened, w_dtype, head_dtype = _run(checkpoints[name], prompts, max_tokens=9)
    assert w_dtype == head_dtype == torch.float32
    monkeypatch.setenv(narrow_weights.ENV, "auto")
    calls = []
    real = cpu_ops.bf16_tiled_gemm
    monkeypatch.setattr(cpu_ops, "bf16_tiled_gemm",
                        lambda x, p, n, b=None: calls.append(x.shape[0]) or real(x, p, n, b))
    kept, w_dtype, head_dtype = _run(checkpoints[name], prompts, max_tokens=9)
    assert w_dtype == head_dtype == (torch.float16 if name == "fp16" else torch.bfloat16)
    # bf16 weights only (fp16 has no packed copy), and only where asked; 40
    # sequences decode on it (fewer may reach 17 rows in their prefill only).
    if tiled == "0" or name == "fp16":
        assert not calls, f"seed={seed}"
    elif num_seqs == 40:
        assert sum(m == num_seqs for m in calls) > 0, (calls, f"seed={seed}")
    # Token ids, sampled logprobs (decode steps: the head's logits) and prompt
    # logprobs (the prefill's logits at every position): equal, not close.
    if packed == "1" and onednn_linear.packing_available(torch.float32) and tiled == "0":
        assert kept == widened, f"seed={seed}"
        return
    # Without packed copies a bf16 head past dense_gemv's rows (prompt
    # logprobs, 40 sequences) runs it on row slices where the float32 head ran
    # one GEMM, and bf16_tiled_gemm sums the linears of 12+ rows in another
    # order than oneDNN: other float32 sums. So logprobs agree to 1e-5, and a token in
    # one side's top TOP only is tied (to 1e-5) with that side's TOP-th (each
    # dict also holds the position's own token, ranked or not).
    assert [k[0] for k in kept] == [w[0] for w in widened], f"seed={seed}"
    for k, w in zip(kept, widened):
        for k_pos, w_pos in zip(k[1] + k[2], w[1] + w[2]):
            assert all(abs(k_pos[t] - w_pos[t]) < 1e-5 for t in k_pos.keys() & w_pos.keys()), f"seed={seed}"
            for one, other in ((k_pos, w_pos), (w_pos, k_pos)):
                for t in one.keys() - other.keys():
                    assert abs(one[t] - sorted(one.values(), reverse=True)[TOP - 1]) < 1e-5, (t, one, other,
                                                                                             f"seed={seed}")


@needs_kernels
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_matches_transformers_float64(checkpoints, name):
    prompt = _prompts(1, 0)[0]
    results, w_dtype, _ = _run(checkpoints[name], [prompt], max_tokens=1)
    engine = results[0][2]
    assert w_dtype != torch.float32
    ref = torch.log_softmax(hf_logits(checkpoints[name], prompt), dim=-1)
    worst = max(abs(lp - float(ref[pos, t])) for pos, entries in enumerate(engine) for t, lp in entries.items())
    assert worst < 1e-4
