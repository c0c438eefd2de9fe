"""benchmarks/per_head_kv_scales.py on the tiny Llama: a row per scale kind with every cell measured,
equal per-head scales giving the per-layer tokens; checkpoints of the wrong kind refused."""

from __future__ import annotations

import pytest
import torch

from benchmark_scripts import run_table
from checkpoints import add_tensors, set_quantization_config, write_tiny_llama
from kv_scale_checkpoints import COMPRESSED_TENSORS_KV_ONLY, add_per_head_kv_scales, copy_checkpoint

SCALES = [(0.03125, 0.0625), (0.015625, 0.125)]  # per layer (k, v); powers of two: the fold is exact


@pytest.fixture
def checkpoints(tmp_path):
    model = write_tiny_llama(tmp_path / "llama")
    per_layer = copy_checkpoint(model, tmp_path / "per-layer")
    add_tensors(per_layer, {f"model.layers.{i}.self_attn.{kind}_proj.output_scale": torch.tensor([s])
                            for i, pair in enumerate(SCALES) for kind, s in zip("kv", pair)})
    set_quantization_config(per_layer, COMPRESSED_TENSORS_KV_ONLY)
    per_head = copy_checkpoint(model, tmp_path / "per-head")
    add_per_head_kv_scales(per_head, [[k, k] for k, _ in SCALES], [[v, v] for _, v in SCALES])
    return per_layer, per_head


def test_every_cell_and_the_same_tokens(monkeypatch, tmp_path, checkpoints):
    per_layer, per_head = checkpoints
    text, rows = run_table(monkeypatch, tmp_path, "per_head_kv_scales.py", "--per-layer", str(per_layer),
                           "--per-head", str(per_head), "--dtype", "float32", "--prompt-len", "12", "--steps", "5",
                           "--rounds", "2", "--batch-sizes", "1,3", header="| scales")
    assert [r[0] for r in rows] == ["per layer", "per KV head", "per KV head / per layer"]
    for r in rows:
        assert len(r) == 3 and all(float(v.rstrip("x")) > 0 for v in r[1:]), r
    assert "batch 1: 1 of 1 requests' greedy tokens identical" in text
    assert "batch 3: 3 of 3 requests' greedy tokens identical" in text


def test_checkpoints_of_the_wrong_kind_are_refused(monkeypatch, tmp_path, checkpoints):
    per_layer, per_head = checkpoints
    with pytest.raises(SystemExit):
        run_table(monkeypatch, tmp_path, "per_head_kv_scales.py", "--per-layer", str(per_layer),
                  "--per-head", str(per_layer), "--dtype", "float32", header="| scales")
