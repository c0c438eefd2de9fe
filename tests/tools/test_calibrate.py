"""`fp8serve calibrate` end to end on a tiny Llama: the table, a JSON that the
engine takes through --quantization-param-path, and a checkpoint copy whose
scales the engine reads as `checkpoint:` sources with no flags."""

from __future__ import annotations

import json

import pytest

from checkpoints import write_tiny_llama
from cli_runs import count_fp8_layers_of_built_llms

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


def test_default_seq_len_fits_a_short_context_model(calibrated, capsys):
    """The default --seq-len (512) failed on a model with a shorter context (256 here)."""
    model, _, _ = calibrated
    assert json.loads((model / "config.json").read_text())["max_position_embeddings"] == 256
    assert main(["calibrate", str(model), "--num-tokens", "600"]) == 0
    assert "600 tokens in 3 chunks of <= 256" in capsys.readouterr().out


def test_missing_model_is_named(tmp_path, capsys):
    assert main(["calibrate", str(tmp_path / "nope")]) == 2
    assert f"model path '{tmp_path / 'nope'}' does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("margin", ["0", "-1", "nan", "inf"])
def test_bad_margin_is_a_user_error(calibrated, capsys, margin):
    model, _, _ = calibrated
    assert main(["calibrate", str(model), "--margin", margin]) == 2
    assert "--margin must be a finite number > 0" in capsys.readouterr().err


def test_outputs_and_seq_len_are_checked_before_the_model_runs(calibrated, capsys, monkeypatch):
    """A bad output path or --seq-len fails at once, naming calibrate's own flag."""
    import fp8serve.calibration.runner as runner

    model, _, root = calibrated
    a_file = root / "a_file.txt"
    a_file.write_text("x")
    existing = root / "existing_dir"
    existing.mkdir()
    runs = []
    monkeypatch.setattr(runner, "run_chunks", lambda *a, **k: runs.append(a))
    monkeypatch.setattr(runner, "build_llm", lambda *a, **k: runs.append(a))
    one_char = root / "one_char.txt"
    one_char.write_text("h")
    cases = [
        (["--out-json", str(a_file / "scales.json")], f"{a_file} is a file, not a directory"),
        (["--out-json", str(existing)], "is a directory; expected a file path"),
        (["--out-checkpoint", str(existing)], f"--out-checkpoint {existing} already exists"),
        (["--out-checkpoint", str(a_file / "ckpt")], f"{a_file} is a file, not a directory"),
        (["--seq-len", "0"], "--seq-len must be >= 2 (a chunk of one token predicts nothing), got 0"),
        (["--seq-len", "1"], "--seq-len must be >= 2"),
        (["--seq-len", "100000"], "--seq-len 100000 exceeds the model's max_position_embeddings"),
        (["--num-tokens", "1"], "--num-tokens must be >= 2, got 1"),
        (["--text", str(one_char)], f"--text {one_char}: shorter than 2 tokens"),
    ]
    for extra, words in cases:
        assert main(["calibrate", str(model), "--num-tokens", "64", *extra]) == 2
        err = capsys.readouterr().err
        assert words in err and "--max-model-len" not in err, err
    assert runs == []


