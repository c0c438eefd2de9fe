"""`fp8serve compare`: configurations from MODEL lists and MODEL@SPEC, and a
markdown table that marks the first token differing from configuration #1."""

from __future__ import annotations

import pytest

from checkpoints import make_tokenizer, write_tiny_llama
from cli_runs import count_fp8_layers_of_built_llms

from fp8serve.calibration.kv_config import KVConfig
from fp8serve.engine.tokenizer import load_tokenizer
from fp8serve.entrypoints.cli import main
from fp8serve.errors import UserError
from fp8serve.tools.compare import first_difference, parse_run_configs, render_marked, token_pieces


def test_first_difference_and_marking():
    ref = ["The", " cat", " sat", "."]
    assert first_difference(ref, ref) is None
    assert first_difference(["The", " dog", " sat", "."], ref) == 1
    assert first_difference(["The", " cat"], ref) == 2
    assert render_marked(["The", " dog", " sat", "|", "\n"], 1) == "The⟦ dog⟧ sat\\|\\n"
    assert render_marked(["The", " cat"], 2) == "The cat⟦⏹⟧"
    # a token ending mid-character is marked with the token completing it
    assert render_marked(["a", "", "é", "b"], 1) == "a⟦é⟧b"


def test_token_pieces_join_to_the_text(tmp_path):
    make_tokenizer(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    ids = tok.encode("Hello world, the cat sat.", add_special_tokens=False)
    pieces = token_pieces(tok, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == tok.decode(ids)


def test_parse_run_configs(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    configs = parse_run_configs([a, f"{b}@fp8_e4m3:scale1"], ["auto", "fp8_e5m2"], None)
    assert [(c.model, c.kv) for c in configs] == [
        (a, KVConfig("auto")), (a, KVConfig("fp8_e5m2")), (b, KVConfig("fp8_e4m3", "scale1"))]


def test_parse_run_configs_quantization(tmp_path):
    """-q is for MODELs without @SPEC, as --kv-cache-dtype is; a SPEC says it in a last field q=fp8
    (or quantization=fp8), after the KV cache's own fields."""
    a = str(tmp_path / "a")
    scales = tmp_path / "s:1.json"  # a ':' in the scale file's path is still the file's
    scales.write_text("{}")
    configs = parse_run_configs([a, f"{a}@auto", f"{a}@auto:q=fp8", f"{a}@fp8_e4m3:scale1:quantization=fp8",
                                 f"{a}@fp8_e4m3:json={scales}:q=fp8", f"{a}@q=fp8"], ["auto"], None, "fp8")
    assert [(c.kv, c.quantization) for c in configs] == [
        (KVConfig("auto"), "fp8"), (KVConfig("auto"), None), (KVConfig("auto"), "fp8"),
        (KVConfig("fp8_e4m3", "scale1"), "fp8"), (KVConfig("fp8_e4m3", "json", str(scales)), "fp8"),
        (KVConfig("auto"), "fp8")]
    assert [c.label for c in configs[1:3]] == ["a @ auto", "a @ auto:q=fp8"]
    assert parse_run_configs([a], ["auto"], None)[0].quantization is None
    for spec, words in (("auto:q=awq", "quantization 'awq' is not one of fp8"),
                        ("auto:quantization=", "quantization '' is not one of fp8")):
        with pytest.raises(UserError, match=words):
            parse_run_configs([f"{a}@{spec}"], ["auto"], None)


@pytest.mark.parametrize("spec, words", [
    ("auto:q=fp8:q=fp8", "q= (quantization=) is given twice (q=fp8 and q=fp8); a SPEC takes one q=METHOD"),
    ("fp8_e4m3:scale1:quantization=fp8:q=fp8", "is given twice (quantization=fp8 and q=fp8)"),
    ("q=fp8:q=fp8", "is given twice (q=fp8 and q=fp8)"),
    ("q=fp8:fp8_e4m3", "q=fp8 must be the SPEC's last field (MODEL@DTYPE[:SCALES]:q=METHOD)"),
])
def test_a_repeated_or_misplaced_q_field_is_named(tmp_path, spec, words):
    """The first of two q= fields was read as part of the KV cache SPEC: "scales apply to an FP8 KV cache
    only" or "unknown KV cache dtype 'q=fp8'"."""
    item = f"{tmp_path / 'a'}@{spec}"
    with pytest.raises(UserError) as e:
        parse_run_configs([item], ["auto"], None)
    assert str(e.value).startswith(f"'{item}': ") and words in str(e.value), str(e.value)
    assert "KV config" not in str(e.value)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    return write_tiny_llama(root / "a", seed=0), write_tiny_llama(root / "b", seed=1)


def test_compare_table(models, tmp_path, capsys):
    a, b = models
    out = tmp_path / "cmp.md"
    rc = main(["compare", f"{a}@auto", f"{a}@fp8_e4m3:scale1", f"{b}@auto", "--max-tokens", "6",
               "--prompt", "Hello there", "--prompt", "What is the capital of France?",
               "--dtype", "float32", "--kv-cache-memory", "4MiB", "--out", str(out)])
    assert rc == 0
    md = out.read_text()
    assert md.strip() == capsys.readouterr().out.split("\nwrote ")[0].strip()
    lines = md.splitlines()
    config_rows = [line for line in lines if line.startswith("| 1 |") or line.startswith("| 2 |")
                   or line.startswith("| 3 |")]
    assert len(config_rows) == 3
    assert "forced" in config_rows[1] and "fp8_e4m3" in config_rows[1]
    assert "2/2" in config_rows[0]  # #1 is identical to itself
    output_rows = [line for line in lines if line.startswith("| Hello there |") or line.startswith("| What is")]
    assert len(output_rows) == 2
    # a different random model diverges: its cells carry the first-difference mark, #1's never do
    for row in output_rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert "⟦" not in cells[1]
        assert "⟦" in cells[3]


def test_arguments_are_checked_before_any_model_loads(models, tmp_path, capsys, monkeypatch):
    """--max-tokens 0 (the message lacked the flag), an --out under a file (a traceback after the whole
    run), --kv-cache-dtype with every MODEL@SPEC (ignored without a word), and a later MODEL that cannot
    run as specified (found only when its turn came)."""
    import fp8serve

    from checkpoints import set_quantization_config
    from kv_scale_checkpoints import COMPRESSED_TENSORS_KV_ONLY, copy_checkpoint, quantize_to_fp8_checkpoint

    a, _ = models
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    fp8_dir = tmp_path / "fp8"  # q=fp8 on it is redundant, not an error
    quantize_to_fp8_checkpoint(a, fp8_dir)
    ct_dir = copy_checkpoint(a, tmp_path / "ct")
    set_quantization_config(ct_dir, COMPRESSED_TENSORS_KV_ONLY)
    monkeypatch.setattr(fp8serve, "LLM", lambda *args, **kw: pytest.fail("must not load a model"))
    cases = [
        ([f"{a}@auto", "--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
        ([f"{a}@auto", "--max-model-len", "0"], "--max-model-len must be >= 1, got 0"),
        ([f"{a}@auto", "--out", str(a_file / "x.md")], f"{a_file} is a file, not a directory"),
        ([f"{a}@auto", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype applies to MODELs given without @SPEC"),
        ([str(a), "--kv-cache-dtype", "auto", "fp8", "--quantization-param-path", str(a_file)],
         "--quantization-param-path applies to FP8 KV caches only"),
        ([f"{a}@auto", "-q", "fp8"], "--quantization applies to MODELs given without @SPEC, and every MODEL has one; "
                                     "put it in the SPEC (MODEL@auto:q=fp8)"),
        ([f"{a}@auto:q=awq"], f"'{a}@auto:q=awq': quantization 'awq' is not one of fp8"),
        # A later MODEL that is missing, or quantized otherwise than its q= says, fails before #1 runs.
        ([f"{a}@auto", f"{tmp_path / 'nowhere'}@auto"], f"model path '{tmp_path / 'nowhere'}' does not exist"),
        ([f"{a}@auto", f"{fp8_dir}@auto:q=fp8", f"{ct_dir}@auto:q=fp8"],
         "--quantization fp8 does not match the checkpoint"),
    ]
    for argv, words in cases:
        assert main(["compare", *argv]) == 2
        assert words in capsys.readouterr().err


def test_quantization_reaches_the_engines_it_is_given_for(models, tmp_path, monkeypatch):
    """-q fp8 for the MODEL without @SPEC, :q=fp8 in a SPEC: those engines, and only those, have FP8 projections,
    and the table says which configuration ran with them."""
    num_fp8_layers = count_fp8_layers_of_built_llms(monkeypatch)
    a, _ = models
    out = tmp_path / "cmp.md"
    assert main(["compare", str(a), f"{a}@auto", f"{a}@fp8_e4m3:q=fp8", "-q", "fp8", "--max-tokens", "3",
                 "--prompt", "Hi", "--dtype", "float32", "--kv-cache-memory", "4MiB", "--out", str(out)]) == 0
    assert num_fp8_layers[0] > 0 and num_fp8_layers[1] == 0 and num_fp8_layers[2] == num_fp8_layers[0]
    md = out.read_text()
    assert "| # | model | quantization | KV cache |" in md
    assert "| 1 | a | fp8 | float32 (auto) |" in md and "| 2 | a | - | float32 (auto) |" in md
    assert "| 3 | a | fp8 | fp8_e4m3 (fp8_e4m3) |" in md


def test_max_model_len_fits_a_small_kv_budget(models, capsys):
    """The "cache too small" error told compare's users to lower --max-model-len, which compare lacked."""
    a, _ = models
    argv = ["compare", f"{a}@auto", "--max-tokens", "2", "--prompt", "Hi", "--dtype", "float32",
            "--kv-cache-memory", "64KiB"]
    assert main(argv) == 2
    assert "lower --max-model-len" in capsys.readouterr().err
    assert main([*argv, "--max-model-len", "64"]) == 0
    assert "| Hi |" in capsys.readouterr().out
