"""Raw-socket WebSocket clients for the hostile-client and back-pressure tests: the handshake and every
frame are built by hand (RFC 6455), so a test can send what no well-behaved library would (fragments
in the wrong order, invalid UTF-8, oversized lengths, floods of control frames) and can stop reading.

Also a well-behaved reference session (`good_session`) whose audio must be byte-exact whatever the
hostile clients do meanwhile; a gateway in its own process (`served_gateway`) whose memory a test can
measure (`MemoryWatch`, `cpu_seconds`), raw HTTP requests whose body a test pours as it likes (`RawHttp`), and a probe of
the event loop's responsiveness while an attack runs (`HealthProbe`)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import websockets

from tests.gateway_server import audio_by_sentence, receive_until
from tests.resume_fixtures import GatewayProcess, start_process, wait_ready

OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA


def frame(opcode: int, payload: bytes, *, fin: bool = True, length: int | None = None) -> bytes:
    """A masked client frame. `length` overrides the declared payload length (to lie about it)."""
    declared = len(payload) if length is None else length
    head = bytes([(0x80 if fin else 0) | opcode])
    if declared < 126:
        head += bytes([0x80 | declared])
    elif declared < 1 << 16:
        head += bytes([0x80 | 126]) + struct.pack("!H", declared)
    else:
        head += bytes([0x80 | 127]) + struct.pack("!Q", declared)
    mask = os.urandom(4)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def text(message: dict[str, Any] | str) -> bytes:
    body = message if isinstance(message, str) else json.dumps(message)
    return frame(OP_TEXT, body.encode())


@dataclass
class ServerFrame:
    opcode: int
    payload: bytes
    fin: bool

    @property
    def json(self) -> dict[str, Any]:
        return json.loads(self.payload)

    @property
    def close_code(self) -> int | None:
        return struct.unpack("!H", self.payload[:2])[0] if self.opcode == OP_CLOSE and len(self.payload) >= 2 else None


@dataclass
class RawClient:
    """A WebSocket client over a plain socket; reads only when asked."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    received: list[ServerFrame] = field(default_factory=list)

    @classmethod
    async def connect(cls, port: int, path: str = "/v1/audio/speech/stream", *, rcvbuf: int | None = None,
                      headers: dict[str, str] | None = None) -> "RawClient":
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # before connect, so the TCP window is small from the start
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        # The stream reader stops reading the socket at twice its limit: with a small rcvbuf, keep it small
        # too, so that not reading really leaves the data with the server.
        reader, writer = await asyncio.open_connection(sock=sock, limit=4096 if rcvbuf is not None else 1 << 20)
        client = cls(reader, writer)
        await client.handshake(port, path, headers or {})
        return client

    async def handshake(self, port: int, path: str, headers: dict[str, str]) -> None:
        key = base64.b64encode(os.urandom(16)).decode()
        lines = [f"GET {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Upgrade: websocket", "Connection: Upgrade",
                 f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        await self.writer.drain()
        response = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 10)
        assert response.startswith(b"HTTP/1.1 101"), response

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def send_json(self, message: dict[str, Any]) -> None:
        await self.send(text(message))

    async def read_frame(self, timeout: float = 10.0) -> ServerFrame:
        async def read() -> ServerFrame:
            b0, b1 = await self.reader.readexactly(2)
            length = b1 & 0x7F
            if length == 126:
                (length,) = struct.unpack("!H", await self.reader.readexactly(2))
            elif length == 127:
                (length,) = struct.unpack("!Q", await self.reader.readexactly(8))
            payload = await self.reader.readexactly(length)  # server frames are not masked
            return ServerFrame(b0 & 0x0F, payload, bool(b0 & 0x80))

        received = await asyncio.wait_for(read(), timeout)
        self.received.append(received)
        return received

    async def read_until(self, predicate, timeout: float = 20.0) -> ServerFrame:
        """Frames up to the first one `predicate` accepts (raises on a close frame that does not match)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            got = await self.read_frame(max(0.01, deadline - asyncio.get_running_loop().time()))
            if predicate(got):
                return got
            if got.opcode == OP_CLOSE:
                raise AssertionError(f"closed with {got.close_code}: {got.payload[2:]!r}")

    async def read_json_until(self, kind: str, timeout: float = 20.0) -> dict[str, Any]:
        got = await self.read_until(lambda f: f.opcode == OP_TEXT and f.json.get("type") == kind, timeout)
        return got.json

    async def read_close(self, timeout: float = 10.0) -> int | None:
        """The close code the server sends (frames before it are skipped), or None if the TCP connection
        ended without a close frame."""
        try:
            got = await self.read_until(lambda f: f.opcode == OP_CLOSE, timeout)
        except asyncio.IncompleteReadError:
            return None
        return got.close_code

    async def eof(self, timeout: float = 10.0) -> bool:
        """True once the server has closed the TCP connection."""
        try:
            while True:
                if not await asyncio.wait_for(self.reader.read(65536), timeout):
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True

    def close(self) -> None:
        self.writer.transport.abort()


# ------------------------------------------------------------------------------------ reference session

GOOD_TEXT = "The reference session keeps talking. Its audio must not change, whatever the others do. Done now."
GOOD_CONFIG = {"type": "session.config", "voice": "tone-mid", "stream_audio": True, "response_format": "pcm"}


async def good_session(ws_url: str, rounds: int = 1) -> list[tuple[list[str], dict[int, bytes]]]:
    """A well-behaved client: `rounds` utterances of GOOD_TEXT; per round its sentences and audio."""
    results = []
    async with websockets.connect(ws_url, max_size=None) as ws:
        await ws.send(json.dumps(GOOD_CONFIG))
        await receive_until(ws, "session.started")
        for n in range(rounds):
            context = f"good-{n}"
            await ws.send(json.dumps({"type": "input.text", "text": GOOD_TEXT, "context_id": context}))
            await ws.send(json.dumps({"type": "input.done", "context_id": context}))
            messages = await receive_until(ws, "utterance.done", timeout=60)
            assert not [m for m in messages if isinstance(m, dict) and m.get("type") == "error"], messages
            done = [m for m in messages if isinstance(m, dict) and m.get("type") == "audio.done"]
            assert all(not m["error"] for m in done)
            sentences = [m["sentence_text"] for m in messages if isinstance(m, dict) and m.get("type") == "audio.start"]
            audio = audio_by_sentence(messages)
            assert [len(audio[m["sentence_index"]]) for m in done] == [m["total_bytes"] for m in done]
            results.append((sentences, list(audio.values())))
        await ws.send(json.dumps({"type": "session.close"}))
        await receive_until(ws, "session.done")
    return results


# ------------------------------------------------------------------------------------ a gateway process


@contextlib.contextmanager
def served_gateway(*flags: str, env: dict[str, str] | None = None) -> Iterator[GatewayProcess]:
    """`voxgate serve --backend synthetic` in a process of its own (so that its RSS is the gateway's
    alone), with `flags` and `env` (VOXGATE_* settings); stopped on exit."""
    gateway = start_process([sys.executable, "-m", "gateway.cli", "serve", "--port", "0", "--backend", "synthetic",
                             "--log-level", "info", *flags], env)
    try:
        wait_ready(gateway)
        yield gateway
    finally:
        gateway.kill()
        with contextlib.suppress(OSError):
            os.unlink(gateway.log_path)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class MemoryWatch:
    """The resident memory of a process: `start()` takes the current RSS and resets the kernel's peak
    (VmHWM), `growth` is how far the peak rose above that since, however briefly."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.before = 0

    def _status(self, field_name: str) -> int:
        with open(f"/proc/{self.pid}/status") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
        raise KeyError(field_name)

    def start(self) -> None:
        with open(f"/proc/{self.pid}/clear_refs", "w") as clear:
            clear.write("5")  # resets VmHWM to the current RSS
        self.before = self._status("VmRSS")

    @property
    def growth(self) -> int:
        return self._status("VmHWM") - self.before


