"""Scales written by `fp8serve.calibration.writers` must come back unchanged
through the engine's own readers: the JSON through --quantization-param-path,
the checkpoint copy through `fp8serve scales` / engine start-up as
`checkpoint:` sources."""

from __future__ import annotations

import json

import pytest
import torch

from checkpoints import checkpoint_tensor_names, read_tensor, write_tiny_llama
from kv_scale_checkpoints import add_kv_scales, quantize_to_fp8_checkpoint

from fp8serve import LLM
from fp8serve.calibration.writers import (
    KV_ONLY_QUANTIZATION_CONFIG,
    attention_prefixes,
    kv_scales_json_doc,
    write_kv_scale_checkpoint,
    write_kv_scales_json,
)
from fp8serve.errors import UserError
from fp8serve.model_loader.weights_mapper import is_kv_scale_param
from fp8serve.models.llama import LlamaForCausalLM
from fp8serve.quantization.kv_scales import load_quantization_param_json
from fp8serve.tools.scales import inspect_kv_scales

NUM_LAYERS = 3
K = [0.011, 0.02, 0.0305]
V = [0.013, 0.017, 0.04]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("writers") / "llama", num_layers=NUM_LAYERS)


def test_json_round_trips_through_the_engine_loader(tmp_path):
    path = write_kv_scales_json(tmp_path / "s.json", "llama", K, V)
    assert json.loads(path.read_text()) == kv_scales_json_doc("llama", [max(k, v) for k, v in zip(K, V)])
    got = load_quantization_param_json(path, expected_model_type="llama", num_layers=NUM_LAYERS)
    assert got == {i: max(k, v) for i, (k, v) in enumerate(zip(K, V))}


def _mapper_predicate():
    class Cfg:  # the Llama mapper reads only this field
        tie_word_embeddings = False

    mapper = LlamaForCausalLM.weights_mapper(Cfg())
    return lambda n: any(is_kv_scale_param(t.param_name) for t in mapper.map(n))


@pytest.mark.parametrize("fmt", ["both", "k_v", "kv"])
def test_checkpoint_copy_of_16bit_model(base, tmp_path, fmt):
    out = write_kv_scale_checkpoint(base, tmp_path / "out", K, V, kv_scale_format=fmt,
                                    is_kv_scale_tensor=_mapper_predicate())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == KV_ONLY_QUANTIZATION_CONFIG
    assert (out / "tokenizer.json").is_file() and not (tmp_path / ".out.partial").exists()
    # weights are untouched
    for name in checkpoint_tensor_names(base):
        assert torch.equal(read_tensor(out, name), read_tensor(base, name))
    _, scales = inspect_kv_scales(str(out), "fp8_e4m3")
    for i, s in enumerate(scales):
        p = f"model.layers.{i}.self_attn"
        if fmt == "both":  # k_scale/v_scale win over the seed's kv_scale written beside them
            assert read_tensor(out, f"{p}.kv_scale") == pytest.approx(max(K[i], V[i]))
        if fmt in ("k_v", "both"):
            assert (s.k_scale, s.v_scale) == pytest.approx((K[i], V[i]))
            assert s.source == f"checkpoint:{p}.k_scale,{p}.v_scale"
            assert read_tensor(out, f"{p}.k_scale").dtype == torch.float32
            assert read_tensor(out, f"{p}.k_scale").shape == ()
        else:
            assert (s.k_scale, s.v_scale) == pytest.approx((max(K[i], V[i]),) * 2)
            assert s.source == f"checkpoint:{p}.kv_scale"
    # and the engine sets exactly those
    llm = LLM(str(out), kv_cache_dtype="fp8", kv_cache_memory="4MiB", max_model_len=64)
    layers = llm.llm_engine.model_runner.attn_layers
    assert [layer.kv_scale_source for layer in layers] == [s.source for s in scales]


def test_checkpoint_copy_replaces_existing_scales_of_fp8_model(base, tmp_path):
    fp8 = tmp_path / "fp8"
    quantize_to_fp8_checkpoint(base, fp8)
    add_kv_scales(fp8, "kv_scale")  # old scales, a different name family
    out = write_kv_scale_checkpoint(fp8, tmp_path / "out", K, V, is_kv_scale_tensor=_mapper_predicate())
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    # the old kv_scale tensors are gone; the ones there now are the new max(k, v)
    kv_names = sorted(n for n in checkpoint_tensor_names(out) if n.endswith(".kv_scale"))
    assert [float(read_tensor(out, n)) for n in kv_names] == pytest.approx([max(k, v) for k, v in zip(K, V)])
    _, scales = inspect_kv_scales(str(out), "fp8_e4m3")
    assert [s.k_scale for s in scales] == pytest.approx(K)
    assert [s.v_scale for s in scales] == pytest.approx(V)


def test_checkpoint_copy_refuses_existing_destination(base, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(UserError, match="already exists"):
        write_kv_scale_checkpoint(base, tmp_path / "out", K, V)


def test_attention_prefixes():
    names = [f"model.layers.{i}.self_attn.k_proj.weight" for i in (1, 0)] + ["model.norm.weight"]
    assert attention_prefixes(names, 2) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    with pytest.raises(UserError, match=r"layers \[2\]"):
        attention_prefixes(names, 3)
