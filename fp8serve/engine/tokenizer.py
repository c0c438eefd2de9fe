"""Tokenizer and end-of-sequence ids of a local checkpoint (never the hub)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(model_dir: str):
    """A transformers tokenizer from `model_dir`, or None if it ships none."""
    d = Path(model_dir)
    if not any((d / f).is_file() for f in _TOKENIZER_FILES):
        logger.warning("%s has no tokenizer files: only token-id prompts can be used", d)
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d), local_files_only=True)


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
