"""Where k_scale / v_scale come from: tiny hand-written safetensors checkpoints
(scale tensors plus a dummy weight) and --quantization-param-path JSON files."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kv_scale_checkpoints import record_scale_reads

from fp8serve.errors import ConfigError
from fp8serve.model_loader.weights_mapper import WeightsMapper, kv_scale_rules
from fp8serve.quantization import kv_scales
from fp8serve.quantization.kv_scales import (
    LayerKVScale,
    is_fp8_checkpoint,
    load_quantization_param_json,
    read_checkpoint_kv_scales,
    resolve_kv_scales,
)

NUM_LAYERS = 4
MAPPER = WeightsMapper(kv_scale_rules())
FP8_CONFIG = {"model_type": "llama", "quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}
CT_CONFIG = {
    "model_type": "llama",
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
    },
}
BF16_CONFIG = {"model_type": "llama", "torch_dtype": "bfloat16"}


def k_of(layer: int) -> float:
    return 0.01 * (layer + 1)  # distinct per layer, and distinct from V


def v_of(layer: int) -> float:
    return 0.5 + 0.125 * layer


def kv_scale_family(num_layers=NUM_LAYERS):
    """The seed PR's one scale for K and V."""
    return {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(k_of(i)) for i in range(num_layers)}


def k_v_scale_family(num_layers=NUM_LAYERS):
    out = {}
    for i in range(num_layers):
        out[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k_of(i))
        out[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v_of(i))
    return out


def output_scale_family(num_layers=NUM_LAYERS):
    """compressed-tensors stores shape [1]."""
    out = {}
    for i in range(num_layers):
        out[f"model.layers.{i}.self_attn.k_proj.output_scale"] = torch.tensor([k_of(i)])
        out[f"model.layers.{i}.self_attn.v_proj.output_scale"] = torch.tensor([v_of(i)])
    return out


def dummy_weights():
    return {
        "model.embed_tokens.weight": torch.randn(8, 4),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(4, 4),
        "model.layers.0.self_attn.k_proj.weight_scale": torch.tensor(0.1),
    }


