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
goes on on the worker with the most headroom that has not failed it. Where the workers have codes
("resume_codes", base.py), it goes on from the codes of the chunks delivered whole (each chunk's C frames
follow its audio, framing.py): the new worker continues the same take after those frames, and only the
audio delivered past them (part of a chunk) is dropped from its start, so the pause is one prefill, not the
delivered part made again (issue 33). Otherwise it is sent again whole and the bytes already delivered are
dropped from the new stream, as a session resume does: with a seeded request the audio goes on byte for
byte where numerics do not depend on the batch (the CPU). Either way word timings already delivered are
dropped, and the client sees only a pause. The failed worker counts as down until it answers an info
query again, and the session is bound to its new worker.

Trust. A worker is used only once it has proved, on every connection and before any text is sent, that it
holds the shared token and answers at the address the connection reached (connection.py: a relay at
another address gets no proof), and a worker found in the registry only through a record signed with that
token (discovery.py), whose id it must prove too, as must a static member listed as `ID@ADDRESS`. Whatever a worker sends is bounded before it is
believed: frame sizes (framing.py), an info answer's every field (a sample rate of 8-48 kHz, numbers that are
numbers), and per sentence the audio (MAX_SECONDS_PER_CHAR of the text's characters, at the worker's rate),
the word timings (one per character at most). A worker that breaks one of these bounds (or sends a bad
frame) is set aside for QUARANTINE_S (logged, counted in voxgate_pool_workers_quarantined_total) and its
sentence goes to another worker as if it had died; with no other worker the sentence fails with a
retryable error, never silence.

