"""Observed amax must be what an independent implementation computes: K after
RoPE and V from transformers' own KV cache (float64), linear inputs from
forward pre-hooks on transformers' q_proj / gate_proj / down_proj."""

from __future__ import annotations

import math

import pytest
import torch

from checkpoints import load_hf_model, write_tiny_llama

from fp8serve.calibration.observers import (
    E4M3_MAX,
    InputAmaxObserver,
    KVAmaxObserver,
    scale_from_amax,
)
from fp8serve.calibration.runner import build_llm, run_chunks

NUM_LAYERS = 3
CHUNKS = [list(range(3, 40)), [7, 100, 200, 300, 400, 11, 12, 13, 14, 15, 16], list(range(450, 500))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("observers") / "llama", num_layers=NUM_LAYERS)


@torch.no_grad()
def hf_reference(model_dir):
    """(per-layer K amax, V amax, {hf module: input amax}, per-layer per-KV-head K and V amax) over
    CHUNKS, float64."""
    model = load_hf_model(model_dir, torch.float64)
    watched = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")
    inputs: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if name.endswith(watched):
            def hook(mod, args, name=name):
                inputs[name] = max(inputs.get(name, 0.0), float(args[0].abs().max()))
            hooks.append(module.register_forward_pre_hook(hook))
    k_amax, v_amax = [0.0] * NUM_LAYERS, [0.0] * NUM_LAYERS
    k_heads, v_heads = [None] * NUM_LAYERS, [None] * NUM_LAYERS
    for chunk in CHUNKS:
        out = model(input_ids=torch.tensor([chunk]), use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values
        for i, layer in enumerate(cache.layers):  # keys: [1, kv_heads, seq, head_dim], after RoPE
            k_amax[i] = max(k_amax[i], float(layer.keys.abs().max()))
            v_amax[i] = max(v_amax[i], float(layer.values.abs().max()))
            k, v = layer.keys.abs().amax(dim=(0, 2, 3)), layer.values.abs().amax(dim=(0, 2, 3))
            k_heads[i] = k if k_heads[i] is None else torch.maximum(k_heads[i], k)
            v_heads[i] = v if v_heads[i] is None else torch.maximum(v_heads[i], v)
    for h in hooks:
        h.remove()
    return k_amax, v_amax, inputs, (k_heads, v_heads)


def test_kv_and_input_amax_match_transformers(model_dir):
    k_ref, v_ref, inputs_ref, (k_heads_ref, v_heads_ref) = hf_reference(model_dir)
    llm = build_llm(str(model_dir), seq_len=64, kv_cache_memory="16MiB")
    runner = llm.llm_engine.model_runner
    modules = dict(runner.model.named_modules())
    ours = {f"model.layers.{i}.{m}": modules[f"model.layers.{i}.{m}"]
            for i in range(NUM_LAYERS) for m in ("self_attn.qkv_proj", "self_attn.o_proj",
                                                 "mlp.gate_up_proj", "mlp.down_proj")}
    kv = KVAmaxObserver(runner.attn_layers)
    with kv, InputAmaxObserver(ours) as inputs:
        assert run_chunks(llm, CHUNKS) == sum(map(len, CHUNKS))
    # detached: hooks gone, a second run changes nothing
    assert all(layer.kv_observer is None for layer in runner.attn_layers)
    before = dict(inputs.amax)
    run_chunks(llm, [[1, 2, 3, 4]])
    assert inputs.amax == before

    for i, s in enumerate(kv.stats):
        assert s.layer == i and s.num_tokens == sum(map(len, CHUNKS))
        assert s.k_amax == pytest.approx(k_ref[i], rel=1e-5)
        assert s.v_amax == pytest.approx(v_ref[i], rel=1e-5)
        assert s.k_scale() == pytest.approx(k_ref[i] / E4M3_MAX, rel=1e-5)
        # Per KV head (strategy attn_head): 2 KV heads, distinct maxima, the largest is the layer's.
        assert s.k_head_amax == pytest.approx(k_heads_ref[i].tolist(), rel=1e-5) and len(s.k_head_amax) == 2
        assert s.v_head_amax == pytest.approx(v_heads_ref[i].tolist(), rel=1e-5)
        assert max(s.k_head_amax) == s.k_amax and len(set(s.k_head_amax)) == 2
        assert s.v_head_scales(1.5) == pytest.approx([1.5 * a / E4M3_MAX for a in v_heads_ref[i].tolist()], rel=1e-5)
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}"
        pairs = [("self_attn.qkv_proj", "self_attn.q_proj"), ("self_attn.o_proj", "self_attn.o_proj"),
                 ("mlp.gate_up_proj", "mlp.gate_proj"), ("mlp.down_proj", "mlp.down_proj")]
        for mine, theirs in pairs:
            assert inputs.amax[f"{p}.{mine}"] == pytest.approx(inputs_ref[f"{p}.{theirs}"], rel=1e-5), mine
            assert inputs.num_tokens[f"{p}.{mine}"] == sum(map(len, CHUNKS))


def test_input_observer_leaves_unrun_modules_none():
    used, unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    with InputAmaxObserver({"used": used, "unused": unused}) as obs:
        used(torch.tensor([[1.0, -3.0, 2.0, 0.0]]))
    assert obs.amax == {"used": 3.0, "unused": None}


def test_attach_twice_is_refused(model_dir):
    llm = build_llm(str(model_dir), seq_len=16, kv_cache_memory="4MiB")
    layers = llm.llm_engine.model_runner.attn_layers
    with KVAmaxObserver(layers):
        with pytest.raises(RuntimeError, match="already has a kv_observer"):
            KVAmaxObserver(layers).attach()


def test_scale_from_amax():
    assert scale_from_amax(448.0) == 1.0
    assert scale_from_amax(224.0, margin=1.5) == 0.75
    assert scale_from_amax(0.0) > 0  # never 0: loaders reject it
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            scale_from_amax(bad)
    with pytest.raises(ValueError):
        scale_from_amax(1.0, margin=0)
