"""A real gateway on a free loopback port, for tests and benchmarks of any area.

    from tests.gateway_server import running_gateway

    with running_gateway(backend="synthetic") as server:          # settings as keyword overrides
        ws_url = server.ws_url                                     # ws://127.0.0.1:PORT/v1/audio/speech/stream
        httpx.get(server.url + "/health")

    with running_gateway(backend=my_synthesizer, idle_timeout_s=1) as server: ...   # a Synthesizer instance

uvicorn runs in a background thread with its own event loop; the context manager waits until /ready
answers 200 (backend loaded and warm) and stops the server on exit. `server.app` and `server.gateway`
give access to the app's state (store, metrics) from the test; touch it only from the server's loop via
`server.call(coroutine_function, ...)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn

from bench.ports import free_port  # noqa: F401 - below the kernel's ephemeral ports (bench/ports.py)
from gateway.app import create_app
from gateway.cli import uvicorn_options
from gateway.settings import GatewaySettings
from tts_backend.base import Synthesizer
from tts_backend.synthetic import SyntheticSynthesizer


def wait_until_ready(url: str, timeout_s: float, startup_failure: Callable[[], str | None] = lambda: None,
                     path: str = "/ready") -> None:
    """Poll `url + path` until it answers 200. Raises RuntimeError as soon as `startup_failure()` gives a
    reason (the server died, its backend failed), TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        failure = startup_failure()
        if failure is not None:
            raise RuntimeError(failure)
        try:
            if httpx.get(url + path, timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}{path} did not answer 200 within {timeout_s} s")
        time.sleep(0.02)


@dataclass
class RunningGateway:
    url: str  # http://127.0.0.1:PORT
    app: Any
    settings: GatewaySettings
    server: uvicorn.Server
    loop: asyncio.AbstractEventLoop

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://", 1) + "/v1/audio/speech/stream"

    @property
    def gateway(self):
        return self.app.state.gateway

    def call(self, func, *args: Any, timeout: float = 10.0) -> Any:
        """Run `await func(*args)` on the server's event loop and return its result."""
        future: Future = asyncio.run_coroutine_threadsafe(func(*args), self.loop)
        return future.result(timeout)


