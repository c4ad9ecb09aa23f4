"""The HTTP surface: OpenAI's completions and chat completions (plain and streamed), models, health, metrics.

Handlers only parse, submit to the scheduler and format; the scheduler's worker thread does all model work and
tokenising runs in a thread pool, so the event loop stays free to accept, reject (429) and stream. Any error a
client causes is answered with an OpenAI-style 4xx body and the server carries on; a bug in one request is a 500
for that request only, whose body names no file and quotes no exception (those go to the server's log).

A server on a laptop must not be drivable by web pages the user visits: a POST must say it is JSON (a form or
`text/plain` post, which browsers send cross-site without asking, gets 415), the Host header must name the address
the server is bound to (a DNS-rebinding page's Host is its own domain: 421), and with an API key every /v1 route
wants `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from draftsmith.serve.metrics import ServerMetrics
from draftsmith.serve.protocol import APIError, ChatRequest, CompletionRequest, parse, to_generation
from draftsmith.serve.scheduler import INTERNAL_ERROR, Job, Overloaded, Scheduler, WorkerDead
from draftsmith.serve.throttle import ErrorScore, ThrottleRefusals
from draftsmith.target import Target

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


@dataclass
class ServerState:
    target: Target
    scheduler: Scheduler
    metrics: ServerMetrics
    model_name: str
    default_max_tokens: int = 256
    max_body_bytes: int = 1 << 20
    body_timeout: float = 30.0  # seconds to send the whole body; a client trickling it gets 408
    allowed_hosts: frozenset[str] | None = None  # Host header names accepted (None: any, a wildcard bind)
    api_key: str | None = None  # when set, every /v1 route wants `Authorization: Bearer <api_key>`
    on_ready: Callable[[], None] | None = None  # called once the scheduler runs (prints the "ready" line)
    refusals: ErrorScore = field(default_factory=ErrorScore)  # how long a client's next 4xx answer is held back
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.scheduler.start()
        if state.on_ready:
            state.on_ready()
        yield
        state.scheduler.stop()

    app = FastAPI(title="draftsmith", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Guard, allowed_hosts=state.allowed_hosts, api_key=state.api_key)
    app.add_middleware(_CountResponses, metrics=state.metrics)
    app.add_middleware(ThrottleRefusals, scores=state.refusals)  # outermost: it holds back every 4xx, the guard's too

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(APIError(exc.status_code, message, code=code).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        traceback.print_exception(exc, file=sys.stderr)
        path = request.url.path if request.url.path in ROUTES else "other"
        with state.metrics.update():  # Starlette answers bugs outside the counting middleware: count them here
            state.metrics.http_requests.inc(path=path, code="500")
        body = APIError(500, INTERNAL_ERROR, kind="server_error").body()
        return JSONResponse(body, status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        active, queued = state.scheduler.load()
        alive = state.scheduler.alive()
        body = {"status": "ok" if alive else "error", "worker": "alive" if alive else "dead", "model": state.model_name,
                "active": active, "queued": queued}  # fmt: skip
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "draftsmith",
            "max_model_len": state.target.context_length,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await _read_json(request, state.max_body_bytes, state.body_timeout))
        return await _generate(request, req, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatRequest, await _read_json(request, state.max_body_bytes, state.body_timeout))
        return await _generate(request, req, "chat.completion")

    async def _generate(request: Request, req: CompletionRequest | ChatRequest, kind: str):
        if req.model is not None and req.model != state.model_name:
            raise APIError(
                404,
                f"model {req.model!r} does not exist; this server serves {state.model_name!r}",
                param="model",
                code="model_not_found",
            )
        try:
            state.scheduler.check_capacity()  # a flood is refused before anything is tokenised
            gen_req = await asyncio.to_thread(to_generation, req, state.target, state.default_max_tokens)
            job = state.scheduler.submit(gen_req)
        except Overloaded as exc:
            raise APIError(
                429,
                f"{exc}; retry after {exc.retry_after} s",
                code="overloaded",
                kind="rate_limit_error",
                headers={"Retry-After": str(exc.retry_after)},
            ) from None
        except WorkerDead:
            raise APIError(503, "the decoding worker has stopped; restart the server", kind="server_error") from None
        reply = _Reply(kind, state.model_name, job)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _SSEResponse(reply.stream(include_usage), on_close=lambda: state.scheduler.cancel(job))
        try:
            return await reply.whole(request)
        finally:
            state.scheduler.cancel(job)  # a no-op once the answer is complete; frees the slot if the client left

    return app


class _Reply:
    """One answer in OpenAI's format, whole or as server-sent events, built from the job's events."""

    def __init__(self, kind: str, model: str, job: Job) -> None:
        self.kind, self.model, self.job = kind, model, job
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]], usage: dict | None = None) -> dict[str, Any]:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def _usage(self) -> dict[str, int]:
        u = self.job.usage
        total = u.prompt_tokens + u.completion_tokens
        return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": total}

    def _choice(self, text: str | None, finish_reason: str | None, *, delta: bool, role: bool = False) -> dict:
        if self.kind == "text_completion":
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        if not delta:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
        content: dict[str, str] = {"role": "assistant"} if role else {}
        if text is not None:
            content["content"] = text
        return {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish_reason}

    async def whole(self, request: Request, poll: float = 0.5) -> dict[str, Any]:
        """The whole answer; every `poll` seconds (events or not) checks that the client is still there."""
        parts: list[str] = []
        checked = time.monotonic()
        while True:
            try:
                event = await asyncio.wait_for(self.job.events.get(), timeout=poll)
            except TimeoutError:
                event = None
            if time.monotonic() - checked >= poll:
                checked = time.monotonic()
                if await request.is_disconnected():
                    raise _ClientGone()
            if event is None:
                continue
            if event.error:
                raise APIError(500, f"generation failed: {event.error}", kind="server_error")  # no exception text
            parts.append(event.text)
            if event.finish_reason:
                choice = self._choice("".join(parts), event.finish_reason, delta=False)
                return self._envelope(self.kind, [choice], self._usage())

    async def stream(self, include_usage: bool) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if self.kind == "chat.completion" else "text_completion"
        if self.kind == "chat.completion":
            yield _sse(self._envelope(obj, [self._choice("", None, delta=True, role=True)]))
        while True:
            event = await self.job.events.get()
            if event.error:
                yield _sse(APIError(500, f"generation failed: {event.error}", kind="server_error").body())
                break
            if event.text:
                yield _sse(self._envelope(obj, [self._choice(event.text, None, delta=True)]))
            if event.finish_reason:
                yield _sse(self._envelope(obj, [self._choice(None, event.finish_reason, delta=True)]))
                if include_usage:
                    yield _sse(self._envelope(obj, [], self._usage()))
                break
        yield "data: [DONE]\n\n"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _ClientGone(Exception):
    """The client of a non-streaming request disconnected; there is nobody to answer."""


class _SSEResponse(StreamingResponse):
    """A text/event-stream response that runs `on_close` however it ends (done, error, or client gone)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _read_json(request: Request, limit: int, timeout: float) -> Any:
    """The body as JSON: it must say it is JSON, hold at most `limit` bytes (refused before reading them all) and
    arrive within `timeout` seconds; nesting too deep to parse is a 400 like any other bad JSON."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise APIError(
            415, f"Content-Type must be application/json, found {media_type or 'none'!r}", code="unsupported_media_type"
        )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {declared} bytes; the limit is {limit}", code="body_too_large")

    async def read() -> bytearray:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"the request body exceeds {limit} bytes", code="body_too_large")
        return body

    try:
        body = await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="body_timeout") from None
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    if b"\\u" in body.lower() and _has_lone_surrogate(payload):  # only an escape can make one
        raise APIError(
            400, "the request body holds a lone UTF-16 surrogate (\\ud800-\\udfff), not text", code="invalid_json"
        )
    return payload


def _has_lone_surrogate(payload: Any) -> bool:
    try:
        json.dumps(payload, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    return False


class _Guard:
    """ASGI middleware: the Host header must be one this server is bound to (DNS rebinding: 421), and with an API
    key every /v1 route wants it as a Bearer token (401)."""

    def __init__(self, app: ASGIApp, allowed_hosts: frozenset[str] | None, api_key: str | None) -> None:
        self.app, self.allowed_hosts, self.api_key = app, allowed_hosts, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.allowed_hosts is not None and host_name(headers.get("host", "")) not in self.allowed_hosts:
            error = APIError(421, "the Host header does not name this server", code="misdirected_request")
        elif self.api_key is not None and scope["path"].startswith("/v1") and not self._authorised(headers):
            error = APIError(401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key",
                             kind="authentication_error", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        else:
            await self.app(scope, receive, send)
            return
        await JSONResponse(error.body(), status_code=error.status, headers=error.headers)(scope, receive, send)

    def _authorised(self, headers: dict[str, str]) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.api_key.encode())


def host_name(host: str) -> str:
    """The name part of a Host header: `[::1]:8000` -> `::1`, `localhost:8000` -> `localhost`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class _CountResponses:
    """ASGI middleware counting responses by path and status (a plain wrapper, so streams and disconnects pass
    through untouched, unlike Starlette's BaseHTTPMiddleware)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in ROUTES else "other"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                with self.metrics.update():
                    self.metrics.http_requests.inc(path=path, code=str(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except _ClientGone:
            with self.metrics.update():
                self.metrics.http_requests.inc(path=path, code="499")  # nginx's "client closed request"
