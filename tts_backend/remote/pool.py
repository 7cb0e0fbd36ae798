"""The gateway's `remote` backend: sessions spread over a pool of `voxgate worker`s.

The pool is one worker on a local socket (`socket=PATH`, as before), a list (`workers=ADDR,ADDR`), or the
workers registered in Redis (`discover=REDIS_URL`, discovery.py). Every `info_refresh_s` it reads each
worker's info (readiness, capacity, live streams, queued requests, measured real-time factor, draining).

Routing. A session (`SynthesisRequest.session_key`) is placed on its first request and stays on that
worker for the rest of its life, so a backend may keep context across its sentences. It goes to the
worker with the most headroom: 1 minus its streams over its capacity; a worker with requests queued for a
place, or whose running streams' measured real-time factor reaches RTF_LIMIT, has none. The streams are
the worker's last report plus those this gateway started or ended on it since (counted the moment a
worker is chosen), so a burst of sessions within one refresh does not all land on the worker that looked
emptiest. Other gateways' placements show only at the next refresh, so the worker has the last word: a
session's first request asks it to take the session ("place"), and a worker whose capacity is in use
answers `full`, which sends the request to the next best at the cost of one round trip. `load()` is the utilization of the emptiest ready
worker, so the gateway refuses new sessions with `overloaded` only when every worker is full. A request of
an admitted session is never refused for load: it goes to the worker with the most headroom, even when
that is none, where it waits for a place (text already accepted is never dropped).

Worker death. A stream whose connection breaks before "done" (the worker was killed, its host went away)
is sent again, whole, to the worker with the most headroom that has not failed it, and the bytes (and
word timings) already delivered are dropped from the new stream, as a session resume does: with a seeded
request the audio goes on byte for byte, and the client sees only a pause. The failed worker counts as
down until it answers an info query again, and the session is bound to its new worker.

Drain. A worker that drains takes no new session; a session bound to it stays there for the utterance in
progress (the worker still serves it) and moves with its next utterance. A worker that answers
`draining` anyway (it started draining since the last refresh) is left for the next one at once.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..base import (
    AudioChunk,
    BackendMetric,
    BackendOverloadedError,
    ReferenceAudio,
    SynthesisError,
    SynthesisRequest,
    Synthesizer,
    UnknownVoiceError,
    Voice,
    WordTiming,
)
from . import framing
from .connection import Dialer, WorkerAddress, client_tls_context, read_token
from .discovery import WorkerRegistry

_ERRORS = {code: kind for kind, code in framing.ERROR_CODES.items()}
_MAX_SESSIONS = 100_000  # session bindings remembered (least recently used forgotten first)
# A worker whose running streams spend this many wall seconds per second of audio has no headroom: one more
# stream and its listeners would outrun it.
RTF_LIMIT = 0.9

log = logging.getLogger("voxgate.pool")


class WorkerLost(ConnectionError):
    """The connection to a worker failed or broke before its answer was complete."""


class WorkerDraining(RuntimeError):
    """The worker refused new work because it is draining."""


class WorkerFull(RuntimeError):
    """The worker refused to take a new session's first request: its capacity is in use."""


def _split(value: str | list | tuple | None) -> list[str]:
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [str(item).strip() for item in items if str(item).strip()]


