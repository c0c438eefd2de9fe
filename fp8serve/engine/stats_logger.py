"""The server's periodic stats line, as vLLM logs it: throughput over the last
interval, the batch, KV cache usage and (with prefix caching) the hit rate.

Called by the engine thread after every step and every idle poll with the
snapshot it just took; it logs at most once per interval, and only when
something happened since the last line (a server with nothing to do stays
quiet, but the interval in which the last request finished is reported)."""

from __future__ import annotations

import logging
import time
from typing import Protocol

logger = logging.getLogger(__name__)


class _Snapshot(Protocol):
    num_running: int
    num_waiting: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int

    @property
    def kv_cache_usage(self) -> float: ...


class StatsLogger:
    def __init__(self, interval_s: float = 5.0, prefix_caching: bool = False, spec_decode: bool = False) -> None:
        if interval_s < 0:
            raise ValueError(f"the stats interval must be >= 0 seconds, got {interval_s}")
        self.interval_s = interval_s
        self.prefix_caching = prefix_caching
        self.spec_decode = spec_decode
        self._last_time = time.monotonic()
        self._last: _Snapshot | None = None

    def maybe_log(self, snap: _Snapshot, now: float | None = None) -> str | None:
        """Log (and return) the line when the interval has passed and there was work; else None."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._last_time
        if elapsed < self.interval_s or elapsed <= 0:
            return None
        last = self._last
        prompt = snap.prompt_tokens_total - (last.prompt_tokens_total if last else 0)
        generated = snap.generation_tokens_total - (last.generation_tokens_total if last else 0)
        self._last_time, self._last = now, snap
        if not (prompt or generated or snap.num_running or snap.num_waiting):
            return None
        line = (f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {generated / elapsed:.1f} tokens/s, "
                f"Running: {snap.num_running} reqs, Waiting: {snap.num_waiting} reqs, "
                f"KV cache usage: {100 * snap.kv_cache_usage:.1f}%")
        if self.prefix_caching:
            # Since start: prompt tokens found in the cache over those looked up.
            queries = snap.prefix_cache_queries
            line += f", Prefix cache hit rate: {100 * snap.prefix_cache_hits / queries if queries else 0.0:.1f}%"
        logger.info("%s", line)
        if self.spec_decode:
            # Over the interval, as vLLM's line: the mean acceptance length counts the token every
            # verify pass emits after its kept drafts.
            drafts = snap.spec_decode_num_drafts - (last.spec_decode_num_drafts if last else 0)
            drafted = snap.spec_decode_num_draft_tokens - (last.spec_decode_num_draft_tokens if last else 0)
            accepted = snap.spec_decode_num_accepted_tokens - (last.spec_decode_num_accepted_tokens if last else 0)
            spec_line = (f"SpecDecoding metrics: Draft acceptance rate: {100 * accepted / drafted if drafted else 0.0:.1f}%, "
                         f"Mean acceptance length: {1 + accepted / drafts if drafts else 0.0:.2f}, "
                         f"Accepted: {accepted} tokens, Drafted: {drafted} tokens")
            logger.info("%s", spec_line)
            line += "\n" + spec_line
        return line