Deadlines. A worker whose backend is still working on a sentence (queued for an engine slot, waiting for
the forced aligner's word timings) says so: it sends {"op": "wait"} after every
framing.KEEPALIVE_S (1 s) without output (framing.py; only to a gateway that asks with "keepalive": true,
as this one does). Any frame, a keep-alive included, proves the worker alive, so the deadline
for the next frame is first_audio_timeout_s (10 s) until the worker's first frame and chunk_timeout_s (5 s)
after each: with keep-alives it catches only a worker that is truly silent (hung, dead, hostile), however
slow its backend; a worker too old to send keep-alives is held to the same deadlines as before. So that no
worker can stall a sentence forever, its waits are bounded in all too: the silent waits (those ended by
audio, words or nothing) by first_audio_timeout_s plus as long as the most audio it may send would last,
as before, and the waits ended by keep-alives by a further KEEPALIVE_WAIT_S (60 s) per sentence, past which
they count as silence. A sentence kept waiting longer than that is no use to a live caller; the cap is
separate and larger because a slow backend under load is not a misbehaving one. (A text stream's waits
for its text are the caller's and count nowhere.) Word timings that come after a sentence's audio (the
worker's "audio_ended" frame says so) are waited for by the gateway for far less than these deadlines
(gateway/session/word_times.py), and then it closes the stream: late timings are never a worker's fault.
A deadline miss proves the worker slow or stuck, not hostile: its sentence goes to another worker, or, with
none, fails with a retryable error, but the worker stays in the pool (its info queries say whether it is
alive) and is set aside only while another worker is ready, so that a slow worker under load sheds its
sessions to the others but overload of the only worker never turns into a QUARANTINE_S outage of new
sessions.

Drain. A worker that drains takes no new session. It hands this gateway's open streams over
({"op": "handover"} after a chunk, framing.py): each goes on from its codes on another worker, as after a
death but without counting the worker down, and the worker exits once they are all handed over. With no
other worker ready, the stream goes back to the draining worker from its codes, asking for no hand-over,
and it serves it to the end (the audio degrades to a pause, never fails). A worker without codes keeps
serving the utterance in progress, which moves with its next utterance. A worker that answers `draining`
(it started draining since the last refresh) is left for the next one at once.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import dataclasses
import logging
import math
import random
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..base import (
    MAX_CODEBOOKS,
    MAX_FRAME_RATE,
    MAX_SECONDS_PER_CHAR,
    MIN_SENTENCE_S,
    AudioChunk,
    BackendMetric,
    BackendOverloadedError,
    ReferenceAudio,
    SynthesisError,
    SynthesisRequest,
    Synthesizer,
    TextStream,
    UnknownVoiceError,
    Voice,
    WordTiming,
    max_code_bytes,
)
from ..log_format import redact
from . import framing
from .connection import Dialer, WorkerAddress, client_tls_context, read_token
from .discovery import WorkerRegistry, registry_key

_ERRORS = {code: kind for kind, code in framing.ERROR_CODES.items()}
_MAX_SESSIONS = 100_000  # session bindings remembered (least recently used forgotten first)
# Text frames carry at most this many characters: JSON escapes one as up to 12 bytes (a non-BMP character
# as two \u escapes), which keeps a frame under framing.MAX_CONTROL_FRAME.
_TEXT_PIECE_CHARS = 4096
# A worker whose running streams spend this many wall seconds per second of audio has no headroom: one more
# stream and its listeners would outrun it.
RTF_LIMIT = 0.9
# What a gateway believes of a worker (see the module doc).
SAMPLE_RATES = (8000, 48000)  # the lowest and highest sample rate a worker may say it has
MAX_VOICES = 10_000
QUARANTINE_S = 30.0  # a worker that broke a bound gets no stream for this long
KEEPALIVE_WAIT_S = 60.0  # per sentence, waits a worker's keep-alives cover, on top of the silent ones (module doc)

log = logging.getLogger("voxgate.pool")


class WorkerLost(ConnectionError):
    """The connection to a worker failed or broke before its answer was complete."""


class WorkerMisbehaved(WorkerLost):
    """The worker sent what no worker of this version sends (too much, malformed): it is set aside and its
    work goes elsewhere."""


class WorkerHandedOver(WorkerLost):
    """The worker drains and handed the stream over after its last whole chunk: it goes on elsewhere."""


class WorkerTimedOut(WorkerLost):
    """The worker kept a sentence waiting past its deadline (module doc): slow or stuck, not proved hostile;
    its work goes elsewhere."""


def _number(info: dict, name: str, default: float = 0.0) -> float:
    value = info.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise framing.ProtocolError(f"info.{name} is {str(value)[:40]!r}, not a number >= 0")
    return float(value)


def checked_info(info: dict) -> dict:
    """A worker's info answer with every field the pool reads checked and normalised; a ProtocolError
    names the first that is not what a worker sends."""
    rate = info.get("sample_rate")
    if isinstance(rate, bool) or not isinstance(rate, int) or not SAMPLE_RATES[0] <= rate <= SAMPLE_RATES[1]:
        raise framing.ProtocolError(f"info.sample_rate is {str(rate)[:40]!r}, not a whole number of "
                                    f"{SAMPLE_RATES[0]}-{SAMPLE_RATES[1]} Hz")
    capacity = info.get("capacity")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
        raise framing.ProtocolError(f"info.capacity is {str(capacity)[:40]!r}, not a whole number >= 1")
    voices = info.get("voices", [])
    if not isinstance(voices, list) or len(voices) > MAX_VOICES:
        raise framing.ProtocolError("info.voices is not a list of voices")
    try:
        parsed = [Voice(**v) for v in voices]
    except TypeError as exc:
        raise framing.ProtocolError(f"info.voices: {exc}") from None
    if not all(isinstance(v.id, str) and isinstance(v.name, str) for v in parsed):
        raise framing.ProtocolError("info.voices: a voice's id and name must be strings")
    honours = info.get("honours", [])
    if not isinstance(honours, list) or not all(isinstance(h, str) for h in honours):
        raise framing.ProtocolError("info.honours is not a list of strings")
    codebooks = info.get("codebooks", 0)
    if isinstance(codebooks, bool) or not isinstance(codebooks, int) or not 0 <= codebooks <= MAX_CODEBOOKS:
        raise framing.ProtocolError(f"info.codebooks is {str(codebooks)[:40]!r}, not a whole number of "
                                    f"0-{MAX_CODEBOOKS}")
    frame_rate = _number(info, "frame_rate")
    if frame_rate > MAX_FRAME_RATE or (codebooks and not frame_rate):
        raise framing.ProtocolError(f"info.frame_rate is {frame_rate!r}, not a rate of 0-{MAX_FRAME_RATE:g} "
                                    "frames a second")
    for name in ("id", "name", "default_voice"):
        if info.get(name) is not None and not isinstance(info[name], str):
            raise framing.ProtocolError(f"info.{name} is not a string")
    return {
        **info, "sample_rate": rate, "capacity": capacity, "voices": voices, "honours": honours,
        "ready": info.get("ready") is True, "draining": info.get("draining") is True,
        "speaks_only_clones": info.get("speaks_only_clones") is True,
        "streams": _number(info, "streams"), "queued": _number(info, "queued"), "rtf": _number(info, "rtf"),
        "load": _number(info, "load"), "codebooks": codebooks, "frame_rate": frame_rate,
    }


def max_audio_bytes(text: str, sample_rate: int) -> int:
    """The most s16 audio a worker may send for `text` (see MAX_SECONDS_PER_CHAR)."""
    return int((MIN_SENTENCE_S + MAX_SECONDS_PER_CHAR * len(text)) * sample_rate) * 2


class WorkerDraining(RuntimeError):
    """The worker refused new work because it is draining."""


class WorkerFull(RuntimeError):
    """The worker refused to take a new session's first request: its capacity is in use."""


def _split(value: str | list | tuple | None) -> list[str]:
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [str(item).strip() for item in items if str(item).strip()]


def pinned_member(item: str) -> tuple[str | None, WorkerAddress]:
    """A static member as `workers=` lists it: an address, or `ID@ADDRESS`, the id the worker at that address
    must prove it has (its --worker-id) on every connection."""
    item = item.strip()
    worker_id = None
    if not item.startswith(("/", "unix:", "tcp://", "tls://")) and "@" in item:
        worker_id, item = item.split("@", 1)
        if not worker_id:
            raise ValueError(f"worker {item!r}: write ID@ADDRESS, or the address alone")
    return worker_id, WorkerAddress.parse(item)


class WorkerClient:
    """One worker of the pool: how to reach it, what it last said of itself, and what this gateway runs
    on it now."""

    def __init__(self, address: WorkerAddress, dialer: Dialer, worker_id: str | None = None, *,
                 first_audio_timeout_s: float = 10.0, chunk_timeout_s: float = 5.0) -> None:
        self.address = address
        self.dialer = dialer
        self.id = worker_id or str(address)
        # A worker found in the registry must prove it is the one its signed record names; a static member
        # with an id (pinned_member), that one.
        self.expected_id = worker_id
        self.first_audio_timeout_s = first_audio_timeout_s
        self.chunk_timeout_s = chunk_timeout_s
        self.info: dict | None = None
        self.down = False  # the last contact failed
        self.draining = False
        self.streams = 0  # streams this gateway has open on it now
        # ...of which the worker has not answered yet: a report it makes meanwhile may not count them (their
        # request may still be in the handshake or on its way), so they are counted on top of it.
        self._opening = 0
        self._streams_at_info = 0
        self.quarantined_until = 0.0  # monotonic; it broke a bound (module doc)
        self.wrong_rate = False  # its sample rate is not the pool's

    # ---- state -------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return bool(self.info and self.info.get("ready")) and not self.down and not self.wrong_rate \
            and time.monotonic() >= self.quarantined_until

    @property
    def resumes(self) -> bool:
        """It tells codes and continues from them (base.py's "resume_codes")."""
        return bool(self.info and "resume_codes" in self.info["honours"] and self.info["codebooks"])

    def quarantine(self, why: str) -> None:
        log.warning("worker %s (%s) set aside for %g s: %s", self.id, self.address, QUARANTINE_S, why)
        self.quarantined_until = time.monotonic() + QUARANTINE_S

    @property
    def routable(self) -> bool:
        return self.ready and not self.draining

    @property
    def capacity(self) -> int | None:
        return self.info["capacity"] if self.info else None

    def estimated_streams(self) -> float:
        reported = self.info["streams"] if self.info else 0.0
        return max(0.0, reported + self.streams - self._streams_at_info)

    def utilization(self) -> float:
        """0 idle, 1 full (see the module doc)."""
        if not self.info:
            return 1.0
        capacity = self.capacity
        by_streams = self.estimated_streams() / capacity if capacity else self.info["load"]
        queued = self.info["queued"]
        utilization = by_streams
        # The pace is a limit, not a measure of fill: streams that produce barely faster than real time mean
        # no room, but a pace well under it says nothing of how many more streams fit.
        if self.info["rtf"] >= RTF_LIMIT:
            utilization = max(utilization, 1.0)
        if queued > 0:
            utilization = max(utilization, 1.0 + queued / (capacity or 1))
        return utilization

    def mark_full(self) -> None:
        """It said it is full: count it so until its next report, for every placement of this gateway."""
        if self.info is not None and self.capacity:
            self.info = {**self.info, "streams": max(self.info["streams"], float(self.capacity))}
            self._streams_at_info = self.streams - self._opening

    def apply_info(self, info: dict) -> None:
        """A checked_info answer."""
        self.info = info
        self._streams_at_info = self.streams - self._opening
        self.down = False
        self.draining = info["draining"]
        if info.get("id") is not None:
            self.id = info["id"]

    # ---- talking to it -----------------------------------------------------------------------------
    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await self.dialer.open(self.address, self.expected_id)
        except OSError as exc:
            raise WorkerLost(f"worker {self.id} unreachable: {exc}") from exc

    async def query(self, op: str, timeout_s: float | None = None, max_answer: int = framing.MAX_ANSWER_FRAME,
                    **fields) -> dict:
        reader, writer = await self._open()
        try:
            writer.write(framing.encode_json({"op": op, **fields}))
            await writer.drain()
            frame = await asyncio.wait_for(framing.read_frame(reader, max_answer), timeout_s)
            if frame is None or frame[0] != framing.JSON:
                raise WorkerLost(f"worker {self.id} closed the connection without answering")
            if len(frame[1]) > framing.MAX_STREAM_FRAME:  # a clone's prompt: milliseconds of parsing, off the loop
                return await asyncio.to_thread(framing.decode_json, frame[1])
            return framing.decode_json(frame[1])
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
            raise WorkerLost(f"worker {self.id}: {exc or type(exc).__name__}") from exc
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def refresh(self, timeout_s: float) -> None:
        """Read its info; never raises. A query whose connection failed is tried once more before the worker
        counts as down (one lost connection, a handshake a worker under a flood of connections dropped, is no
        sign of death); any other failure, whatever the worker sent, marks it down at once (logged once)."""
        try:
            try:
                info = await self.query("info", timeout_s)
            except WorkerLost:
                info = await self.query("info", timeout_s)
            if info.get("op") == "error":
                raise WorkerLost(f"worker {self.id}: {str(info.get('message', info.get('code')))[:200]}")
            if info.get("op") != "info":
                raise framing.ProtocolError(f"answered info with op {str(info.get('op'))[:40]!r}")
            self.apply_info(checked_info(info))
        except Exception as exc:  # noqa: BLE001 - a worker's answer, however wrong, only makes it down
            if not self.down:
                if self.draining:  # the end of a drain: expected
                    log.info("worker %s (%s) has stopped after draining", self.id, self.address)
                else:
                    log.warning("worker %s (%s) is down: %s", self.id, self.address, exc)
            self.down = True

    async def stream(self, request: SynthesisRequest, place: bool = False,
                     handover: bool = True) -> AsyncIterator[AudioChunk]:
        """The worker's chunks for `request`. place: the request places a session here, and the worker may
        answer that it is full. handover: a draining worker may hand the stream over (framing.py); without,
        it serves it to the end (the pool's last worker). Raises WorkerLost when the connection fails or breaks
        before "done" (WorkerMisbehaved when the worker breaks a bound, see the module doc; WorkerHandedOver
        when it hands the stream over), WorkerDraining, WorkerFull, or the request's own error."""
        # Counted before the first await, so that placements made in the same moment see each other.
        self.streams += 1
        self._opening += 1
        try:
            reader, writer = await self._open()
        except BaseException:
            self.streams -= 1
            self._opening -= 1
            raise
        rate = self.info["sample_rate"] if self.info else SAMPLE_RATES[1]
        # A text stream's bounds grow with its text (request.full_text): what it may send, and how long it
        # may keep the request waiting, count the text pushed so far.
        audio_sent = words_sent = 0
        # Seconds the worker kept this request waiting, all waits together, and of those the waits its
        # keep-alives ended: at most the first frame's wait and the time the most audio it may send would
        # last, plus KEEPALIVE_WAIT_S of kept-alive waits (module doc).
        waited_s = alive_s = 0.0
        first = True
        forward = None
        opening = True
        try:
            # keepalive: this gateway takes {"op": "wait"} frames (module doc), and audio_ended the frame that
            # says only words may follow (framing.py); a worker sends them only then.
            # codes and handover: C frames, and {"op": "handover"} when it drains (framing.py).
            message = {"op": "synthesize", "request": framing.request_to_json(request), "keepalive": True,
                       "audio_ended": True, "codes": True, "handover": handover}
            codebooks = self.info["codebooks"] if self.info else 0
            frame_rate = self.info["frame_rate"] if self.info else 0.0
            codes_sent = 0
            if place:
                message["place"] = True
            if request.text_stream is not None:
                message["text_stream"] = True
            writer.write(framing.encode_json(message))
            try:
                await writer.drain()
            except OSError as exc:
                raise WorkerLost(f"worker {self.id} broke off: {exc or type(exc).__name__}") from exc
            if request.text_stream is not None:
                forward = asyncio.ensure_future(_forward_text(request, writer))
            while True:
                audio_cap = max_audio_bytes(request.full_text, rate)
                wait_left = self.first_audio_timeout_s + audio_cap / (2 * rate) + min(alive_s, KEEPALIVE_WAIT_S) \
                    - waited_s
                deadline = min(self.first_audio_timeout_s if first else self.chunk_timeout_s, wait_left)
                try:
                    frame, waited = await _next_frame(reader, deadline, request.text_stream)
                    waited_s += waited
                except asyncio.TimeoutError:
                    why = "sent nothing" if deadline < wait_left else "kept this sentence waiting too long, last"
                    raise WorkerTimedOut(f"worker {self.id} {why} for {deadline:.1f} s") from None
                except (OSError, asyncio.IncompleteReadError) as exc:
                    raise WorkerLost(f"worker {self.id} broke off: {exc or type(exc).__name__}") from exc
                except framing.ProtocolError as exc:
                    raise WorkerMisbehaved(f"worker {self.id} sent a bad frame: {exc}") from exc
                first = False
                if opening:  # the worker answered: it counts this stream in its reports from now on
                    self._opening -= 1
                    opening = False
                if frame is None:
                    raise WorkerLost(f"worker {self.id} closed the stream before it was done")
                kind, payload = frame
                if kind == framing.AUDIO:
                    audio_sent += len(payload)
                    if audio_sent > audio_cap or len(payload) % 2:
                        raise WorkerMisbehaved(f"worker {self.id} sent more audio than {len(request.full_text)} "
                                               "characters can hold, or a partial sample")
                    yield AudioChunk(payload)
                elif kind == framing.CODES:
                    codes_sent += len(payload)
                    if not codebooks or len(payload) % (2 * codebooks) or \
                            codes_sent > max_code_bytes(codebooks, frame_rate, len(request.full_text)):
                        raise WorkerMisbehaved(f"worker {self.id} sent codes that are not whole frames of its "
                                               f"{codebooks} codebooks, or more than {len(request.full_text)} "
                                               "characters can make")
                    yield AudioChunk(b"", codes=payload)
                else:
                    try:
                        message = framing.decode_json(payload)
                    except framing.ProtocolError as exc:
                        raise WorkerMisbehaved(f"worker {self.id} sent a bad frame: {exc}") from exc
                    op = message["op"]
                    if op == "wait":  # a keep-alive: proof of life, nothing to deliver
                        alive_s += waited
                    elif op == "audio_ended":
                        yield AudioChunk(b"", audio_ended=True)
                    elif op == "words":
                        words = _words(message.get("words"), self.id)
                        words_sent += len(words)
                        if words_sent > len(request.full_text) + 16:
                            raise WorkerMisbehaved(f"worker {self.id} sent more word timings than the text has "
                                                   "characters")
                        yield AudioChunk(b"", words)
                    elif op == "done":
                        return
                    elif op == "handover":
                        raise WorkerHandedOver(f"worker {self.id} drains and handed the stream over")
                    elif op == "error":
                        raise _worker_error(message, self.id)
                    else:
                        raise WorkerMisbehaved(f"worker {self.id} sent op {str(op)[:40]!r} in a stream")
                # Frames that were already buffered are read without a pause: let the rest of the gateway (its
                # /health, its other sessions) run between any two of them, however fast the worker sends.
                await asyncio.sleep(0)
        finally:
            self.streams -= 1
            if forward is not None:
                forward.cancel()
            if opening:
                self._opening -= 1
            # Closing the connection is the cancel signal when we stop early; harmless after "done".
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def _words(value: object, worker_id: str) -> tuple[WordTiming, ...]:
    if not isinstance(value, list):
        raise WorkerMisbehaved(f"worker {worker_id} sent a words frame without a list of words")
    try:
        return tuple(WordTiming.from_json(w) for w in value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise WorkerMisbehaved(f"worker {worker_id} sent a bad word timing: {str(exc)[:100]}") from None


def _worker_error(message: dict, worker_id: str) -> Exception:
    code, text = message.get("code"), str(message.get("message", "worker error"))[:500]
    code = code if isinstance(code, str) else None
    if code == "draining":
        return WorkerDraining(text)
    if code == "full":
        return WorkerFull(text)
    if code == "unauthorized":
        return SynthesisError(f"worker {worker_id} refused this gateway's token")
    return _ERRORS.get(code, SynthesisError)(text)


async def _next_frame(reader: asyncio.StreamReader, timeout_s: float,
                      text_stream: TextStream | None) -> tuple[tuple[bytes, bytes] | None, float]:
    """The worker's next frame and the seconds of waiting for it that count against the worker. While a
    text stream's text is still coming, a worker that sends nothing may be waiting for text (the caller's
    time, however long the caller takes): no timeout then; from the text's end on, the wait counts."""
    read = asyncio.ensure_future(framing.read_frame(reader, framing.MAX_STREAM_FRAME))
    try:
        while text_stream is not None and not text_stream.finished:
            finished = asyncio.ensure_future(text_stream.wait_beyond(sys.maxsize))  # wakes at finish() only
            try:
                await asyncio.wait({read, finished}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                finished.cancel()
            if read.done():
                return read.result(), 0.0
        started = time.monotonic()
        done, _ = await asyncio.wait({read}, timeout=max(0.0, timeout_s))
        if not done:
            raise asyncio.TimeoutError
        return read.result(), time.monotonic() - started
    finally:
        if not read.done():
            read.cancel()


async def _forward_text(request: SynthesisRequest, writer: asyncio.StreamWriter) -> None:
    """A text stream's text after the request's own, as it comes, then its end, as frames on the request's
    connection (framing.py). From the start each time: a stream sent again to another worker after its
    worker failed gets all the text pushed so far at once, then the rest as it comes."""
    with contextlib.suppress(ConnectionError, RuntimeError):  # a broken connection: the reader sees it
        async for piece in request.text_stream.pieces(len(request.text)):
            for start in range(0, len(piece), _TEXT_PIECE_CHARS):  # under the worker's text frame bound
                writer.write(framing.encode_json({"op": "text", "text": piece[start: start + _TEXT_PIECE_CHARS]}))
            await writer.drain()
        writer.write(framing.encode_json({"op": "text_done"}))
        await writer.drain()


@dataclass
class _Binding:
    worker: WorkerClient
    utterance_key: str | None


class RemoteSynthesizer(Synthesizer):
    """socket: one local worker's socket path. workers: addresses (comma-separated or a list), each may be
    written ID@ADDRESS to pin the id the worker there must prove (pinned_member). discover: a
    Redis URL whose registry lists the workers (discover_cluster: a Redis Cluster). token / token_file: the
    workers' shared secret (default $VOXGATE_WORKER_TOKEN); discovery needs it (records are signed with it).
    tls_ca: CA file for tls:// workers. start() waits up to `connect_timeout_s` for a ready worker (it may
    still be loading its model and capturing graphs); `info_refresh_s`: how often each worker's info is
    read; `discover_refresh_s`: how often the registry is. first_audio_timeout_s / chunk_timeout_s: how long
    a worker may keep a sentence waiting for its first frame / each next one before it is set aside and the
    sentence goes to another worker."""

    name = "remote"

    def __init__(self, socket: str | None = None, workers: str | list | None = None, discover: str | None = None,
                 discover_cluster: bool = False, discover_prefix: str = "voxgate:", token: str | None = None,
                 token_file: str | None = None, tls_ca: str | None = None, connect_timeout_s: float = 600.0,
                 info_refresh_s: float = 0.25, discover_refresh_s: float = 1.0, dial_timeout_s: float = 5.0,
                 first_audio_timeout_s: float = 10.0, chunk_timeout_s: float = 5.0) -> None:
        addresses = _split(workers)
        if socket is not None:
            addresses.insert(0, f"unix:{socket}")
        if not addresses and not discover:
            addresses = ["unix:/tmp/voxgate-worker.sock"]
        try:
            pinned = [pinned_member(a) for a in addresses]
            parsed = [address for _, address in pinned]
            token = read_token(token, token_file)
        except ValueError as exc:
            raise SynthesisError(str(exc)) from None
        if discover and token is None:
            raise SynthesisError("discover= needs the workers' token (token_file=, token= or $VOXGATE_WORKER_TOKEN): "
                                 "registry records are signed with it, and only signed ones are used")
        self._timeouts = {"first_audio_timeout_s": float(first_audio_timeout_s),
                          "chunk_timeout_s": float(chunk_timeout_s)}
        tls = client_tls_context(tls_ca) if tls_ca or any(a.scheme == "tls" for a in parsed) or discover else None
        self.dialer = Dialer(token=token, tls=tls, timeout_s=dial_timeout_s)
        self.members: dict[str, WorkerClient] = {}
        for worker_id, address in pinned:
            self.members[str(address)] = WorkerClient(address, self.dialer, worker_id, **self._timeouts)
        self.registry = WorkerRegistry(discover, discover_cluster, discover_prefix,
                                       key=registry_key(token)) if discover else None
        self.connect_timeout_s = connect_timeout_s
        self.info_refresh_s = info_refresh_s
        self.discover_refresh_s = discover_refresh_s
        self._bindings: collections.OrderedDict[str, _Binding] = collections.OrderedDict()
        self._tasks: list[asyncio.Task] = []
        self._first: dict | None = None  # the info the pool's voices and rate come from
        self.failovers = 0
        self.handovers = 0
        self.resumed_from_codes = 0  # streams gone on from their codes after a failover or a hand-over
        # The pauses failovers and hand-overs cost a listener (lost to the next audio), the last few, for
        # benchmarks and tests.
        self.pauses_ms: collections.deque[float] = collections.deque(maxlen=1024)
        self.moved_for_drain = 0
        self.placements_refused = 0
        self.quarantined = 0
        self._rate: int | None = None  # the pool's sample rate: the first ready worker's, for good

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
                member = self.members[key] = WorkerClient(address, self.dialer, record["id"], **self._timeouts)
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
        if self._rate is None:
            self._rate = next((m.info["sample_rate"] for m in members if m.ready), None)
        for member in members:
            # Audio is bytes at the pool's rate: a worker at another rate would be played at the wrong speed.
            wrong = member.info is not None and self._rate is not None and member.info["sample_rate"] != self._rate
            if wrong and not member.wrong_rate:
                log.warning("worker %s (%s) runs at %d Hz, the pool at %d Hz: not used", member.id, member.address,
                            member.info["sample_rate"], self._rate)
            member.wrong_rate = wrong
        ready = [m for m in members if m.ready]
        if ready:
            self._first = ready[0].info

    def _apply_first(self) -> None:
        info = self._first
        if info is None:
            return
        self.sample_rate = self._rate
        self._voices = [Voice(**v) for v in info.get("voices", [])]
        self.honours = frozenset(info.get("honours", ()))  # a worker too old to say honours nothing
        self.codebooks = info["codebooks"]
        self.frame_rate = info["frame_rate"]
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
                where = redact(self.registry.url) if self.registry else ", ".join(self.members) or "nowhere"
                raise SynthesisError(f"no ready worker at {where} after {self.connect_timeout_s:.0f} s")
            await asyncio.sleep(0.1)
        self._apply_first()
        self._tasks.append(asyncio.create_task(self._refresh_forever()))
        if self.registry is not None:
            self._tasks.append(asyncio.create_task(self._discover_forever()))

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.info_refresh_s)
            try:
                await self._refresh_all()
                self._apply_first()
            except Exception:  # noqa: BLE001 - the pool must go on following its workers whatever happened
                log.exception("refreshing the workers' info failed; trying again")

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
        return sum(int(m.info["queued"]) for m in self.members.values() if m.ready and m.info)

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
            raise SynthesisError("no worker is reachable" if not failed else
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
        codes = bytearray()  # codes yielded so far (after the request's own resume_codes)
        past_codes = 0  # audio bytes yielded after the chunk that carried the last of them
        failed: set[WorkerClient] = set()
        full: set[WorkerClient] = set()
        lost_at: float | None = None
        lost_from: WorkerClient | None = None
        last_resort: WorkerClient | None = None  # a draining worker that handed the stream over to no one
        while True:
            if last_resort is not None:
                worker, placing = last_resort, False
            else:
                worker, placing = self._worker_for(request, failed, full)
            handover, last_resort = last_resort is None, None
            attempt = request
            if codes and worker.resumes:  # the same take goes on after the delivered frames (module doc)
                attempt = dataclasses.replace(request, resume_codes=request.resume_codes + bytes(codes))
                skip_bytes, skip_codes = past_codes, 0
                self.resumed_from_codes += 1
            else:  # made again from the start (or from the request's own codes): what was delivered is dropped
                skip_bytes, skip_codes = delivered, len(codes)
            skip_words = words_delivered
            try:
                async for chunk in worker.stream(attempt, place=placing, handover=handover):
                    words = chunk.words
                    if words and skip_words:
                        words, skip_words = words[skip_words:], max(0, skip_words - len(words))
                    pcm = chunk.pcm
                    if pcm and skip_bytes:
                        pcm, skip_bytes = pcm[skip_bytes:], max(0, skip_bytes - len(pcm))
                    new_codes = chunk.codes
                    if new_codes and skip_codes:
                        new_codes, skip_codes = new_codes[skip_codes:], max(0, skip_codes - len(new_codes))
                    if not pcm and not words and not new_codes and not chunk.audio_ended:
                        continue
                    if lost_at is not None and pcm:
                        pause_ms = (time.monotonic() - lost_at) * 1000
                        self.pauses_ms.append(pause_ms)
                        log.info("failover session=%s sentence=%s from=%s to=%s pause_ms=%.1f resumed=%s",
                                 request.session_key, request.request_id.rpartition("/")[2], lost_from.id, worker.id,
                                 pause_ms, attempt is not request)
                        lost_at = None
                    delivered += len(pcm)
                    words_delivered += len(words)
                    if new_codes:
                        codes += new_codes
                        past_codes = 0
                    past_codes += len(pcm)
                    yield AudioChunk(pcm, words, chunk.audio_ended, new_codes)
                return
            except WorkerDraining:
                worker.draining = True
                failed.add(worker)
            except WorkerFull:
                worker.mark_full()
                full.add(worker)
                self.placements_refused += 1
            except WorkerHandedOver:
                worker.draining = True
                self.handovers += 1
                if any(m.ready for m in self.members.values() if m is not worker and m not in failed):
                    failed.add(worker)
                else:  # no one to take it: the draining worker goes on with it to the end, from its codes
                    last_resort = worker
                if lost_at is None:
                    lost_at, lost_from = time.monotonic(), worker
            except WorkerLost as exc:
                if isinstance(exc, WorkerTimedOut):
                    # Slow, not proved hostile (module doc): set aside only while another worker can take over.
                    if any(m.ready for m in self.members.values() if m is not worker):
                        worker.quarantine(str(exc))
                        self.quarantined += 1
                else:
                    worker.down = True
                if isinstance(exc, WorkerMisbehaved):
                    worker.quarantine(str(exc))
                    self.quarantined += 1
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
                answer = await worker.query("clone", max_answer=framing.MAX_REQUEST_FRAME,
                                            samples=base64.b64encode(reference.samples).decode(),
                                            ref_text=reference.ref_text, x_vector_only=x_vector_only)
                break
            except WorkerLost as exc:
                log.warning("cloning on worker %s failed: %s", worker.id, exc)
                worker.down = True
                failed.add(worker)
        if answer.get("op") == "error":
            raise _worker_error(answer, worker.id)
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
            BackendMetric("pool_handovers", "counter", "Streams a draining worker handed over, gone on elsewhere "
                          "from their codes", samples=(((), float(self.handovers)),)),
            BackendMetric("pool_resumed_from_codes", "counter", "Streams gone on from their codes on another "
                          "worker (not made again)", samples=(((), float(self.resumed_from_codes)),)),
            BackendMetric("pool_drain_moves", "counter", "Sessions moved off a draining worker at a new utterance",
                          samples=(((), float(self.moved_for_drain)),)),
            BackendMetric("pool_placements_refused", "counter", "Session placements a worker refused as full "
                          "(the next best was asked)", samples=(((), float(self.placements_refused)),)),
            BackendMetric("pool_workers_quarantined", "counter", "Times a worker was set aside for breaking a bound "
                          "(too much audio or too many words for its text, a bad frame, a deadline "
                          "while another was ready)",
                          samples=(((), float(self.quarantined)),)),
            BackendMetric("pool_registry_records_refused", "counter", "Registry entries ignored: unsigned, badly "
                          "signed or stale", samples=(((), float(self.registry.refused if self.registry else 0)),)),
        ]
        return own + [BackendMetric(f.name, f.kind, f.help, f.labels, tuple(values[f.name].items()))
                      for f in summed.values()]
