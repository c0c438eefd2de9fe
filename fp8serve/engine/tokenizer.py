"""Tokenizer and end-of-sequence ids of a local checkpoint (never the hub)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from fp8serve.errors import ConfigError, InvalidParameterError

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
# Those that hold a vocabulary; tokenizer_config.json only configures one.
VOCABULARY_FILES = TOKENIZER_FILES[:3]


def has_tokenizer_files(model_dir: str | os.PathLike) -> bool:
    return any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(model_dir: str):
    """A transformers tokenizer from `model_dir`, or None if it ships none."""
    d = Path(model_dir)
    if not has_tokenizer_files(d):
        logger.warning("%s has no tokenizer files: only token-id prompts can be used (or pass --tokenizer DIR)", d)
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any failure here is the checkpoint's
        # transformers validates config.json and the tokenizer files as it
        # loads them (with errors of its own and of huggingface_hub): the
        # checkpoint's fault, said in one line. Without a vocabulary file its
        # error is a paragraph about tokenizer backends; the missing file is the news.
        # (Checked only on failure: a tokenizer may keep its vocabulary under another name.)
        if not any((d / f).is_file() for f in VOCABULARY_FILES):
            raise ConfigError(f"{d}: cannot load a tokenizer from tokenizer_config.json alone: expected "
                              f"{' or '.join(VOCABULARY_FILES)} next to it") from None
        raise ConfigError(f"{d}: transformers cannot load the tokenizer ({type(e).__name__}: "
                          f"{' '.join(str(e).split())})") from None


def first_invalid_text(value, path: str) -> tuple[str, int] | None:
    """(path, character index) of the first string inside `value` (a string,
    or nested lists and dicts of them) that UTF-8 cannot encode, or None.
    Why: JSON may carry a lone UTF-16 surrogate (`"\\ud83d"`), which Python
    decodes into a str that no tokenizer accepts; the request should fail as
    the client's error, naming the field, not as an internal one deep in
    tokenization."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return path, e.start
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        found = first_invalid_text(item, f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]")
        if found is not None:
            return found
    return None


def check_text(value, path: str, parameter: str | None = None) -> None:
    """Raise InvalidParameterError (a ValueError and a UserError) when a string
    inside `value` is not valid Unicode (see first_invalid_text)."""
    found = first_invalid_text(value, path)
    if found is not None:
        where, index = found
        raise InvalidParameterError(
            f"{where} is not valid Unicode text: a lone UTF-16 surrogate at character {index} (surrogates "
            f"\\ud800-\\udfff must come in pairs); send UTF-8 text", parameter or path)


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def eos_token_ids(model_dir: str, hf_config: dict, tokenizer) -> list[int]:
    """generation_config.json wins (Llama 3 lists several), then config.json,
    then the tokenizer."""
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        try:
            ids = _as_list(json.loads(gen.read_text()).get("eos_token_id"))
            if ids:
                return ids
        except (json.JSONDecodeError, TypeError, ValueError):
            logger.warning("%s: cannot read eos_token_id; falling back to config.json", gen)
    ids = _as_list(hf_config.get("eos_token_id"))
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return ids
