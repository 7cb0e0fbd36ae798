"""The FastAPI application factory: routes, lifespan (backend and store start/stop), per-app state.

Everything mutable belongs to one `Gateway` object per app (gateway/gateway.py: backend, store, metrics,
admission), so tests and embedders can run several apps in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tts_backend.base import Synthesizer
from tts_backend.registry import create_backend

from .auth import AuthError, Authenticator, api_key_authenticator, authorization_scheme
from .http.routes import ApiError, router
from .limits import Admission
from .metrics import GatewayMetrics
from .nari_speech import NARI_PATH, NARI_PROTOCOL, NariSocket, offers_protocol
from .protocol import CloseCode, ErrorCode, ProtocolError
from .audio.decoder import ReferenceDecoder
from .http.cors import Cors
from .http.guard import RequestGuard
from .session.connection import StreamingSession
from .settings import GatewaySettings
from .gateway import Gateway
from .store.base import SessionStore
from .store.factory import create_store
from .pronunciation.registry import PronunciationRegistry
from .voices import VoiceRegistry
from .http.static import mount_web_demo
from .http.unserved import is_json_media_type, unserved

log = logging.getLogger("voxgate")

STREAM_PATHS = ("/v1/audio/speech/stream", "/v1/tts/stream")


def backend_options(settings: GatewaySettings) -> dict[str, Any]:
    """Constructor options for the configured backend: --model and --device plus backend_options."""
    options: dict[str, Any] = {}
    if settings.model is not None:
        options["model"] = settings.model
    if settings.device is not None:
        options["device"] = settings.device
    options.update(settings.backend_options)
    return options


async def _refuse(websocket: WebSocket | NariSocket, error: ProtocolError, metrics: GatewayMetrics) -> None:
    """Tell a connection why it is refused and close it. A client that reads nothing is dropped by the
    WebSocket protocol's write deadline (gateway.limits), which ends these writes."""
    metrics.errors_total.labels(error.code.value).inc()
    with contextlib.suppress(WebSocketDisconnect):
        await websocket.send_text(error.to_message().encode())
        await websocket.close(int(error.close or CloseCode.policy), reason=error.code.value)


def add_docs_pages(app: FastAPI) -> None:
    """/docs and /redoc, whose pages fetch /openapi.json with their own query string (a browser can
    only pass the key as ?api_key=)."""

    def schema_url(request: Request) -> str:
        query = request.url.query
        return "/openapi.json" + (f"?{query}" if query else "")

    @app.get("/docs", include_in_schema=False)
    async def swagger(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=schema_url(request), title=f"{app.title} - API")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        return get_redoc_html(openapi_url=schema_url(request), title=f"{app.title} - API")


