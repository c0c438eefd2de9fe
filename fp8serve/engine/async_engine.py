"""`LLMEngine` behind an asyncio API, for the server.

One background thread owns the engine: every engine method is called from
it and nowhere else. Requests and aborts reach it through a thread-safe
command queue and are applied between steps; outputs go back to each
request's asyncio queue with `loop.call_soon_threadsafe`. A failed step
fails every request in flight (their clients get the error instead of
hanging) and marks the engine dead; `is_healthy()` also turns false when
there is work but no step has finished for `stall_timeout` seconds.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fp8serve.engine.llm_engine import LLMEngine, PromptInput
from fp8serve.engine.stats_logger import StatsLogger
from fp8serve.errors import UserError
from fp8serve.outputs import RequestOutput
from fp8serve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long the idle loop waits for a command before refreshing its heartbeat.
_IDLE_POLL_S = 0.2


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a step raised, or it was shut down)."""


class EngineDrainingError(RuntimeError):
    """The engine is shutting down and accepts no new requests."""


@dataclass
class _Add:
    request_id: str
    prompt: PromptInput
    params: SamplingParams
    stream: "_RequestStream"
    arrival_time: float


@dataclass
class _Abort:
    request_id: str


class _AbortAll:
    """Abort every request the engine holds (a drain that ran out of time)."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Scheduler and cache numbers, copied by the engine thread after every
    step so that other threads never call into the engine to read them."""

    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    prompt_tokens_total: int = 0
    prompt_tokens_cached_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


