"""`fp8serve eval-kv`: an unquantized configuration against the reference is
exactly 0 KL and 100% top-1; scales 100x too small (K/V saturate at +-448 *
scale) cost far more than calibrated ones; --json and --plot are written."""

from __future__ import annotations

import json

import pytest

from checkpoints import write_tiny_llama
from cli_runs import count_fp8_layers_of_built_llms

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


def test_arguments_are_checked_before_the_reference_runs(setup, capsys, monkeypatch):
    """Bad output paths, --num-tokens 0 and a missing model failed only after the whole run or
    with the wrong reason (found by probing the CLI)."""
    import fp8serve.calibration.runner as runner

    model, text, good, _, root = setup
    a_file = root / "a_file.txt"
    a_file.write_text("x")
    binary = root / "binary.txt"
    binary.write_bytes(bytes(range(256)) * 4)
    built = []
    monkeypatch.setattr(runner, "build_llm", lambda *a, **k: built.append(a))
    cases = [
        (["--json", str(a_file / "r.json")], f"--json {a_file / 'r.json'}: {a_file} is a file, not a directory"),
        (["--plot", str(root)], f"--plot {root} is a directory; expected a file path"),
        (["--num-tokens", "0"], "--num-tokens must be >= 2 (leave it out to use all the text), got 0"),
        (["--seq-len", "1000"], "--seq-len 1000 exceeds the model's max_position_embeddings (256)"),
        (["--config", "auto:calculate"], "scales apply to an FP8 KV cache only"),
        (["--kv-cache-dtype", "auto", "fp8", "--quantization-param-path", str(good)],
         "--quantization-param-path applies to FP8 KV caches only, but --kv-cache-dtype includes auto"),
    ]
    for extra, words in cases:
        assert main(["eval-kv", str(model), "--text", str(text), *extra]) == 2
        assert words in capsys.readouterr().err
    assert main(["eval-kv", str(model), "--text", str(binary)]) == 2
    assert "a binary file (it holds NUL bytes)" in capsys.readouterr().err
    assert main(["eval-kv", str(root / "nope"), "--text", str(text)]) == 2
    assert f"model path '{root / 'nope'}' does not exist" in capsys.readouterr().err
    assert built == []


def test_default_seq_len_fits_a_short_context_model(setup, capsys, tmp_path):
    """The default --seq-len 512 failed on a model with a 256-token context."""
    model, text, _, _, _ = setup
    out = tmp_path / "new" / "dir" / "r.json"  # missing folders are made
    assert main(["eval-kv", str(model), "--text", str(text), "--kv-cache-dtype", "fp8_e5m2",
                 "--num-tokens", "300", "--json", str(out)]) == 0
    assert "chunks of <= 256" in capsys.readouterr().out
    assert json.loads(out.read_text())["seq_len"] == 256


def test_quantization_applies_to_the_reference_and_every_configuration(setup, capsys, monkeypatch):
    """-q fp8: every engine, the reference's included, has FP8 projections, so an unquantized KV cache is
    still exactly the reference (KL 0) and the numbers are the KV cache's cost on the FP8-weight model; the
    JSON and the table say so."""
    model, text, _, _, root = setup
    num_fp8_layers = count_fp8_layers_of_built_llms(monkeypatch)
    docs, stdout = {}, {}
    for flags in ([], ["-q", "fp8"]):
        out_json = root / f"r{''.join(flags)}.json"
        assert main(["eval-kv", str(model), "--text", str(text), "--seq-len", "64", "--num-tokens", "128",
                     "--config", "auto", "--config", "fp8_e5m2", "--json", str(out_json), *flags]) == 0
        stdout[bool(flags)] = capsys.readouterr().out
        docs[bool(flags)] = json.loads(out_json.read_text())
    assert num_fp8_layers[:3] == [0, 0, 0] and min(num_fp8_layers[3:]) > 0 and len(num_fp8_layers) == 6
    plain, quantized = docs[False], docs[True]
    assert plain["reference"]["quantization"] is None and quantized["reference"]["quantization"] == "fp8"
    assert quantized["reference"]["ppl"] != plain["reference"]["ppl"]
    assert quantized["configs"][0]["kld_mean"] == 0.0 and quantized["configs"][1]["kld_mean"] > 0
    assert "reference: float32 compute, fp8 weights quantized at load, float32 KV cache" in stdout[True]
    assert "reference: float32 compute, float32 KV cache" in stdout[False]


def test_a_redundant_quantization_flag_is_not_reported_as_quantized_at_load(setup, capsys, tmp_path):
    """-q fp8 on a checkpoint that is already FP8 reads its weights as they are (ModelConfig drops the
    flag as redundant, as vLLM takes it): the JSON and the table must not say "quantized at load"."""
    from fp8serve.calibration.fp8_checkpoint import write_fp8_checkpoint

    model, text, _, _, _ = setup
    fp8 = tmp_path / "fp8"
    write_fp8_checkpoint(model, fp8, activation_scheme="dynamic")
    out_json = tmp_path / "r.json"
    assert main(["eval-kv", str(fp8), "--text", str(text), "--seq-len", "64", "--num-tokens", "128",
                 "--config", "fp8_e5m2", "--json", str(out_json), "-q", "fp8"]) == 0
    stdout = capsys.readouterr().out
    assert json.loads(out_json.read_text())["reference"]["quantization"] is None
    assert "quantized at load" not in stdout and "reference: float32 compute, float32 KV cache" in stdout
