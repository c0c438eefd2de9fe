"""The metadata of the forward pass in progress.

A context variable rather than a module global, so two engines in one
process (or two threads) never see each other's batch."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from fp8serve.attention.metadata import AttentionMetadata

_current: contextvars.ContextVar[AttentionMetadata | None] = contextvars.ContextVar("fp8serve_attn_metadata", default=None)


@contextlib.contextmanager
def set_forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    token = _current.set(metadata)
    try:
        yield
    finally:
        _current.reset(token)


def get_attn_metadata() -> AttentionMetadata:
    metadata = _current.get()
    if metadata is None:
        raise RuntimeError("attention layer called outside set_forward_context()")
    return metadata
