"""FP8 weight checkpoints (quant_method fp8) through the real loader: tiny
Llama and Mixtral checkpoints with float8_e4m3fn weights and per-tensor
weight_scale (different for q/k/v and gate/up shards), static and dynamic
activation schemes, must give the logits of a float64 transformers model
built from the dequantized weights. On CPU the engine dequantizes weights at
load and does not quantize activations, so static input_scale is not applied."""

from __future__ import annotations

import pytest
import torch

from checkpoints import hf_logits, load_hf_model, load_state_dict, write_tiny_llama, write_tiny_mixtral
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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("activation_scheme", ["dynamic", "static"])
def test_fp8_linear_runs_scaled_mm_on_requantized_shards(activation_scheme, device, seed, monkeypatch):
    """On an FP8-capable GPU a fused q/k/v layer with per-shard weight scales
    and a bias runs torch._scaled_mm: shards requantized to the largest scale
    (one scale per matmul, as vLLM does for per-tensor checkpoints),
    activations quantized to e4m3 (dynamic: max|x| / 448; static: the
    largest shard's input_scale). Checked against float64 arithmetic on those
    same codes; on the CPU the same path is forced (torch's CPU _scaled_mm
    adds in float32)."""
    from fp8serve.layers.linear import MergedLinear
    from fp8serve.quantization import fp8_linear
    from fp8serve.quantization.fp8 import quantize_fp8
    from fp8serve.quantization.fp8_linear import Fp8Config

    if device == "cpu":
        monkeypatch.setattr(fp8_linear, "_use_scaled_mm", lambda d: True)
    gen = torch.Generator().manual_seed(seed)
    hidden, sizes = 64, {"q": 64, "k": 32, "v": 32}  # multiples of 16, as _scaled_mm requires
    with torch.device(device):
        layer = MergedLinear(hidden, list(sizes.values()), bias=True, quant_config=Fp8Config(activation_scheme, []),
                             prefix="model.layers.0.self_attn.qkv_proj", params_dtype=torch.float32,
                             shard_names=tuple(sizes))
    decoded, scales = [], []
    for (shard, rows), magnitude, in_scale in zip(sizes.items(), (0.3, 0.5, 1.0), (0.010, 0.025, 0.015)):
        w = torch.randn(rows, hidden, generator=gen) * magnitude
        scale = float(torch.tensor(float(w.abs().max()) / FP8_E4M3.max_finite, dtype=torch.float32))
        codes = quantize_fp8(w, scale, FP8_E4M3)
        layer.weight.weight_loader(layer.weight, codes.view(torch.float8_e4m3fn), shard)
        layer.weight_scale.weight_loader(layer.weight_scale, torch.tensor(scale), shard)
        if activation_scheme == "static":
            layer.input_scale.weight_loader(layer.input_scale, torch.tensor(in_scale), shard)
        layer.bias.weight_loader(layer.bias, torch.randn(rows, generator=gen), shard)
        decoded.append(dequantize_fp8(codes, scale, FP8_E4M3))
        scales.append(scale)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.fp8_backend == "scaled_mm"
    max_scale = max(scales)
    want_codes = quantize_fp8(torch.cat(decoded), max_scale, FP8_E4M3)
    assert torch.equal(layer.weight.t().contiguous().view(torch.uint8).cpu(), want_codes)
    assert float(layer.weight_scale) == max_scale
    w_ref = dequantize_fp8(want_codes, 1.0, FP8_E4M3).double() * max_scale
    b_ref = layer.bias.double().cpu()

    for m in (1, 16, 80):
        x = torch.randn(m, hidden, generator=gen)
        if activation_scheme == "static":
            x_scale = torch.tensor(0.025)
        else:
            x_scale = (x.abs().max() / FP8_E4M3.max_finite).clamp(min=1e-12)
        xq = (x / x_scale).clamp(-FP8_E4M3.max_finite, FP8_E4M3.max_finite).to(torch.float8_e4m3fn)
        xq = xq.double() * float(x_scale)
        out = layer(x.to(device)).cpu().double()
        ref = xq @ w_ref.t() + b_ref
        magnitude = xq.abs() @ w_ref.abs().t() + b_ref.abs()
        # The FP8 tensor cores add products in a narrower accumulator than
        # float32 (~14 bits, DeepSeek-V3 report section 3.3.2; on an H200,
        # torch 2.11, K = 64: 2^-12.7 of sum |a b| measured): allow 2^-11 of
        # the absolute sum there, far below the activation rounding checked
        # next. On the CPU: any float32 sum of K products and a bias.
        rel = 2.0**-11 if device == "cuda" else (hidden + 2) * 2.0**-24
        err = (out - ref).abs()
        bound = rel * magnitude + 1e-6
        assert bool((err <= bound).all()), f"seed={seed} M={m} max error {err.max():.3g}"
        unquantized = x.double() @ w_ref.t() + b_ref
        assert float((unquantized - ref).abs().max()) > 10 * float(err.max()), "activations were not quantized"
        print(f"{device} {activation_scheme} M={m}: max |out - ref| {err.max():.2e}, "
              f"max error bound {bound.max():.2e}")


