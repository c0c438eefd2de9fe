"""`fp8serve calibrate` end to end on a tiny Llama: the table, a JSON that the
engine takes through --quantization-param-path, and a checkpoint copy whose
scales the engine reads as `checkpoint:` sources with no flags."""

from __future__ import annotations

import json

import pytest

from checkpoints import write_tiny_llama

from fp8serve import LLM
from fp8serve.calibration.observers import E4M3_MAX
from fp8serve.entrypoints.cli import main

NUM_LAYERS = 2


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrate")
    model = write_tiny_llama(root / "llama", num_layers=NUM_LAYERS)
    text = root / "text.jsonl"
    text.write_text("\n".join(json.dumps({"text": f"Line {i}: the cat sat on the mat and looked at the dog."})
                              for i in range(30)))
    return model, text, root


def test_calibrate_writes_json_and_checkpoint(calibrated, capsys):
    model, text, root = calibrated
    out_json, out_ckpt = root / "scales.json", root / "ckpt"
    rc = main(["calibrate", str(model), "--text", str(text), "--num-tokens", "300", "--seq-len", "64",
               "--margin", "1.25", "--out-json", str(out_json), "--out-checkpoint", str(out_ckpt)])
    out = capsys.readouterr().out
    assert rc == 0
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert len(rows) == NUM_LAYERS
    table = {int(r[0]): tuple(map(float, r[1:])) for r in rows}  # k_amax v_amax k_scale v_scale json_scale
    for layer, (k_amax, v_amax, k, v, j) in table.items():
        assert k == pytest.approx(1.25 * k_amax / E4M3_MAX, rel=1e-3)
        assert v == pytest.approx(1.25 * v_amax / E4M3_MAX, rel=1e-3)
        assert j == max(k, v)
    assert "margin 1.25" in out and "300 tokens" in out

    doc = json.loads(out_json.read_text())
    assert doc["model_type"] == "llama" and doc["kv_cache"]["dtype"] == "float8_e4m3fn"
    json_scales = doc["kv_cache"]["scaling_factor"]["0"]
    llm = LLM(str(model), kv_cache_dtype="fp8", quantization_param_path=str(out_json),
              kv_cache_memory="4MiB", max_model_len=64)
    for i, layer in enumerate(llm.llm_engine.model_runner.attn_layers):
        assert layer.kv_scale_source == f"json:{out_json}"
        assert float(layer.k_scale) == pytest.approx(json_scales[str(i)]) == pytest.approx(table[i][4], rel=1e-3)

    assert main(["scales", str(out_ckpt), "--kv-cache-dtype", "fp8", "--json"]) == 0
    layers = json.loads(capsys.readouterr().out)["layers"]
    assert [entry["source"].split(":")[0] for entry in layers] == ["checkpoint"] * NUM_LAYERS
    for entry in layers:
        k, v = table[entry["layer"]][2:4]
        assert (entry["k_scale"], entry["v_scale"]) == (pytest.approx(k, rel=1e-3), pytest.approx(v, rel=1e-3))
        assert max(entry["k_scale"], entry["v_scale"]) == pytest.approx(json_scales[str(entry["layer"])])


def test_calibrate_without_outputs_says_so(calibrated, capsys):
    model, _, _ = calibrated
    assert main(["calibrate", str(model), "--num-tokens", "64", "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert "built-in sample" in out and "nothing written" in out


def test_bad_margin_is_a_user_error(calibrated, capsys):
    model, _, _ = calibrated
    assert main(["calibrate", str(model), "--margin", "0"]) == 2
    assert "--margin must be > 0" in capsys.readouterr().err