def create_app(
    settings: GatewaySettings | None = None,
    backend: Synthesizer | None = None,
    *,
    store: SessionStore | None = None,
    authenticate: Authenticator | None = None,
    freeze_gc_when_ready: bool = False,
    reference_decoder: ReferenceDecoder | None = None,
) -> FastAPI:
    """A gateway app. `backend` defaults to the one `settings.backend` names (created, started and
    stopped by the app's lifespan); `authenticate` is the auth hook (default: API keys from settings).
    `freeze_gc_when_ready`: once the backend is up, move every object alive then out of the cyclic
    collector's reach (`gc.freeze`); for a process that is the server (`voxgate serve` sets it), not for an
    app embedded in a larger one. `reference_decoder`: the processes that decode reference clips (default:
    gateway/audio/decoder.py's, started when first needed)."""
    settings = settings or GatewaySettings()
    if backend is None:
        backend = create_backend(settings.backend, **backend_options(settings))
    if store is None:
        store = create_store(
            settings.store,
            ttl_s=settings.session_ttl_s,
            replay_log_bytes=settings.replay_log_bytes,
            redis_url=settings.redis_url,
            replay_log_s=settings.replay_log_s,
            key_prefix=settings.redis_key_prefix,
            redis_cluster=settings.redis_cluster,
            lease_s=settings.session_lease_s,
        )
    admission = Admission(settings, backend)
    gateway = Gateway(
        settings=settings,
        backend=backend,
        store=store,
        metrics=GatewayMetrics(),
        authenticate=authenticate or api_key_authenticator(settings),
        admission=admission,
        voices=VoiceRegistry(backend, store, settings, admission, reference_decoder),
        pronunciations=PronunciationRegistry(store),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            await gateway.store.start()
        except Exception as exc:  # noqa: BLE001 - reported in one line (/health, voxgate serve's exit), not a traceback
            gateway.store_error = exc
            log.error("%s", gateway.failure)
            yield
            return
        await gateway.admission.start()
        # The backend loads in the background: /health answers at once, /ready once it is warm (and the
        # operator's shared voices are cloned).
        async def start_backend() -> None:
            await gateway.backend.start()
            if settings.shared_voices_dir:
                try:
                    await gateway.voices.load_shared(settings.shared_voices_dir)
                except (OSError, ValueError, ProtocolError) as exc:
                    raise RuntimeError(f"--shared-voices-dir: {exc}") from None
                finally:
                    gateway.shared_voices_pending = False

        gateway.shared_voices_pending = bool(settings.shared_voices_dir)

        starting_at = time.monotonic()
        starting = asyncio.create_task(start_backend(), name="backend-start")
        lag_watch = asyncio.create_task(gateway.metrics.watch_loop_lag(), name="loop-lag")

        def started(task: asyncio.Task) -> None:
            if task.cancelled():
                return
            if task.exception() is not None:
                gateway.backend_error = task.exception()
            else:
                gateway.check_default_voice()
            if gateway.backend_error is not None:
                log.error("%s", gateway.failure)
                return
            if freeze_gc_when_ready:
                # A full collection scans every tracked object; with the model, torch and the tokenizer
                # loaded that is millions, and each pause stops the event loop (and an in-process engine
                # thread) for hundreds of ms: under load, late audio and slow handshakes. What exists now
                # lives as long as the process, so collect once and freeze it.
                gc.collect()
                gc.freeze()
                log.info("froze %d start-up objects out of the cyclic garbage collector", gc.get_freeze_count())
            # The one line that says sessions are served now (/ready answers 200); never after a failure.
            log.info("ready (%s, voice %s) in %.1f s", gateway.backend.name, gateway.default_voice,
                     time.monotonic() - starting_at)

        starting.add_done_callback(started)
        try:
            yield
        finally:
            gateway.draining = True
            if not starting.done():
                starting.cancel()
            lag_watch.cancel()
            await asyncio.gather(starting, lag_watch, return_exceptions=True)
            await gateway.backend.stop()
            await gateway.voices.stop()
            await gateway.admission.stop()
            await gateway.store.stop()

    # The API docs are off unless asked for; with keys set, the key guards them (RequestGuard).
    app = FastAPI(title="Voxgate", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json" if settings.api_docs else None)
    app.state.gateway = gateway
    app.include_router(router)
    app.add_middleware(RequestGuard, gateway=gateway)
    app.add_middleware(Cors, settings=settings)  # outermost: a preflight is answered before the guard's key check
    if settings.api_docs:
        add_docs_pages(app)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        """Every error answered to an HTTP request before its response started is counted here."""
        gateway.metrics.errors_total.labels(exc.code.value).inc()
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """No route serves the path (404), or not with the method (405): said in the API's error shape."""
        if exc.status_code in (404, 405):
            return await api_error(request, unserved(request))
        return await http_exception_handler(request, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e["type"] == "json_invalid" for e in errors):
            reasons = "; ".join(str(e.get("ctx", {}).get("error", e["msg"])) for e in errors)
            return await api_error(request, ApiError(ErrorCode.invalid_json, f"the body is not valid JSON: {reasons}"))
        content_type = request.headers.get("content-type", "")
        if any(tuple(e["loc"]) == ("body",) for e in errors) and not is_json_media_type(content_type):
            # FastAPI reads a body as JSON only when it says so; curl's -d says form data.
            return await api_error(request, ApiError(
                ErrorCode.invalid_message,
                "the body must be JSON, sent with Content-Type: application/json (this request's Content-Type is"
                f" {content_type!r}; with curl: -H 'Content-Type: application/json')" if content_type else
                "the body must be JSON, sent with Content-Type: application/json (this request has none)",
            ))
        details = "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body')}: {e['msg']}" for e in errors)
        return await api_error(request, ApiError(ErrorCode.invalid_message, f"invalid request: {details}"))

    async def speech_stream(websocket: WebSocket) -> None:
        await serve_session(websocket, websocket)

    async def nari_speech_stream(websocket: WebSocket) -> None:
        """Nari Labs' live-text protocol (gateway/nari_speech.py), on the same sessions."""
        if not offers_protocol(websocket):
            await websocket.accept()
            await websocket.close(1002, reason=f"required subprotocol: {NARI_PROTOCOL}")
            return
        await serve_session(websocket, NariSocket(websocket, max_event_bytes=settings.max_config_bytes))

    async def serve_session(websocket: WebSocket, socket: WebSocket | NariSocket) -> None:
        """Authenticate `websocket`, admit it and run a session on `socket`: the same WebSocket, or one that
        speaks another protocol over it."""
        try:
            principal = await gateway.authenticate(websocket)
        except AuthError as exc:
            error = ProtocolError(ErrorCode.unauthorized, str(exc), close=CloseCode.policy)
            if authorization_scheme(websocket) == "api-key":
                # Baseten-style clients (LiveKit's Baseten plugin) retry anything that fails after the
                # upgrade and stop only on a 4xx answer to it, so they are refused there, as Baseten does.
                # Others get the protocol's error on an accepted socket: browsers cannot read the status.
                gateway.metrics.errors_total.labels(error.code.value).inc()
                await websocket.send_denial_response(JSONResponse(error.to_message().model_dump(exclude_none=True), 401))
                return
            await socket.accept()
            await _refuse(socket, error, gateway.metrics)
            return
        await socket.accept()
        if not gateway.ready:
            reason = ("the gateway is shutting down" if gateway.draining
                      else gateway.failure or "the speech backend is not ready")
            await _refuse(
                socket,
                ProtocolError(ErrorCode.overloaded, f"{reason}; retry shortly", close=CloseCode.try_again_later),
                gateway.metrics,
            )
            return
        try:
            async with gateway.admission.session(principal) as claim:
                session = StreamingSession(
                    socket,
                    settings=settings,
                    backend=gateway.backend,
                    store=gateway.store,
                    metrics=gateway.metrics,
                    admission=gateway.admission,
                    admission_claim=claim,
                    principal=principal,
                    voices=gateway.voices,
                    pronunciations=gateway.pronunciations,
                )
                gateway.sessions.add(session)
                try:
                    await session.run()
                finally:
                    gateway.sessions.discard(session)
        except ProtocolError as error:
            await _refuse(socket, error, gateway.metrics)

    for path in STREAM_PATHS:
        app.add_api_websocket_route(path, speech_stream)
    app.add_api_websocket_route(NARI_PATH, nari_speech_stream)
    mount_web_demo(app)  # last: its catch-all "/" must not shadow the API
    return app