class WorkerClient:
    """One worker of the pool: how to reach it, what it last said of itself, and what this gateway runs
    on it now."""

    def __init__(self, address: WorkerAddress, dialer: Dialer, worker_id: str | None = None) -> None:
        self.address = address
        self.dialer = dialer
        self.id = worker_id or str(address)
        self.info: dict | None = None
        self.down = False  # the last contact failed
        self.draining = False
        self.streams = 0  # streams this gateway has open on it now
        self._streams_at_info = 0

    # ---- state -------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return bool(self.info and self.info.get("ready")) and not self.down

    @property
    def routable(self) -> bool:
        return self.ready and not self.draining

    @property
    def capacity(self) -> int | None:
        value = self.info.get("capacity") if self.info else None
        return int(value) if isinstance(value, (int, float)) and value > 0 else None

    def estimated_streams(self) -> float:
        reported = float(self.info.get("streams", 0)) if self.info else 0.0
        return max(0.0, reported + self.streams - self._streams_at_info)

    def utilization(self) -> float:
        """0 idle, 1 full (see the module doc)."""
        if not self.info:
            return 1.0
        capacity = self.capacity
        by_streams = self.estimated_streams() / capacity if capacity else float(self.info.get("load", 0.0))
        queued = float(self.info.get("queued", 0) or 0)
        utilization = by_streams
        # The pace is a limit, not a measure of fill: streams that produce barely faster than real time mean
        # no room, but a pace well under it says nothing of how many more streams fit.
        if float(self.info.get("rtf", 0.0) or 0.0) >= RTF_LIMIT:
            utilization = max(utilization, 1.0)
        if queued > 0:
            utilization = max(utilization, 1.0 + queued / (capacity or 1))
        return utilization

    def mark_full(self) -> None:
        """It said it is full: count it so until its next report, for every placement of this gateway."""
        if self.info is not None and self.capacity:
            self.info = {**self.info, "streams": max(float(self.info.get("streams", 0)), self.capacity)}
            self._streams_at_info = self.streams

    def apply_info(self, info: dict) -> None:
        self.info = info
        self._streams_at_info = self.streams
        self.down = False
        self.draining = bool(info.get("draining", False))
        if isinstance(info.get("id"), str):
            self.id = info["id"]

    # ---- talking to it -----------------------------------------------------------------------------
    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await self.dialer.open(self.address)
        except OSError as exc:
            raise WorkerLost(f"worker {self.id} unreachable: {exc}") from exc

    async def query(self, op: str, timeout_s: float | None = None, **fields) -> dict:
        reader, writer = await self._open()
        try:
            writer.write(framing.encode_json({"op": op, **fields}))
            await writer.drain()
            frame = await asyncio.wait_for(framing.read_frame(reader), timeout_s)
            if frame is None or frame[0] != framing.JSON:
                raise WorkerLost(f"worker {self.id} closed the connection without answering")
            return framing.decode_json(frame[1])
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
            raise WorkerLost(f"worker {self.id}: {exc or type(exc).__name__}") from exc
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def refresh(self, timeout_s: float) -> None:
        try:
            info = await self.query("info", timeout_s)
            if info.get("op") == "error":
                raise WorkerLost(f"worker {self.id}: {info.get('message', info.get('code'))}")
            self.apply_info(info)
        except (WorkerLost, framing.ProtocolError, KeyError, TypeError, ValueError) as exc:
            if not self.down:
                if self.draining:  # the end of a drain: expected
                    log.info("worker %s (%s) has stopped after draining", self.id, self.address)
                else:
                    log.warning("worker %s (%s) is down: %s", self.id, self.address, exc)
            self.down = True

    async def stream(self, request: SynthesisRequest, place: bool = False) -> AsyncIterator[AudioChunk]:
        """The worker's chunks for `request`. place: the request places a session here, and the worker may
        answer that it is full. Raises WorkerLost when the connection fails or breaks before "done",
        WorkerDraining, WorkerFull, or the request's own error."""
        # Counted before the first await, so that placements made in the same moment see each other.
        self.streams += 1
        try:
            reader, writer = await self._open()
        except BaseException:
            self.streams -= 1
            raise
        try:
            message = {"op": "synthesize", "request": framing.request_to_json(request)}
            if place:
                message["place"] = True
            writer.write(framing.encode_json(message))
            while True:
                try:
                    await writer.drain()
                    frame = await framing.read_frame(reader)
                except (OSError, asyncio.IncompleteReadError) as exc:
                    raise WorkerLost(f"worker {self.id} broke off: {exc or type(exc).__name__}") from exc
                except framing.ProtocolError as exc:
                    raise WorkerLost(f"worker {self.id} broke off inside a frame: {exc}") from exc
                if frame is None:
                    raise WorkerLost(f"worker {self.id} closed the stream before it was done")
                kind, payload = frame
                if kind == framing.AUDIO:
                    yield AudioChunk(payload)
                    continue
                message = framing.decode_json(payload)
                if message["op"] == "words":
                    try:
                        words = tuple(WordTiming.from_json(w) for w in message["words"])
                    except (KeyError, TypeError, ValueError) as exc:
                        raise framing.ProtocolError(f"bad words frame: {exc}") from exc
                    yield AudioChunk(b"", words)
                    continue
                if message["op"] == "done":
                    return
                if message["op"] == "error":
                    code = message.get("code")
                    if code == "draining":
                        raise WorkerDraining(message.get("message", "draining"))
                    if code == "full":
                        raise WorkerFull(message.get("message", "full"))
                    if code == "unauthorized":
                        raise SynthesisError(f"worker {self.id} refused this gateway's token")
                    raise _ERRORS.get(code, SynthesisError)(message.get("message", "worker error"))
                raise framing.ProtocolError(f"unexpected op {message['op']!r}")
        finally:
            self.streams -= 1
            # Closing the connection is the cancel signal when we stop early; harmless after "done".
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


