"""FP8 weight checkpoints (quant_method fp8) through the real loader: tiny
Llama and Mixtral checkpoints with float8_e4m3fn weights and per-tensor
weight_scale (different for q/k/v and gate/up shards), static and dynamic
activation schemes, must give the logits of a float64 transformers model
built from the dequantized weights. On CPU the engine dequantizes weights at
load and does not quantize activations, so static input_scale is not applied."""

from __future__ import annotations

import pytest
import torch

from checkpoints import hf_logits, load_state_dict, write_tiny_llama, write_tiny_mixtral
from kv_scale_checkpoints import quantize_to_fp8_checkpoint

from fp8serve.quantization.fp8 import FP8_E4M3, dequantize_fp8
from fp8serve import LLM, SamplingParams

PROMPT = [3, 17, 101, 45, 260, 7, 88, 300, 12, 499, 64, 5]
TOP_K = 5


@pytest.fixture(scope="module")
def base_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_weights_base")
    return {"llama": write_tiny_llama(root / "llama"), "mixtral": write_tiny_mixtral(root / "mixtral")}


def engine_prompt_logprobs(model_dir) -> list[dict[int, float]]:
    """token id -> logprob at prompt positions 1.. (the prompt token and the top-k)."""
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="4MiB")
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=TOP_K)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    return [{t: lp.logprob for t, lp in pos.items()} for pos in out.prompt_logprobs[1:]]


def max_logprob_error(engine: list[dict[int, float]], reference_logits: torch.Tensor) -> float:
    ref = torch.log_softmax(reference_logits, dim=-1)  # [len(PROMPT), vocab]
    worst = 0.0
    for pos, entries in enumerate(engine):
        assert PROMPT[pos + 1] in entries and len(entries) >= TOP_K
        for token, logprob in entries.items():
            worst = max(worst, abs(logprob - float(ref[pos, token])))
    return worst


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
@pytest.mark.parametrize("activation_scheme", ["dynamic", "static"])
def test_fp8_weights_match_dequantized_reference(base_checkpoints, tmp_path, arch, activation_scheme):
    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    scales = quantize_to_fp8_checkpoint(base_checkpoints[arch], fp8_dir, ref_dir, activation_scheme=activation_scheme)

    # The checkpoint is what it claims: FP8 codes, float32 scalar scales, shards with their own scales.
    state = load_state_dict(fp8_dir)
    p = "model.layers.0.self_attn"
    assert state[f"{p}.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert state[f"{p}.q_proj.weight_scale"].dtype == torch.float32
    assert len({scales[f"{p}.{x}_proj.weight"] for x in "qkv"}) == 3
    if arch == "llama":
        assert scales["model.layers.0.mlp.gate_proj.weight"] != scales["model.layers.0.mlp.up_proj.weight"]
    else:
        e = "model.layers.0.block_sparse_moe.experts.0"
        assert scales[f"{e}.w1.weight"] != scales[f"{e}.w3.weight"]
        assert state["model.layers.0.block_sparse_moe.gate.weight"].dtype == torch.float32  # router stays
    assert (f"{p}.q_proj.input_scale" in state) == (activation_scheme == "static")

    engine = engine_prompt_logprobs(fp8_dir)
    error = max_logprob_error(engine, hf_logits(ref_dir, PROMPT))
    # The same comparison against the original (unquantized) weights shows the
    # check can tell FP8 weights from the originals.
    error_vs_original = max_logprob_error(engine, hf_logits(base_checkpoints[arch], PROMPT))
    print(f"{arch} {activation_scheme}: max |engine - dequantized reference| = {error:.2e}, "
          f"vs original weights = {error_vs_original:.2e}")
    assert error < 1e-4
    assert error_vs_original > 100 * error


def test_fp8_weights_are_dequantized_per_shard(base_checkpoints, tmp_path):
    """Each shard of the fused qkv / gate_up weight is decoded with its own scale."""
    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    quantize_to_fp8_checkpoint(base_checkpoints["llama"], fp8_dir, ref_dir)
    llm = LLM(str(fp8_dir), dtype="float32", kv_cache_memory="4MiB")
    layer = llm.llm_engine.model_runner.model.model.layers[0]
    ref = load_state_dict(ref_dir)
    p = "model.layers.0"
    qkv = torch.cat([ref[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"])
    gate_up = torch.cat([ref[f"{p}.mlp.{x}_proj.weight"] for x in ("gate", "up")])
    for module, expected in ((layer.self_attn.qkv_proj, qkv), (layer.mlp.gate_up_proj, gate_up)):
        assert torch.equal(_decoded_weight(module), expected)


def _decoded_weight(module) -> torch.Tensor:
    """The float weight a linear layer computes with: kept at one byte per
    element with a per-row scale on the CPU kernel path, decoded at load
    otherwise."""
    if module.weight.dtype == torch.uint8:
        return dequantize_fp8(module.weight, 1.0, FP8_E4M3) * module.weight_scale[:, None]
    return module.weight


def test_float32_compute_keeps_the_checkpoints_bf16_head(tmp_path, monkeypatch):
    """A bf16 FP8 checkpoint under float32 compute stores its (tied)
    embedding / LM head in bf16, and gives the same logprobs as with the head
    upcast to float32 at load (bf16 -> float32 is exact)."""
    from fp8serve.quantization.fp8_linear import Fp8Config

    base = write_tiny_llama(tmp_path / "base", dtype=torch.bfloat16, tie_word_embeddings=True)
    fp8_dir = tmp_path / "fp8"
    quantize_to_fp8_checkpoint(base, fp8_dir)
    llm = LLM(str(fp8_dir), dtype="float32", kv_cache_memory="4MiB")
    model = llm.llm_engine.model_runner.model
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.lm_head.weight is model.model.embed_tokens.weight
    narrow = engine_prompt_logprobs(fp8_dir)
    monkeypatch.setattr(Fp8Config, "vocab_weight_dtype", lambda self, compute, checkpoint: compute)
    wide_llm = LLM(str(fp8_dir), dtype="float32", kv_cache_memory="4MiB")
    assert wide_llm.llm_engine.model_runner.model.lm_head.weight.dtype == torch.float32
    wide = engine_prompt_logprobs(fp8_dir)
    worst = max(abs(a[t] - b[t]) for a, b in zip(narrow, wide) for t in a)
    assert [set(a) for a in narrow] == [set(b) for b in wide] and worst < 1e-5, worst
