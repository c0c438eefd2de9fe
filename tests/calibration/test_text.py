"""Calibration text: plain and JSONL files, the built-in sample, chunking."""

from __future__ import annotations

import json

import pytest

from checkpoints import make_tokenizer

from fp8serve.calibration.text import load_text, token_chunks
from fp8serve.engine.tokenizer import load_tokenizer
from fp8serve.errors import UserError


def test_plain_jsonl_and_builtin(tmp_path):
    (tmp_path / "a.txt").write_text("Hello there.\n{not json")
    assert load_text(tmp_path / "a.txt").text == "Hello there.\n{not json"
    (tmp_path / "b.data").write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate("xyz")))
    assert load_text(tmp_path / "b.data").text == "x\n\ny\n\nz"
    (tmp_path / "c.jsonl").write_text('{"text": "ok"}\n{"body": "no"}\n')
    with pytest.raises(UserError, match=r"c.jsonl:2"):
        load_text(tmp_path / "c.jsonl")
    builtin = load_text(None)
    assert len(builtin.text) > 3000 and "built-in" in builtin.description
    with pytest.raises(UserError, match="cannot read"):
        load_text(tmp_path / "missing.txt")


def test_token_chunks(tmp_path):
    make_tokenizer(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    text = load_text(None).text
    ids = tok.encode(text, add_special_tokens=False)
    chunks = token_chunks(tok, text, 1000, 300)
    assert [len(c) for c in chunks] == [300, 300, 300, 100]
    assert sum(chunks, []) == ids[:1000]
    # a 1-token tail predicts nothing and is dropped
    assert [len(c) for c in token_chunks(tok, text, 601, 300)] == [300, 300]
    assert tok.model_max_length < 10**6  # restored after the long encode


def test_binary_and_non_utf8_files_are_refused(tmp_path):
    (tmp_path / "nul.txt").write_bytes(b"text\x00more")
    with pytest.raises(UserError, match=r"nul.txt: a binary file \(it holds NUL bytes\)"):
        load_text(tmp_path / "nul.txt")
    (tmp_path / "latin1.txt").write_bytes("Ünïcödé ".encode("latin-1") * 10)
    with pytest.raises(UserError, match=r"latin1.txt: not UTF-8 text \(first bad byte at offset 0\)"):
        load_text(tmp_path / "latin1.txt")
    # One stray byte in a long UTF-8 text is replaced, the text used.
    (tmp_path / "stray.txt").write_bytes(b"plain text " * 20 + b"\xff" + b" and more")
    assert load_text(tmp_path / "stray.txt").text.count("\ufffd") == 1