@dataclass
class _Binding:
    worker: WorkerClient
    utterance_key: str | None


class RemoteSynthesizer(Synthesizer):
    """socket: one local worker's socket path. workers: addresses (comma-separated or a list). discover: a
    Redis URL whose registry lists the workers (discover_cluster: a Redis Cluster). token / token_file: the
    workers' shared secret (default $VOXGATE_WORKER_TOKEN). tls_ca: CA file for tls:// workers.
    start() waits up to `connect_timeout_s` for a ready worker (it may still be loading its model and
    capturing graphs); `info_refresh_s`: how often each worker's info is read; `discover_refresh_s`: how
    often the registry is."""

    name = "remote"

    def __init__(self, socket: str | None = None, workers: str | list | None = None, discover: str | None = None,
                 discover_cluster: bool = False, discover_prefix: str = "voxgate:", token: str | None = None,
                 token_file: str | None = None, tls_ca: str | None = None, connect_timeout_s: float = 600.0,
                 info_refresh_s: float = 0.25, discover_refresh_s: float = 1.0, dial_timeout_s: float = 5.0) -> None:
        addresses = _split(workers)
        if socket is not None:
            addresses.insert(0, f"unix:{socket}")
        if not addresses and not discover:
            addresses = ["unix:/tmp/voxgate-worker.sock"]
        try:
            parsed = [WorkerAddress.parse(a) for a in addresses]
            token = read_token(token, token_file)
        except ValueError as exc:
            raise SynthesisError(str(exc)) from None
        tls = client_tls_context(tls_ca) if tls_ca or any(a.scheme == "tls" for a in parsed) or discover else None
        self.dialer = Dialer(token=token, tls=tls, timeout_s=dial_timeout_s)
        self.members: dict[str, WorkerClient] = {}
        for address in parsed:
            self.members[str(address)] = WorkerClient(address, self.dialer)
        self.registry = WorkerRegistry(discover, discover_cluster, discover_prefix) if discover else None
        self.connect_timeout_s = connect_timeout_s
        self.info_refresh_s = info_refresh_s
        self.discover_refresh_s = discover_refresh_s
        self._bindings: collections.OrderedDict[str, _Binding] = collections.OrderedDict()
        self._tasks: list[asyncio.Task] = []
        self._first: dict | None = None  # the info the pool's voices and rate come from
        self.failovers = 0
        self.moved_for_drain = 0
        self.placements_refused = 0

    # ---- membership --------------------------------------------------------------------------------
    async def _discover(self) -> None:
        records = await self.registry.live()
        seen = set()
        for record in records:
            try:
                address = WorkerAddress.parse(record["address"])
            except ValueError:
                log.warning("registry: worker %s has an unusable address %r", record.get("id"), record.get("address"))
                continue
            key = str(address)
            seen.add(key)
            member = self.members.get(key)
            if member is None:
                member = self.members[key] = WorkerClient(address, self.dialer, record["id"])
                log.info("worker %s joined the pool at %s", record["id"], address)
                await member.refresh(self.dialer.timeout_s)
            if record.get("draining"):
                member.draining = True
        for key, member in list(self.members.items()):
            if key not in seen:
                log.info("worker %s left the registry", member.id)
                del self.members[key]

    async def _refresh_all(self) -> None:
        members = list(self.members.values())
        if members:
            await asyncio.gather(*(m.refresh(max(1.0, self.info_refresh_s * 4)) for m in members))
        ready = [m for m in members if m.ready]
        if ready:
            self._first = ready[0].info

    def _apply_first(self) -> None:
        info = self._first
        if info is None:
            return
        self.sample_rate = int(info["sample_rate"])
        self._voices = [Voice(**v) for v in info.get("voices", [])]
        # A worker too old to say honours nothing. Text streaming needs the pool to forward what is pushed,
        # which it does not do yet: not offered, whatever the workers' backends can do.
        self.honours = frozenset(info.get("honours", ())) - {"text_streaming"}
        self.speaks_only_clones = bool(info.get("speaks_only_clones", False))
        self.name = f"remote:{info.get('name', '?')}"

    async def start(self) -> None:
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                if self.registry is not None:
                    await self._discover()
            except Exception as exc:  # noqa: BLE001 - Redis not up yet: wait as for a worker
                log.debug("registry not readable yet: %s", exc)
            await self._refresh_all()
            if self._first is not None:
                break
            if time.monotonic() > deadline:
                where = self.registry.url if self.registry else ", ".join(self.members) or "nowhere"
                raise SynthesisError(f"no ready worker at {where} after {self.connect_timeout_s:.0f} s")
            await asyncio.sleep(0.1)
        self._apply_first()
        self._tasks.append(asyncio.create_task(self._refresh_forever()))
        if self.registry is not None:
            self._tasks.append(asyncio.create_task(self._discover_forever()))

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.info_refresh_s)
            await self._refresh_all()
            self._apply_first()

    async def _discover_forever(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.discover_refresh_s)
            try:
                await self._discover()
                failing = False
            except Exception as exc:  # noqa: BLE001 - keep the last membership through a Redis outage
                if not failing:
                    log.warning("cannot read the worker registry: %s", exc)
                failing = True

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self.registry is not None:
            await self.registry.close()

    # ---- the Synthesizer interface -----------------------------------------------------------------
    _voices: list[Voice] = []

    @property
    def ready(self) -> bool:
        return any(m.ready for m in self.members.values())

    def voices(self) -> list[Voice]:
        return list(self._voices)

    @property
    def default_voice(self) -> str:
        if self._first and self._first.get("default_voice"):
            return self._first["default_voice"]
        return super().default_voice

    def load(self) -> float:
        routable = [m for m in self.members.values() if m.routable]
        return min((m.utilization() for m in routable), default=1.0)

    def capacity(self) -> int | None:
        capacities = [m.capacity for m in self.members.values() if m.routable]
        return sum(c for c in capacities if c) or None

    def queued(self) -> int:
        return sum(int(m.info.get("queued", 0) or 0) for m in self.members.values() if m.ready and m.info)

    # ---- routing -----------------------------------------------------------------------------------
    def _best(self, exclude: set[WorkerClient] = frozenset()) -> WorkerClient | None:
        candidates = [m for m in self.members.values() if m.routable and m not in exclude]
        if not candidates:  # nothing takes new sessions: a draining one still beats failing the request
            candidates = [m for m in self.members.values() if m.ready and m not in exclude]
        if not candidates:
            return None
        return min(candidates, key=lambda m: (m.utilization(), m.estimated_streams(), random.random()))

    def _worker_for(self, request: SynthesisRequest, failed: set[WorkerClient],
                    full: set[WorkerClient]) -> tuple[WorkerClient, bool]:
        """The worker for `request`, and whether the request places its session there (the worker may then
        say it is full, and the next best is asked). failed: workers that failed this request; full: those
        that said they are full to it."""
        key = request.session_key or request.utterance_key or request.request_id
        binding = self._bindings.get(key) if key else None
        if binding is not None and binding.worker not in failed and binding.worker not in full \
                and binding.worker.ready and self.members.get(str(binding.worker.address)) is binding.worker:
            if not binding.worker.draining or binding.utterance_key == request.utterance_key:
                binding.utterance_key = request.utterance_key
                self._bindings.move_to_end(key)
                return binding.worker, False
            self.moved_for_drain += 1
        worker = self._best(failed | full)
        placing = worker is not None
        if worker is None:  # every worker said it is full: the emptiest takes it, where it waits for a place
            worker = self._best(failed)
        if worker is None:
            raise SynthesisError("no worker is reachable" if not exclude else
                                 "the worker serving this sentence failed and no other worker is reachable")
        if key:
            self._bindings[key] = _Binding(worker, request.utterance_key)
            self._bindings.move_to_end(key)
            while len(self._bindings) > _MAX_SESSIONS:
                self._bindings.popitem(last=False)
        return worker, placing

    async def synthesize(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        self.refuse_text_stream(request)
        if request.voice_prompt is None and self._voices and not self.has_voice(request.voice):
            raise UnknownVoiceError(f"unknown voice {request.voice!r}")
        delivered = 0  # audio bytes yielded so far
        words_delivered = 0
        failed: set[WorkerClient] = set()
        full: set[WorkerClient] = set()
        lost_at: float | None = None
        lost_from: WorkerClient | None = None
        while True:
            worker, placing = self._worker_for(request, failed, full)
            skip_bytes, skip_words = delivered, words_delivered
            try:
                async for chunk in worker.stream(request, place=placing):
                    words = chunk.words
                    if words and skip_words:
                        words, skip_words = words[skip_words:], max(0, skip_words - len(words))
                    pcm = chunk.pcm
                    if pcm and skip_bytes:
                        pcm, skip_bytes = pcm[skip_bytes:], max(0, skip_bytes - len(pcm))
                    if not pcm and not words:
                        continue
                    if lost_at is not None and pcm:
                        pause_ms = (time.monotonic() - lost_at) * 1000
                        log.info("failover session=%s sentence=%s from=%s to=%s pause_ms=%.1f", request.session_key,
                                 request.request_id.rpartition("/")[2], lost_from.id, worker.id, pause_ms)
                        lost_at = None
                    delivered += len(pcm)
                    words_delivered += len(words)
                    yield AudioChunk(pcm, words)
                return
            except WorkerDraining:
                worker.draining = True
                failed.add(worker)
            except WorkerFull:
                worker.mark_full()
                full.add(worker)
                self.placements_refused += 1
            except WorkerLost as exc:
                worker.down = True
                failed.add(worker)
                self.failovers += 1
                if lost_at is None:
                    lost_at, lost_from = time.monotonic(), worker
                log.warning("worker %s lost a stream of session %s (%s); sending it to another worker",
                            worker.id, request.session_key, exc)

    async def clone_voice(self, reference: ReferenceAudio, x_vector_only: bool = False) -> bytes:
        if not self.can_clone:  # as the workers said in their info
            return await super().clone_voice(reference, x_vector_only)
        failed: set[WorkerClient] = set()
        while True:
            worker = self._best(failed)
            if worker is None:
                raise BackendOverloadedError("no worker is reachable to clone the voice")
            try:
                answer = await worker.query("clone", samples=base64.b64encode(reference.samples).decode(),
                                            ref_text=reference.ref_text, x_vector_only=x_vector_only)
                break
            except WorkerLost as exc:
                log.warning("cloning on worker %s failed: %s", worker.id, exc)
                worker.down = True
                failed.add(worker)
        if answer.get("op") == "error":
            raise _ERRORS.get(answer.get("code"), SynthesisError)(answer.get("message", "worker error"))
        if answer.get("op") != "clone":
            raise framing.ProtocolError(f"unexpected op {answer.get('op')!r}")
        return framing.decode_base64(answer.get("prompt"), "prompt")

    async def metrics(self) -> list[BackendMetric]:
        """The pool's own metrics, and the workers' (their backends' and their own) summed by name and
        labels across workers, read at each call (the gateway's scrape bounds how long it waits). An
        unreachable worker, or one too old to know the op, adds none."""
        members = list(self.members.values())

        async def of(member: WorkerClient) -> list[BackendMetric]:
            try:
                answer = await member.query("metrics", 5.0)
                if answer.get("op") != "metrics":
                    return []
                return [BackendMetric.from_json(m) for m in answer.get("metrics", [])]
            except (WorkerLost, framing.ProtocolError, KeyError, TypeError, ValueError):
                log.debug("no metrics from worker %s", member.id, exc_info=True)
                return []

        summed: dict[str, BackendMetric] = {}
        values: dict[str, dict[tuple[str, ...], float]] = {}
        for family in [m for ms in await asyncio.gather(*(of(m) for m in members)) for m in ms]:
            if family.name not in summed:
                summed[family.name] = family
                values[family.name] = {}
            if summed[family.name].labels != family.labels:
                continue
            for labels, value in family.samples:
                values[family.name][labels] = values[family.name].get(labels, 0.0) + value
        states = collections.Counter("down" if not m.ready else "draining" if m.draining else "ready" for m in members)
        own = [
            BackendMetric("pool_workers", "gauge", "Workers of the pool by state", ("state",),
                          tuple(((state,), float(states.get(state, 0))) for state in ("ready", "draining", "down"))),
            BackendMetric("pool_streams", "gauge", "Streams this gateway runs on each worker", ("worker",),
                          tuple(((m.id,), float(m.streams)) for m in members)),
            BackendMetric("pool_failovers", "counter", "Streams sent again to another worker after theirs failed",
                          samples=(((), float(self.failovers)),)),
            BackendMetric("pool_drain_moves", "counter", "Sessions moved off a draining worker at a new utterance",
                          samples=(((), float(self.moved_for_drain)),)),
            BackendMetric("pool_placements_refused", "counter", "Session placements a worker refused as full "
                          "(the next best was asked)", samples=(((), float(self.placements_refused)),)),
        ]
        return own + [BackendMetric(f.name, f.kind, f.help, f.labels, tuple(values[f.name].items()))
                      for f in summed.values()]
