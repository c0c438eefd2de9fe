"""The OpenAI-compatible HTTP app: routes, errors, auth, body limit, draining.

`build_app` takes a running `AsyncLLMEngine`; everything the app holds lives
on the app (no module state), so several apps can live in one process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fp8serve.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineDrainingError
from fp8serve.entrypoints.openai.metrics import ServerMetrics
from fp8serve.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, check_request_text, error_body,
)
from fp8serve.entrypoints.openai.serving_chat import ChatServer
from fp8serve.entrypoints.openai.serving_common import RequestError, run_unless_disconnected, sse
from fp8serve.entrypoints.openai.serving_completion import CompletionServer
from fp8serve.entrypoints.openai.serve import DEFAULT_MAX_BODY_BYTES
from fp8serve.errors import UserError

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    model_name: str
    metrics: ServerMetrics
    api_key: str | None = None
    # --chat-template: used where a chat request names none (None: the tokenizer's).
    chat_template: str | None = None
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    # Tokenization and chat templates run here, off the event loop: a prompt
    # of megabytes takes seconds to tokenize, and every other request (and
    # /health) would wait on it. One worker, as in vLLM, so the tokenizer is
    # never entered by two requests at once (the tokenizers library releases
    # the GIL while it encodes, so the loop keeps serving meanwhile).
    tokenizer_executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp8serve-tokenizer"))

    async def off_loop(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_executor, fn)


def _error(message: str, status: int, err_type: str = "BadRequestError", param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, status, param), status_code=status)


def _from_exception(e: Exception) -> JSONResponse:
    if isinstance(e, RequestError):
        return _error(str(e), e.status, e.err_type, e.param)
    if isinstance(e, (UserError, ValueError)):
        return _error(str(e), 400, param=getattr(e, "parameter", None))
    if isinstance(e, EngineDrainingError):
        return _error(str(e), 503, "ServiceUnavailableError")
    if isinstance(e, EngineDeadError):
        return _error(str(e), 500, "InternalServerError")
    logger.exception("request failed")
    return _error(f"internal error: {type(e).__name__}: {e}", 500, "InternalServerError")


class _GuardMiddleware:
    """Pure ASGI (so streaming is untouched): 503 while draining, 401 without
    the API key on /v1/*, 413 for bodies over the limit."""

    def __init__(self, app, state: ServerState, max_body_bytes: int) -> None:
        self.app, self.state, self.max_body_bytes = app, state, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self.state.draining and path.startswith("/v1/") and scope["method"] == "POST":
            return await _error("the server is shutting down", 503, "ServiceUnavailableError")(scope, receive, send)
        if self.state.api_key is not None and path.startswith("/v1/"):
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if auth != f"Bearer {self.state.api_key}":
                return await _error("invalid or missing API key", 401, "AuthenticationError")(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await self._too_large(scope, receive, send)
        # Read the whole body here (it is bounded by the limit), so an oversized
        # chunked body is refused before the app parses any of it.
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away while sending
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await self._too_large(scope, receive, send)
        replayed = False

        async def replay_receive():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay_receive, send)

    async def _too_large(self, scope, receive, send):
        await _error(f"request body exceeds {self.max_body_bytes} bytes", 413, "RequestTooLargeError")(
            scope, receive, send)


def build_app(engine: AsyncLLMEngine, served_model_name: str | list[str], api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, chat_template: str | None = None) -> FastAPI:
    # vLLM's --served-model-name NAME...: a request may name any; the first is the metrics' label
    # and the name of a response to a request that names none.
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"served model names must be distinct and at least one, got {names}")
    served_model_name = names[0]
    state = ServerState(engine, served_model_name, ServerMetrics(engine, served_model_name), api_key,
                        chat_template=chat_template)
    completions, chat = CompletionServer(state), ChatServer(state)
    app = FastAPI(title="fp8serve OpenAI-compatible server")
    app.state.server = state
    app.add_middleware(_GuardMiddleware, state=state, max_body_bytes=max_body_bytes)

    _STATUS_TYPES = {404: "NotFoundError", 405: "MethodNotAllowedError"}

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # Unknown routes, wrong methods, bodies FastAPI cannot parse: the same
        # error shape as every other failure, not FastAPI's {"detail": ...}.
        return _error(str(exc.detail), exc.status_code, _STATUS_TYPES.get(exc.status_code, "BadRequestError"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        if errors and errors[0].get("type") == "json_invalid":
            return _error(f"malformed JSON body: {errors[0].get('ctx', {}).get('error', '')}", 400)
        # An error about the body as a whole (a JSON array, a string) has no field to name.
        parts = [f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'request body'}: {e.get('msg')}"
                 for e in errors]
        # The request's own field (`stop`), not the last step of pydantic's
        # path into a union (`stop.list[str].1` would say `1`).
        fields = [x for e in errors for x in e.get("loc", ()) if x != "body"]
        param = str(fields[0]) if fields else None
        return _error("; ".join(parts) or "invalid request", 400, param=param)

    def check_model(name: str | None) -> None:
        if name is not None and name not in names:
            raise RequestError(f"The model `{name}` does not exist.", 404, "NotFoundError", "model")

    async def respond(request: Request, body, server) -> Response:
        try:
            check_model(body.model)

            def prepare():
                check_request_text(body)
                return server.prepare(body)

            prepared = await state.off_loop(prepare)
            if body.stream:
                return StreamingResponse(_guard_stream(server.stream(body, prepared)),
                                         media_type="text/event-stream")
            result = await run_unless_disconnected(request, server.complete(body, prepared))
            if result is None:  # the client went away; nobody reads this
                return Response(status_code=499)
            return JSONResponse(result)
        except Exception as e:  # noqa: BLE001 - a failed request must never take the server down
            return _from_exception(e)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        return await respond(request, body, completions)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        return await respond(request, body, chat)

    @app.get("/v1/models")
    async def list_models():
        mc = engine.config.model_config
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": state.created, "owned_by": "fp8serve",
            "root": mc.model, "parent": None, "max_model_len": mc.max_model_len} for name in names]}

    @app.get("/health")
    async def health():
        if state.draining:
            return Response(status_code=503, content="draining")
        return Response(status_code=200 if engine.is_healthy() else 503)

    # vLLM's /ping (the SageMaker health check, GET or POST): /health's answer.
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/version")
    async def version():
        from fp8serve import __version__

        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        try:
            check_model(body.model)
            tok = engine.tokenizer
            if tok is None:
                raise RequestError("this model has no tokenizer")

            def token_ids() -> list[int]:
                check_request_text(body)
                if body.messages is not None:
                    return chat.apply_chat_template(body)
                return tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)

            ids = await state.off_loop(token_ids)
            # vLLM's response: token_strs null unless asked for.
            strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
            return {"count": len(ids), "max_model_len": engine.config.model_config.max_model_len, "tokens": ids,
                    "token_strs": strs}
        except Exception as e:  # noqa: BLE001
            return _from_exception(e)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        try:
            check_model(body.model)
            vocab = engine.config.model_config.arch.vocab_size
            bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"token id {bad} is out of range for a vocabulary of {vocab}", param="tokens")
            return {"prompt": engine.tokenizer.decode(body.tokens)}
        except Exception as e:  # noqa: BLE001
            return _from_exception(e)

    return app


async def _guard_stream(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once a stream has started, an error can only be reported in-band."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as e:  # noqa: BLE001
        body = json.loads(_from_exception(e).body)
        yield sse(body)
        yield sse("[DONE]")
