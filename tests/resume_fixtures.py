"""Real `voxgate serve` processes sharing a Redis, and a raw WebSocket listener that keeps its resume
position, for the resume, failover and drain tests (and bench/failover.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import websockets

VOICE = "tone-mid"
# 8x faster than real time in 40 ms chunks: a 50-character sentence takes ~0.4 s to stream, long enough
# to act in the middle of it.
PACED = ("-o", "speed=8", "-o", "chunk_ms=40")


# The startup line names the WebSocket: the port a process started with --port 0 bound (gateway/drain.py).
BOUND_PORT = re.compile(r"WebSocket ws://127\.0\.0\.1:(\d+)/")


@dataclass
class GatewayProcess:
    """A gateway in a process of its own. Started with --port 0 (a port picked here and bound there could be
    taken in between), it binds a free port itself; `port` is None until `wait_ready` has read it from the
    process's startup line."""

    port: int | None
    process: subprocess.Popen
    log_path: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/audio/speech/stream"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as handle:
            return handle.read()

    def kill(self) -> None:
        """SIGKILL: the replica dies without a word."""
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)


async def until_draining(gateway: GatewayProcess, timeout_s: float) -> None:
    """Until the gateway's /ready answers 503: it has taken the signal sent to it and begun to drain (its
    signal handler only sets a flag, which the server polls: on a loaded machine that takes a while, so a
    fixed pause before looking raced). `timeout_s`: the drain's length - a drain not begun by then never
    will."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5.0) as client:
        while (await client.get(gateway.url + "/ready")).status_code != 503:
            assert gateway.process.poll() is None, f"the gateway exited before draining:\n{gateway.log()}"
            assert time.monotonic() < deadline, f"no drain within {timeout_s} s of the signal:\n{gateway.log()}"
            await asyncio.sleep(0.02)


def start_process(command: list[str], env: dict[str, str] | None = None) -> GatewayProcess:
    """Run `command`, a gateway told --port 0 and a log level that shows its startup line (info or lower),
    its output in a temporary log file."""
    log = tempfile.NamedTemporaryFile(prefix="voxgate-", suffix=".log", delete=False)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    return GatewayProcess(None, process, log.name)


def start_gateway(redis_url: str, prefix: str, *extra: str) -> GatewayProcess:
    return start_process([
        sys.executable, "-m", "gateway.cli", "serve", "--port", "0", "--backend", "synthetic",
        "--store", "redis", "--redis-url", redis_url, "--redis-key-prefix", prefix, "--log-level", "info",
        *extra,
    ])


def wait_ready(*gateways: GatewayProcess, timeout_s: float = 30.0) -> None:
    """Until each gateway has said which port it bound and its /ready answers 200."""
    deadline = time.monotonic() + timeout_s
    for gateway in gateways:
        while True:
            if gateway.process.poll() is not None:
                raise RuntimeError(f"gateway process {gateway.process.pid} exited:\n{gateway.log()}")
            if gateway.port is None and (bound := BOUND_PORT.search(gateway.log())):
                gateway.port = int(bound.group(1))
            if gateway.port is not None:
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(gateway.url + "/ready", timeout=1.0).status_code == 200:
                        break
            if time.monotonic() > deadline:
                raise TimeoutError(f"gateway process {gateway.process.pid} not ready:\n{gateway.log()}")
            time.sleep(0.05)


@contextlib.contextmanager
def gateways(redis_url: str, prefix: str, count: int, *extra: str) -> Iterator[list[GatewayProcess]]:
    """`count` replicas (started in parallel) on one Redis key prefix; killed on exit."""
    running = [start_gateway(redis_url, prefix, *extra) for _ in range(count)]
    try:
        wait_ready(*running)
        yield running
    finally:
        for gateway in running:
            if gateway.process.poll() is None:
                gateway.kill()
            with contextlib.suppress(OSError):
                os.unlink(gateway.log_path)


@dataclass
class Listener:
    """What a client has received, across connections: audio per sentence, in order, and messages."""

    audio: dict[int, bytearray] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    open_sentence: int | None = None
    last_done: int = -1
    session_id: str | None = None
    first_audio_at: float | None = None  # monotonic time of the first audio byte on the current connection

    def feed(self, frame: str | bytes) -> dict[str, Any] | None:
        if isinstance(frame, bytes):
            assert self.open_sentence is not None, "audio outside audio.start/audio.done"
            if self.first_audio_at is None:
                self.first_audio_at = time.monotonic()
            self.audio[self.open_sentence] += frame
            return None
        message = json.loads(frame)
        self.messages.append(message)
        kind = message["type"]
        if kind == "session.started":
            self.session_id = message["session_id"]
        elif kind == "audio.start":
            self.open_sentence = message["sentence_index"]
            self.audio.setdefault(self.open_sentence, bytearray())
        elif kind == "audio.done":
            assert message["sentence_index"] == self.open_sentence
            assert message["total_bytes"] == len(self.audio[self.open_sentence]), message
            self.open_sentence = None
            self.last_done = max(self.last_done, message["sentence_index"])
        return message

    def position(self) -> tuple[int, int]:
        """(sentence_index, bytes_received): the first byte this client lacks."""
        if self.open_sentence is not None:
            return self.open_sentence, len(self.audio[self.open_sentence])
        return self.last_done + 1, 0

    def resume_message(self) -> str:
        index, received = self.position()
        return json.dumps(
            {"type": "session.resume", "session_id": self.session_id, "sentence_index": index, "bytes_received": received}
        )

    def pcm(self) -> bytes:
        return b"".join(bytes(self.audio[i]) for i in sorted(self.audio))

    async def receive(self, ws, until: str | tuple[str, ...], timeout: float = 30.0) -> dict[str, Any]:
        """Feed frames until a message of type `until` (returned)."""
        until = (until,) if isinstance(until, str) else until
        deadline = time.monotonic() + timeout
        while True:
            message = self.feed(await asyncio.wait_for(ws.recv(), max(0.01, deadline - time.monotonic())))
            if message is not None and message["type"] in until:
                return message

    async def receive_until_closed(self, ws, timeout: float = 30.0) -> websockets.ConnectionClosed:
        """Feed frames until the connection closes; returns how it closed."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                self.feed(await asyncio.wait_for(ws.recv(), max(0.01, deadline - time.monotonic())))
        except websockets.ConnectionClosed as closed:
            return closed


