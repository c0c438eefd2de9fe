"""`--quantization fp8` (vLLM's dynamic FP8): a 16/32-bit checkpoint's
projections quantized at load run exactly as the checkpoint `fp8serve
quantize` writes of the same model (the same e4m3 codes and per-tensor
scales, through the same kernels; that path is checked against float64
transformers in test_fp8_linear_checkpoint.py), and bad input is named."""

from __future__ import annotations

import pytest
import torch

from checkpoints import write_tiny_llama, write_tiny_mixtral
from fp8serve import LLM, SamplingParams
from fp8serve.calibration.fp8_checkpoint import write_fp8_checkpoint
from fp8serve.errors import ConfigError

PROMPT = [3, 17, 101, 45, 260, 7, 88, 300, 12, 499, 64, 5]


def make_llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), kv_cache_memory="4MiB", **{"dtype": "float32", **kw})


def run(llm: LLM) -> tuple[list[int], list[dict[int, float]]]:
    """Greedy tokens and the prompt's top-5 logprobs per position."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=5, logprobs=5)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    lps = [{t: lp.logprob for t, lp in pos.items()} for pos in out.prompt_logprobs[1:]]
    lps += [{t: lp.logprob for t, lp in pos.items()} for pos in out.outputs[0].logprobs]
    return out.outputs[0].token_ids, lps


def fp8_layers(llm: LLM) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in llm.llm_engine.model_runner.model.named_modules()
            if getattr(m, "fp8_backend", None) is not None}


@pytest.mark.parametrize("arch, ckpt_dtype, dtype", [("llama", torch.float32, "float32"),
                                                      ("llama", torch.bfloat16, "float32"),
                                                      ("llama", torch.bfloat16, "bfloat16"),
                                                      ("mixtral", torch.float32, "float32"),
                                                      ("mixtral", torch.bfloat16, "bfloat16")])
def test_quantized_at_load_equals_the_quantize_tools_checkpoint(tmp_path, arch, ckpt_dtype, dtype):
    write = write_tiny_llama if arch == "llama" else write_tiny_mixtral
    base = write(tmp_path / "base", dtype=ckpt_dtype)
    fp8_dir = tmp_path / "fp8"
    write_fp8_checkpoint(base, fp8_dir, activation_scheme="dynamic")

    online, offline = make_llm(base, quantization="fp8", dtype=dtype), make_llm(fp8_dir, dtype=dtype)
    got, ref = fp8_layers(online), fp8_layers(offline)
    # Every projection is FP8 (attention and MLP / each expert's), the router and the head are not.
    assert set(got) == set(ref) and len(got) == 2 * 2 + (2 * 4 * 2 if arch == "mixtral" else 2 * 2)
    assert not any(name.endswith(("lm_head", ".gate")) for name in got)
    for name, layer in got.items():
        assert layer.fp8_backend == ref[name].fp8_backend, name
        assert torch.equal(layer.weight, ref[name].weight), name
        assert torch.equal(layer.weight_scale, ref[name].weight_scale), name
    tokens, lps = run(online)
    ref_tokens, ref_lps = run(offline)
    assert tokens == ref_tokens and lps == ref_lps
    # And the weights did change: the 16-bit model's logprobs are elsewhere.
    _, plain = run(make_llm(base, dtype=dtype))
    assert max(abs(a[t] - b[t]) for a, b in zip(lps, plain) for t in a.keys() & b.keys()) > 1e-4


def test_an_fp8_checkpoint_is_read_as_it_is(tmp_path):
    """--quantization fp8 on a checkpoint whose weights are FP8 already changes nothing."""
    base = write_tiny_llama(tmp_path / "base")
    fp8_dir = tmp_path / "fp8"
    write_fp8_checkpoint(base, fp8_dir, activation_scheme="dynamic")
    assert run(make_llm(fp8_dir, quantization="fp8")) == run(make_llm(fp8_dir))


def test_an_unsupported_method_is_refused_naming_the_flag(tmp_path):
    base = write_tiny_llama(tmp_path / "base")
    with pytest.raises(ConfigError, match=r"--quantization 'awq' is not supported \(supported: fp8"):
        make_llm(base, quantization="awq")


@pytest.mark.parametrize("write, name", [
    (write_tiny_llama, "model.layers.1.self_attn.v_proj.weight"),
    (write_tiny_llama, "model.layers.0.mlp.up_proj.weight"),
    (write_tiny_mixtral, "model.layers.1.block_sparse_moe.experts.2.w3.weight"),
])
def test_a_nan_weight_is_named_not_quantized(tmp_path, write, name):
    """Named as the checkpoint spells it (v_proj, an expert's w3), not as the fused layer it lands in."""
    from safetensors.torch import load_file, save_file

    base = write(tmp_path / "base")
    path = next(base.glob("*.safetensors"))
    tensors = load_file(str(path))
    tensors[name][3, 5] = float("nan")
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ConfigError) as e:
        make_llm(base, quantization="fp8")
    msg = str(e.value)
    assert f"checkpoint tensor '{name}' holds NaN or infinite values" in msg and str(base) in msg


def test_float16_compute_says_the_weights_were_dequantized(tmp_path, caplog):
    """The CPU FP8 kernels take float32/bfloat16 activations: with --dtype float16 the codes are
    widened back at load, which used to happen without a word (2 bytes per weight, no FP8 speed)."""
    base = write_tiny_llama(tmp_path / "base", dtype=torch.bfloat16)
    with caplog.at_level("WARNING", logger="fp8serve.quantization.fp8_linear"):
        llm = make_llm(base, quantization="fp8", dtype="float16")
    assert {m.fp8_backend for m in fp8_layers(llm).values()} == {"dequantized"}
    said = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert said == ["FP8 weights dequantized to float16 at load (the CPU FP8 kernels take float32 or bfloat16 "
                    "activations, not torch.float16: --dtype bfloat16 keeps 1 byte): they take 2 bytes per weight, "
                    "not 1"], said
    caplog.clear()
    with caplog.at_level("WARNING", logger="fp8serve.quantization.fp8_linear"):
        make_llm(base, quantization="fp8", dtype="bfloat16")
    assert not [r for r in caplog.records if "dequantized" in r.getMessage()]
