"""`fp8serve eval-kv`: an unquantized configuration against the reference is
exactly 0 KL and 100% top-1; scales 100x too small (K/V saturate at +-448 *
scale) cost far more than calibrated ones; --json and --plot are written."""

from __future__ import annotations

import json

import pytest

from checkpoints import write_tiny_llama

from fp8serve.entrypoints.cli import main
from fp8serve.errors import UserError
from fp8serve.tools.eval_kv import configs_from_args


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_kv")
    model = write_tiny_llama(root / "llama", num_layers=2)
    calib = root / "calib.txt"
    calib.write_text("Once upon a time a fox and a dog walked to the village to buy bread. " * 8)
    text = root / "eval.txt"
    text.write_text("The weather was cold, so we read our books and drank tea by the window. " * 12)
    good = root / "good.json"
    assert main(["calibrate", str(model), "--text", str(calib), "--seq-len", "64", "--out-json", str(good)]) == 0
    doc = json.loads(good.read_text())
    layers = doc["kv_cache"]["scaling_factor"]["0"]
    doc["kv_cache"]["scaling_factor"]["0"] = {k: v / 100 for k, v in layers.items()}
    bad = root / "bad.json"
    bad.write_text(json.dumps(doc))
    return model, text, good, bad, root


def test_self_is_zero_and_wrong_scales_hurt(setup, capsys):
    model, text, good, bad, root = setup
    out_json, out_png = root / "r.json", root / "r.png"
    argv = ["eval-kv", str(model), "--text", str(text), "--seq-len", "64", "--num-tokens", "256",
            "--config", "auto", "--config", f"fp8_e4m3:json={good}", "--config", f"fp8_e4m3:json={bad}",
            "--config", "fp8_e5m2", "--json", str(out_json)]
    try:
        import matplotlib  # noqa: F401
        argv += ["--plot", str(out_png)]
    except ImportError:
        out_png = None
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "| config" in stdout and "fp8_e4m3:json=bad.json" in stdout

    doc = json.loads(out_json.read_text())
    assert doc["complete"] is True
    assert doc["reference"]["kv_cache_dtype"] == "float32" and doc["reference"]["num_tokens"] == 256
    same, ok, wrong, e5m2 = doc["configs"]
    for c in doc["configs"]:
        assert {"kv_cache_dtype", "scales", "kld_mean", "top1_agreement", "ppl", "ppl_ref", "ppl_rel_change"} <= set(c)
        assert c["ppl_ref"] == doc["reference"]["ppl"]
    assert same["kld_mean"] == 0.0 and same["top1_agreement"] == 100.0 and same["ppl_rel_change"] == 0.0
    assert ok["scales"] == f"json:{good}" and ok["scale_source"] == "json"
    assert 0 < ok["kld_mean"] < 0.01
    assert wrong["kld_mean"] > 10 * ok["kld_mean"]
    assert wrong["top1_agreement"] < ok["top1_agreement"]
    assert e5m2["kv_cache_dtype"] == "fp8_e5m2" and e5m2["scale_source"] == "default"
    if out_png is not None:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_config_flags(tmp_path):
    class Args:
        configs = None
        kv_cache_dtype = None
        quantization_param_path = None
        calculate_kv_scales = False

    a = Args()
    assert [c.label for c in configs_from_args(a)] == ["fp8_e4m3", "fp8_e5m2"]
    a.kv_cache_dtype, a.calculate_kv_scales = ["fp8"], True
    assert [c.label for c in configs_from_args(a)] == ["fp8_e4m3:calculate"]
    a.configs = ["fp8_e5m2"]
    with pytest.raises(UserError, match="not both"):
        configs_from_args(a)