def config_message(**overrides: Any) -> str:
    return json.dumps({"type": "session.config", "voice": VOICE, "response_format": "pcm", "stream_audio": True, **overrides})


async def start_session(ws, listener: Listener, text: str, *, done: bool = True) -> None:
    await ws.send(config_message())
    await listener.receive(ws, "session.started")
    await ws.send(json.dumps({"type": "input.text", "text": text}))
    if done:
        await ws.send(json.dumps({"type": "input.done"}))


async def receive_into_sentence(ws, listener: Listener, index: int, min_bytes: int = 4 * 1920) -> None:
    """Until `min_bytes` of sentence `index` arrived (mid-sentence)."""
    while not (listener.open_sentence == index and len(listener.audio[index]) >= min_bytes):
        listener.feed(await asyncio.wait_for(ws.recv(), 30))


async def uninterrupted_pcm(ws_url: str, text: str) -> bytes:
    """The reference: the same text on one connection that nobody interrupts."""
    listener = Listener()
    async with websockets.connect(ws_url, max_size=None) as ws:
        await ws.send(config_message())
        await listener.receive(ws, "session.started")
        await ws.send(json.dumps({"type": "input.text", "text": text}))
        await ws.send(json.dumps({"type": "input.done"}))
        await listener.receive(ws, "session.done")
    return listener.pcm()


class OneWayOutage:
    """A TCP proxy in front of a gateway whose client-to-gateway direction can fail silently: with
    `drop_client_bytes` set, what the client sends is read and thrown away (the client's socket looks
    healthy, as on a dying replica whose kernel still takes bytes). `cut()` then drops every connection
    and stops listening, so a reconnect through it is refused."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.drop_client_bytes = False
        self.dropped = 0  # client bytes thrown away
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._writers: list[asyncio.StreamWriter] = []

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/audio/speech/stream"

    async def __aenter__(self) -> "OneWayOutage":
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.cut()

    def cut(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.transport.abort()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            client_writer.transport.abort()
            return
        self._writers += [client_writer, upstream_writer]

        async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, from_client: bool) -> None:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while data := await reader.read(65536):
                    if from_client and self.drop_client_bytes:
                        self.dropped += len(data)
                        continue
                    writer.write(data)
                    await writer.drain()
            writer.transport.abort()

        await asyncio.gather(pump(client_reader, upstream_writer, True), pump(upstream_reader, client_writer, False))

    async def wait_dropped(self, at_least: int, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.dropped < at_least:
            assert time.monotonic() < deadline, f"only {self.dropped} of {at_least} client bytes reached the proxy"
            await asyncio.sleep(0.005)


async def resume(url: str, listener: Listener):
    """A new connection that resumes the listener's session from where it is; the session.started checked."""
    ws = await websockets.connect(url, max_size=None)
    listener.first_audio_at = None
    await ws.send(listener.resume_message())
    started = await listener.receive(ws, ("session.started", "error"))
    assert started["type"] == "session.started", started
    assert started["session_id"] == listener.session_id
    return ws