def write_checkpoint(d: Path, tensors: dict, hf_config: dict, num_shards: int = 1) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(hf_config))
    tensors = {**dummy_weights(), **tensors}
    if num_shards == 1:
        save_file(tensors, str(d / "model.safetensors"))
        return d
    names = sorted(tensors)
    weight_map = {}
    for s in range(num_shards):
        file = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::num_shards]}
        save_file(part, str(d / file))
        weight_map.update({n: file for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def scale_json(scales: dict | None = None, *, model_type="llama", dtype="float8_e4m3fn", ranks=None) -> dict:
    if ranks is None:
        ranks = {"0": {str(i): s for i, s in (scales or {i: 0.1 * (i + 1) for i in range(NUM_LAYERS)}).items()}}
    return {"model_type": model_type, "kv_cache": {"dtype": dtype, "scaling_factor": ranks}}


def write_json(path: Path, obj) -> str:
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(path)


@pytest.fixture
def log(caplog):
    logger = logging.getLogger("test_kv_scales")
    caplog.set_level(logging.INFO, logger="test_kv_scales")
    return logger


def resolve(model_dir, hf_config, kv_cache_dtype, json_path=None, logger=None, num_layers=NUM_LAYERS, **kw):
    return resolve_kv_scales(
        model_dir=model_dir, hf_config=hf_config, num_layers=num_layers, kv_cache_dtype=kv_cache_dtype,
        mapper=MAPPER, quantization_param_path=json_path, logger=logger, **kw,
    )


def records(caplog, level):
    return [r for r in caplog.records if r.name == "test_kv_scales" and r.levelno == level]


# ----------------------------------------------------------------- detection


@pytest.mark.parametrize(
    "cfg, expected",
    [
        (FP8_CONFIG, True),
        (CT_CONFIG, True),
        ({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {}}}, False),
        ({"quantization_config": {"quant_method": "gptq"}}, False),
        (BF16_CONFIG, False),
    ],
)
def test_is_fp8_checkpoint(cfg, expected):
    assert is_fp8_checkpoint(cfg) is expected


# ----------------------------------------------------------- checkpoint reader


@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize(
    "family, same_tensor",
    [(kv_scale_family, True), (k_v_scale_family, False), (output_scale_family, False)],
    ids=["kv_scale", "k_scale/v_scale", "output_scale"],
)
def test_read_checkpoint_scales_per_family(tmp_path, family, same_tensor, num_shards):
    tensors = family()
    d = write_checkpoint(tmp_path / "m", tensors, FP8_CONFIG, num_shards)
    got = read_checkpoint_kv_scales(d, MAPPER)
    assert sorted(got) == list(range(NUM_LAYERS))
    for i in range(NUM_LAYERS):
        (k, k_name), (v, v_name) = got[i]["k"], got[i]["v"]
        assert k == pytest.approx(k_of(i)) and k_name in tensors and f"layers.{i}." in k_name
        assert v == pytest.approx(k_of(i) if same_tensor else v_of(i)) and v_name in tensors
        assert (k_name == v_name) is same_tensor


def test_reader_reads_only_scale_tensors(tmp_path, monkeypatch):
    d = write_checkpoint(tmp_path / "m", k_v_scale_family(), FP8_CONFIG, num_shards=2)
    read = record_scale_reads(monkeypatch)
    read_checkpoint_kv_scales(d, MAPPER)
    assert sorted(read) == sorted(k_v_scale_family())


def test_checkpoint_without_scales_reads_empty(tmp_path):
    assert read_checkpoint_kv_scales(write_checkpoint(tmp_path / "m", {}, FP8_CONFIG), MAPPER) == {}


@pytest.mark.parametrize("shape", [(), (1,)])
def test_scalar_shapes_accepted(tmp_path, shape):
    tensors = {n: t.reshape(shape) for n, t in kv_scale_family().items()}
    got = read_checkpoint_kv_scales(write_checkpoint(tmp_path / "m", tensors, FP8_CONFIG), MAPPER)
    assert got[3]["k"][0] == pytest.approx(k_of(3))


# --------------------------------------------------------------------- rules


@pytest.mark.parametrize("kv_dtype", ["auto", "bfloat16", "float16", "float32"])
def test_unscaled_kv_dtype_ignores_given_scales_with_one_info(tmp_path, log, caplog, kv_dtype):
    d = write_checkpoint(tmp_path / "m", k_v_scale_family(), FP8_CONFIG)
    # An invalid JSON proves the ignored file is not even read.
    bad = write_json(tmp_path / "s.json", scale_json(model_type="other"))
    scales = resolve(d, FP8_CONFIG, kv_dtype, bad, logger=log)
    assert scales == [LayerKVScale(i, 1.0, 1.0, "default") for i in range(NUM_LAYERS)]
    (info,) = records(caplog, logging.INFO)
    assert "ignoring" in info.getMessage() and kv_dtype in info.getMessage() and bad in info.getMessage()
    assert "model.layers.0.self_attn.k_scale" in info.getMessage()
    assert not records(caplog, logging.WARNING)


def test_unscaled_kv_dtype_without_scales_is_silent(tmp_path, log, caplog):
    d = write_checkpoint(tmp_path / "m", {}, BF16_CONFIG)
    assert all(s.source == "default" for s in resolve(d, BF16_CONFIG, "auto", logger=log))
    assert not [r for r in caplog.records if r.name == "test_kv_scales"]


@pytest.mark.parametrize("with_scales", [False, True])
def test_e5m2_uses_one_with_one_info(tmp_path, log, caplog, with_scales):
    d = write_checkpoint(tmp_path / "m", k_v_scale_family() if with_scales else {}, FP8_CONFIG)
    json_path = write_json(tmp_path / "s.json", scale_json()) if with_scales else None
    scales = resolve(d, FP8_CONFIG, "fp8_e5m2", json_path, logger=log)
    assert scales == [LayerKVScale(i, 1.0, 1.0, "default") for i in range(NUM_LAYERS)]
    (info,) = records(caplog, logging.INFO)
    assert "fp8_e5m2" in info.getMessage() and "1.0" in info.getMessage()
    assert ("ignoring" in info.getMessage()) is with_scales
    assert not records(caplog, logging.WARNING)


@pytest.mark.parametrize("num_shards", [1, 2])
@pytest.mark.parametrize(
    "cfg, family",
    [(FP8_CONFIG, kv_scale_family), (FP8_CONFIG, k_v_scale_family), (CT_CONFIG, output_scale_family)],
    ids=["kv_scale", "k_scale/v_scale", "compressed-tensors"],
)
def test_e4m3_fp8_checkpoint_scales(tmp_path, log, caplog, cfg, family, num_shards):
    d = write_checkpoint(tmp_path / "m", family(), cfg, num_shards)
    scales = resolve(d, cfg, "fp8_e4m3", logger=log)
    for i, s in enumerate(scales):
        assert s.layer == i and s.k_scale == pytest.approx(k_of(i))
        assert s.v_scale == pytest.approx(k_of(i) if family is kv_scale_family else v_of(i))
        assert s.source.startswith("checkpoint:model.layers.")
    if family is kv_scale_family:
        assert scales[2].source == "checkpoint:model.layers.2.self_attn.kv_scale"
    elif family is k_v_scale_family:
        assert scales[2].source == "checkpoint:model.layers.2.self_attn.k_scale,model.layers.2.self_attn.v_scale"
    assert len(records(caplog, logging.INFO)) == 1 and not records(caplog, logging.WARNING)


@pytest.mark.parametrize("change, words", [
    ({"num_bits": 8, "type": "int"}, "type 'int'"),
    ({"num_bits": 4}, "num_bits 4"),
    ({"strategy": "channel"}, "strategy 'channel'"),
    ({"dynamic": True}, "dynamic True"),
    ({"symmetric": False}, "symmetric False"),
])
def test_e4m3_refuses_scales_of_another_kv_cache_scheme(tmp_path, log, change, words):
    """An int8 scheme's scales (amax / 127) used for e4m3 (amax / 448) would saturate the cache:
    they loaded silently (found by probing). Refused, as vLLM does; a 16-bit cache ignores them."""
    scheme = {**CT_CONFIG["quantization_config"]["kv_cache_scheme"], **change}
    cfg = {**CT_CONFIG, "quantization_config": {**CT_CONFIG["quantization_config"], "kv_cache_scheme": scheme}}
    d = write_checkpoint(tmp_path / "m", output_scale_family(), cfg)
    with pytest.raises(ConfigError, match="quantization_config.kv_cache_scheme has") as info:
        resolve(d, cfg, "fp8_e4m3", logger=log)
    assert words in str(info.value) and "only static symmetric 8-bit float KV scales" in str(info.value)
    assert "strategy tensor or attn_head" in str(info.value)
    assert [s.k_scale for s in resolve(d, cfg, "auto", logger=log)] == [1.0] * NUM_LAYERS


def test_e4m3_checkpoint_scales_win_over_json(tmp_path, log, caplog):
    d = write_checkpoint(tmp_path / "m", k_v_scale_family(), FP8_CONFIG)
    json_path = write_json(tmp_path / "s.json", scale_json())
    scales = resolve(d, FP8_CONFIG, "fp8_e4m3", json_path, logger=log)
    assert [s.k_scale for s in scales] == pytest.approx([k_of(i) for i in range(NUM_LAYERS)])
    (info,) = records(caplog, logging.INFO)
    assert f"ignoring --quantization-param-path {json_path}" in info.getMessage()


@pytest.mark.parametrize("cfg", [BF16_CONFIG, FP8_CONFIG], ids=["16-bit checkpoint", "FP8 checkpoint without scales"])
def test_e4m3_scales_from_json(tmp_path, log, caplog, cfg):
    d = write_checkpoint(tmp_path / "m", {}, cfg)
    values = {i: 0.02 * (i + 1) for i in range(NUM_LAYERS)}
    json_path = write_json(tmp_path / "s.json", scale_json(values))
    scales = resolve(d, cfg, "fp8_e4m3", json_path, logger=log)
    assert scales == [LayerKVScale(i, values[i], values[i], f"json:{json_path}") for i in range(NUM_LAYERS)]
    assert len(records(caplog, logging.INFO)) == 1 and not records(caplog, logging.WARNING)


def test_16bit_checkpoint_scale_tensors_are_not_used(tmp_path, log, caplog):
    d = write_checkpoint(tmp_path / "m", k_v_scale_family(), BF16_CONFIG)
    scales = resolve(d, BF16_CONFIG, "fp8_e4m3", logger=log)
    assert all(s.source == "default" for s in scales)
    assert len(records(caplog, logging.WARNING)) == 1


def test_e4m3_without_scales_warns_once(tmp_path, log, caplog):
    d = write_checkpoint(tmp_path / "m", {}, FP8_CONFIG)
    scales = resolve(d, FP8_CONFIG, "fp8_e4m3", logger=log)
    assert scales == [LayerKVScale(i, 1.0, 1.0, "default") for i in range(NUM_LAYERS)]
    (warning,) = records(caplog, logging.WARNING)
    msg = warning.getMessage()
    assert "accuracy may drop" in msg and "--quantization-param-path" in msg and "fp8serve calibrate" in msg
    assert not records(caplog, logging.INFO)


def test_mixtral_json(tmp_path):
    cfg = {"model_type": "mixtral"}
    d = write_checkpoint(tmp_path / "m", {}, cfg)
    json_path = write_json(tmp_path / "s.json", scale_json({i: 0.3 for i in range(NUM_LAYERS)}, model_type="mixtral"))
    assert {s.k_scale for s in resolve(d, cfg, "fp8_e4m3", json_path)} == {0.3}


def test_json_rank_selection(tmp_path):
    ranks = {str(r): {str(i): 0.1 * (r + 1) for i in range(NUM_LAYERS)} for r in range(2)}
    path = write_json(tmp_path / "s.json", scale_json(ranks=ranks))
    got = load_quantization_param_json(path, expected_model_type="llama", num_layers=NUM_LAYERS, tp_size=2, tp_rank=1)
    assert got == {i: pytest.approx(0.2) for i in range(NUM_LAYERS)}


def test_unknown_kv_cache_dtype_is_a_bug(tmp_path):
    with pytest.raises(ValueError, match="fp8"):
        resolve(write_checkpoint(tmp_path / "m", {}, BF16_CONFIG), BF16_CONFIG, "fp8")


# -------------------------------------------------------------- JSON errors


def layers(**overrides):
    base = {str(i): 0.1 for i in range(NUM_LAYERS)}
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not ...}


