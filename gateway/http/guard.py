"""What every HTTP request passes before the app reads its body: the key, the body's size, its deadline.

FastAPI reads a whole request body before it runs a route's dependencies, so on its own a client without
a key could send hundreds of megabytes, or one byte every few seconds, before hearing 401. Here, as an
ASGI middleware in front of the routes:
- API routes (`/v1/...`) and the API docs (when keys are set) are authenticated from the request's
  headers and query alone; a refusal (401) is answered before a byte of the body is read;
- a `Content-Length` over `max_http_body_bytes` (for a voice upload, POST /v1/audio/voices: what a
  reference clip of `max_reference_audio_bytes` takes, if more) is refused (413, `message_too_large`) at once, and a body
  without one (chunked) as soon as what has arrived passes the limit;
- the whole body must arrive within `http_body_timeout_s` of the request (408, `request_timeout`).
A refusal closes the connection (`Connection: close`): the rest of the body is never read.
"""

from __future__ import annotations

import asyncio

from starlette.datastructures import Headers
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..auth import PRINCIPAL_SCOPE_KEY, AuthError
from ..gateway import Gateway
from ..protocol import ErrorCode
from .routes import ApiError

VOICE_UPLOAD_PATH = "/v1/audio/voices"
UPLOAD_FIELDS_BYTES = 64 * 1024  # a voice upload's fields besides the clip, and multipart's boundaries
DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


class _Refused(Exception):
    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


class _GuardedBody:
    """The request's `receive`, counting body bytes against the limit and the deadline. Once the body
    is complete it passes through unchanged (a streaming response waits on it for the disconnect)."""

    def __init__(self, receive: Receive, limit: int, timeout_s: float) -> None:
        self._receive = receive
        self._limit = limit
        self._timeout_s = timeout_s
        self._deadline = asyncio.get_running_loop().time() + timeout_s
        self._received = 0
        self._complete = False
        self.refusal: ApiError | None = None

    async def __call__(self) -> Message:
        if self._complete:
            return await self._receive()
        if self.refusal is not None:
            raise _Refused(self.refusal)
        remaining = self._deadline - asyncio.get_running_loop().time()
        try:
            message = await asyncio.wait_for(self._receive(), max(0.0, remaining))
        except asyncio.TimeoutError:
            self._refuse(ApiError(
                ErrorCode.request_timeout,
                f"the request body did not arrive within {self._timeout_s:g} s", status=408,
            ))
        if message["type"] == "http.request":
            self._received += len(message.get("body", b""))
            if self._received > self._limit:
                self._refuse(_too_large(self._limit))
            self._complete = not message.get("more_body", False)
        else:
            self._complete = True  # http.disconnect: nothing more will come
        return message

    def _refuse(self, error: ApiError) -> None:
        self.refusal = error
        raise _Refused(error)


def _too_large(limit: int) -> ApiError:
    return ApiError(ErrorCode.message_too_large, f"the request body exceeds the {limit}-byte limit")


class RequestGuard:
    """The ASGI middleware (see the module's docstring)."""

    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway

    def _needs_key(self, path: str) -> bool:
        return path.startswith("/v1/") or (path in DOCS_PATHS and bool(self.gateway.settings.api_keys))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        settings = self.gateway.settings
        if self._needs_key(scope["path"]):
            try:
                scope[PRINCIPAL_SCOPE_KEY] = await self.gateway.authenticate(HTTPConnection(scope))
            except AuthError as exc:
                await self._answer(ApiError(ErrorCode.unauthorized, str(exc)), scope, send)
                return
        limit = settings.max_http_body_bytes
        if scope["path"] == VOICE_UPLOAD_PATH and scope["method"] == "POST":
            # A reference clip, in base64 (4/3 of its size) or a multipart file, and a few small fields.
            limit = max(limit, settings.max_reference_audio_bytes * 4 // 3 + UPLOAD_FIELDS_BYTES)
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._answer(_too_large(limit), scope, send)
            return

        body = _GuardedBody(receive, limit, settings.http_body_timeout_s)
        started = False

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if body.refusal is not None:
                return  # the app's own answer to the failed read (FastAPI: 400); ours goes out instead
            started = True
            await send(message)

        try:
            await self.app(scope, body, guarded_send)
        except _Refused:
            pass
        if body.refusal is not None and not started:
            await self._answer(body.refusal, scope, send)

    async def _answer(self, error: ApiError, scope: Scope, send: Send) -> None:
        """The refusal, closing the connection: uvicorn closes a response that says `Connection: close`
        without reading what is left of the body."""
        self.gateway.metrics.errors_total.labels(error.code.value).inc()
        response = error.response()
        response.headers["Connection"] = "close"
        await response(scope, _no_body, send)


async def _no_body() -> Message:
    return {"type": "http.disconnect"}
