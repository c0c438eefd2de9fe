"""FP8 KV scales through the real engine start-up: tiny Llama and Mixtral
checkpoints in every scale-name family (and a vLLM-schema JSON for a 16-bit
checkpoint) are loaded by `LLM(...)`, and every Attention layer must hold
exactly the written scales; KV cache blocks must scale with the storage dtype."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from checkpoints import add_tensors, read_config, set_quantization_config, write_tiny_llama, write_tiny_mixtral
from kv_scale_checkpoints import (
    COMPRESSED_TENSORS_KV_ONLY,
    KV_SCALE_FAMILIES,
    add_kv_scales,
    add_per_head_kv_scales,
    copy_checkpoint,
    expected_scales,
    kv_scale_tensors,
    quantize_to_fp8_checkpoint,
    write_scales_json,
)

from fp8serve import LLM, SamplingParams

# 1.5 MiB: a multiple of every bytes-per-block below (3-layer Llama, 2-layer Mixtral),
# so the block ratios are exact rather than floored.
KV_CACHE_MEMORY = 3 << 19
ARCHS = ("llama", "mixtral")


@pytest.fixture(scope="module")
def base_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv_e2e_base")
    return {
        # 3 layers and GQA 4:2 for Llama; Mixtral with its defaults (2 layers, 4 experts).
        "llama": write_tiny_llama(root / "llama", num_layers=3),
        "mixtral": write_tiny_mixtral(root / "mixtral"),
    }


@pytest.fixture(scope="module")
def family_checkpoints(base_checkpoints, tmp_path_factory):
    """(arch, family) -> checkpoint dir. kv_scale / k_v_scale sit in FP8-weight
    checkpoints (quant_method fp8); output_scale in a 16-bit checkpoint whose
    only quantization is compressed-tensors' kv_cache_scheme."""
    root = tmp_path_factory.mktemp("kv_e2e_families")
    out = {}
    for arch in ARCHS:
        for family in KV_SCALE_FAMILIES:
            d = root / f"{arch}-{family}"
            if family == "output_scale":
                copy_checkpoint(base_checkpoints[arch], d)
            else:
                quantize_to_fp8_checkpoint(base_checkpoints[arch], d)
            add_kv_scales(d, family)
            out[arch, family] = d
    return out


def build(model_dir, kv_cache_dtype, **kw) -> LLM:
    return LLM(str(model_dir), dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_memory=KV_CACHE_MEMORY, **kw)


def layer_scales(llm: LLM) -> list[tuple[float, float, float, float, str]]:
    """(k_scale param, v_scale param, _k_scale, _v_scale, source) per Attention layer."""
    return [
        (a.k_scale.item(), a.v_scale.item(), a._k_scale, a._v_scale, a.kv_scale_source)
        for a in llm.llm_engine.model_runner.attn_layers
    ]


def assert_scales(llm: LLM, expected: list[tuple[float, float, str]]) -> None:
    got = layer_scales(llm)
    assert len(got) == len(expected)
    for i, ((kp, vp, kf, vf, source), (k, v, want_source)) in enumerate(zip(got, expected)):
        # Parameters are float32; the expected values are exact in float32.
        assert (kp, vp, kf, vf) == (k, v, k, v), f"layer {i}"
        assert source == want_source, f"layer {i}"


def assert_defaults(llm: LLM) -> None:
    n = len(llm.llm_engine.model_runner.attn_layers)
    assert_scales(llm, [(1.0, 1.0, "default")] * n)