@pytest.mark.parametrize(
    "content, field, expected",
    [
        ("{not json", None, "not valid JSON"),
        ([1, 2], "<top level>", "an object"),
        (scale_json(model_type="mistral"), "model_type", "'llama'"),
        ({"kv_cache": {}}, "model_type", "'llama'"),
        ({"model_type": "llama"}, "kv_cache", "an object"),
        (scale_json(dtype="float8_e5m2"), "kv_cache.dtype", "'float8_e4m3fn'"),
        (scale_json(ranks={"0": layers(), "1": layers()}), "kv_cache.scaling_factor", "1 tensor-parallel rank"),
        (scale_json(ranks={"1": layers()}), "kv_cache.scaling_factor.0", "the scales of rank 0"),
        (scale_json(ranks={"0": layers(**{"2": ...})}), "kv_cache.scaling_factor.0.2", "a scale for every layer"),
        (scale_json(ranks={"0": layers(**{"4": 0.1})}), "kv_cache.scaling_factor.0.4", "layers 0..3 only"),
        (scale_json(ranks={"0": layers(**{"x": 0.1})}), "kv_cache.scaling_factor.0.x", "a decimal layer index"),
        (scale_json(ranks={"0": layers(**{"1": "0.5"})}), "kv_cache.scaling_factor.0.1", "a number > 0"),
        (scale_json(ranks={"0": layers(**{"1": True})}), "kv_cache.scaling_factor.0.1", "a number > 0"),
        (scale_json(ranks={"0": layers(**{"1": None})}), "kv_cache.scaling_factor.0.1", "a number > 0"),
        (scale_json(ranks={"0": layers(**{"3": 0})}), "kv_cache.scaling_factor.0.3", "a finite number > 0"),
        (scale_json(ranks={"0": layers(**{"3": -0.5})}), "kv_cache.scaling_factor.0.3", "a finite number > 0"),
        (scale_json(ranks={"0": layers(**{"3": math.nan})}), "kv_cache.scaling_factor.0.3", "a finite number > 0"),
        (scale_json(ranks={"0": layers(**{"3": math.inf})}), "kv_cache.scaling_factor.0.3", "a finite number > 0"),
        (scale_json(ranks={"0": [0.1] * NUM_LAYERS}), "kv_cache.scaling_factor.0", "an object"),
        # Positive and finite, but 0 or inf as the float32 the cache keeps.
        (scale_json(ranks={"0": layers(**{"3": 1e-300})}), "kv_cache.scaling_factor.0.3",
         "a scale a float32 holds as a normal number"),
        (scale_json(ranks={"0": layers(**{"0": 1e300})}), "kv_cache.scaling_factor.0.0",
         "a scale a float32 holds as a normal number"),
    ],
)
def test_json_errors_name_file_and_field(tmp_path, content, field, expected):
    path = write_json(tmp_path / "scales.json", content)
    d = write_checkpoint(tmp_path / "m", {}, BF16_CONFIG)
    with pytest.raises(ConfigError) as e:
        resolve(d, BF16_CONFIG, "fp8_e4m3", path)
    msg = str(e.value)
    assert path in msg and expected in msg and "\n" not in msg
    if field is not None:
        assert f"field '{field}'" in msg


