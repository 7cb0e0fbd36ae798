"""`voxgate worker`: a synthesis backend in its own process, served over a Unix socket or TCP.

A GPU host runs one worker per GPU (`--gpus`, launcher.py); gateways reach them with `--backend remote`,
one local socket (`-o socket=PATH`) or a pool (`-o workers=...`, or `-o discover=REDIS_URL` with the
workers started with `--registry`). The protocol is in framing.py, addresses and TLS in connection.py.

What a worker tells the gateways, in its `info` answer and its registry record: its capacity (streams it
serves at once at full speed: the engine's KV slots, or `--capacity`), the streams it serves now, the
requests queued for a place, and its measured real-time factor (wall seconds spent producing a second of
audio, over the last few seconds, first chunks left out). A pool routes each new session by what is left.

Drain (SIGTERM): it says `draining` in its info and registry record, so gateways stop routing new
sessions to it within a heartbeat. A stream whose gateway takes hand-overs ("handover": true, framing.py) on
a backend with codes ("resume_codes") is handed over at once: after the last chunk it wrote whole (its audio
and its codes), the worker ends it with {"op": "handover"}, and the gateway's pool goes on with it from the
codes on another worker (a rolling upgrade cuts no sentence and waits for none); such a gateway's new
requests are answered `draining`, which sends them to another worker at once (a pool with no other worker
sends a handed-over stream back, from its codes and taking no hand-over: it is served to the end). Any other
stream finishes where it started, and the utterances of those gateways that it has served a sentence of are
still served; their other requests are answered `draining`. Once no stream runs and none of the second kind has run for
`drain_linger_s` (an open utterance's next sentence comes within that, as a talking client's do), or at
`--drain-timeout-s`, it withdraws from the registry and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import dataclasses
import gc
import ipaddress
import json
import logging
import os
import resource
import secrets
import signal
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

from ..base import AudioChunk, BackendMetric, ReferenceAudio, SynthesisError, Synthesizer, TextStream, check_codes
from ..log_format import TextFormatter, redact
from ..registry import create_backend
from . import framing
from .connection import (
    WorkerAddress,
    default_worker_id,
    listen_address,
    normalized,
    reached_address,
    read_token,
    server_tls_context,
)
from .discovery import WorkerRegistry, registry_key
from .health import HealthServer
from .pending import PendingHandshakes

log = logging.getLogger(__name__)

# Connections that have not finished the handshake (framing.py) count apart from the authenticated ones
# (max_connections): at most MAX_UNAUTHENTICATED at once (fewer where the process may open few descriptors)
# and a quarter of those from one source (an IPv4 address, an IPv6 /64), past which one is dropped as
# pending.py chooses, an idle one before any that sent its hello, so that idle or slow peers, from anywhere,
# never keep a gateway's handshake, one round trip, out. Each is given AUTH_TIMEOUT_S from its accept (a
# TLS handshake included).
MAX_UNAUTHENTICATED = 2048
AUTH_TIMEOUT_S = 3.0
# Read-ahead per connection (a StreamReader's limit; readexactly reads past it): small, since a worker reads
# small frames but for a request's, and thousands of peers that proved nothing may be connected at once.
SERVER_READ_LIMIT = 16 * 1024
REQUEST_TIMEOUT_S = 10.0  # the request frame must have arrived this long after the handshake (or the accept)
# After refusing a request it took, the worker reads on (and drops) what the client still sends, this long at
# most, until the client closes (_linger).
CLOSE_LINGER_S = 2.0
# Request frames larger than LARGE_REQUEST are counted against one budget for the whole worker while they
# are read and served, so that many connections sending large frames (clones carry megabytes) cannot take
# more memory than the budget; one that would pass it is answered `overloaded`.
LARGE_REQUEST = 64 * 1024
LARGE_REQUEST_BUDGET = 32 * 1024 * 1024
MAX_TEXT_CHARS = 2000  # default --max-text-chars: the longest text of one synthesize (the gateway's cap is 300)
_SEEN_UTTERANCES = 65536  # utterance keys remembered for the drain (oldest forgotten first)


def error_code(exc: BaseException) -> str:
    for kind, code in framing.ERROR_CODES.items():
        if isinstance(exc, kind):
            return code
    if isinstance(exc, SynthesisError):
        return "synthesis_failed"
    return "internal"


@dataclasses.dataclass(frozen=True)
class _Takes:
    """The frames a synthesize's gateway takes besides audio, words, done and error (framing.py): an older
    gateway, which would take them for bad frames, asks for none."""

    keepalive: bool = False  # {"op": "wait"}
    audio_ended: bool = False  # {"op": "audio_ended"}
    codes: bool = False  # C frames
    handover: bool = False  # {"op": "handover"} (needs codes)

    @classmethod
    def of(cls, message: dict) -> "_Takes":
        codes = message.get("codes") is True
        return cls(message.get("keepalive") is True, message.get("audio_ended") is True, codes,
                   codes and message.get("handover") is True)


class _Busy(Exception):
    """A request the worker cannot take now (answered `overloaded`)."""


async def _refuse(writer: asyncio.StreamWriter, code: str, message: str) -> None:
    """Answer a connection's request with an error (the connection is closed after it)."""
    writer.write(framing.encode_json({"op": "error", "code": code, "message": message}))
    await writer.drain()


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Let the client read a refusal. A client streaming text writes on until it reads the answer; closed at
    once, this end would answer those writes with a reset, and a client whose loop was busy loses the answer
    still unread in its kernel with the connection (a gateway whose text a worker refused then took a healthy
    worker for lost and failed the sentences after). So: end our side, drop what comes until the client
    closes, CLOSE_LINGER_S at most."""
    with contextlib.suppress(Exception):
        if writer.can_write_eof():
            writer.write_eof()

        async def drop() -> None:
            while await reader.read(65536):
                pass

        await asyncio.wait_for(drop(), CLOSE_LINGER_S)


class RealTimeMeter:
    """Wall seconds spent waiting for the backend per second of audio it produced, over the last
    `window_s`: under 1 the backend keeps ahead of real time. A stream's first chunk is left out (that is
    its time to first audio, not its pace)."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, float, float]] = collections.deque()
        self._wait = 0.0
        self._audio = 0.0

    def add(self, wait_s: float, audio_s: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._samples.append((now, wait_s, audio_s))
        self._wait += wait_s
        self._audio += audio_s
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self.window_s:
            _, wait_s, audio_s = self._samples.popleft()
            self._wait -= wait_s
            self._audio -= audio_s

    def value(self, now: float | None = None) -> float:
        self._expire(time.monotonic() if now is None else now)
        return self._wait / self._audio if self._audio > 0.05 else 0.0


class WorkerServer:
    """Serves `backend` on `listen` (a WorkerAddress, or a Unix socket path). token: every connection
    must start with it (see framing.py). tls: the server context for tls:// addresses."""

    def __init__(self, backend: Synthesizer, listen: WorkerAddress | str, *, token: str | None = None,
                 tls=None, worker_id: str | None = None, advertise: WorkerAddress | None = None,
                 capacity: int | None = None, drain_linger_s: float = 2.0, max_connections: int = 4096,
                 model: str | None = None, max_text_chars: int = MAX_TEXT_CHARS,
                 reachable_at: tuple[WorkerAddress, ...] = ()) -> None:
        self.backend = backend
        self.listen = listen if isinstance(listen, WorkerAddress) else WorkerAddress.parse(listen)
        if self.listen.scheme == "tls" and tls is None:
            raise ValueError("a tls:// worker needs a certificate and key (--tls-cert, --tls-key)")
        self.token = token
        self.tls = tls if self.listen.scheme == "tls" else None
        self.advertise = advertise or self.listen
        self.reachable_at = reachable_at
        self._answers_to: frozenset[WorkerAddress] = frozenset()  # set by start() (connection.py)
        self._resolving: asyncio.Task | None = None
        self._given_id = worker_id
        self.worker_id = worker_id or default_worker_id(self.listen)
        self._capacity = capacity
        self.model = model  # what it serves, for the registry: the checkpoint folder's name
        self.drain_linger_s = drain_linger_s
        self.max_connections = max_connections  # authenticated connections (all, without a token)
        self.max_text_chars = max_text_chars
        # Each pending connection, and each authenticated one, is a descriptor (with room for the rest).
        cap = max(64, min(MAX_UNAUTHENTICATED, descriptor_limit() // 4))
        self._pending = PendingHandshakes(cap, per_source=cap // 4)
        self._large_request_bytes = 0
        self._server: asyncio.AbstractServer | None = None
        self.streams_in_flight = 0
        self.connections = 0
        self.draining = False
        self.started_at = time.time()
        self.meter = RealTimeMeter()
        self._utterances: collections.OrderedDict[str, None] = collections.OrderedDict()
        # When a stream that is not handed over at a drain last ran (module doc): None while none has.
        self._last_stream_at: float | None = None
        self.handing_over = asyncio.Event()  # set by drain(): streams that can be are handed over
        self.handed_over = 0
        self.refused_unauthorized = 0
        self.handshakes_dropped = 0  # unfinished in time, or dropped for a newer one past the cap
        self.bad_requests = 0

    @property
    def socket_path(self) -> str:
        return self.listen.path

    @property
    def bound_port(self) -> int:
        """The TCP port listened on (the one the OS chose for port 0)."""
        if self._server is None or not self._server.sockets:
            return self.listen.port
        return self._server.sockets[0].getsockname()[1]

    def capacity(self) -> int | None:
        return self._capacity if self._capacity is not None else self.backend.capacity()

    def full(self) -> bool:
        """No room for another session: every place of the capacity is taken, or requests wait for one."""
        capacity = self.capacity()
        return capacity is not None and (self.streams_in_flight >= capacity or self.backend.queued() > 0)

    def info(self) -> dict:
        return {
            "op": "info",
            "id": self.worker_id,
            "name": self.backend.name,
            "sample_rate": self.backend.sample_rate,
            "ready": self.backend.ready,
            "draining": self.draining,
            "load": self.backend.load(),
            "streams": self.streams_in_flight,
            "capacity": self.capacity(),
            "queued": self.backend.queued(),
            # The pace of the streams running now: an idle worker's last pace says nothing of its headroom.
            "rtf": round(self.meter.value(), 4) if self.streams_in_flight else 0.0,
            "default_voice": self.backend.default_voice,
            "voices": [dataclasses.asdict(v) for v in self.backend.voices()],
            "honours": sorted(self.backend.honours),
            "speaks_only_clones": self.backend.speaks_only_clones,
            "codebooks": self.backend.codebooks,
            "frame_rate": self.backend.frame_rate,
        }

    def record(self) -> dict:
        """What the registry holds of this worker (discovery.py)."""
        info = self.info()
        return {
            "id": self.worker_id, "address": str(self.advertise), "backend": info["name"], "model": self.model,
            "voices": [v["id"] for v in info["voices"]], "capacity": info["capacity"], "streams": info["streams"],
            "queued": info["queued"], "rtf": info["rtf"], "load": info["load"], "draining": self.draining,
            "ready": info["ready"], "started_at": self.started_at, "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def own_metrics(self) -> list[BackendMetric]:
        def gauge(name: str, help_text: str, value: float | None) -> BackendMetric:
            return BackendMetric(name, "gauge", help_text, samples=(((), float(value if value is not None else 0)),))

        return [
            gauge("worker_streams", "Streams the worker is serving now", self.streams_in_flight),
            gauge("worker_capacity", "Streams the worker serves at once at full speed (KV slots)", self.capacity()),
            gauge("worker_queued", "Requests waiting for a place among the capacity", self.backend.queued()),
            gauge("worker_rtf", "Wall seconds per second of audio produced, over the last 5 s", self.meter.value()),
            gauge("worker_draining", "1 while the worker drains (SIGTERM)", 1.0 if self.draining else 0.0),
            gauge("worker_connections", "Open connections", self.connections),
            BackendMetric("worker_unauthorized_connections", "counter", "Connections refused for a wrong or "
                          "missing proof of the token", samples=(((), float(self.refused_unauthorized)),)),
            BackendMetric("worker_handshakes_dropped", "counter", "Connections dropped before finishing the handshake "
                          "(too slow, or the oldest past the cap)", samples=(((), float(self.handshakes_dropped)),)),
            BackendMetric("worker_bad_requests", "counter", "Connections refused for a malformed frame or request",
                          samples=(((), float(self.bad_requests)),)),
            BackendMetric("worker_streams_handed_over", "counter", "Streams handed over to the gateway's pool at a "
                          "drain, to go on from their codes on another worker",
                          samples=(((), float(self.handed_over)),)),
        ]

    async def all_metrics(self) -> list[BackendMetric]:
        return [*self.own_metrics(), *await self.backend.metrics()]

    async def metrics(self) -> dict:
        """The backend's metrics and the worker's own, for the gateway's /metrics (pool.py)."""
        return {"op": "metrics", "metrics": [m.to_json() for m in await self.all_metrics()]}

    async def clone(self, message: dict) -> dict:
        ref_text = message.get("ref_text")
        if ref_text is not None and (not isinstance(ref_text, str) or len(ref_text) > self.max_text_chars):
            raise framing.ProtocolError(f"ref_text must be null or a string of at most {self.max_text_chars} characters")
        samples = message.get("samples")
        samples = await asyncio.to_thread(framing.decode_base64, samples, "samples") \
            if isinstance(samples, str) and len(samples) > LARGE_REQUEST else framing.decode_base64(samples, "samples")
        reference = ReferenceAudio(samples, ref_text)
        try:
            prompt = await self.backend.clone_voice(reference, bool(message.get("x_vector_only", False)))
        except SynthesisError as exc:
            return {"op": "error", "code": error_code(exc), "message": str(exc)}
        except Exception as exc:  # noqa: BLE001 - reported to the client, logged here
            log.exception("cloning failed")
            return {"op": "error", "code": "internal", "message": str(exc)}
        return {"op": "clone", "prompt": base64.b64encode(prompt).decode()}

    async def start(self) -> None:
        if self.listen.scheme == "unix":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.listen.path)
            self._server = await asyncio.start_unix_server(self._handle, path=self.listen.path,
                                                           limit=SERVER_READ_LIMIT)
            os.chmod(self.listen.path, 0o660)
        else:
            tls = {"ssl": self.tls, "ssl_handshake_timeout": AUTH_TIMEOUT_S} if self.tls else {}
            self._server = await asyncio.start_server(self._handle, self.listen.host, self.listen.port,
                                                      limit=SERVER_READ_LIMIT, **tls)
        if self.listen.is_network and self.listen.port == 0:  # port 0: name the one the OS chose
            if self.advertise.port == 0:
                self.advertise = self.advertise.with_port(self.bound_port)
            if self._given_id is None:
                self.worker_id = default_worker_id(self.listen.with_port(self.bound_port))
        self._answer_to_addresses()

    def _answer_to_addresses(self) -> None:
        """Besides the address a connection reaches on its side, this worker proves itself for its advertise
        and --reachable-at addresses (connection.py): those with an IP at once, those with a host name once it
        is resolved, in the background (a DNS slow to answer must not hold the worker's start)."""
        given = []
        for address in (self.advertise, *self.reachable_at):
            if address.scheme != self.listen.scheme:
                log.warning("%s is not a %s address: this worker does not answer to it", address, self.listen.scheme)
            else:
                given.append(normalized(address))
        self._answers_to = frozenset(a for a in given if a.scheme == "unix" or a.host_is_ip)
        names = [a for a in given if a.scheme != "unix" and not a.host_is_ip]
        if names:
            self._resolving = asyncio.create_task(self._resolve(names))

    async def _resolve(self, names: list[WorkerAddress]) -> None:
        loop = asyncio.get_running_loop()
        for address in names:
            try:
                found = await loop.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM)
            except OSError as exc:
                log.warning("cannot resolve %s (%s): gateways that reach this worker through it are refused; "
                            "direct connections are not affected", address, exc)
                continue
            self._answers_to |= {reached_address(address.scheme, sockaddr) for *_, sockaddr in found}

    def answers_to(self, dialled: object, writer: asyncio.StreamWriter) -> bool:
        """Whether `dialled`, the address a gateway's hello says its connection reached, is this worker's."""
        if not isinstance(dialled, str) or len(dialled) > 1024:
            return False
        try:
            address = normalized(WorkerAddress.parse(dialled))
        except ValueError:
            return False
        if address.scheme != self.listen.scheme:
            return False
        if address.scheme == "unix":
            return address.path == self.listen.path or address in self._answers_to
        sockname = writer.get_extra_info("sockname")
        return (sockname is not None and address == reached_address(address.scheme, sockname)) \
            or address in self._answers_to

    async def close(self) -> None:
        if self._resolving is not None:
            self._resolving.cancel()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        if self.listen.scheme == "unix":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.listen.path)

    # ---- drain -------------------------------------------------------------------------------------
    @property
    def has_codes(self) -> bool:
        """The backend tells codes and continues from them (base.py): its streams can be handed over."""
        return "resume_codes" in self.backend.honours and self.backend.codebooks > 0

    def _admit(self, request_data: dict, takes: _Takes) -> bool:
        """May this request start? Always, unless draining: then only for a gateway that takes no hand-over,
        for an utterance already served or a sentence it goes on with from its codes (a stream this worker
        handed over to no one: the gateway's pool has no other worker, module doc)."""
        key = request_data.get("utterance_key") or request_data.get("session_key")
        if self.draining:
            if takes.handover and self.has_codes:
                return False
            return (isinstance(key, str) and key in self._utterances) or bool(request_data.get("resume_codes"))
        if isinstance(key, str):
            self._utterances[key] = None
            self._utterances.move_to_end(key)
            while len(self._utterances) > _SEEN_UTTERANCES:
                self._utterances.popitem(last=False)
        return True

    async def drain(self, timeout_s: float) -> None:
        """Stop taking new work and wait until the open utterances are done (see the module doc)."""
        self.draining = True
        self.handing_over.set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            since = time.monotonic() - self._last_stream_at if self._last_stream_at is not None else None
            lingering = since is not None and since < self.drain_linger_s
            if self.streams_in_flight == 0 and not lingering:
                return
            await asyncio.sleep(0.05)
        log.warning("drain timeout (%g s): %d streams still running are cut", timeout_s, self.streams_in_flight)

    # ---- connections -------------------------------------------------------------------------------
    async def _authenticate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """The handshake (framing.py), within AUTH_TIMEOUT_S, as one of the pending connections (pending.py)."""
        for dropped in self._pending.add(writer, _source(writer)):
            dropped.transport.abort()  # its handler ends on the broken read
            self.handshakes_dropped += 1
        try:
            return await asyncio.wait_for(self._handshake(reader, writer), AUTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.handshakes_dropped += 1
            return False
        finally:
            self._pending.remove(writer)

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        frame = await framing.read_frame(reader, framing.MAX_AUTH_FRAME)
        if frame is None:
            return False
        hello = framing.decode_json(frame[1]) if frame[0] == framing.JSON else {}
        if hello.get("op") != "hello":
            self.refused_unauthorized += 1
            await _refuse(writer, "unauthorized", "this worker wants the hello handshake first (a gateway of this version)")
            return False
        client_nonce = framing.parse_nonce(hello.get("nonce"))
        self._pending.greet(writer)
        if "proof" in hello:  # the one-way hello of a gateway of this user, on a Unix socket only (framing.py)
            if self.listen.scheme == "unix" and framing.proof_matches(hello["proof"],
                                                                      framing.local_proof(self.token, client_nonce)):
                return True
            self.refused_unauthorized += 1
            await _refuse(writer, "unauthorized", "wrong proof of the worker token")
            return False
        dialled = hello.get("to")
        if dialled is not None and not self.answers_to(dialled, writer):
            # A proof for an address that is not this worker's is what a relay wants (framing.py).
            self.refused_unauthorized += 1
            await _refuse(writer, "wrong_address", f"this worker does not answer at {str(dialled)[:200]} (its "
                          "own address, --advertise and --reachable-at are what it answers to)")
            return False
        worker_nonce = secrets.token_bytes(framing.NONCE_BYTES)
        if dialled is None:  # an older gateway's hello (framing.py)
            proof = framing.v1_worker_proof(self.token, client_nonce, worker_nonce, self.worker_id)
            expected = framing.v1_gateway_proof(self.token, worker_nonce, client_nonce)
        else:
            proof = framing.worker_proof(self.token, client_nonce, worker_nonce, dialled, self.worker_id)
            expected = framing.gateway_proof(self.token, worker_nonce, client_nonce, dialled, self.worker_id)
        writer.write(framing.encode_json({"op": "hello", "nonce": worker_nonce.hex(), "id": self.worker_id,
                                          "proof": proof}))
        await writer.drain()
        frame = await framing.read_frame(reader, framing.MAX_AUTH_FRAME)
        if frame is None:
            return False
        auth = framing.decode_json(frame[1]) if frame[0] == framing.JSON else {}
        if auth.get("op") != "auth" or not framing.proof_matches(auth.get("proof"), expected):
            self.refused_unauthorized += 1
            await _refuse(writer, "unauthorized", "wrong proof of the worker token")
            return False
        return True

    async def _read_request(self, reader: asyncio.StreamReader) -> tuple[dict | None, int]:
        """The connection's request, and the bytes of LARGE_REQUEST_BUDGET it holds (the caller gives them
        back when the request is done)."""
        head = await framing.read_header(reader, framing.MAX_REQUEST_FRAME)
        if head is None:
            return None, 0
        kind, size = head
        if kind != framing.JSON:
            raise framing.ProtocolError("expected a JSON frame first")
        held = size if size > LARGE_REQUEST else 0
        if held and self._large_request_bytes + held > LARGE_REQUEST_BUDGET:
            raise _Busy("this worker is reading as many large requests as it takes at once")
        self._large_request_bytes += held
        try:
            payload = await reader.readexactly(size)
            # A large frame's JSON takes milliseconds to parse: off the loop, which other streams share.
            message = await asyncio.to_thread(framing.decode_json, payload) if held else framing.decode_json(payload)
        except BaseException:
            self._large_request_bytes -= held
            raise
        return message, held

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held = 0
        counted = False
        linger = False  # the client may still be writing (a request refused, a text stream ended early): _linger
        try:
            if self.token is not None and not await self._authenticate(reader, writer):
                return
            if self.connections >= self.max_connections:
                await _refuse(writer, "overloaded", "too many connections to this worker")
                return
            self.connections += 1
            counted = True
            message, held = await asyncio.wait_for(self._read_request(reader), REQUEST_TIMEOUT_S)
            if message is None:
                return
            if message["op"] == "info":
                writer.write(framing.encode_json(self.info()))
                await writer.drain()
            elif message["op"] == "metrics":
                writer.write(framing.encode_json(await self.metrics()))
                await writer.drain()
            elif message["op"] == "clone":
                writer.write(framing.encode_json(await self.clone(message)))
                await writer.drain()
            elif message["op"] == "synthesize":
                data = message.get("request") or {}
                if not isinstance(data, dict):
                    raise framing.ProtocolError("request must be an object")
                text = data.get("text")
                if not isinstance(text, str) or len(text) > self.max_text_chars:
                    raise framing.ProtocolError(f"text must be a string of at most {self.max_text_chars} characters")
                takes = _Takes.of(message)
                if not self._admit(data, takes):
                    linger = True
                    await _refuse(writer, "draining", "this worker is draining")
                    return
                if message.get("place") and self.full():
                    linger = True
                    await _refuse(writer, "full", "this worker's capacity is in use")
                    return
                linger = await self._synthesize(data, reader, writer, bool(message.get("text_stream")), takes)
            else:
                raise framing.ProtocolError(f"unknown op {str(message['op'])[:64]!r}")
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            pass  # the client went away (its stream was cancelled with it), or never said anything
        except framing.ProtocolError as exc:
            self.bad_requests += 1
            log.debug("refused a malformed request: %s", exc)
            linger = True
            with contextlib.suppress(ConnectionError):
                await _refuse(writer, "bad_request", str(exc)[:200])
        except _Busy as exc:
            linger = True
            with contextlib.suppress(ConnectionError):
                await _refuse(writer, "overloaded", str(exc))
        finally:
            self._large_request_bytes -= held
            try:
                if linger and counted:  # counted: a lingering connection still counts against max_connections
                    await _linger(reader, writer)
            finally:
                if counted:
                    self.connections -= 1
                writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _synthesize(self, data: dict, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          text_stream: bool = False, takes: _Takes = _Takes()) -> bool:
        """Stream the request's answer; True when its client may still be writing text (a text stream that
        ended, in an error or a handover, before its text did)."""
        # The stream counts from its admission, before anything yields: a burst of requests checked against
        # full() together (a failover's or a drain's streams, from several gateways) each see the places the
        # ones before took. Counted once the producing task ran, all of them passed the check and the worker
        # took more than its capacity: in the fleet simulation a handed-over stream then waited 268 ms for a
        # slot while another worker had three free.
        self.streams_in_flight += 1
        try:
            return await self._synthesize_counted(data, reader, writer, text_stream, takes)
        finally:
            self.streams_in_flight -= 1

    async def _synthesize_counted(self, data: dict, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                  text_stream: bool, takes: _Takes) -> bool:
        text = TextStream(data.get("text") if isinstance(data.get("text"), str) else "") if text_stream else None
        produce = asyncio.create_task(self._stream(data, writer, text, takes))
        # Any frame or end-of-file from the client while we stream means "stop" (but the text of a text stream).
        hangup = asyncio.create_task(self._read_text(reader, text) if text is not None else reader.read(1))
        try:
            done, _ = await asyncio.wait({produce, hangup}, return_when=asyncio.FIRST_COMPLETED)
            if produce not in done:
                produce.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                    await produce
                hangup.result()  # a bad text frame: the ProtocolError is answered bad_request by _handle
                return False
            await produce
            return text is not None and not text.finished
        finally:
            hangup.cancel()

    async def _read_text(self, reader: asyncio.StreamReader, text: TextStream) -> None:
        """A text stream's frames: "text" pushes, "text_done" finishes; returns at end-of-file or any other
        frame once the text is done (stop, as for any request). Raises ProtocolError on a bad text frame or a
        text past max_text_chars (the bound of any request's text), which stops the request too."""
        while not text.finished:
            frame = await framing.read_frame(reader, framing.MAX_CONTROL_FRAME)
            if frame is None:
                return
            kind, payload = frame
            message = framing.decode_json(payload) if kind == framing.JSON else {}
            if message.get("op") == "text_done":
                text.finish()
            elif message.get("op") == "text" and isinstance(message.get("text"), str):
                if len(text.text) + len(message["text"]) > self.max_text_chars:
                    raise framing.ProtocolError(f"text must be a string of at most {self.max_text_chars} characters")
                text.push(message["text"])
            else:
                return  # not text: "stop"
        await reader.read(1)

    async def _stream(self, data: dict, writer: asyncio.StreamWriter, text: TextStream | None = None,
                      takes: _Takes = _Takes()) -> None:
        hands_over = takes.handover and self.has_codes
        try:
            await self._stream_inner(data, writer, text, takes, hands_over)
        finally:
            if not hands_over:
                self._last_stream_at = time.monotonic()

    def _checked_request(self, data: dict, text: TextStream | None):
        request = framing.request_from_json(data)
        if request.resume_codes:
            # A gateway is a peer: its codes must be whole frames and no more than the text could make (a
            # text stream's text is bounded by max_text_chars). The backend checks that they are its own.
            if "resume_codes" not in self.backend.honours:
                raise SynthesisError(f"the {self.backend.name} backend cannot continue a sentence from codes")
            chars = self.max_text_chars if text is not None else len(request.text)
            check_codes(request.resume_codes, self.backend.codebooks, self.backend.max_code_bytes(chars),
                        "resume_codes")
        if text is not None:  # its initial text was bounded with any request's (_handle)
            request = dataclasses.replace(request, text_stream=text)
        return request

    async def _stream_inner(self, data: dict, writer: asyncio.StreamWriter, text: TextStream | None,
                            takes: _Takes, hands_over: bool) -> None:
        """takes: the frames the client takes besides the basic ones (framing.py). hands_over: at a drain,
        end the stream with {"op": "handover"} after the last chunk written whole (module doc)."""
        seconds_per_byte = 1.0 / (2 * self.backend.sample_rate)
        try:
            request = self._checked_request(data, text)
            stream = self.backend.synthesize(request)
            # Done once the drain begins: one wait for the stream's life, not one a chunk.
            handover = asyncio.ensure_future(self.handing_over.wait()) if hands_over else None
            try:
                first_audio = True
                while True:
                    asked = time.monotonic()
                    try:
                        chunk = await self._next_chunk(stream, writer, takes.keepalive, handover)
                    except StopAsyncIteration:
                        break
                    if chunk is None:  # draining: the chunks written so far are whole, with their codes
                        self.handed_over += 1
                        writer.write(framing.encode_json({"op": "handover"}))
                        await writer.drain()
                        return
                    if chunk.audio_ended and takes.audio_ended:
                        writer.write(framing.encode_json({"op": "audio_ended"}))
                    if chunk.pcm:
                        # A text stream's waits are its text's, not this worker's speed: not metered.
                        if not first_audio and text is None:
                            self.meter.add(time.monotonic() - asked, len(chunk.pcm) * seconds_per_byte)
                        first_audio = False
                    # The words before the chunk's audio, as the backend gave them; both in frames no larger
                    # than a gateway takes (framing.MAX_STREAM_FRAME).
                    for at in range(0, len(chunk.words), framing.WORDS_PER_FRAME):
                        words = chunk.words[at:at + framing.WORDS_PER_FRAME]
                        writer.write(framing.encode_json({"op": "words", "words": [w.to_json() for w in words]}))
                    pcm = memoryview(chunk.pcm)
                    for at in range(0, len(pcm), framing.AUDIO_FRAME_BYTES):
                        writer.write(framing.encode(framing.AUDIO, pcm[at:at + framing.AUDIO_FRAME_BYTES]))
                    if chunk.codes and takes.codes and self.has_codes:  # after its audio: the chunk is whole now
                        writer.write(framing.encode_codes(chunk.codes, self.backend.codebooks))
                    await writer.drain()  # a slow reader slows the stream: back-pressure reaches the engine
            finally:
                if handover is not None:
                    handover.cancel()
                await stream.aclose()
            writer.write(framing.encode_json({"op": "done"}))
        except (SynthesisError, TypeError, ValueError) as exc:
            writer.write(framing.encode_json({"op": "error", "code": error_code(exc), "message": str(exc)}))
        except ConnectionError:
            return
        except Exception as exc:  # noqa: BLE001 - reported to the client, logged here
            log.exception("synthesis failed")
            writer.write(framing.encode_json({"op": "error", "code": "internal", "message": str(exc)}))
        await writer.drain()


    @staticmethod
    async def _next_chunk(stream: AsyncIterator[AudioChunk], writer: asyncio.StreamWriter, keepalive: bool,
                          handover: asyncio.Future | None) -> AudioChunk | None:
        """The backend's next chunk, or None once `handover` is done (the chunk in the making is dropped: the
        gateway goes on from the codes of those written). keepalive: while it takes longer than
        framing.KEEPALIVE_S (queued for a slot, the aligner's queue), a {"op": "wait"} every KEEPALIVE_S
        tells the gateway this stream is alive, so that its deadline catches only a worker that is truly
        silent."""
        if handover is not None and handover.done():
            return None
        if not keepalive and handover is None:
            return await anext(stream)
        pending = asyncio.ensure_future(anext(stream))
        try:
            while True:
                done, _ = await asyncio.wait({pending, handover} - {None}, return_when=asyncio.FIRST_COMPLETED,
                                             timeout=framing.KEEPALIVE_S if keepalive else None)
                if pending in done:
                    return pending.result()
                if handover in done:
                    return None
                writer.write(framing.encode_json({"op": "wait"}))
                await writer.drain()
        finally:
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await pending


def _source(writer: asyncio.StreamWriter) -> str:
    """Where a connection comes from, as pending.py counts sources: its IPv4 address, its IPv6 /64 (a host
    commonly has a whole one), one source for a Unix socket's peers."""
    peer = writer.get_extra_info("peername")
    if not isinstance(peer, tuple):
        return ""
    address = reached_address("tcp", peer)
    if ":" in address.host:
        return str(ipaddress.ip_network(f"{address.host}/64", strict=False))
    return address.host


def descriptor_limit() -> int:
    """How many descriptors this process may open (its soft limit)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def raise_descriptor_limit() -> None:
    """The soft limit on descriptors up to the hard one: each connection is one, and a worker serves thousands."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def default_advertise(listen: WorkerAddress) -> WorkerAddress:
    """The listen address, with a wildcard host (0.0.0.0, ::) replaced by this host's address."""
    if listen.scheme == "unix" or listen.host not in ("0.0.0.0", "::", ""):
        return listen
    try:
        host = socket.gethostbyname(socket.gethostname())
    except OSError:
        host = "127.0.0.1"
    return WorkerAddress(listen.scheme, host, listen.port)


def _split_env(value: str | None) -> list[str]:
    return [item.strip() for item in (value or "").split(",") if item.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="voxgate worker", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default=env("VOXGATE_WORKER_LISTEN"),
                        help="unix:/PATH, tcp://HOST:PORT or tls://HOST:PORT (default unix:/tmp/voxgate-worker.sock)")
    parser.add_argument("--socket", default=env("VOXGATE_WORKER_SOCKET"), help="Unix socket path (= --listen unix:PATH)")
    parser.add_argument("--token-file", default=env("VOXGATE_WORKER_TOKEN_FILE"),
                        help="file whose first line is the shared token (else $VOXGATE_WORKER_TOKEN)")
    parser.add_argument("--insecure-no-auth", action="store_true",
                        help="listen on a non-loopback TCP address without a token")
    parser.add_argument("--tls-cert", default=env("VOXGATE_WORKER_TLS_CERT"), help="certificate chain (tls://)")
    parser.add_argument("--tls-key", default=env("VOXGATE_WORKER_TLS_KEY"), help="private key (tls://)")
    parser.add_argument("--registry", default=env("VOXGATE_WORKER_REGISTRY"),
                        help="Redis URL to register in, for gateways started with -o discover=URL")
    parser.add_argument("--registry-cluster", action="store_true",
                        default=env("VOXGATE_WORKER_REGISTRY_CLUSTER", "").lower() in ("1", "true", "yes"),
                        help="--registry names a node of a Redis Cluster")
    parser.add_argument("--registry-prefix", default=env("VOXGATE_WORKER_REGISTRY_PREFIX", "voxgate:"))
    parser.add_argument("--heartbeat-s", type=float, default=1.0, help="seconds between registry renewals")
    parser.add_argument("--lease-s", type=float, default=3.0, help="seconds a registration lasts unrenewed")
    parser.add_argument("--advertise", default=env("VOXGATE_WORKER_ADVERTISE"),
                        help="the address gateways dial (default: --listen, a wildcard host made this host's)")
    parser.add_argument("--reachable-at", action="append", default=_split_env(env("VOXGATE_WORKER_REACHABLE_AT")),
                        metavar="ADDRESS", help="an address gateways reach this worker by through a forwarder (load "
                        "balancer, NAT or container port mapping), as they dial it; repeatable")
    parser.add_argument("--worker-id", default=env("VOXGATE_WORKER_ID"), help="default: HOSTNAME-PORT")
    parser.add_argument("--capacity", type=int, default=None,
                        help="streams served at once at full speed (default: the backend's, e.g. its KV slots)")
    parser.add_argument("--health-port", type=int, default=int(env("VOXGATE_WORKER_HEALTH_PORT", "0")) or None,
                        help="HTTP port for /health, /ready and /metrics")
    parser.add_argument("--health-host", default=env("VOXGATE_WORKER_HEALTH_HOST"),
                        help="address the health port binds (default: --listen's host; loopback for a Unix socket)")
    parser.add_argument("--max-text-chars", type=int, default=MAX_TEXT_CHARS,
                        help="longest text of one synthesis request (longer ones are refused)")
    parser.add_argument("--drain-timeout-s", type=float, default=float(env("VOXGATE_WORKER_DRAIN_TIMEOUT_S", "30")),
                        help="on SIGTERM: seconds open utterances get before the worker exits")
    parser.add_argument("--drain-linger-s", type=float, default=2.0,
                        help="on SIGTERM: exit once no stream has run for this long")
    parser.add_argument("--gpus", help="one worker per GPU: a list (0,1,2) or 'all'; ports count up from --listen's")
    parser.add_argument("--backend", default=env("VOXGATE_BACKEND", "qwen3"),
                        help="backend to serve (qwen3, synthetic, piper)")
    parser.add_argument("--model", default=env("VOXGATE_MODEL"), help="checkpoint folder (qwen3)")
    parser.add_argument("--device", default=env("VOXGATE_DEVICE"), help="torch device (qwen3)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="extra backend option (repeatable); values are parsed as JSON when they can be")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    if args.listen and args.socket:
        parser.error("give --listen or --socket, not both")
    return args


def backend_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if args.model:
        options["model"] = args.model
    if args.device:
        options["device"] = args.device
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--option needs KEY=VALUE, got {item!r}")
        try:
            options[key.replace("-", "_")] = json.loads(value)
        except ValueError:
            options[key.replace("-", "_")] = value
    return options


def server_from_args(args: argparse.Namespace, backend: Synthesizer) -> WorkerServer:
    """The server as the flags describe it; SystemExit with one line for a setting that cannot work."""
    try:
        listen = listen_address(args.listen, args.socket)
        token = read_token(token_file=args.token_file)
        advertise = WorkerAddress.parse(args.advertise) if args.advertise else default_advertise(listen)
        reachable_at = tuple(WorkerAddress.parse(item) for value in args.reachable_at for item in _split_env(value))
    except ValueError as exc:
        raise SystemExit(f"voxgate worker: {exc}") from None
    if listen.is_network and not listen.is_loopback and token is None and not args.insecure_no_auth:
        raise SystemExit(f"voxgate worker: listening on {listen} without a token lets anyone on the network use "
                         "this GPU; give --token-file (or VOXGATE_WORKER_TOKEN), or --insecure-no-auth")
    if args.registry and token is None:
        raise SystemExit("voxgate worker: --registry needs the token (--token-file or VOXGATE_WORKER_TOKEN): the "
                         "record is signed with it, and gateways ignore records that are not")
    tls = None
    if listen.scheme == "tls":
        if not (args.tls_cert and args.tls_key):
            raise SystemExit("voxgate worker: a tls:// address needs --tls-cert and --tls-key")
        try:
            tls = server_tls_context(args.tls_cert, args.tls_key)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"voxgate worker: cannot load the TLS certificate or key: {exc}") from None
    return WorkerServer(backend, listen, token=token, tls=tls, worker_id=args.worker_id, advertise=advertise,
                        capacity=args.capacity, drain_linger_s=args.drain_linger_s, max_text_chars=args.max_text_chars,
                        reachable_at=reachable_at,
                        model=os.path.basename(os.path.normpath(args.model)) if args.model else None)


def health_host(listen: WorkerAddress, given: str | None) -> str:
    """Where the health port binds: `given`, else the listen address's host (a wildcard stays a wildcard,
    so probes reach it from outside), loopback for a Unix socket; never wider than the worker itself."""
    if given:
        return given
    if listen.scheme == "unix" or listen.host == "localhost":
        return "127.0.0.1"
    return listen.host


async def keep_registered(server: WorkerServer, registry: WorkerRegistry, heartbeat_s: float) -> None:
    """Renew the registration every heartbeat, with the live load; a Redis outage is logged and retried
    (the lease runs out meanwhile, so gateways stop routing new sessions here, which is what they should do
    when they cannot see this worker's load)."""
    failing = False
    while True:
        try:
            await registry.announce(server.record())
            if failing:
                log.info("registered again in %s", redact(registry.url))
            failing = False
        except Exception as exc:  # noqa: BLE001 - any Redis failure: retry at the next beat
            if not failing:
                log.warning("cannot renew the registration: %s", exc)
            failing = True
        await asyncio.sleep(heartbeat_s)


async def serve(args: argparse.Namespace) -> None:
    raise_descriptor_limit()
    backend = create_backend(args.backend, **backend_options(args))
    server = server_from_args(args, backend)  # refuses bad flags before the model loads
    await backend.start()
    # As `voxgate serve` does once its backend is up: keep the cyclic collector's full passes off the
    # model's and torch's objects, whose scans would pause the engine thread for hundreds of ms.
    gc.collect()
    gc.freeze()
    await server.start()
    health = None
    if args.health_port:
        health = HealthServer(args.health_port, lambda: backend.ready and not server.draining, server.all_metrics,
                              host=health_host(server.listen, args.health_host))
        await health.start()
    registry = heartbeat = None
    if args.registry:
        registry = WorkerRegistry(args.registry, args.registry_cluster, args.registry_prefix, args.lease_s,
                                  key=registry_key(server.token))
        try:  # registered before it says it is ready; a Redis not up yet is retried by the heartbeat, not fatal
            await registry.announce(server.record())
        except Exception as exc:  # noqa: BLE001 - any Redis failure
            log.warning("cannot register in %s yet: %s", redact(args.registry), exc)
        heartbeat = asyncio.create_task(keep_registered(server, registry, args.heartbeat_s))
    listen = server.listen.with_port(server.bound_port) if server.listen.is_network else server.listen
    log.info("voxgate worker %s: %s backend ready on %s", server.worker_id, backend.name, listen)
    # One write, line and newline together: the workers of one --gpus launcher share its output, and print's
    # two writes let their lines run into each other.
    print(f"voxgate worker ready: backend={backend.name} listen={listen} id={server.worker_id}\n", end="", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        stop.clear()
        log.info("draining: open streams handed over where the gateway takes it, the others finish (at most %g s)",
                 args.drain_timeout_s)
        if registry is not None:  # tell the gateways now, not at the next beat
            server.draining = True
            with contextlib.suppress(Exception):
                await registry.announce(server.record())
        drained = asyncio.create_task(server.drain(args.drain_timeout_s))
        again = asyncio.create_task(stop.wait())  # a second signal: stop now
        await asyncio.wait({drained, again}, return_when=asyncio.FIRST_COMPLETED)
        drained.cancel()
        again.cancel()
    finally:
        if heartbeat is not None:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
        if registry is not None:
            with contextlib.suppress(Exception):
                await registry.withdraw(server.worker_id)
            await registry.close()
        if health is not None:
            await health.close()
        await server.close()
        await backend.stop()
    log.info("voxgate worker %s: stopped", server.worker_id)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(TextFormatter())  # as the gateway's text lines: fields shown, credentials masked
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    from .launcher import follow_launcher

    follow_launcher()  # a worker started by --gpus ends with its launcher
    if args.gpus:
        from .launcher import run_per_gpu

        return run_per_gpu(args, argv if argv is not None else [])
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