def test_quantization_calibrates_the_fp8_weight_model_and_says_so(calibrated, capsys, monkeypatch):
    """-q fp8: the engine that runs the text has FP8 projections, so the amax are that model's, not the
    16-bit one's; the output says the weights were quantized at load and to serve the scales with the flag."""
    model, text, root = calibrated
    num_fp8_layers = count_fp8_layers_of_built_llms(monkeypatch)
    outputs, amax = {}, {}
    for flags in ([], ["-q", "fp8"]):
        out_json = root / f"scales{''.join(flags)}.json"
        assert main(["calibrate", str(model), "--text", str(text), "--num-tokens", "128", "--seq-len", "64",
                     "--out-json", str(out_json), *flags]) == 0
        out = outputs[bool(flags)] = capsys.readouterr().out
        amax[bool(flags)] = [line.split()[1:3] for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert num_fp8_layers[0] == 0 and num_fp8_layers[1] > 0
    assert amax[True] != amax[False]
    plain, quantized = outputs[False], outputs[True]
    assert "compute dtype: float32, weights: quantized to fp8 at load (--quantization fp8), KV cache: " in quantized
    assert "weights:" not in plain and "--quantization fp8" not in plain
    assert (f"(use: --quantization fp8 --kv-cache-dtype fp8 --quantization-param-path {root / 'scales-qfp8.json'})"
            in quantized)


def test_per_head_strategy_writes_a_checkpoint_the_engine_reads_per_head(calibrated, capsys):
    """--kv-scale-strategy attn_head: llm-compressor's layout ([num_kv_heads, 1, 1] k_scale/v_scale,
    kv_cache_scheme strategy attn_head), each head's scale margin * its amax / 448, as the observer
    measured; the engine and `fp8serve scales` read them back per head."""
    from fp8serve.calibration.observers import KVAmaxObserver
    from fp8serve.calibration.runner import build_llm, run_chunks
    from fp8serve.calibration.text import load_text, token_chunks
    from fp8serve.engine.tokenizer import load_tokenizer

    model, text, root = calibrated
    out_ckpt = root / "per-head"
    argv = ["calibrate", str(model), "--text", str(text), "--num-tokens", "300", "--seq-len", "64", "--margin", "1.25"]
    assert main([*argv, "--kv-scale-strategy", "attn_head", "--out-checkpoint", str(out_ckpt)]) == 0
    out = capsys.readouterr().out
    assert "per-KV-head scales (what --out-checkpoint writes):" in out and "  layer 1: k [" in out
    config = json.loads((out_ckpt / "config.json").read_text())
    assert config["quantization_config"]["kv_cache_scheme"]["strategy"] == "attn_head"

    # What the observer sees on the same text, independently of the command.
    chunks = token_chunks(load_tokenizer(str(model)), load_text(str(text)).text, 300, 64)
    llm = build_llm(str(model), seq_len=64, dtype="float32", kv_cache_memory="4MiB")
    with KVAmaxObserver(llm.llm_engine.model_runner.attn_layers) as observer:
        run_chunks(llm, chunks)
    served = LLM(str(out_ckpt), kv_cache_dtype="fp8", kv_cache_memory="4MiB", max_model_len=64)
    for s, layer in zip(observer.stats, served.llm_engine.model_runner.attn_layers):
        assert layer.k_head_scales.view(-1).tolist() == pytest.approx(s.k_head_scales(1.25), rel=1e-5)
        assert layer.v_head_scales.view(-1).tolist() == pytest.approx(s.v_head_scales(1.25), rel=1e-5)
        assert len(set(s.k_head_amax)) == len(s.k_head_amax) == 2  # the heads differ: the test can tell
    assert main(["scales", str(out_ckpt), "--kv-cache-dtype", "fp8", "--json"]) == 0
    layers = json.loads(capsys.readouterr().out)["layers"]
    assert all(len(entry["k_head_scales"]) == 2 for entry in layers)


@pytest.mark.parametrize("extra, words", [
    (["--out-json", "x.json"], "--out-json writes vLLM's --quantization-param-path schema, one scale per layer"),
    (["--out-checkpoint", "ck", "--kv-scale-format", "both"], "--kv-scale-format both: per-head scales are written"),
])
def test_per_head_strategy_refuses_outputs_that_cannot_hold_it(calibrated, capsys, tmp_path, extra, words):
    model, text, _ = calibrated
    extra = [str(tmp_path / e) if e in ("x.json", "ck") else e for e in extra]
    rc = main(["calibrate", str(model), "--text", str(text), "--kv-scale-strategy", "attn_head", *extra])
    assert rc == 2 and words in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_quantization_on_a_quantized_checkpoint_is_not_suggested(calibrated, tmp_path, capsys):
    """-q fp8 on a checkpoint whose quant_method is fp8 already: it said "quantized to fp8 at load" and
    suggested serving with --quantization fp8; the checkpoint's own FP8 weights ran, and serve without it."""
    from fp8serve.calibration.fp8_checkpoint import write_fp8_checkpoint

    model, text, _ = calibrated
    fp8_dir = tmp_path / "fp8"
    write_fp8_checkpoint(model, fp8_dir, activation_scheme="dynamic")
    out_json = tmp_path / "scales.json"
    assert main(["calibrate", str(fp8_dir), "--text", str(text), "--num-tokens", "64", "--seq-len", "32",
                 "--out-json", str(out_json), "-q", "fp8"]) == 0
    out = capsys.readouterr().out
    assert f"(use: --kv-cache-dtype fp8 --quantization-param-path {out_json})" in out, out
    assert "--quantization fp8" not in out and "at load" not in out, out


def test_quantization_flags_that_cannot_be_served_are_refused_before_the_model_runs(calibrated, tmp_path, capsys,
                                                                                      monkeypatch):
    """A checkpoint copy of a 16-bit model gets a compressed-tensors quantization_config, which --quantization
    is refused with: its "use: --quantization fp8 ..." hint could not be followed. A checkpoint with a
    quantization_config of another method is refused by the engine's config, before the weights load."""
    import shutil

    import fp8serve.calibration.runner as runner
    import fp8serve.engine.llm_engine as llm_engine
    from checkpoints import set_quantization_config

    model, text, _ = calibrated
    monkeypatch.setattr(runner, "run_chunks", lambda *a, **k: pytest.fail("calibration ran"))
    monkeypatch.setattr(llm_engine, "ModelRunner", lambda *a, **k: pytest.fail("the weights started loading"))
    out_ckpt = tmp_path / "ckpt"
    assert main(["calibrate", str(model), "--text", str(text), "--num-tokens", "64", "--seq-len", "32",
                 "--out-checkpoint", str(out_ckpt), "-q", "fp8"]) == 2
    err = capsys.readouterr().err
    assert ("--out-checkpoint with --quantization fp8: the copy would keep the 16/32-bit weights under a "
            "compressed-tensors quantization_config") in err, err
    assert "fp8serve quantize MODEL --out DIR --activation-scheme dynamic --kv-cache" in err
    assert not out_ckpt.exists()

    kv_only = tmp_path / "kv_only"
    shutil.copytree(model, kv_only)
    set_quantization_config(kv_only, {"quant_method": "compressed-tensors", "kv_cache_scheme": {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}})
    assert main(["calibrate", str(kv_only), "--text", str(text), "--num-tokens", "64", "--seq-len", "32",
                 "--out-json", str(tmp_path / "s.json"), "-q", "fp8"]) == 2
    err = capsys.readouterr().err
    assert f"{kv_only / 'config.json'} declares quantization_config.quant_method 'compressed-tensors'" in err, err