def test_a_key_given_twice_is_an_error(tmp_path):
    """json keeps the last of two equal keys without a word; a scale file with
    two scales for one layer is ambiguous."""
    text = json.dumps(scale_json()).replace('"0": {', '"0": {"1": 0.5, ', 1)
    path = tmp_path / "scales.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"scales.json: key '1' appears twice in one JSON object"):
        load_quantization_param_json(path, expected_model_type="llama", num_layers=NUM_LAYERS)


def test_missing_json_file_is_an_error(tmp_path):
    path = str(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match="nope.json"):
        load_quantization_param_json(path, expected_model_type="llama", num_layers=2)


# -------------------------------------------------------- checkpoint errors


def errors_for(tmp_path, tensors, num_shards=1, num_layers=NUM_LAYERS) -> str:
    d = write_checkpoint(tmp_path / "m", tensors, FP8_CONFIG, num_shards)
    with pytest.raises(ConfigError) as e:
        resolve(d, FP8_CONFIG, "fp8_e4m3", num_layers=num_layers)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("shape", [(2,), (8, 1), (1, 4)])
def test_non_scalar_checkpoint_scale(tmp_path, shape):
    tensors = k_v_scale_family()
    tensors["model.layers.1.self_attn.v_scale"] = torch.full(shape, 0.5)
    msg = errors_for(tmp_path, tensors)
    assert "model.safetensors" in msg and "'model.layers.1.self_attn.v_scale'" in msg
    assert str(list(shape)) in msg and "expected a scalar" in msg


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_bad_checkpoint_scale_value(tmp_path, value):
    tensors = output_scale_family()
    tensors["model.layers.2.self_attn.k_proj.output_scale"] = torch.tensor([value])
    msg = errors_for(tmp_path, tensors)
    assert "model.safetensors" in msg and "'model.layers.2.self_attn.k_proj.output_scale'" in msg
    assert "expected a finite KV scale > 0" in msg