def _hf_with_gpu_fp8_arithmetic(fp8_dir, ref_dir, activation_scheme: str):
    """transformers in float64 computing what the GPU path computes: each
    fused group's shards (q/k/v, gate/up) requantized to the group's largest
    weight scale, and every quantized linear's input rounded to e4m3 with one
    scale per call (dynamic: max|x| / 448; static: the group's largest
    input_scale)."""
    from fp8serve.quantization.fp8 import quantize_fp8

    model = load_hf_model(ref_dir, torch.float64)
    state = load_state_dict(fp8_dir)
    groups = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
              ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))

    def round_input(static_scale):
        def hook(module, args):
            (x,) = args
            scale = static_scale if static_scale is not None else max(float(x.abs().max()) / FP8_E4M3.max_finite, 1e-12)
            xq = (x / scale).clamp(-FP8_E4M3.max_finite, FP8_E4M3.max_finite).to(torch.float8_e4m3fn)
            return (xq.double() * scale,)
        return hook

    for i, layer in enumerate(model.model.layers):
        for sub, names in groups:
            prefix = f"model.layers.{i}.{sub}"
            scales = [float(state[f"{prefix}.{n}.weight_scale"]) for n in names]
            static = (max(float(state[f"{prefix}.{n}.input_scale"]) for n in names)
                      if activation_scheme == "static" else None)
            for n, scale in zip(names, scales):
                decoded = dequantize_fp8(state[f"{prefix}.{n}.weight"].view(torch.uint8), scale, FP8_E4M3)
                requantized = quantize_fp8(decoded, max(scales), FP8_E4M3)
                module = getattr(getattr(layer, sub), n)
                module.weight.data = dequantize_fp8(requantized, 1.0, FP8_E4M3).double() * max(scales)
                module.register_forward_pre_hook(round_input(static))
    return model


def _prompt_logprobs(llm: LLM) -> list[dict[int, float]]:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=TOP_K)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    return [{t: lp.logprob for t, lp in pos.items()} for pos in out.prompt_logprobs[1:]]


def _scaled_mm_linears(llm: LLM) -> list:
    from fp8serve.layers.linear import MergedLinear

    model = llm.llm_engine.model_runner.model
    return [m for m in model.modules() if isinstance(m, MergedLinear)]


