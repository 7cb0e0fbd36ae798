"""Hostile workers for the worker-tier security tests (issue 24): raw asyncio servers on loopback that speak
as much of tts_backend/remote/framing.py as their part needs, and record every byte they are sent.

- `FakeWorker(token=TOKEN, synthesize=...)`: holds the token (as a compromised or broken worker would),
  answers `info` with what `info` holds at that moment, and serves each synthesize with `synthesize`.
- `FakeWorker(token=None)`: a forged worker, planted where a gateway may dial it, knowing no token. To a
  gateway that sends the token in the clear it would be a worker like any other (it answers info and
  streams silence), so a test sees what it was sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable

from tts_backend.remote import framing

SYNTHETIC_INFO = {
    "op": "info", "id": "fake", "name": "synthetic", "sample_rate": 24000, "ready": True, "draining": False,
    "load": 0.0, "streams": 0, "capacity": None, "queued": 0, "rtf": 0.0, "default_voice": "tone-mid",
    "voices": [{"id": v, "name": v, "language": "en", "description": ""} for v in ("tone-low", "tone-mid", "tone-high")],
    "honours": ["seed", "word_timestamps"], "speaks_only_clones": False,
}

Synthesize = Callable[[dict, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def send_silence(_message: dict, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(framing.encode(framing.AUDIO, b"\0\0" * 2400) + framing.encode_json({"op": "done"}))
    await writer.drain()


class FakeWorker:
    def __init__(self, token: str | None, synthesize: Synthesize = send_silence, worker_id: str = "fake") -> None:
        self.token = token
        self.worker_id = worker_id
        self.info = {**SYNTHETIC_INFO, "id": worker_id}
        self.synthesize = synthesize
        self.received = bytearray()  # every byte any connection sent, as it came
        self.connections = 0
        self.requests: list[dict] = []
        self._server: asyncio.AbstractServer | None = None

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> "FakeWorker":
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _frame(self, reader: asyncio.StreamReader) -> dict | None:
        head = await reader.readexactly(5)
        payload = await reader.readexactly(int.from_bytes(head[:4], "big") - 1)
        self.received += head + payload
        return framing.decode_json(payload) if head[4:] == framing.JSON else None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            message = await self._frame(reader)
            if message["op"] == "hello":
                client_nonce = bytes.fromhex(message["nonce"])
                worker_nonce = os.urandom(framing.NONCE_BYTES)
                if self.token is None:  # it cannot prove anything: it tries anyway, and listens
                    proof = "0" * 64
                else:
                    proof = framing.worker_proof(self.token, client_nonce, worker_nonce, message["to"], self.worker_id)
                writer.write(framing.encode_json({"op": "hello", "nonce": worker_nonce.hex(), "id": self.worker_id,
                                                  "proof": proof}))
                await writer.drain()
                if self.token is None:
                    while data := await reader.read(65536):
                        self.received += data
                    return
                await self._frame(reader)  # the gateway's proof: trusted, this worker is not the one under test
                message = await self._frame(reader)
            elif message["op"] == "auth":  # a gateway that sends its token in the clear
                message = await self._frame(reader)
            self.requests.append(message)
            if message["op"] == "info":
                writer.write(framing.encode_json(self.info))
                await writer.drain()
            elif message["op"] == "synthesize":
                await self.synthesize(message, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


class RelayWorker:
    """The relay attack: a listener that holds no token, at an address a gateway dials (a static pool's
    member whose port it took over, an address a replayed registry record names), forwarding each
    connection to a real worker at `upstream` ("tcp://HOST:PORT"). It records every byte the gateways send
    it. Every other connection (every one with `strip_to`) it also tries to be served itself: it relays the
    handshake, and once the gateway has written its proof, sends the worker that proof and an info request of
    its own in place of the gateway's request; `served` counts the answers the worker gave it."""

    def __init__(self, upstream: str, port: int = 0, strip_to: bool = False) -> None:
        self.upstream = upstream.removeprefix("tcp://").rsplit(":", 1)
        self.port = port
        self.strip_to = strip_to  # a downgrade: each hello relayed without the address it binds (framing.py)
        self.received = bytearray()
        self.connections = 0
        self.served = 0
        self._server: asyncio.AbstractServer | None = None

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> "RelayWorker":
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, record: bool) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                if record:
                    self.received += data
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _gateway_frame(self, reader: asyncio.StreamReader) -> tuple[bytes, dict]:
        head = await reader.readexactly(5)
        payload = await reader.readexactly(int.from_bytes(head[:4], "big") - 1)
        self.received += head + payload
        return head + payload, (framing.decode_json(payload) if head[4:] == framing.JSON else {})

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        hijack = self.connections % 2 == 0 or self.strip_to
        upstream_reader = upstream_writer = None
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(self.upstream[0], int(self.upstream[1]))
            if not hijack:
                await asyncio.gather(self._pump(reader, upstream_writer, True),
                                     self._pump(upstream_reader, writer, False))
                return
            hello, message = await self._gateway_frame(reader)
            if self.strip_to:
                message.pop("to", None)
                hello = framing.encode_json(message)
            upstream_writer.write(hello)
            answer = await framing.read_frame(upstream_reader, framing.MAX_AUTH_FRAME)
            if answer is None:
                return
            writer.write(framing.encode(*answer))
            auth, message = await self._gateway_frame(reader)
            if message.get("op") != "auth":
                return
            upstream_writer.write(auth + framing.encode_json({"op": "info"}))
            served = await asyncio.wait_for(framing.read_frame(upstream_reader, framing.MAX_ANSWER_FRAME), 10)
            if served is not None and framing.decode_json(served[1]).get("op") == "info":
                self.served += 1
            with contextlib.suppress(asyncio.TimeoutError):  # what else the gateway sent: its request
                self.received += await asyncio.wait_for(reader.read(65536), 1)
        except (ConnectionError, OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, framing.ProtocolError):
            pass
        finally:
            writer.close()
            if upstream_writer is not None:
                upstream_writer.close()