def test_checkpoint_scale_below_float32_normals(tmp_path):
    tensors = output_scale_family()
    tensors["model.layers.2.self_attn.k_proj.output_scale"] = torch.tensor([1e-300], dtype=torch.float64)
    msg = errors_for(tmp_path, tensors)
    assert "'model.layers.2.self_attn.k_proj.output_scale'" in msg
    assert "a scale a float32 holds as a normal number" in msg


@pytest.mark.parametrize("drop, present, missing", [("v", "k_scale", "v_scale"), ("k", "v_scale", "k_scale")])
def test_k_without_v_and_v_without_k(tmp_path, drop, present, missing):
    tensors = k_v_scale_family()
    del tensors[f"model.layers.3.self_attn.{drop}_scale"]
    msg = errors_for(tmp_path, tensors, num_shards=2)
    assert ".safetensors" in msg and f"'model.layers.3.self_attn.{present}'" in msg
    assert f"expected 'model.layers.3.self_attn.{missing}'" in msg


def test_some_layers_without_scales(tmp_path):
    tensors = {n: t for n, t in kv_scale_family().items() if ".layers.2." not in n}
    msg = errors_for(tmp_path, tensors)
    assert str(tmp_path / "m") in msg and "3 of 4 layers" in msg
    assert "'model.layers.2.self_attn.kv_scale'" in msg


def test_checkpoint_scales_for_extra_layers(tmp_path):
    msg = errors_for(tmp_path, kv_scale_family(NUM_LAYERS + 1))
    assert "model.safetensors" in msg and "'model.layers.4.self_attn.kv_scale'" in msg and "layers 0..3" in msg


def test_two_scales_for_one_slot(tmp_path):
    tensors = {**k_v_scale_family(), "model.layers.0.self_attn.k_proj.output_scale": torch.tensor(0.3)}
    msg = errors_for(tmp_path, tensors)
    assert "model.layers.0.self_attn.k_scale" in msg and "model.layers.0.self_attn.k_proj.output_scale" in msg
    assert "expected exactly one" in msg


