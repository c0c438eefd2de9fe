"""Drive an engine over token chunks while observers watch.

Calibration runs with a 16/32-bit KV cache: the K/V a layer produces depend
on what earlier layers read back from the cache, and we want the ranges of
the unquantized model, not of one already distorted by guessed scales."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm

from fp8serve.errors import ConfigError, UserError

logger = logging.getLogger(__name__)

# Long enough for the RoPE angles a served prompt reaches, short enough that one chunk's
# prefill is quick; capped at the model's own context when that is shorter.
DEFAULT_SEQ_LEN = 512


def resolve_seq_len(model: str, seq_len: int | None) -> int:
    """Before any work: `model`'s config.json reads, and `seq_len` (None: the default) fits
    its context. Errors name --seq-len and the file."""
    from fp8serve.config import ModelArchConfig, read_hf_config

    hf_config, config_path = read_hf_config(model)
    limit = ModelArchConfig.from_dict(hf_config, config_path).max_position_embeddings
    if seq_len is None:
        return min(DEFAULT_SEQ_LEN, limit)
    if seq_len < 2:
        raise UserError(f"--seq-len must be >= 2 (a chunk of one token predicts nothing), got {seq_len}")
    if seq_len > limit:
        raise UserError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings ({limit}) in "
                        f"{config_path}; pass --seq-len {limit} or less")
    return seq_len


def build_llm(model: str | None, *, seq_len: int, dtype: str = "float32", kv_cache_dtype: str = "auto",
              device: str = "auto", kv_cache_memory: str | None = None, seed: int = 0, **kwargs):
    """An `LLM` sized for teacher-forcing chunks of at most `seq_len` tokens:
    max_model_len = seq_len keeps the KV cache budget check about what we
    actually run, not the model's full context."""
    from fp8serve import LLM

    if seq_len < 1:
        raise UserError(f"--seq-len must be a positive integer, got {seq_len}")
    try:
        return LLM(model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, device=device,
                   kv_cache_memory=kv_cache_memory, max_model_len=seq_len, seed=seed, **kwargs)
    except ConfigError as e:
        # The engine knows seq_len as its max_model_len; the user gave --seq-len.
        raise ConfigError(str(e).replace("--max-model-len", "--seq-len")) from None


def iter_prompt_logits(llm, chunks: list[list[int]], desc: str) -> Iterator[tuple[list[int], torch.Tensor]]:
    """(chunk, logits [len(chunk), vocab] float32) for every chunk, with a
    progress bar counting tokens."""
    if not chunks:
        raise UserError("no text to run: the text is shorter than 2 tokens")
    engine = llm.llm_engine
    total = sum(len(c) for c in chunks)
    t0 = time.perf_counter()
    with tqdm(total=total, desc=desc, unit="tok", leave=False) as bar:
        for chunk in chunks:
            logits = engine.prompt_logits(chunk)
            bar.update(len(chunk))
            yield chunk, logits
    logger.info("%s: %d tokens in %d chunks, %.1f s", desc, total, len(chunks), time.perf_counter() - t0)


def run_chunks(llm, chunks: list[list[int]], desc: str = "Calibrating") -> int:
    """Teacher-force every chunk (for the observers' sake); returns the number of tokens."""
    n = 0
    for chunk, _ in iter_prompt_logits(llm, chunks, desc):
        n += len(chunk)
    return n