class _RequestStream:
    """One request's outputs, written by the engine thread, read by asyncio."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        # Called from the engine thread; the loop may already be closed when a
        # client's event loop went away first.
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, stall_timeout: float = 120.0, log_stats: bool = True,
                 log_stats_interval: float = 5.0) -> None:
        """log_stats: a stats line every `log_stats_interval` seconds of work (vLLM's; the server's
        --disable-log-stats turns it off)."""
        self.engine = engine
        # A server lives long: it will run far more than the 64 eager decode steps a fresh engine
        # waits before its first recording (a compile a short offline run would not win back), so
        # it records as soon as a batch size has run its record_after eager steps
        # (fp8serve/engine/decode_capture.py).
        engine.model_runner.decode_captures.first_record_after = 0
        self.stall_timeout = stall_timeout
        self._stats_logger = StatsLogger(log_stats_interval, engine.block_manager.enable_prefix_caching,
                                                 spec_decode=engine.proposer is not None) \
            if log_stats else None
        self._commands: queue.SimpleQueue[_Add | _Abort | _AbortAll | None] = queue.SimpleQueue()
        # Touched only by the engine thread.
        self._streams: dict[str, _RequestStream] = {}
        self._ids = itertools.count()
        # Written by the engine thread, read anywhere (plain attribute reads).
        self.last_progress_time = time.monotonic()
        self.has_work = False
        self.errored: BaseException | None = None
        self.snapshot = EngineSnapshot()
        self._take_snapshot()
        self._num_in_flight = 0  # requests handed to generate() and not yet done
        self._accepting = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fp8serve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, model: str | None = None, stall_timeout: float = 120.0, log_stats: bool = True,
                  **kwargs) -> "AsyncLLMEngine":
        return cls(LLMEngine.from_args(model, **kwargs), stall_timeout=stall_timeout, log_stats=log_stats)

    # ------------------------------------------------------------ public API
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self):
        return self.engine.config

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.errored is None

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def is_healthy(self) -> bool:
        if not self.is_running:
            return False
        if self.has_work and time.monotonic() - self.last_progress_time > self.stall_timeout:
            return False
        return True

    def new_request_id(self) -> str:
        return f"areq-{next(self._ids)}"

    async def generate(
        self, prompt: PromptInput, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request, the last one with `finished=True`.

        Raises UserError if the engine rejects the request, EngineDrainingError
        once shutdown has begun (while draining and after), EngineDeadError if
        the engine loop failed; aborts the request if the caller stops early."""
        if self.errored is not None:
            raise EngineDeadError(f"the engine loop failed ({self.errored!r})")
        # Before the liveness check: a drain that has already finished stopped
        # the loop on purpose, and the caller should hear "shutting down".
        if not self._accepting:
            raise EngineDrainingError("the server is shutting down")
        if not self._thread.is_alive():
            raise EngineDeadError("the engine loop is not running")
        request_id = request_id or self.new_request_id()
        stream = _RequestStream(asyncio.get_running_loop())
        self._num_in_flight += 1
        self._commands.put(_Add(request_id, prompt, params, stream, time.monotonic()))
        try:
            while True:
                try:
                    item = await asyncio.wait_for(stream.queue.get(), timeout=1.0)
                except TimeoutError:
                    if not self._thread.is_alive():
                        stream.finished = True
                        raise EngineDeadError(f"the engine loop is not running ({self.errored!r})") from None
                    continue
                if isinstance(item, BaseException):
                    stream.finished = True
                    raise item
                if item.finished:
                    stream.finished = True
                yield item
                if item.finished:
                    return
        finally:
            self._num_in_flight -= 1
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def abort_all(self) -> None:
        """Abort every running and waiting request: each caller of generate() gets its last
        output with finish_reason "abort", so a client sees its response end, not a cut."""
        self._commands.put(_AbortAll())

    async def abort_in_flight(self, timeout: float = 5.0) -> bool:
        """abort_all, then wait up to `timeout` s for the callers to take their last outputs
        (the server writes the final chunks); False if some are still in flight."""
        self.abort_all()
        return await self.wait_idle(timeout)

    async def wait_idle(self, timeout: float) -> bool:
        """Waits until no request is in flight; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._num_in_flight > 0 and self.is_running:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def stop_accepting(self) -> None:
        self._accepting = False

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stops taking requests, lets running ones finish for up to
        `drain_timeout` seconds, aborts the rest, and stops the loop."""
        self.stop_accepting()
        if not await self.wait_idle(drain_timeout):
            logger.warning("shutdown: %d requests still running after %.0f s; aborting them",
                           self._num_in_flight, drain_timeout)
            await self.abort_in_flight()
        self._stop.set()
        self._commands.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)

    # ------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands(block=not self.engine.has_unfinished_requests())
                if self._stop.is_set():
                    break
                self.has_work = self.engine.has_unfinished_requests()
                if not self.has_work:
                    self.last_progress_time = time.monotonic()
                    self._take_snapshot()
                    self._log_stats()
                    continue
                outputs = self.engine.step()
                self.last_progress_time = time.monotonic()
                self._take_snapshot()
                self._log_stats()
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    if out.finished:
                        del self._streams[out.request_id]
                    stream.put(out)
            self._abort_all(EngineDeadError("the engine was shut down"), "abort")
        except BaseException as e:  # noqa: BLE001 - any failure must reach the clients
            logger.exception("engine loop failed; failing %d requests", len(self._streams))
            self.errored = e
            self._abort_all(EngineDeadError(f"the engine failed: {type(e).__name__}: {e}"), "error")
        finally:
            self.has_work = False

    def _log_stats(self) -> None:
        if self._stats_logger is not None:
            self._stats_logger.maybe_log(self.snapshot, self.last_progress_time)

    def _take_snapshot(self) -> None:
        e = self.engine
        self.snapshot = EngineSnapshot(
            num_running=e.scheduler.num_running,
            num_waiting=e.scheduler.num_waiting,
            num_preemptions=e.scheduler.num_preemptions,
            num_blocks=e.block_manager.num_blocks,
            num_free_blocks=e.block_manager.num_free_blocks,
            prompt_tokens_total=e.stats.prompt_tokens_total,
            prompt_tokens_cached_total=e.stats.prompt_tokens_cached_total,
            generation_tokens_total=e.stats.generation_tokens_total,
            prefix_cache_queries=e.block_manager.prefix_cache_queries,
            prefix_cache_hits=e.block_manager.prefix_cache_hits,
            spec_decode_num_drafts=e.stats.spec_decode_num_drafts,
            spec_decode_num_draft_tokens=e.stats.spec_decode_num_draft_tokens,
            spec_decode_num_accepted_tokens=e.stats.spec_decode_num_accepted_tokens,
        )

    def _apply_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd is None:
                return
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _AbortAll):
                for request_id in list(self._streams):
                    self._abort(request_id)
            else:
                self._abort(cmd.request_id)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, cmd: _Add) -> None:
        try:
            if cmd.request_id in self._streams:
                raise UserError(f"request id '{cmd.request_id}' is already in use")
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, arrival_time=cmd.arrival_time)
        except (UserError, ValueError) as e:
            cmd.stream.put(e)
            return
        self._streams[cmd.request_id] = cmd.stream

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        request = self.engine.get_request(request_id)
        if self.engine.abort_request(request_id):
            logger.debug("aborted %s", request_id)
        if stream is not None:
            if request is not None:
                stream.put(self.engine.make_output(request))
            else:
                stream.put(EngineDeadError(f"request {request_id} was aborted"))

    def _abort_all(self, error: BaseException, finish_reason: str) -> None:
        """Ends every request with `error` for its caller; `finish_reason` ("abort" at shutdown,
        "error" after a failure) is what the stat loggers record for it."""
        for request_id in list(self._streams):
            try:
                self.engine.abort_request(request_id, finish_reason)
            except Exception:  # noqa: BLE001 - the engine may be broken; the clients matter more
                pass
            self._streams.pop(request_id).put(error)
        # Adds that never reached the engine.
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                cmd.stream.put(error)
