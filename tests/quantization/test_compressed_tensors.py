"""compressed-tensors FP8 weight checkpoints (llm-compressor's FP8 / FP8_DYNAMIC / W8A16 schemes)
through the real loader: tiny Llama and Mixtral checkpoints with float8_e4m3fn weights and
per-channel (bf16 [out, 1]) or per-tensor scales, groups chosen by "Linear" / regex targets, and
an ignore list, must give the logits of a float64 transformers model built from the
dequantized weights; what fp8serve cannot run is refused naming the field."""

from __future__ import annotations

import pytest
import torch

from checkpoints import (
    add_tensors,
    hf_logits,
    load_state_dict,
    read_config,
    remove_tensors,
    set_quantization_config,
    write_tiny_llama,
    write_tiny_mixtral,
)
from kv_scale_checkpoints import (
    FP8_DYNAMIC_TOKEN,
    FP8_STATIC_TENSOR,
    compressed_tensors_config,
    fp8_group,
    quantize_to_compressed_tensors_checkpoint,
)
from test_fp8_linear_checkpoint import _decoded_weight, engine_prompt_logprobs, max_logprob_error

from fp8serve import LLM
from fp8serve.errors import ConfigError


@pytest.fixture(scope="module")
def base_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("compressed_tensors_base")
    return {"llama": write_tiny_llama(root / "llama"), "mixtral": write_tiny_mixtral(root / "mixtral")}


def _check_against_references(base, fp8_dir, ref_dir) -> float:
    engine = engine_prompt_logprobs(fp8_dir)
    error = max_logprob_error(engine, hf_logits(ref_dir, PROMPT))
    # The same engine output against the original weights: the check can tell FP8 from them.
    error_vs_original = max_logprob_error(engine, hf_logits(base, PROMPT))
    print(f"max |engine - dequantized reference| = {error:.2e}, vs original weights = {error_vs_original:.2e}")
    assert error < 1e-4
    assert error_vs_original > 100 * error
    return error