def test_specific_scales_win_over_the_shared_kv_scale(tmp_path):
    # Calibration tools write k_scale, v_scale and the seed's kv_scale together.
    specific = k_v_scale_family()
    shared = {n: torch.tensor(7.0) for n in kv_scale_family()}
    d = write_checkpoint(tmp_path / "m", {**shared, **specific}, FP8_CONFIG)
    got = resolve(d, FP8_CONFIG, "fp8_e4m3")
    for s in got:
        assert s.k_scale == pytest.approx(float(specific[f"model.layers.{s.layer}.self_attn.k_scale"]))
        assert s.v_scale == pytest.approx(float(specific[f"model.layers.{s.layer}.self_attn.v_scale"]))
        assert "kv_scale" not in s.source




# ----------------------------------------------------------------- per-KV-head scales (strategy attn_head)

NUM_KV_HEADS = 3
CT_HEAD_CONFIG = {
    "model_type": "llama", "num_attention_heads": 6, "num_key_value_heads": NUM_KV_HEADS,
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": False,
                            "symmetric": True},
    },
}


def k_head_of(layer: int, head: int) -> float:
    return (layer + 1) / 64 * (head + 1)  # exact in float32


def v_head_of(layer: int, head: int) -> float:
    return 0.5 + layer / 8 + head / 4


def per_head_family(num_layers=NUM_LAYERS, shape=(NUM_KV_HEADS, 1, 1)):
    """llm-compressor's attn_head layout: self_attn.k_scale / v_scale of shape [num_kv_heads, 1, 1]."""
    out = {}
    for i in range(num_layers):
        out[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(
            [k_head_of(i, h) for h in range(NUM_KV_HEADS)]).reshape(shape)
        out[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(
            [v_head_of(i, h) for h in range(NUM_KV_HEADS)]).reshape(shape)
    return out


@pytest.mark.parametrize("shape", [(NUM_KV_HEADS, 1, 1), (NUM_KV_HEADS,)])
def test_attn_head_scales_are_read_per_kv_head(tmp_path, log, caplog, shape):
    d = write_checkpoint(tmp_path / "m", per_head_family(shape=shape), CT_HEAD_CONFIG)
    scales = resolve(d, CT_HEAD_CONFIG, "fp8_e4m3", logger=log)
    for i, s in enumerate(scales):
        assert s.k_head_scales == tuple(k_head_of(i, h) for h in range(NUM_KV_HEADS))
        assert s.v_head_scales == pytest.approx(tuple(v_head_of(i, h) for h in range(NUM_KV_HEADS)))
        # The per-layer numbers are the heads' max, what a per-layer reader would show.
        assert (s.k_scale, s.v_scale) == (max(s.k_head_scales), max(s.v_head_scales))
    (info,) = records(caplog, logging.INFO)
    assert "per-layer, per-KV-head scales from the checkpoint" in info.getMessage()
    # A 16-bit cache and e5m2 ignore them, as they ignore per-layer scales.
    assert all(s.k_head_scales is None for s in resolve(d, CT_HEAD_CONFIG, "fp8_e5m2", logger=log))


@pytest.mark.parametrize("cfg, tensors, words", [
    # The scheme says per tensor, the tensors are per head: which one is right is not ours to guess.
    (CT_CONFIG, per_head_family(), "needs config.json's quantization_config.kv_cache_scheme to say strategy "
                                   "'attn_head'"),
    # The scheme says per head, the tensors have the wrong count.
    (CT_HEAD_CONFIG, per_head_family() | {"model.layers.0.self_attn.k_scale": torch.tensor([0.1, 0.2])},
     "expects one scale per KV head: shape [3, 1, 1]"),
    (CT_HEAD_CONFIG, k_v_scale_family(), "expects one scale per KV head: shape [3, 1, 1]"),
    (CT_HEAD_CONFIG, per_head_family() | {"model.layers.2.self_attn.v_scale": torch.tensor([0.1, 0.0, 0.2])},
     "model.layers.2.self_attn.v_scale' (KV head 1) is 0.0; expected a finite KV scale > 0"),
])
def test_per_head_scales_that_disagree_with_the_scheme_are_refused(tmp_path, log, cfg, tensors, words):
    d = write_checkpoint(tmp_path / "m", tensors, cfg)
    with pytest.raises(ConfigError) as info:
        resolve(d, cfg, "fp8_e4m3", logger=log)
    assert words in str(info.value)