@contextlib.contextmanager
def running_gateway(
    backend: str | Synthesizer = "synthetic",
    *,
    ready_timeout_s: float = 60.0,
    ready_path: str = "/ready",
    store: Any = None,
    authenticate: Any = None,
    reference_decoder: Any = None,
    **settings_overrides: Any,
) -> Iterator[RunningGateway]:
    """Start a gateway (settings = defaults + overrides; `backend` a name or a Synthesizer instance;
    `store` a SessionStore, `authenticate` an auth hook and `reference_decoder` a ReferenceDecoder, passed to
    create_app). It is entered once
    `ready_path` answers 200: "/health" to see the gateway before its backend is ready."""
    if isinstance(store, str):  # the settings' store kind ("memory", "redis"), not an instance
        settings_overrides["store"], store = store, None
    # The socket is bound here and handed to uvicorn: a port picked and released here could be taken by
    # another socket before uvicorn binds it.
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    instance = backend if isinstance(backend, Synthesizer) else None
    name = backend.name if instance is not None else backend
    settings = GatewaySettings(host="127.0.0.1", port=port, backend=name, log_level="warning", **settings_overrides)
    app = create_app(settings, backend=instance, store=store, authenticate=authenticate,
                     reference_decoder=reference_decoder)
    config = uvicorn.Config(app, lifespan="on", **uvicorn_options(settings))
    server = uvicorn.Server(config)
    loop_box: dict[str, asyncio.AbstractEventLoop] = {}

    def serve() -> None:
        loop = asyncio.new_event_loop()
        loop_box["loop"] = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(server.serve(sockets=[listener]))
        finally:
            loop.close()
            listener.close()

    thread = threading.Thread(target=serve, name=f"gateway-{port}", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"

    def startup_failure() -> str | None:
        if not thread.is_alive():
            return "the gateway server thread exited during startup"
        return app.state.gateway.failure

    try:
        wait_until_ready(url, ready_timeout_s, startup_failure, ready_path)
        yield RunningGateway(url=url, app=app, settings=settings, server=server, loop=loop_box["loop"])
    finally:
        server.should_exit = True
        thread.join(timeout=15)


# ------------------------------------------------------------------------------------- client helpers


async def receive_until(ws, *types: str, timeout: float = 20.0) -> list[Any]:
    """Messages from a `websockets` connection up to and including the first JSON one whose type is in
    `types`; JSON frames decoded to dicts, binary frames kept as bytes."""
    import json

    received: list[Any] = []
    deadline = time.monotonic() + timeout
    while True:
        frame = await asyncio.wait_for(ws.recv(), max(0.0, deadline - time.monotonic()))
        if isinstance(frame, bytes):
            received.append(frame)
            continue
        message = json.loads(frame)
        received.append(message)
        if message.get("type") in types:
            return received


async def open_session(url: str, config: dict[str, Any], **connect: Any) -> tuple[Any, dict[str, Any], int | None]:
    """Connect (`connect`: websockets.connect options) and send `config`: (the open connection,
    session.started, None), or, when the gateway refuses the session, (None, its error, the close code)."""
    import json

    import websockets

    ws = await websockets.connect(url, **connect)
    try:
        await ws.send(json.dumps(config))
    except websockets.ConnectionClosed:  # refused at once: the error is still there to read
        pass
    first = (await receive_until(ws, "session.started", "error"))[-1]
    if first["type"] == "session.started":
        return ws, first, None
    try:
        extra = await ws.recv()
    except websockets.ConnectionClosed as closed:
        return None, first, closed.rcvd.code
    raise AssertionError(f"the connection stayed open after refusing the session: {extra!r}")


async def speak_first_sentence(url: str, config: dict[str, Any], text: str, timeout_s: float,
                                cut: tuple[int, Callable[[str], Any]] | None = None) -> tuple[bytes, str]:
    """One session speaks `text` (input.text, input.done) to its end: the first sentence's audio and the session
    id. `cut` = (N, coroutine function): awaited with the session id once N binary frames have come."""
    import json

    ws, started, _ = await open_session(url, config)
    assert ws is not None, started
    await ws.send(json.dumps({"type": "input.text", "text": text}))
    await ws.send(json.dumps({"type": "input.done"}))
    messages, frames = [], 0
    while True:
        frame = await asyncio.wait_for(ws.recv(), timeout_s)
        if isinstance(frame, bytes):
            messages.append(frame)
            frames += 1
            if cut is not None and frames == cut[0]:
                await cut[1](started["session_id"])
            continue
        message = json.loads(frame)
        assert message["type"] != "error", message
        messages.append(message)
        if message["type"] == "session.done":
            break
    await ws.close()
    return audio_by_sentence(messages)[0], started["session_id"]


def audio_by_sentence(messages: list[Any]) -> dict[int, bytes]:
    """Binary frames grouped by the sentence whose audio.start precedes them."""
    audio: dict[int, bytearray] = {}
    current: int | None = None
    for message in messages:
        if isinstance(message, bytes):
            assert current is not None, "binary audio before any audio.start"
            audio[current] += message
        elif message.get("type") == "audio.start":
            current = message["sentence_index"]
            audio[current] = bytearray()
        elif message.get("type") == "audio.done":
            current = None
    return {index: bytes(data) for index, data in audio.items()}


# ------------------------------------------------------------------------------------- test backends


@dataclass
class StreamRecord:
    opened_with: str  # the request's text when it was opened (with a text stream, the start of it)
    started: float
    chunks: int = 0
    finished: float | None = None  # last chunk produced
    closed: float | None = None  # the consumer stopped early (cancel)
    chunk_times: list[float] | None = None
    request: Any = None  # the SynthesisRequest (its text stream, if any, holds the text as it grew)

    @property
    def text(self) -> str:
        """All of the request's text so far (a text stream's grows while the request runs)."""
        return self.request.full_text if self.request is not None else self.opened_with


class RecordingBackend(Synthesizer):
    """Wraps a backend and records, per request, when it started, each chunk it produced, and whether the
    consumer closed it early. `fail_on`: texts containing this substring raise SynthesisError."""

    def __init__(self, inner: Synthesizer, fail_on: str | None = None) -> None:
        self.inner = inner
        self.name = inner.name
        self.sample_rate = inner.sample_rate
        self.honours = inner.honours
        self.fail_on = fail_on
        self.records: list[StreamRecord] = []

    async def start(self) -> None:
        await self.inner.start()
        self.sample_rate = self.inner.sample_rate
        self.honours = self.inner.honours  # a backend may learn at start what it honours (Piper's timings)

    async def stop(self) -> None:
        await self.inner.stop()

    @property
    def ready(self) -> bool:
        return self.inner.ready

    def voices(self):
        return self.inner.voices()

    def has_voice(self, voice: str) -> bool:
        return self.inner.has_voice(voice)

    async def synthesize(self, request):
        from tts_backend.base import SynthesisError

        record = StreamRecord(request.text, time.monotonic(), chunk_times=[], request=request)
        self.records.append(record)
        if self.fail_on and self.fail_on in request.text:
            raise SynthesisError(f"refusing {request.text!r} on purpose")
        completed = False
        try:
            async for chunk in self.inner.synthesize(request):
                record.chunks += 1
                record.chunk_times.append(time.monotonic())
                yield chunk
            completed = True
            record.finished = time.monotonic()
        finally:
            if not completed:
                record.closed = time.monotonic()


class HeldSynthesizer(SyntheticSynthesizer):
    """Synthetic audio, except that a sentence containing HOLD is made only once the test releases it."""

    def __init__(self) -> None:
        super().__init__()
        self.released = threading.Event()
        self.resumed = threading.Event()  # the held sentence is being made

    async def synthesize(self, request):
        if "HOLD" in request.text:
            await asyncio.to_thread(self.released.wait, 60)  # the wait ends early only if a test fails
            self.resumed.set()
        async for chunk in super().synthesize(request):
            yield chunk