def generate_a_little(llm: LLM) -> list[int]:
    out = llm.generate([[5, 6, 7, 8, 9, 10, 11]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    return out[0].outputs[0].token_ids


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("family", KV_SCALE_FAMILIES)
def test_checkpoint_scales_reach_every_layer(family_checkpoints, arch, family):
    d = family_checkpoints[arch, family]
    num_layers = 3 if arch == "llama" else 2
    for spelling in ("fp8", "fp8_e4m3"):
        llm = build(d, spelling)
        assert llm.llm_engine.model_runner.kv_cache_spec.kv_cache_dtype == "fp8_e4m3"
        assert_scales(llm, expected_scales(family, num_layers))
    # The scales are distinct per layer and, except for the single kv_scale, between K and V.
    ks = [s[0] for s in layer_scales(llm)]
    assert len(set(ks)) == num_layers
    assert len(generate_a_little(llm)) == 4


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("family", KV_SCALE_FAMILIES)
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e5m2", "auto", "bfloat16"])
def test_checkpoint_scales_unused_without_e4m3(family_checkpoints, arch, family, kv_cache_dtype):
    assert_defaults(build(family_checkpoints[arch, family], kv_cache_dtype))


@pytest.mark.parametrize("arch", ARCHS)
def test_json_scales_for_16bit_checkpoint(base_checkpoints, tmp_path, arch):
    d = base_checkpoints[arch]
    num_layers = 3 if arch == "llama" else 2
    values = [0.03 + 0.011 * i for i in range(num_layers)]  # not exact in float32
    path = write_scales_json(tmp_path / "scales.json", arch, values)
    llm = build(d, "fp8", quantization_param_path=path)
    for i, (kp, vp, kf, vf, source) in enumerate(layer_scales(llm)):
        f32 = torch.tensor(values[i], dtype=torch.float32).item()
        assert (kp, vp) == (f32, f32)
        assert (kf, vf) == (values[i], values[i])
        assert source == f"json:{path}"
    assert len(generate_a_little(llm)) == 4
    for kv_cache_dtype in ("fp8_e5m2", "auto"):
        assert_defaults(build(d, kv_cache_dtype, quantization_param_path=path))


def test_fp8_checkpoint_scales_win_over_json(family_checkpoints, tmp_path):
    d = family_checkpoints["llama", "k_v_scale"]
    path = write_scales_json(tmp_path / "scales.json", "llama", [0.3, 0.4, 0.5])
    assert_scales(build(d, "fp8", quantization_param_path=path), expected_scales("k_v_scale", 3))


def test_scale_tensors_in_16bit_checkpoint_are_ignored(base_checkpoints, tmp_path):
    d = copy_checkpoint(base_checkpoints["llama"], tmp_path / "ckpt")
    add_tensors(d, kv_scale_tensors("k_v_scale", 3))  # no quantization_config
    assert_defaults(build(d, "fp8"))


def test_fp8_without_scales_is_default_with_warning(base_checkpoints, caplog):
    caplog.set_level(logging.WARNING)
    assert_defaults(build(base_checkpoints["llama"], "fp8"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("without calibrated scales" in m and "--quantization-param-path" in m for m in warnings)


def test_calculate_kv_scales_sets_scales_from_first_prefill(base_checkpoints):
    llm = build(base_checkpoints["llama"], "fp8", calculate_kv_scales=True)
    assert_defaults(llm)  # nothing computed before the first batch
    generate_a_little(llm)
    for kp, vp, kf, vf, source in layer_scales(llm):
        assert source == "calculated"
        assert kp > 0 and vp > 0 and kf == pytest.approx(kp) and vf == pytest.approx(vp)


def test_calculate_kv_scales_is_ignored_for_e5m2(base_checkpoints, caplog):
    caplog.set_level(logging.INFO, logger="fp8serve.engine.model_runner")
    llm = build(base_checkpoints["llama"], "fp8_e5m2", calculate_kv_scales=True)
    generate_a_little(llm)
    assert_defaults(llm)  # the seed's rule: e5m2 runs with scale 1.0
    assert any("ignored with fp8_e5m2" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------- memory

# storage dtype of each --kv-cache-dtype with float32 compute, and its bytes per element
STORAGE = {"fp8": ("fp8_e4m3", 1), "fp8_e4m3": ("fp8_e4m3", 1), "fp8_e5m2": ("fp8_e5m2", 1),
           "bfloat16": ("bfloat16", 2), "float16": ("float16", 2), "float32": ("float32", 4),
           "auto": ("float32", 4)}


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_holds_2x_blocks_of_16bit_and_4x_of_float32(base_checkpoints, caplog, arch):
    caplog.set_level(logging.INFO, logger="fp8serve.engine.model_runner")
    d = base_checkpoints[arch]
    num_layers, num_kv_heads, head_size = (3 if arch == "llama" else 2), 2, 16
    blocks = {}
    for kv_cache_dtype, (storage, elem) in STORAGE.items():
        caplog.clear()
        llm = build(d, kv_cache_dtype)
        runner = llm.llm_engine.model_runner
        bytes_per_block = 2 * 16 * num_kv_heads * head_size * elem * num_layers
        assert runner.kv_cache_spec.bytes_per_block == bytes_per_block
        assert runner.num_blocks == KV_CACHE_MEMORY // bytes_per_block
        assert llm.llm_engine.config.cache_config.num_blocks == runner.num_blocks
        # Each layer's cache: [K/V, blocks + null block, block_size, kv heads, head size].
        cache = runner.kv_caches[0]
        assert cache.shape == (2, runner.num_blocks + 1, 16, num_kv_heads, head_size)
        assert cache.element_size() == elem
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
        assert len(lines) == 1
        assert lines[0].startswith(f"KV cache: {storage}, {runner.num_blocks} blocks x 16 tokens, "
                                   f"{bytes_per_block} bytes per block")
        blocks[kv_cache_dtype] = runner.num_blocks
    for fp8 in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        assert blocks[fp8] / blocks["bfloat16"] == 2.0
        assert blocks[fp8] / blocks["float16"] == 2.0
        assert blocks[fp8] / blocks["float32"] == 4.0
        assert blocks[fp8] / blocks["auto"] == 4.0  # auto = float32 compute here


def test_log_line_reports_tokens_and_concurrency(base_checkpoints, caplog):
    caplog.set_level(logging.INFO, logger="fp8serve.engine.model_runner")
    llm = build(base_checkpoints["llama"], "fp8")
    n = llm.llm_engine.model_runner.num_blocks
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert f"{n * 16} tokens" in line
    # max_model_len 256 = 16 blocks per request
    m = re.search(r"maximum concurrency for 256 tokens per request: ([0-9.]+)x", line)
    assert m and float(m.group(1)) == pytest.approx(n / 16, abs=0.005)


def _prompt_and_decode_logprobs(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens, and the logprob of every prompt token (from position 1)
    and of every chosen token, as one float64 vector."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, prompt_logprobs=1, logprobs=1)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    comp = out.outputs[0]
    values = [pos[t].logprob for pos, t in zip(out.prompt_logprobs[1:], prompt[1:])]
    values += [pos[t].logprob for pos, t in zip(comp.logprobs, comp.token_ids)]
    return comp.token_ids, torch.tensor(values, dtype=torch.float64)


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_kv_cache_on_cuda_matches_cpu(family_checkpoints, arch):
    """A 16-bit checkpoint whose kv_cache_scheme carries per-layer scales,
    served with an FP8 cache on the GPU (torch_sdpa backend) and on the CPU
    (the engine's CPU backend): same scales in every layer, FP8 cache tensors
    on the device with twice the blocks of a bfloat16 cache, and the same
    logprobs up to float32 arithmetic, while the FP8 cache visibly moves them
    away from the float32-cache run (so the comparison can tell)."""
    d = family_checkpoints[arch, "output_scale"]
    num_layers = 3 if arch == "llama" else 2
    prompt = [int(t) for t in torch.randint(3, 500, (37,), generator=torch.Generator().manual_seed(7))]
    runs = {}
    for device, kv in (("cuda", "fp8"), ("cpu", "fp8"), ("cuda", "auto")):
        llm = build(d, kv, device=device)
        runner = llm.llm_engine.model_runner
        if kv == "fp8":
            assert_scales(llm, expected_scales("output_scale", num_layers))
            assert all(c.device.type == device and c.element_size() == 1 for c in runner.kv_caches)
        runs[device, kv] = _prompt_and_decode_logprobs(llm, prompt, 12)
        runs[device, kv, "blocks"] = runner.num_blocks
        del llm
    assert runs["cuda", "fp8", "blocks"] == runs["cpu", "fp8", "blocks"] == 4 * runs["cuda", "auto", "blocks"]
    (ids_gpu, lp_gpu), (ids_cpu, lp_cpu), (_, lp_auto) = runs["cuda", "fp8"], runs["cpu", "fp8"], runs["cuda", "auto"]
    n = min(len(lp_gpu), len(lp_cpu), len(lp_auto))
    gpu_vs_cpu = float((lp_gpu[:n] - lp_cpu[:n]).abs().max())
    fp8_vs_float32 = float((lp_gpu[:n] - lp_auto[:n]).abs().max())
    print(f"{arch}: max |logprob| difference, fp8 cache cuda vs cpu {gpu_vs_cpu:.2e}; "
          f"fp8 vs float32 cache on cuda {fp8_vs_float32:.2e}")
    assert ids_gpu == ids_cpu
    assert gpu_vs_cpu < 1e-3
    assert fp8_vs_float32 > 10 * gpu_vs_cpu


@pytest.mark.parametrize("arch", ARCHS)
def test_per_head_scales_reach_every_layer_and_generate(base_checkpoints, tmp_path, arch):
    """compressed-tensors' strategy attn_head: each layer holds its heads' scales (k_scale/v_scale
    their max), and generation runs (decode captures included) with them."""
    config = read_config(base_checkpoints[arch])
    layers, heads = config["num_hidden_layers"], config["num_key_value_heads"]
    k = [[0.01 * (i + 1) * (h + 1) for h in range(heads)] for i in range(layers)]
    v = [[0.2 + i / 8 - 0.05 * h for h in range(heads)] for i in range(layers)]
    d = copy_checkpoint(base_checkpoints[arch], tmp_path / "per-head")
    add_per_head_kv_scales(d, k, v)
    llm = build(d, "fp8")
    for i, a in enumerate(llm.llm_engine.model_runner.attn_layers):
        f32 = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
        assert torch.equal(a.k_head_scales.view(-1), f32(k[i])) and torch.equal(a.v_head_scales.view(-1), f32(v[i]))
        assert (a._k_scale, a._v_scale) == (f32(k[i]).max().item(), f32(v[i]).max().item())
    assert len(generate_a_little(llm)) == 4
    # A 16-bit cache ignores them.
    assert all(a.k_head_scales is None for a in build(d, "auto").llm_engine.model_runner.attn_layers)


def test_equal_per_head_scales_give_what_one_scale_per_layer_gives(base_checkpoints, tmp_path):
    """Per-head scales that are all equal must store the codes and produce the logprobs of the
    per-layer path: the fold around the backend (k / s into the cache, q * s, output * s) is exact
    in float32 for powers of two, so any slip (a missing q or output factor) shows."""
    scales = [(2.0**-6 * (i + 1), 2.0**-3 * (i + 2)) for i in range(3)]
    per_layer = copy_checkpoint(base_checkpoints["llama"], tmp_path / "per-layer")
    add_tensors(per_layer, {f"model.layers.{i}.self_attn.k_proj.output_scale": torch.tensor([k])
                            for i, (k, _) in enumerate(scales)}
                | {f"model.layers.{i}.self_attn.v_proj.output_scale": torch.tensor([v])
                   for i, (_, v) in enumerate(scales)})
    set_quantization_config(per_layer, COMPRESSED_TENSORS_KV_ONLY)
    per_head = copy_checkpoint(base_checkpoints["llama"], tmp_path / "per-head")
    add_per_head_kv_scales(per_head, [[k, k] for k, _ in scales], [[v, v] for _, v in scales])
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    tokens, logprobs = _prompt_and_decode_logprobs(build(per_layer, "fp8"), prompt, 6)
    tokens_h, logprobs_h = _prompt_and_decode_logprobs(build(per_head, "fp8"), prompt, 6)
    assert tokens_h == tokens
    torch.testing.assert_close(logprobs_h, logprobs, rtol=0, atol=1e-5)