class HealthProbe:
    """Asks /health, one request after another, while an attack runs; `worst` is the slowest answer
    (a request that has not come back yet counts with its time so far)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.worst = 0.0
        self.answered = 0
        self._asked_at: float | None = None  # the request in flight
        self._task: asyncio.Task | None = None
        self._first = asyncio.Event()

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            while True:
                self._asked_at = time.monotonic()
                response = await client.get(self.url + "/health")
                assert response.status_code == 200
                self.worst = max(self.worst, time.monotonic() - self._asked_at)
                self._asked_at = None
                self.answered += 1
                self._first.set()
                await asyncio.sleep(0.02)

    async def __aenter__(self) -> "HealthProbe":
        self._task = asyncio.create_task(self._run())
        await asyncio.wait_for(self._first.wait(), 10)  # connected and answered before the attack starts
        self.worst = 0.0
        return self

    async def __aexit__(self, *exc_info) -> None:
        assert self._task is not None
        if self._task.done():
            self._task.result()  # a failed probe fails the test
        if self._asked_at is not None:
            self.worst = max(self.worst, time.monotonic() - self._asked_at)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


# ------------------------------------------------------------------------------------ raw HTTP


@dataclass
class RawHttp:
    """An HTTP/1.1 request over a plain connection: the head is sent at once, the body as the test likes;
    `poured` counts the body bytes the socket took."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    poured: int = 0

    @classmethod
    async def send_head(cls, port: int, method: str, path: str, headers: dict[str, str]) -> "RawHttp":
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", *(f"{k}: {v}" for k, v in headers.items())]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        await writer.drain()
        return cls(reader, writer)

    async def pour(self, total: int, *, chunked: bool = False, piece: int = 64 * 1024) -> None:
        """Send up to `total` body bytes (as chunks of a chunked body if `chunked`, never terminated),
        stopping quietly when the server drops the connection."""
        data = b"x" * piece
        framed = f"{piece:x}\r\n".encode() + data + b"\r\n" if chunked else data
        try:
            while self.poured < total:
                self.writer.write(framed)
                await self.writer.drain()
                self.poured += piece
                await asyncio.sleep(0)  # drain() does not yield while the socket takes all: let the reader run
        except (ConnectionError, OSError):
            pass

    async def response(self, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
        """(status, headers with lower-case names, body) of the response."""
        async def read() -> tuple[int, dict[str, str], bytes]:
            head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            status_line, *header_lines = head.strip().split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
            body = await self.reader.readexactly(int(headers.get("content-length", "0")))
            return int(status_line.split()[1]), headers, body

        return await asyncio.wait_for(read(), timeout)

    async def closed_by_server(self, timeout: float = 10.0) -> bool:
        """True once the server has ended the connection (EOF or reset)."""
        try:
            while await asyncio.wait_for(self.reader.read(65536), timeout):
                pass
        except (ConnectionError, OSError):
            pass
        return True

    def close(self) -> None:
        self.writer.transport.abort()


def children_of(pid: int) -> list[int]:
    """The pids whose parent is `pid`, read from /proc (Linux): the processes a server started."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found
