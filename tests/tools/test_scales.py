"""`fp8serve scales`: the per-layer KV scales and their sources, read without
loading the model, must be exactly what the engine sets on its Attention layers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from checkpoints import write_tiny_llama, write_tiny_mixtral
from kv_scale_checkpoints import (
    KV_SCALE_FAMILIES,
    add_kv_scales,
    add_per_head_kv_scales,
    record_scale_reads,
    copy_checkpoint,
    expected_scales,
    quantize_to_fp8_checkpoint,
    write_scales_json,
)

from fp8serve import LLM
from fp8serve.entrypoints.cli import main

NUM_LAYERS = 3


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("scales_base") / "llama", num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def families(base, tmp_path_factory):
    """family -> checkpoint: kv_scale / k_v_scale in FP8-weight checkpoints,
    output_scale in a 16-bit compressed-tensors kv_cache_scheme checkpoint."""
    root = tmp_path_factory.mktemp("scales_families")
    out = {}
    for family in KV_SCALE_FAMILIES:
        d = root / family
        if family == "output_scale":
            copy_checkpoint(base, d)
        else:
            quantize_to_fp8_checkpoint(base, d)
        add_kv_scales(d, family)
        out[family] = d
    return out


def scales_json(capsys, *args) -> dict:
    rc = main(["scales", *map(str, args), "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out)  # stdout is the JSON document and nothing else


def check_shape(doc: dict, kv_cache_dtype: str, num_layers: int = NUM_LAYERS) -> None:
    assert set(doc) == {"kv_cache_dtype", "layers"}
    assert doc["kv_cache_dtype"] == kv_cache_dtype
    assert [row["layer"] for row in doc["layers"]] == list(range(num_layers))
    for row in doc["layers"]:
        assert set(row) == {"layer", "k_scale", "v_scale", "source"}
        assert isinstance(row["k_scale"], float) and isinstance(row["v_scale"], float)


@pytest.mark.parametrize("family", KV_SCALE_FAMILIES)
def test_checkpoint_sources_per_family(capsys, families, family):
    doc = scales_json(capsys, families[family], "--kv-cache-dtype", "fp8")
    check_shape(doc, "fp8_e4m3")  # fp8 is normalized
    got = [(row["k_scale"], row["v_scale"], row["source"]) for row in doc["layers"]]
    assert got == expected_scales(family, NUM_LAYERS)


@pytest.mark.parametrize("family", KV_SCALE_FAMILIES)
def test_agrees_with_engine(capsys, families, family):
    doc = scales_json(capsys, families[family], "--kv-cache-dtype", "fp8_e4m3")
    llm = LLM(str(families[family]), dtype="float32", kv_cache_dtype="fp8_e4m3", kv_cache_memory="1MiB")
    engine = [{"layer": i, "k_scale": a._k_scale, "v_scale": a._v_scale, "source": a.kv_scale_source}
              for i, a in enumerate(llm.llm_engine.model_runner.attn_layers)]
    assert doc["layers"] == engine


def test_per_head_scales(capsys, base, tmp_path):
    """strategy attn_head: k_scale/v_scale stay numbers (the heads' max, for scripts that read one
    scale per layer), k_head_scales/v_head_scales list the heads; the table shows the lists; the
    engine holds the same."""
    d = copy_checkpoint(base, tmp_path / "per-head")
    k = [[0.015625 * (i + 1), 0.25] for i in range(NUM_LAYERS)]
    v = [[0.5, 0.125 * (i + 1)] for i in range(NUM_LAYERS)]
    add_per_head_kv_scales(d, k, v)
    doc = scales_json(capsys, d, "--kv-cache-dtype", "fp8")
    assert [row["k_head_scales"] for row in doc["layers"]] == k
    assert [row["v_head_scales"] for row in doc["layers"]] == v
    assert [(row["k_scale"], row["v_scale"]) for row in doc["layers"]] == [(max(a), max(b)) for a, b in zip(k, v)]
    llm = LLM(str(d), dtype="float32", kv_cache_dtype="fp8_e4m3", kv_cache_memory="1MiB")
    for row, a in zip(doc["layers"], llm.llm_engine.model_runner.attn_layers):
        assert row["k_head_scales"] == a.k_head_scales.view(-1).tolist()
        assert row["v_head_scales"] == a.v_head_scales.view(-1).tolist()
        assert row["source"] == a.kv_scale_source
    assert main(["scales", str(d), "--kv-cache-dtype", "fp8"]) == 0
    table = capsys.readouterr().out
    assert "  0  [0.015625 0.25]  [0.5 0.125]  checkpoint:" in table


def test_default_source_with_warning(capsys, caplog, base):
    rc = main(["scales", str(base), "--kv-cache-dtype", "fp8_e4m3", "--json"])
    captured = capsys.readouterr()
    assert rc == 0
    doc = json.loads(captured.out)
    check_shape(doc, "fp8_e4m3")
    assert all((r["k_scale"], r["v_scale"], r["source"]) == (1.0, 1.0, "default") for r in doc["layers"])
    # The engine's warning (under pytest, logging goes to caplog; the subprocess test sees stderr).
    assert any("without calibrated scales" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def test_json_file_source(capsys, base, tmp_path):
    values = [0.05, 0.125, 0.3]
    path = write_scales_json(tmp_path / "kv.json", "llama", values)
    doc = scales_json(capsys, base, "--kv-cache-dtype", "fp8", "--quantization-param-path", path)
    check_shape(doc, "fp8_e4m3")
    assert [(r["k_scale"], r["v_scale"], r["source"]) for r in doc["layers"]] == [
        (v, v, f"json:{path}") for v in values
    ]


def test_checkpoint_wins_over_json_file(capsys, families, tmp_path):
    path = write_scales_json(tmp_path / "kv.json", "llama", [0.5, 0.5, 0.5])
    doc = scales_json(capsys, families["k_v_scale"], "--kv-cache-dtype", "fp8", "--quantization-param-path", path)
    assert [(r["k_scale"], r["v_scale"], r["source"]) for r in doc["layers"]] == expected_scales("k_v_scale", 3)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e5m2", "auto", "bfloat16", "float32"])
def test_scales_unused_outside_e4m3(capsys, families, kv_cache_dtype):
    rc = main(["scales", str(families["k_v_scale"]), "--kv-cache-dtype", kv_cache_dtype, "--json"])
    captured = capsys.readouterr()
    assert rc == 0
    doc = json.loads(captured.out)
    check_shape(doc, kv_cache_dtype)  # auto is reported as auto
    assert all((r["k_scale"], r["v_scale"], r["source"]) == (1.0, 1.0, "default") for r in doc["layers"])
    assert "note:" in captured.err  # the note never breaks the JSON on stdout


def test_default_kv_cache_dtype_is_auto_with_note(capsys, families):
    assert main(["scales", str(families["kv_scale"])]) == 0
    out = capsys.readouterr().out
    assert out.startswith("KV cache dtype: auto\n")
    assert "scales are unused" in out and "--kv-cache-dtype fp8" in out


def test_human_table(capsys, families):
    assert main(["scales", str(families["k_v_scale"]), "--kv-cache-dtype", "fp8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "KV cache dtype: fp8_e4m3"
    assert lines[1].split() == ["layer", "k_scale", "v_scale", "source"]
    for i, line in enumerate(lines[2:2 + NUM_LAYERS]):
        k, v, source = expected_scales("k_v_scale", NUM_LAYERS)[i]
        assert line.split() == [str(i), f"{k:.6g}", f"{v:.6g}", source]
    assert len(lines) == 2 + NUM_LAYERS  # e4m3 with scales: no note


def test_mixtral(capsys, tmp_path):
    d = write_tiny_mixtral(tmp_path / "mixtral")
    quantize_to_fp8_checkpoint(d, tmp_path / "fp8")
    add_kv_scales(tmp_path / "fp8", "kv_scale")
    doc = scales_json(capsys, tmp_path / "fp8", "--kv-cache-dtype", "fp8")
    check_shape(doc, "fp8_e4m3", num_layers=2)
    assert [(r["k_scale"], r["v_scale"], r["source"]) for r in doc["layers"]] == expected_scales("kv_scale", 2)


def test_reads_only_config_and_scale_tensors(capsys, families, monkeypatch):
    """No model is built and no weight tensor is read."""
    import fp8serve.model_loader.loader as loader
    import fp8serve.quantization.kv_scales as kv_scales
    from fp8serve.models.llama import LlamaForCausalLM

    def forbidden(*a, **k):
        raise AssertionError("the scales command must not load the model")

    monkeypatch.setattr(loader, "load_weights", forbidden)
    monkeypatch.setattr(loader, "iterate_checkpoint", forbidden)
    monkeypatch.setattr(LlamaForCausalLM, "__init__", forbidden)
    read = record_scale_reads(monkeypatch)
    doc = scales_json(capsys, families["k_v_scale"], "--kv-cache-dtype", "fp8")
    assert doc["layers"][0]["source"].startswith("checkpoint:")
    assert read and all(name.endswith((".k_scale", ".v_scale")) for name in read)


@pytest.mark.parametrize("make_args, expected", [
    (lambda d, t: [str(t / "nope")], "does not exist"),
    (lambda d, t: [str(t)], "config.json not found"),
    (lambda d, t: [str(d), "--kv-cache-dtype", "fp8", "--quantization-param-path", str(t / "missing.json")],
     "not found"),
])
def test_errors_are_one_line(capsys, base, tmp_path, make_args, expected):
    rc = main(["scales", *make_args(base, tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith("error: ") and expected in err[-1]
    assert "Traceback" not in "\n".join(err)


@pytest.mark.parametrize("content, expected", [
    ("{not json", "not valid JSON"),
    (json.dumps({"model_type": "mistral", "kv_cache": {}}), "field 'model_type'"),
    (json.dumps({"model_type": "llama", "kv_cache": {"dtype": "float8_e4m3fn",
                                                       "scaling_factor": {"0": {"0": 0.1}}}}), "missing layers 1-2"),
])
def test_bad_json_file(capsys, base, tmp_path, content, expected):
    path = tmp_path / "kv.json"
    path.write_text(content)
    rc = main(["scales", str(base), "--kv-cache-dtype", "fp8", "--quantization-param-path", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith(f"error: {path}") and expected in err[-1]


def test_bad_checkpoint_scale_is_an_error(capsys, base, tmp_path):
    import torch
    from checkpoints import add_tensors

    d = tmp_path / "fp8"
    quantize_to_fp8_checkpoint(base, d)
    add_kv_scales(d, "kv_scale")
    add_tensors(d, {"model.layers.1.self_attn.kv_scale": torch.tensor(-1.0)})
    rc = main(["scales", str(d), "--kv-cache-dtype", "fp8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "model.layers.1.self_attn.kv_scale" in err[-1] and "> 0" in err[-1]


def test_model_defaults_to_builtin(capsys, base, monkeypatch):
    import fp8serve.default_model as default_model

    monkeypatch.setattr(default_model, "ensure_default_model", lambda: base)
    doc = scales_json(capsys, "--kv-cache-dtype", "fp8")
    check_shape(doc, "fp8_e4m3")


def test_listed_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "scales" in capsys.readouterr().out


@pytest.mark.slow
def test_subprocess_on_default_model():
    """The installed entry point, on the built-in model: JSON alone on stdout, logs on stderr."""
    env = dict(os.environ, FP8SERVE_LOG_LEVEL="INFO")
    proc = subprocess.run(
        [sys.executable, "-m", "fp8serve.entrypoints.cli", "scales", "--kv-cache-dtype", "fp8", "--json"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["kv_cache_dtype"] == "fp8_e4m3"
    assert len(doc["layers"]) == 30  # SmolLM2-135M
    assert all(r["source"] == "default" and r["k_scale"] == 1.0 for r in doc["layers"])
    assert "WARNING" in proc.stderr and "without calibrated scales" in proc.stderr
