"""Calibration and evaluation text: read it, tokenize it, cut it into chunks.

Chunks are teacher-forced one at a time through `prompt_logits`, each from
position 0, so `seq_len` sets the longest context (and the largest RoPE
angle) the observed keys see; calibrate with the context lengths you serve.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fp8serve.errors import UserError


@dataclass(frozen=True)
class TextSource:
    text: str
    description: str  # for logs and results files: "FILE (N chars)" or "built-in sample"


def load_text(path: str | Path | None) -> TextSource:
    """Plain text, or JSONL with a "text" field per line (`.jsonl` suffix or
    a first line that parses as a JSON object). None: the built-in sample."""
    if path is None:
        from fp8serve.calibration.default_text import DEFAULT_CALIBRATION_TEXT

        return TextSource(DEFAULT_CALIBRATION_TEXT, f"built-in sample ({len(DEFAULT_CALIBRATION_TEXT)} chars)")
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise UserError(f"--text {p}: cannot read it ({e.strerror or e})") from None
    if b"\x00" in data:
        raise UserError(f"--text {p}: a binary file (it holds NUL bytes); expected UTF-8 text or JSONL")
    try:
        raw = data.decode("utf-8")
    except UnicodeDecodeError as e:
        # A stray byte from another encoding is replaced and the text used; a file that is
        # mostly not UTF-8 would feed the model replacement characters.
        raw = data.decode("utf-8", errors="replace")
        if raw.count("\ufffd") > max(1, len(raw) // 100):
            raise UserError(f"--text {p}: not UTF-8 text (first bad byte at offset {e.start}); "
                            "expected UTF-8 text or JSONL") from None
    if _looks_like_jsonl(p, raw):
        text = "\n\n".join(_jsonl_texts(p, raw))
    else:
        text = raw
    if not text.strip():
        raise UserError(f"--text {p}: no text in it")
    return TextSource(text, f"{p} ({len(text)} chars)")


def _looks_like_jsonl(path: Path, raw: str) -> bool:
    if path.suffix == ".jsonl":
        return True
    first = raw.lstrip().split("\n", 1)[0]
    if not first.startswith("{"):
        return False
    try:
        return isinstance(json.loads(first), dict)
    except json.JSONDecodeError:
        return False


def _jsonl_texts(path: Path, raw: str) -> list[str]:
    texts = []
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"--text {path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise UserError(f'--text {path}:{lineno}: expected an object with a string "text" field')
        texts.append(obj["text"])
    return texts


def token_chunks(tokenizer, text: str, num_tokens: int, seq_len: int) -> list[list[int]]:
    """Up to `num_tokens` tokens of `text` in chunks of `seq_len` (the last may
    be shorter; one of fewer than 2 tokens is dropped: it predicts nothing).

    Tokenized without special tokens: a BOS in the middle of running text is
    not what a served prompt looks like, and not every tokenizer has one."""
    if num_tokens < 2 or seq_len < 2:
        raise UserError(f"--num-tokens and --seq-len must be >= 2, got {num_tokens} and {seq_len}")
    if tokenizer is None:
        raise UserError("the model has no tokenizer, so calibration text cannot be tokenized")
    # The tokenizer's model_max_length is about model inputs, not this text:
    # lifted while encoding so it does not warn about "indexing errors".
    limit = getattr(tokenizer, "model_max_length", None)
    try:
        if limit is not None:
            tokenizer.model_max_length = 1 << 62
        ids = tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    finally:
        if limit is not None:
            tokenizer.model_max_length = limit
    chunks = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]
    return [c for c in chunks if len(c) >= 2]