PROMPT = [3, 17, 101, 45, 260, 7, 88, 300, 12, 499, 64, 5]


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_fp8_dynamic_per_channel_matches_dequantized_reference(base_checkpoints, tmp_path, arch):
    """llm-compressor's FP8_DYNAMIC: every Linear per channel, activations dynamic per token,
    lm_head and the MoE router ignored."""
    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    config = compressed_tensors_config({"group_0": fp8_group(["Linear"], "channel", FP8_DYNAMIC_TOKEN)},
                                       ["lm_head", "re:.*block_sparse_moe.gate$"])
    scales = quantize_to_compressed_tensors_checkpoint(base_checkpoints[arch], fp8_dir, ref_dir,
                                                       strategy_of=lambda m: "channel", quantization_config=config)
    state = load_state_dict(fp8_dir)
    q = "model.layers.0.self_attn.q_proj"
    assert state[f"{q}.weight"].dtype == torch.float8_e4m3fn
    assert state[f"{q}.weight_scale"].dtype == torch.bfloat16
    assert state[f"{q}.weight_scale"].shape == (state[f"{q}.weight"].shape[0], 1)
    assert len(set(scales[f"{q}.weight"].flatten().tolist())) > 1  # really one scale per row
    _check_against_references(base_checkpoints[arch], fp8_dir, ref_dir)

    # The loaded layers hold each row's own scale (fused q/k/v rows keep their projection's).
    llm = LLM(str(fp8_dir), dtype="float32", kv_cache_memory="4MiB")
    layer = llm.llm_engine.model_runner.model.model.layers[0]
    ref = load_state_dict(ref_dir)
    qkv = torch.cat([ref[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(_decoded_weight(layer.self_attn.qkv_proj), qkv)
    if arch == "mixtral":
        assert layer.mlp.gate.weight.dtype == torch.float32  # the ignored router stays unquantized


def test_mixed_groups_regex_targets_and_ignored_layers(base_checkpoints, tmp_path):
    """Two groups as in llm-compressor's examples: attention per channel with 16-bit activations
    (W8A16), MLP per tensor with static input scales; one layer's MLP ignored (left float)."""
    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"

    def strategy_of(module: str) -> str | None:
        if module.startswith("model.layers.1.mlp."):
            return None
        return "channel" if ".self_attn." in module else "tensor"

    config = compressed_tensors_config(
        {"attention": fp8_group([r"re:.*self_attn\.(q|k|v|o)_proj$"], "channel", None),
         "mlp": fp8_group([r"re:.*mlp\.(gate|up|down)_proj$"], "tensor", FP8_STATIC_TENSOR)},
        ["lm_head", "re:model\\.layers\\.1\\.mlp\\..*"])
    quantize_to_compressed_tensors_checkpoint(base_checkpoints["llama"], fp8_dir, ref_dir, strategy_of=strategy_of,
                                              quantization_config=config, static_input_scales=True)
    assert "model.layers.0.mlp.up_proj.input_scale" in load_state_dict(fp8_dir)
    _check_against_references(base_checkpoints["llama"], fp8_dir, ref_dir)
    layers = LLM(str(fp8_dir), dtype="float32", kv_cache_memory="4MiB").llm_engine.model_runner.model.model.layers
    assert layers[0].mlp.gate_up_proj.weight.dtype == torch.uint8  # FP8 codes
    assert layers[1].mlp.gate_up_proj.weight.dtype == torch.float32  # ignored


def test_target_precedence_name_then_regex_then_class(base_checkpoints, tmp_path):
    """A group naming a module wins over a regex group listed before it, a regex over "Linear"."""
    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    down0 = "model.layers.0.mlp.down_proj"

    def strategy_of(module: str) -> str:
        return "tensor" if module == down0 or ".mlp." not in module else "channel"

    config = compressed_tensors_config(
        {"all": fp8_group(["Linear"], "tensor", None),
         "mlp": fp8_group([r"re:.*mlp\..*_proj$"], "channel", None),
         "one": fp8_group([down0], "tensor", None)}, ["lm_head"])
    quantize_to_compressed_tensors_checkpoint(base_checkpoints["llama"], fp8_dir, ref_dir, strategy_of=strategy_of,
                                              quantization_config=config)
    _check_against_references(base_checkpoints["llama"], fp8_dir, ref_dir)


def test_bfloat16_compute_and_dequantized_path(base_checkpoints, tmp_path, monkeypatch):
    """Per-channel scales on the bf16 kernels and on the decode-at-load path (no C++ kernel):
    both compute with codes x row scale."""
    from fp8serve.quantization import fp8_linear

    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    config = compressed_tensors_config({"g": fp8_group(["Linear"], "channel", FP8_DYNAMIC_TOKEN)}, ["lm_head"])
    quantize_to_compressed_tensors_checkpoint(base_checkpoints["llama"], fp8_dir, ref_dir,
                                              strategy_of=lambda m: "channel", quantization_config=config)
    ref = load_state_dict(ref_dir)["model.layers.0.mlp.down_proj.weight"]
    llm = LLM(str(fp8_dir), dtype="bfloat16", kv_cache_memory="4MiB")
    down = llm.llm_engine.model_runner.model.model.layers[0].mlp.down_proj
    assert down.fp8_backend == "cpu_kernel" and torch.equal(_decoded_weight(down), ref)
    monkeypatch.setattr(fp8_linear, "_use_cpu_kernel", lambda device, dtype: False)
    llm = LLM(str(fp8_dir), dtype="float32", kv_cache_memory="4MiB")
    down = llm.llm_engine.model_runner.model.model.layers[0].mlp.down_proj
    assert down.fp8_backend == "dequantized" and torch.equal(down.weight, ref)


def _write(base, tmp_path, config, strategy_of=lambda m: "channel"):
    fp8_dir = tmp_path / "fp8"
    quantize_to_compressed_tensors_checkpoint(base, fp8_dir, strategy_of=strategy_of, quantization_config=config)
    return fp8_dir


def _load_error(model_dir) -> str:
    with pytest.raises(ConfigError) as info:
        LLM(str(model_dir), dtype="float32", kv_cache_memory="4MiB")
    return str(info.value)


@pytest.mark.parametrize("change, words", [
    (lambda g: g.update(format="pack-quantized", weights={**g["weights"], "type": "int", "num_bits": 4}),
     "config_groups.group_0: format 'pack-quantized' is not supported"),
    (lambda g: g["weights"].update(type="int"), "config_groups.group_0.weights is 8-bit int: only 8-bit float"),
    (lambda g: g["weights"].update(strategy="block", block_structure=[128, 128]),
     "weights.strategy is 'block' (block_structure [128, 128]): only 'tensor' and 'channel'"),
    (lambda g: g["weights"].update(strategy="group", group_size=128), "weights.strategy is 'group'"),
    (lambda g: g.update(output_activations=dict(FP8_DYNAMIC_TOKEN)), "output_activations is set"),
    (lambda g: g.update(input_activations={**FP8_STATIC_TENSOR, "strategy": "token"}),
     "input_activations (dynamic False, strategy 'token') is not supported"),
    (lambda g: g["input_activations"].update(symmetric=False), "input_activations.symmetric is False"),
    (lambda g: g.update(targets="Linear"), "config_groups.group_0.targets must be a list of strings"),
    (lambda g: g.update(targets=["re:*proj"]), "config_groups.group_0.targets: 're:*proj' is not a valid regular "
                                               "expression (nothing to repeat at position 0)"),
])
def test_unsupported_schemes_are_refused(base_checkpoints, tmp_path, change, words):
    group = fp8_group(["Linear"], "channel", FP8_DYNAMIC_TOKEN)
    change(group)
    fp8_dir = _write(base_checkpoints["llama"], tmp_path, compressed_tensors_config({"group_0": group}, ["lm_head"]))
    error = _load_error(fp8_dir)
    assert f"{fp8_dir}/config.json: quantization_config" in error and words in error, error


@pytest.mark.parametrize("change, words", [
    ({"transform_config": {"config_groups": {"u": {"type": "hadamard", "apply": [{"location": "input"}]}}}},
     "transform_config is set: weight/activation transforms (Hadamard rotations) are not supported"),
    ({"quantization_status": "frozen"}, "quantization_status is 'frozen': only 'compressed' checkpoints"),
    ({"sparsity_config": {"format": "sparse-24-bitmask", "sparsity_structure": "2:4", "targets": ["Linear"]}},
     "sparsity_config has format 'sparse-24-bitmask': sparse-compressed weights are not supported"),
])
def test_uncompressed_and_sparse_checkpoints_are_refused(base_checkpoints, tmp_path, change, words):
    config = {**compressed_tensors_config({"g": fp8_group(["Linear"], "channel", None)}, ["lm_head"]), **change}
    assert words in _load_error(_write(base_checkpoints["llama"], tmp_path, config))


def test_dense_sparsity_config_loads(base_checkpoints, tmp_path):
    config = compressed_tensors_config({"g": fp8_group(["Linear"], "channel", None)}, ["lm_head"])
    config["sparsity_config"] = {"format": "dense", "global_sparsity": 0.5, "sparsity_structure": "2:4"}
    layer = LLM(str(_write(base_checkpoints["llama"], tmp_path, config)), dtype="float32",
                kv_cache_memory="4MiB").llm_engine.model_runner.model.model.layers[0]
    assert layer.mlp.down_proj.fp8_backend == "cpu_kernel"


def test_fused_projections_quantized_differently_are_refused(base_checkpoints, tmp_path):
    config = compressed_tensors_config({"g": fp8_group(["Linear"], "channel", None)},
                                       ["lm_head", "model.layers.0.self_attn.q_proj"])
    fp8_dir = _write(base_checkpoints["llama"], tmp_path, config,
                     strategy_of=lambda m: None if m == "model.layers.0.self_attn.q_proj" else "channel")
    error = _load_error(fp8_dir)
    assert "the projections fused into model.layers.0.self_attn.qkv_proj are quantized differently" in error
    assert ("model.layers.0.self_attn.q_proj: not quantized, model.layers.0.self_attn.k_proj: FP8 weights per "
            "channel, dynamic activations") in error


def test_unquantized_weights_under_an_fp8_config_are_refused(base_checkpoints, tmp_path):
    """A config claiming FP8 over 16/32-bit weights: the weights were cast to FP8 without a scale."""
    config = compressed_tensors_config({"g": fp8_group(["Linear"], "channel", None)}, ["lm_head"])
    fp8_dir = _write(base_checkpoints["llama"], tmp_path, config,
                     strategy_of=lambda m: None if m.endswith("layers.1.mlp.down_proj") else "channel")
    rows = load_state_dict(fp8_dir)["model.layers.1.mlp.down_proj.weight"].shape[0]
    add_tensors(fp8_dir, {"model.layers.1.mlp.down_proj.weight_scale": torch.ones(rows, 1)})
    error = _load_error(fp8_dir)
    assert "model.layers.1.mlp.down_proj.weight' is torch.float32, expected torch.float8_e4m3fn" in error


def test_bad_channel_scales_are_named(base_checkpoints, tmp_path):
    config = compressed_tensors_config({"g": fp8_group(["Linear"], "channel", None)}, ["lm_head"])
    fp8_dir = _write(base_checkpoints["llama"], tmp_path, config)
    name = "model.layers.0.self_attn.k_proj.weight_scale"
    rows = load_state_dict(fp8_dir)[name].shape[0]
    add_tensors(fp8_dir, {name: torch.ones(rows, 2, dtype=torch.bfloat16)})
    assert (f"tensor '{name}': checkpoint scale for 'model.layers.0.self_attn.qkv_proj.weight_scale' has shape "
            f"({rows}, 2), expected ({rows}, 1)") in _load_error(fp8_dir)
    bad = torch.ones(rows, 1, dtype=torch.bfloat16)
    bad[3] = 0
    add_tensors(fp8_dir, {name: bad})
    error = _load_error(fp8_dir)
    assert "qkv_proj.weight_scale' of shard(s) ['k'] is missing or not a finite number > 0" in error
    assert "1 of" in error and "0.0" in error


def test_fp8_weight_block_size_is_refused(base_checkpoints, tmp_path):
    fp8_dir = _write(base_checkpoints["llama"], tmp_path,
                     {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    assert "weight_block_size is [128, 128]: block-wise FP8 weights are not supported" in _load_error(fp8_dir)


def test_kv_cache_scheme_alongside_fp8_weights(base_checkpoints, tmp_path):
    """A compressed-tensors checkpoint with FP8 weights and a kv_cache_scheme is an FP8-KV checkpoint too."""
    config = compressed_tensors_config({"g": fp8_group(["Linear"], "channel", FP8_DYNAMIC_TOKEN)}, ["lm_head"])
    config["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                 "symmetric": True}
    fp8_dir = _write(base_checkpoints["llama"], tmp_path, config)
    add_tensors(fp8_dir, {f"model.layers.{i}.self_attn.{p}_proj.output_scale": torch.tensor([0.05 * (i + 1)])
                          for i in range(read_config(fp8_dir)["num_hidden_layers"]) for p in "kv"})
    llm = LLM(str(fp8_dir), dtype="float32", kv_cache_memory="4MiB", kv_cache_dtype="fp8")
    layers = llm.llm_engine.model_runner.attn_layers
    assert [float(a.k_scale) for a in layers] == pytest.approx([0.05 * (i + 1) for i in range(len(layers))])
    assert llm.llm_engine.model_runner.model.model.layers[0].self_attn.qkv_proj.fp8_backend == "cpu_kernel"


def test_autofp8_ignored_layers_name_checkpoint_modules(base_checkpoints, tmp_path):
    """`ignored_layers` of an fp8 checkpoint names checkpoint modules (q_proj); listing one part of a
    fused layer is refused instead of quantizing or skipping the whole fused matmul silently."""
    from kv_scale_checkpoints import quantize_to_fp8_checkpoint
    from checkpoints import set_quantization_config

    fp8_dir = tmp_path / "fp8"
    quantize_to_fp8_checkpoint(base_checkpoints["mixtral"], fp8_dir)
    set_quantization_config(fp8_dir, {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "ignored_layers": ["model.layers.1.block_sparse_moe.experts.2.w3"]})
    error = _load_error(fp8_dir)
    assert ("ignored_layers lists model.layers.1.block_sparse_moe.experts.2.w3 but not the projections fused with it "
            "into model.layers.1.mlp.experts.2.gate_up_proj") in error


def test_fp8_attention_q_scale_is_ignored(base_checkpoints, tmp_path):
    """llm-compressor's FP8 attention adds self_attn.q_scale: queries stay unquantized here, so the
    checkpoint loads (it was refused as an unknown tensor) and computes as without it."""
    config = compressed_tensors_config({"g": fp8_group(["Linear"], "channel", None)}, ["lm_head"])
    fp8_dir = _write(base_checkpoints["llama"], tmp_path, config)
    without = LLM(str(fp8_dir), dtype="float32", kv_cache_memory="4MiB").llm_engine.prompt_logits(PROMPT)
    add_tensors(fp8_dir, {f"model.layers.{i}.self_attn.q_scale": torch.tensor([0.02])
                          for i in range(read_config(fp8_dir)["num_hidden_layers"])})
    with_q = LLM(str(fp8_dir), dtype="float32", kv_cache_memory="4MiB").llm_engine.prompt_logits(PROMPT)
    assert torch.equal(with_q, without)


_Q = "model.layers.0.self_attn.q_proj"
_DISAGREE = "the config and the weights disagree"


@pytest.mark.parametrize("activations, name, tensor, words", [
    (FP8_DYNAMIC_TOKEN, f"{_Q}.weight_zero_point", torch.zeros(1, dtype=torch.int8),
     "is a zero point of asymmetric weights, but {where}.config_groups.group_0.weights says symmetric"),
    (FP8_DYNAMIC_TOKEN, f"{_Q}.input_scale", torch.tensor([0.01]),
     "is a static activation scale, but {where}.config_groups.group_0.input_activations says dynamic"),
    (None, f"{_Q}.input_scale", torch.tensor([0.01]),
     "is a static activation scale, but {where}.config_groups.group_0.input_activations is null (16-bit "
     "activations)"),
    (FP8_STATIC_TENSOR, "model.layers.0.mlp.down_proj.input_zero_point", torch.zeros(1, dtype=torch.int8),
     "is a zero point of asymmetric activations, but {where}.config_groups.group_0.input_activations says "
     "symmetric"),
    (FP8_DYNAMIC_TOKEN, f"{_Q}.output_scale", torch.tensor([0.01]),
     "is an output activation scale, but {where}.config_groups.group_0.output_activations is null"),
    (FP8_DYNAMIC_TOKEN, f"{_Q}.output_zero_point", torch.zeros(1, dtype=torch.int8),
     "is a zero point of asymmetric output activations, but {where}.config_groups.group_0.output_activations is "
     "null"),
    (FP8_DYNAMIC_TOKEN, "model.layers.0.self_attn.k_zero_point", torch.zeros(1, dtype=torch.int8),
     "is a zero point of an asymmetric KV cache, but {where}.kv_cache_scheme is not set"),
    (FP8_DYNAMIC_TOKEN, "model.layers.1.self_attn.v_proj.output_zero_point", torch.zeros(1, dtype=torch.int8),
     "is a zero point of an asymmetric KV cache, but {where}.kv_cache_scheme is not set"),
    (FP8_DYNAMIC_TOKEN, "lm_head.weight_scale", torch.tensor([0.01]),
     "is an FP8 weight scale, but {where} leaves lm_head unquantized (it matches {where}.ignore)"),
])
def test_tensors_the_config_contradicts_are_named(base_checkpoints, tmp_path, activations, name, tensor, words):
    """A tensor the model has no place for, that a config field rules out, says which field: the generic
    'does not match any parameter' left the reader to work out that the config and the weights disagree."""
    config = compressed_tensors_config({"group_0": fp8_group(["Linear"], "channel", activations)}, ["lm_head"])
    fp8_dir = _write(base_checkpoints["llama"], tmp_path, config)
    add_tensors(fp8_dir, {name: tensor})
    error = _load_error(fp8_dir)
    where = f"{fp8_dir}/config.json: quantization_config"
    assert error.startswith(f"{fp8_dir}/model.safetensors: tensor '{name}' "), error
    assert words.format(where=where) + f": {_DISAGREE}" in error, error


def test_kv_cache_zero_point_names_the_symmetric_kv_cache_scheme(base_checkpoints, tmp_path):
    config = compressed_tensors_config({"g": fp8_group(["Linear"], "channel", None)}, ["lm_head"])
    config["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                 "symmetric": True}
    fp8_dir = _write(base_checkpoints["llama"], tmp_path, config)
    add_tensors(fp8_dir, {"model.layers.0.self_attn.v_zero_point": torch.zeros(1, dtype=torch.int8)})
    assert (f"tensor 'model.layers.0.self_attn.v_zero_point' is a zero point of an asymmetric KV cache, but "
            f"{fp8_dir}/config.json: quantization_config.kv_cache_scheme says symmetric: {_DISAGREE}"
            ) in _load_error(fp8_dir)


def test_unknown_tensor_keeps_the_generic_message(base_checkpoints, tmp_path):
    config = compressed_tensors_config({"g": fp8_group(["Linear"], "channel", None)}, ["lm_head"])
    fp8_dir = _write(base_checkpoints["llama"], tmp_path, config)
    add_tensors(fp8_dir, {f"{_Q}.lora_A": torch.zeros(2, 2)})
    assert (f"tensor '{_Q}.lora_A' does not match any parameter of LlamaForCausalLM (mapped to "
            "'model.layers.0.self_attn.qkv_proj.lora_A')") in _load_error(fp8_dir)


def test_fp8_weights_of_an_ignored_layer_are_refused(base_checkpoints, tmp_path):
    """FP8 codes for a layer the config leaves in 16 bits were cast to floats without their scale (the
    load then stopped only at the scale, with the generic line)."""
    down = "model.layers.1.mlp.down_proj"
    config = compressed_tensors_config({"g": fp8_group(["Linear"], "channel", None)}, ["lm_head", down])
    fp8_dir = _write(base_checkpoints["llama"], tmp_path, config)
    where = f"{fp8_dir}/config.json: quantization_config"
    assert (f"{fp8_dir}/model.safetensors: tensor '{down}.weight' holds FP8 (torch.float8_e4m3fn) weights, but "
            f"{where} leaves {down} unquantized (it matches {where}.ignore): {_DISAGREE}") in _load_error(fp8_dir)


@pytest.mark.parametrize("quantization_config, static, words", [
    ({k: v for k, v in compressed_tensors_config({}, ["lm_head"]).items() if k != "config_groups"}, False,
     "tensor 'model.layers.0.mlp.down_proj.weight' holds FP8 (torch.float8_e4m3fn) weights, but {where}"
     ".config_groups is not set (without it compressed-tensors quantizes only the KV cache)"),
    ({k: v for k, v in compressed_tensors_config({}, ["lm_head"]).items() if k != "config_groups"}, True,
     "tensor 'model.layers.0.mlp.down_proj.input_scale' is a static activation scale, but {where}"
     ".config_groups is not set (without it compressed-tensors quantizes only the KV cache)"),
    (None, False, "tensor 'model.layers.0.mlp.down_proj.weight' holds FP8 (torch.float8_e4m3fn) weights, but "
     "{config_json} has no quantization_config"),
])
def test_fp8_weights_without_a_weight_config_are_refused(base_checkpoints, tmp_path, quantization_config,
                                                         static, words):
    """float8 weights whose config.json declares none: the codes would be read as plain floats."""
    fp8_dir = tmp_path / "fp8"
    quantize_to_compressed_tensors_checkpoint(base_checkpoints["llama"], fp8_dir, strategy_of=lambda m: "tensor",
                                              quantization_config={}, static_input_scales=static)
    set_quantization_config(fp8_dir, quantization_config)
    error = _load_error(fp8_dir)
    config_json = f"{fp8_dir}/config.json"
    assert words.format(where=f"{config_json}: quantization_config", config_json=config_json) + f": {_DISAGREE}" \
        in error, error


@pytest.mark.parametrize("projection, missing", [
    ("w2", "model.layers.0.block_sparse_moe.experts.0.w2.weight_scale"),
    ("w1", "model.layers.1.block_sparse_moe.experts.2.w1.weight_scale"),
    ("w3", "model.layers.1.block_sparse_moe.experts.3.w3.weight_scale"),
])
def test_a_missing_expert_scale_is_named_as_in_the_checkpoint(base_checkpoints, tmp_path, projection, missing):
    """Mixtral's unfused experts (block_sparse_moe.experts.E.w1/w2/w3) land in experts.E.gate_up_proj /
    down_proj: the missing tensor is named as the checkpoint spells it, not as our parameter."""
    config = compressed_tensors_config({"g": fp8_group(["Linear"], "channel", None)},
                                       ["lm_head", "re:.*block_sparse_moe.gate$"])
    fp8_dir = _write(base_checkpoints["mixtral"], tmp_path, config)
    remove_tensors(fp8_dir, [missing])
    assert f"{fp8_dir}: checkpoint is missing tensors for {missing}" in _load_error(fp8_dir)


def test_group_size_with_channel_strategy_is_refused(base_checkpoints, tmp_path):
    """compressed-tensors' QuantizationArgs refuses a positive group_size without strategy 'group'; here it
    was ignored, loading a config that its own library rejects."""
    group = fp8_group(["Linear"], "channel", None)
    group["weights"]["group_size"] = 128
    fp8_dir = _write(base_checkpoints["llama"], tmp_path, compressed_tensors_config({"group_0": group}, ["lm_head"]))
    assert (f"{fp8_dir}/config.json: quantization_config.config_groups.group_0.weights.group_size is 128 with "
            "strategy 'channel': compressed-tensors uses a positive group_size only with strategy 'group'"
            ) in _load_error(fp8_dir)


def test_channel_group_size_minus_one_loads(base_checkpoints, tmp_path):
    """group_size -1 is compressed-tensors' own spelling of per-channel."""
    group = fp8_group(["Linear"], "channel", None)
    group["weights"]["group_size"] = -1
    fp8_dir = _write(base_checkpoints["llama"], tmp_path, compressed_tensors_config({"group_0": group}, ["lm_head"]))
    layer = LLM(str(fp8_dir), dtype="float32", kv_cache_memory="4MiB").llm_engine.model_runner.model.model.layers[0]
    assert layer.mlp.down_proj.fp8_backend == "cpu_kernel"


@pytest.mark.parametrize("name, tensor, words", [
    (f"{_Q}.input_scale", torch.tensor([0.01]), "is a static activation scale, but {where}.activation_scheme is "
     "'dynamic'"),
    (f"{_Q}.weight_zero_point", torch.zeros(1, dtype=torch.int8), "is a zero point of asymmetric weights, but "
     "{where}.quant_method is 'fp8': symmetric FP8, no zero points"),
    ("lm_head.weight_scale", torch.tensor([0.01]), "is an FP8 weight scale, but {where} leaves lm_head unquantized "
     "(lm_head, MoE routers and {where}.ignored_layers are)"),
])
def test_fp8_tensors_the_config_contradicts_are_named(base_checkpoints, tmp_path, name, tensor, words):
    """The same for AutoFP8's `quant_method: fp8`."""
    from kv_scale_checkpoints import quantize_to_fp8_checkpoint

    fp8_dir = tmp_path / "fp8"
    quantize_to_fp8_checkpoint(base_checkpoints["llama"], fp8_dir)
    add_tensors(fp8_dir, {name: tensor})
    where = f"{fp8_dir}/config.json: quantization_config"
    assert (f"{fp8_dir}/model.safetensors: tensor '{name}' " + words.format(where=where) + f": {_DISAGREE}"
            ) in _load_error(fp8_dir)


def test_a_zero_expert_scale_is_named_as_in_the_checkpoint(base_checkpoints, tmp_path):
    """A loaded but unusable scale of an unfused expert names the checkpoint tensor too, not only
    the parameter it landed in (experts.1.gate_up_proj)."""
    config = compressed_tensors_config({"g": fp8_group(["Linear"], "tensor", None)},
                                       ["lm_head", "re:.*block_sparse_moe.gate$"])
    fp8_dir = _write(base_checkpoints["mixtral"], tmp_path, config, strategy_of=lambda m: "tensor")
    add_tensors(fp8_dir, {"model.layers.0.block_sparse_moe.experts.1.w3.weight_scale": torch.tensor([0.0])})
    error = _load_error(fp8_dir)
    assert ("'model.layers.0.mlp.experts.1.gate_up_proj.weight_scale' of shard(s) [1] is missing or not a finite "
            "number > 0") in error, error
    assert error.endswith("; checkpoint tensor(s) model.layers.0.block_sparse_moe.experts.1.w3.weight_scale"), error


def test_compression_config_key_is_read_as_quantization_config(base_checkpoints, tmp_path):
    """Older llm-compressor checkpoints name the block compression_config; vLLM reads it where
    quantization_config is absent, and so do the engine and the checkpoint writers here."""
    import json

    from fp8serve.calibration.writers import write_kv_scale_checkpoint

    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    config = compressed_tensors_config({"group_0": fp8_group(["Linear"], "channel", FP8_DYNAMIC_TOKEN)}, ["lm_head"])
    quantize_to_compressed_tensors_checkpoint(base_checkpoints["llama"], fp8_dir, ref_dir,
                                              strategy_of=lambda m: "channel", quantization_config=config)
    cfg = read_config(fp8_dir)
    cfg["compression_config"] = cfg.pop("quantization_config")
    (fp8_dir / "config.json").write_text(json.dumps(cfg))
    _check_against_references(base_checkpoints["llama"], fp8_dir, ref_dir)
    layers = LLM(str(fp8_dir), dtype="float32", kv_cache_memory="4MiB").llm_engine.model_runner.model.model.layers
    assert layers[0].self_attn.qkv_proj.weight.dtype == torch.uint8  # FP8 codes, read by compressed-tensors

    # calibrate --out-checkpoint's writer: the weights' groups and the KV scheme in one quantization_config.
    kv_dir = write_kv_scale_checkpoint(fp8_dir, tmp_path / "kv", [0.5, 0.25], [0.75, 1.5])
    written = read_config(kv_dir)
    assert "compression_config" not in written
    assert written["quantization_config"]["config_groups"] == config["config_groups"]
    assert written["quantization_config"]["kv_cache_scheme"]["strategy"] == "tensor"
    llm = LLM(str(kv_dir), dtype="float32", kv_cache_memory="4MiB", kv_cache_dtype="fp8")
    layer = llm.llm_engine.model_runner.model.model.layers[1]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.uint8
    assert (layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale) == (0.25, 1.5)
