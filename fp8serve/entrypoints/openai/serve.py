"""`fp8serve serve [MODEL]`: the OpenAI-compatible server.

SIGTERM (or Ctrl-C) drains: new requests get 503, running ones may finish
for up to --shutdown-timeout seconds, the rest are aborted, and the process
exits 0. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal

from fp8serve.default_model import DEFAULT_MODEL_NAME
from fp8serve.entrypoints.chat_utils import load_chat_template
from fp8serve.entrypoints.engine_args import add_engine_args, engine_kwargs
from fp8serve.errors import UserError
from fp8serve.utils.memory import parse_size

# The server stack (uvicorn, FastAPI, the async engine) is imported in run():
# `fp8serve --help` and every other command build this parser too.
DEFAULT_MAX_BODY_BYTES = 8 << 20
# Seconds the handlers get to send aborted requests' last chunks, within uvicorn's own
# graceful-shutdown limit (timeout_graceful_shutdown below).
_ABORT_GRACE_S = 3.0

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                              description="Serve a model over the OpenAI completions and chat completions APIs.")
    add_engine_args(p, model_positional=True)
    p.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) clients use, as vLLM: requests may name any, responses and metrics use "
                        "the first (default: MODEL as given, or the built-in model's name)")
    g.add_argument("--max-request-body-size", default=str(DEFAULT_MAX_BODY_BYTES),
                   help="larger request bodies get 413 (bytes, or e.g. 8MiB)")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="Jinja chat template (a file, or the template text) for chat requests that name none, "
                        "instead of the tokenizer's (which base models lack)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests may take to finish after SIGTERM")
    g.add_argument("--stall-timeout", type=float, default=120.0,
                   help="/health turns 503 when there is work but no step finished for this long")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line (prompt and generation throughput, running and waiting requests, "
                        "KV cache usage, prefix cache hit rate) every 5 s of work")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug", "trace"))
    p.set_defaults(func=run)


def _draining_server_class():
    import uvicorn

    return type("DrainingServer", (_DrainingMixin, uvicorn.Server), {})


class _DrainingMixin:
    """uvicorn.Server whose first SIGTERM/SIGINT drains instead of stopping."""

    def __init__(self, config, app, engine, drain_timeout: float) -> None:
        super().__init__(config)
        self._app, self._engine, self._drain_timeout = app, engine, drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_started = False

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:
        # uvicorn would re-raise the signal after shutting down (exit -15);
        # a drained shutdown exits 0, so the signal is not recorded.
        if self._drain_started or self._loop is None:
            self.should_exit = True
            self.force_exit = self._drain_started
            return
        self._drain_started = True
        logger.info("received %s: draining (up to %.0f s)", signal.Signals(sig).name, self._drain_timeout)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        self._app.state.server.draining = True
        self._engine.stop_accepting()
        if not await self._engine.wait_idle(self._drain_timeout):
            logger.warning("drain timeout: %d requests still running are aborted", self._engine.num_in_flight)
            # Before uvicorn stops: its own graceful limit would cancel the handlers mid-response
            # (streams cut without [DONE], bare 500s) while the engine went on generating.
            if not await self._engine.abort_in_flight(timeout=_ABORT_GRACE_S):
                logger.warning("%d requests did not finish their responses after the abort",
                               self._engine.num_in_flight)
        self.should_exit = True


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from fp8serve.engine.async_engine import AsyncLLMEngine
    from fp8serve.entrypoints.openai.api_server import build_app

    if args.model_flag is not None and args.model is not None and args.model_flag != args.model:
        raise UserError(f"two models given: MODEL '{args.model}' and --model '{args.model_flag}'; give one")
    model = args.model_flag or args.model
    # Checked before the model loads: a bad flag should not cost a load.
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {args.port}")
    if not (math.isfinite(args.shutdown_timeout) and args.shutdown_timeout >= 0):
        raise UserError(f"--shutdown-timeout must be a finite number of seconds >= 0, got {args.shutdown_timeout}")
    if not (math.isfinite(args.stall_timeout) and args.stall_timeout > 0):
        raise UserError(f"--stall-timeout must be a finite number of seconds > 0, got {args.stall_timeout}")
    try:
        max_body = parse_size(args.max_request_body_size)
    except ValueError as e:
        raise UserError(f"--max-request-body-size: {e}") from None
    if max_body < 1:
        raise UserError(f"--max-request-body-size must be at least 1 byte, got {args.max_request_body_size!r}")
    names = args.served_model_name or [model or DEFAULT_MODEL_NAME]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated or not all(n.strip() for n in names):
        what = f"{', '.join(map(repr, repeated))} given twice" if repeated else "an empty name"
        raise UserError(f"--served-model-name: {what}; give distinct, non-empty names")
    chat_template = load_chat_template(args.chat_template) if args.chat_template is not None else None
    engine = AsyncLLMEngine.from_args(model, stall_timeout=args.stall_timeout, log_stats=not args.disable_log_stats,
                                      **engine_kwargs(args))
    app = build_app(engine, names, api_key=args.api_key, max_body_bytes=max_body, chat_template=chat_template)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=5, access_log=False)
    server = _draining_server_class()(config, app, engine, args.shutdown_timeout)
    logger.info("serving %s at http://%s:%d (model name%s %s)", model or DEFAULT_MODEL_NAME, args.host, args.port,
                "s" if len(names) > 1 else "", ", ".join(f"'{n}'" for n in names))
    server.run()
    asyncio.run(engine.shutdown(drain_timeout=0))
    logger.info("server stopped")
    return 0