@pytest.mark.parametrize("activation_scheme", ["dynamic", "static"])
def test_scaled_mm_path_matches_fp8_arithmetic_reference(base_checkpoints, tmp_path, monkeypatch, activation_scheme):
    """The GPU's FP8 linear path (shards requantized to one scale, activations
    rounded to e4m3, torch._scaled_mm) run on the CPU, where _scaled_mm adds
    in float32: the prompt logprobs must equal transformers in float64 doing
    the same FP8 arithmetic, and differ visibly from the weight-only
    reference (so the activation rounding is really there and really
    matched). On an H200 the same path differs from this reference by
    0.08-0.23 in logprob on this tiny model: its FP8 tensor cores keep about
    13 bits while adding (test_fp8_linear_runs_scaled_mm_on_requantized_shards)."""
    from fp8serve.quantization import fp8_linear

    monkeypatch.setattr(fp8_linear, "_use_scaled_mm", lambda device: True)
    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    quantize_to_fp8_checkpoint(base_checkpoints["llama"], fp8_dir, ref_dir, activation_scheme=activation_scheme)
    llm = LLM(str(fp8_dir), dtype="float32", kv_cache_memory="4MiB", device="cpu")
    linears = _scaled_mm_linears(llm)
    assert linears and all(getattr(m, "fp8_backend", None) == "scaled_mm" for m in linears)
    engine = _prompt_logprobs(llm)
    with torch.no_grad():
        same_arithmetic = _hf_with_gpu_fp8_arithmetic(fp8_dir, ref_dir, activation_scheme)(
            input_ids=torch.tensor([PROMPT]), use_cache=False).logits[0]
    error = max_logprob_error(engine, same_arithmetic)
    error_weight_only = max_logprob_error(engine, hf_logits(ref_dir, PROMPT))
    print(f"scaled_mm path on CPU ({activation_scheme}): max |logprob - FP8-arithmetic reference| = {error:.2e}, "
          f"vs weight-only reference = {error_weight_only:.2e}")
    assert error < 1e-4
    assert error_weight_only > 100 * error


@pytest.mark.cuda
def test_fp8_checkpoint_on_cuda_runs_scaled_mm(base_checkpoints, tmp_path):
    """The engine on a GPU with an FP8 Llama checkpoint: every quantized
    linear runs _scaled_mm and the prompt logprobs come back finite and
    normalized. Their accuracy is checked where it can be exact (the test
    above, and the single-layer test against float64 on this device)."""
    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    quantize_to_fp8_checkpoint(base_checkpoints["llama"], fp8_dir, ref_dir)
    llm = LLM(str(fp8_dir), dtype="float32", kv_cache_memory="4MiB", device="cuda")
    linears = _scaled_mm_linears(llm)
    assert linears and all(getattr(m, "fp8_backend", None) == "scaled_mm" for m in linears)
    engine = _prompt_logprobs(llm)
    assert all(len(pos) >= TOP_K and all(v <= 0.0 and v == v for v in pos.values()) for pos in engine)
    with torch.no_grad():
        same_arithmetic = _hf_with_gpu_fp8_arithmetic(fp8_dir, ref_dir, "dynamic")(
            input_ids=torch.tensor([PROMPT]), use_cache=False).logits[0]
    print(f"FP8 checkpoint on cuda: max |logprob - FP8-arithmetic reference| = "
          f"{max_logprob_error(engine, same_arithmetic):.2e}, vs weight-only reference = "
          f"{max_logprob_error(engine, hf_logits(ref_dir, PROMPT)):.2e}")


def test_a_bad_or_missing_shard_scale_is_named(base_checkpoints, tmp_path):
    """A q/k/v (or gate/up) projection's weight_scale is its own checkpoint tensor: the error names
    the projection and the checkpoint, not only the fused parameter."""
    from safetensors.torch import load_file, save_file

    from fp8serve.errors import ConfigError

    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    quantize_to_fp8_checkpoint(base_checkpoints["llama"], fp8_dir, ref_dir)
    path = next(fp8_dir.glob("*.safetensors"))
    original = load_file(str(path))
    name = "model.layers.1.self_attn.k_proj.weight_scale"

    save_file({**original, name: torch.tensor(-1.0)}, str(path), metadata={"format": "pt"})
    with pytest.raises(ConfigError) as e:
        LLM(str(fp8_dir), dtype="float32", kv_cache_memory="4MiB")
    msg = str(e.value)
    assert str(fp8_dir) in msg and "qkv_proj.weight_scale' of shard(s) ['k'] is missing or not a finite" in msg

    save_file({k: v for k, v in original.items() if k != name}, str(path), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=f"checkpoint is missing tensors for {name}"):
        LLM(str(fp8_dir), dtype="float32", kv_cache_memory="4MiB")


def test_writer_and_loader_share_the_weight_strategies():
    """The checkpoint writer and Fp8LinearMethod accept the same weight strategies: one definition, so
    adding one to the loader cannot leave the writer refusing it (or the reverse)."""
    from fp8serve.calibration import fp8_checkpoint
    from fp8serve.quantization import fp8_linear

    assert fp8_checkpoint.WEIGHT_STRATEGIES is fp8_linear.WEIGHT_STRATEGIES
