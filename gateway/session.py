"""One streaming session per WebSocket: the protocol's state machine.

Ownership of tasks (all created and ended by `StreamingSession.run`):
- the reader (the coroutine `run` itself awaits `_read_loop`) parses client messages, feeds each
  context's segmenter and appends work to the send queue; it never waits on synthesis;
- the sender (`_send_loop`) walks the send queue in order: for each sentence it sends `audio.start`,
  the binary frames, `audio.done`; for an utterance marker `utterance.done`/`session.done`. Only one
  sentence is ever being sent, so two sentences' frames never interleave;
- one synthesis task per sentence (`_synthesize`) fills that sentence's chunk queue. The first
  1 + `lookahead_sentences` sentences of the send queue are synthesizing at any time: sentence N+1 is
  being made while N is sent, so there is no gap, and memory stays bounded.

Every write to the socket takes `_send_lock`, and a sentence's frames are sent only while it is not
cancelled, checked under that lock: after `input.cancel` has taken the lock and marked a context
cancelled, not one more byte of it goes out. Sentence indices count from 0 across the session.

Resume (issue 5): everything the client has sent and everything owed to it is written to the store
before it matters (a sentence before it can make audio, each audio frame before it goes on the socket,
open text, utterance ends), so a connection to any replica can rebuild the session from the store
(`_resume`): it replays the logged bytes the client lacks and re-synthesizes what was never fully
recorded, dropping the bytes already delivered. Each connection writes with its own `owner` token; a
resume elsewhere takes the session over and this connection's next write or lease renewal raises
LeaseLost, which ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from tts_backend.base import BackendOverloadedError, SynthesisError, SynthesisRequest, Synthesizer, UnknownVoiceError

from . import audio
from .auth import Principal
from .limits import Admission
from .logs import session_id_var
from .metrics import GatewayMetrics
from .protocol import (
    STREAMING_FORMATS,
    AudioDone,
    AudioStart,
    CloseCode,
    ContextCancelled,
    ErrorCode,
    InputCancel,
    InputDone,
    InputFlush,
    InputText,
    Ping,
    Pong,
    ProtocolError,
    SessionClose,
    SessionConfig,
    SessionDone,
    SessionResume,
    SessionStarted,
    UtteranceDone,
    parse_client_message,
)
from .segmenter import SentenceSegmenter
from .settings import GatewaySettings
from .store import (
    LeaseLost,
    MarkerRecord,
    OpenUtterance,
    ReplayOutOfRange,
    SentenceRecord,
    SessionChanges,
    SessionRecord,
    SessionStore,
)

log = logging.getLogger("voxgate.session")

_END = object()  # a sentence's synthesis finished
_CANCELLED = object()  # a sentence was cancelled; wakes a sender waiting on its chunks


class _ClientGone(Exception):
    """The socket is closed; stop quietly."""


class _SlowConsumer(Exception):
    """The socket has accepted no data for slow_consumer_timeout_s: the client stopped reading."""


SERVICE_RESTART = 1012  # WebSocket close code: the server is going away; resume elsewhere


# ------------------------------------------------------------------------------------------- state


@dataclass(frozen=True)
class ResolvedConfig:
    """A validated session.config with the gateway's choices filled in."""

    message: SessionConfig
    voice: str
    response_format: str
    stream_audio: bool
    source_rate: int
    output_rate: int

    def snapshot(self) -> dict[str, Any]:
        data = self.message.model_dump(exclude_none=True)
        data.update(voice=self.voice, response_format=self.response_format, sample_rate=self.output_rate)
        return data


@dataclass(eq=False)
class Utterance:
    """The text of one context between its first input.text and its input.done (or cancel)."""

    context_id: str | None
    number: int  # per session, for SynthesisRequest.utterance_key
    segmenter: SentenceSegmenter
    sentences: int = 0
    cancelled: bool = False


@dataclass(eq=False)
class SentenceJob:
    index: int
    text: str
    utterance: Utterance
    config: ResolvedConfig
    released_at: float
    first_of_utterance: bool
    # Resumed sentences: logged bytes to replay first, and how many bytes of freshly synthesized audio to
    # drop because the client already has them or they were replayed. No synthesis if fully recorded.
    replay: list[bytes] = field(default_factory=list)
    skip_bytes: int = 0
    needs_synthesis: bool = True
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)
    task: asyncio.Task | None = None
    started_sending: bool = False
    finished: bool = False
    bytes_sent: int = 0
    source_samples: int = 0  # backend samples received, for duration_ms
    queued_bytes: int = 0  # PCM made but not yet taken by the sender (back-pressure)

    @property
    def cancelled(self) -> bool:
        return self.utterance.cancelled


@dataclass(eq=False)
class UtteranceEnd:
    """Marks the end of an utterance in the send queue."""

    utterance: Utterance
    by_close: bool = False  # ended by session.close, whose own session.done follows
    number: int = 0  # the store's marker number
    after: int = 0  # sentences released before it
    sent: bool = False  # its message went out (set under the send lock)


@dataclass(eq=False)
class SessionEnd:
    """session.close: after everything before it, send session.done and close."""

    number: int = 0  # the store's marker number
    after: int = 0  # sentences released before it


# ------------------------------------------------------------------------------------------ session


class StreamingSession:
    def __init__(
        self,
        websocket: WebSocket,
        *,
        settings: GatewaySettings,
        backend: Synthesizer,
        store: SessionStore,
        metrics: GatewayMetrics,
        admission: Admission | None = None,
        principal: Principal | None = None,
    ) -> None:
        self.ws = websocket
        self.settings = settings
        self.backend = backend
        self.store = store
        self.metrics = metrics
        self.admission = admission
        self.principal = principal or Principal()

        self.session_id: str | None = None
        self.config: ResolvedConfig | None = None
        self.uses_contexts = False  # set once any message names a context_id
        self.next_sentence_index = 0
        self._utterance_count = 0
        self._open: dict[str | None, Utterance] = {}  # context id -> utterance still taking text
        self._queue: deque[SentenceJob | UtteranceEnd | SessionEnd] = deque()
        self._queue_changed = asyncio.Event()
        self._current: SentenceJob | UtteranceEnd | SessionEnd | None = None  # being sent now
        self._pending_chars = 0  # text of released sentences not yet fully sent
        self._send_lock = asyncio.Lock()
        self._closing = False  # session.close received
        self._last_activity = time.monotonic()
        self._sender: asyncio.Task | None = None
        self._reader: asyncio.Task | None = None
        self._synthesis: set[asyncio.Task] = set()  # running synthesis tasks, owned here
        self._stopping = False
        self.owner = uuid.uuid4().hex  # this connection's lease token in the store
        self._marker_count = 0
        # Client inputs (every message after the handshake but ping) handled and recorded in the store,
        # acknowledged by `inputs_received`; what handling the current one changed, written with its count.
        self._inputs = 0
        self._staged = SessionChanges()
        self._staged_items: list[SentenceJob | UtteranceEnd | SessionEnd] = []
        self._lease: asyncio.Task | None = None
        self._handed_over = False  # drain: closed with 1012, nothing more is sent
        # Back-pressure: PCM made and not yet taken by the sender, in all jobs; synthesis waits beyond
        # max_queued_audio_s, and a write the socket has not accepted since `_blocked_since` is watched.
        self._queued_audio = 0
        self._audio_taken = asyncio.Event()
        self._blocked_since: float | None = None
        self._watchdog: asyncio.Task | None = None

    # -------------------------------------------------------------- lifecycle

    async def run(self) -> None:
        """Serve the socket until it closes. The socket must already be accepted."""
        self.metrics.sessions_total.inc()
        self.metrics.sessions_active.inc()
        try:
            if await self._handshake():
                session_id_var.set(self.session_id)  # every log line of this session's tasks carries it
                log.info("session started", extra={"key_id": self.principal.key_id, "voice": self.config.voice,
                                                   "format": self.config.response_format})
                self._sender = asyncio.create_task(self._send_loop(), name=f"sender-{self.session_id}")
                self._reader = asyncio.create_task(self._read_loop(), name=f"reader-{self.session_id}")
                self._lease = asyncio.create_task(self._keep_lease(), name=f"lease-{self.session_id}")
                self._watchdog = asyncio.create_task(self._watch_consumer(), name=f"watchdog-{self.session_id}")
                done, _ = await asyncio.wait(
                    {self._reader, self._sender, self._lease, self._watchdog}, return_when=asyncio.FIRST_COMPLETED
                )
                if self._watchdog in done:
                    self._watchdog.result()  # only ends by _SlowConsumer
                if self._lease in done:
                    self._lease.result()  # only ends by LeaseLost (or a store failure)
                if self._reader in done:
                    self._reader.result()  # raises the fatal error or _ClientGone, if any
                    await self._sender  # after session.close: it sends session.done and closes the socket
                else:
                    self._sender.result()  # the sender only ends on error or after session.close
        except ProtocolError as error:
            await self._fail(error)
        except LeaseLost:
            log.info("session %s was resumed on another connection; this one stops", self.session_id)
            await self._fail(
                ProtocolError(
                    ErrorCode.session_not_found,
                    f"session {self.session_id} was resumed on another connection; this one no longer serves it",
                    close=CloseCode.policy,
                )
            )
        except _SlowConsumer:
            await self._close_slow_consumer()
        except (_ClientGone, WebSocketDisconnect):
            pass
        except Exception:
            log.exception("session %s failed", self.session_id)
            await self._fail(ProtocolError(ErrorCode.internal, "internal error", close=CloseCode.internal))
        finally:
            await self._shutdown()
            self.metrics.sessions_active.dec()
            if self.session_id is not None:
                log.info("session ended", extra={"sentences": self.next_sentence_index})

    async def _shutdown(self) -> None:
        self._stopping = True  # no new synthesis from here on
        tasks = [
            t for t in [self._reader, self._sender, self._lease, self._watchdog, *self._synthesis]
            if t is not None and not t.done()
        ]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        if self._sender is not None and self._sender.done() and not self._sender.cancelled():
            error = self._sender.exception()
            if error is not None and not isinstance(error, (_ClientGone, WebSocketDisconnect)):
                log.error("sender of session %s failed: %r", self.session_id, error)
        if self.session_id is not None:
            try:
                await self.store.detach(self.session_id, owner=self.owner)
            except Exception as exc:  # the store is unreachable: the session expires there on its own
                log.warning("could not detach session %s: %r", self.session_id, exc)
        if self.ws.application_state == WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):  # bounded: a socket that accepts nothing cannot hold us
                await asyncio.wait_for(self.ws.close(CloseCode.normal), self.settings.slow_consumer_timeout_s)

    @property
    def busy(self) -> bool:
        """Audio is being made or sent: the idle timeout does not run."""
        return self._current is not None or bool(self._queue)

    @property
    def between_utterances(self) -> bool:
        """No utterance takes text and no audio is owed: a drain can hand the session over now."""
        return not self._open and not self.busy

    async def _keep_lease(self) -> None:
        """Renew this connection's lease (and the session's expiry) while it is open; LeaseLost ends it."""
        while True:
            await asyncio.sleep(self.settings.session_lease_s / 3)
            await self.store.renew(self.session_id, self.owner)

    async def hand_over(self) -> None:
        """Drain: send nothing more and close with 1012 and the session id as the reason, so that the
        client resumes on another replica. What it has not received is in the store."""
        async with self._send_lock:
            if self._handed_over:
                return
            self._handed_over = True
            self._stopping = True
            if self.ws.application_state == WebSocketState.CONNECTED:
                with contextlib.suppress(Exception):
                    await self.ws.close(SERVICE_RESTART, reason=self.session_id or "")

    # -------------------------------------------------------------- socket I/O

    async def _receive_text(self, timeout: float) -> str:
        """The next text frame. Raises asyncio.TimeoutError, _ClientGone, or ProtocolError for binary frames."""
        message = await asyncio.wait_for(self.ws.receive(), timeout)
        if message["type"] == "websocket.disconnect":
            raise _ClientGone()
        text = message.get("text")
        if text is None:
            raise ProtocolError(ErrorCode.invalid_message, "binary frames are not accepted; send JSON text frames")
        return text

    def _parse(self, raw: str):
        size = len(raw) if raw.isascii() else len(raw.encode("utf-8"))
        if size > self.settings.max_config_bytes:
            raise ProtocolError(
                ErrorCode.message_too_large,
                f"message of {size} bytes exceeds the {self.settings.max_config_bytes}-byte limit",
                close=CloseCode.too_big,
            )
        message = parse_client_message(raw)
        if size > self.settings.max_message_bytes and not isinstance(message, SessionConfig):
            raise ProtocolError(
                ErrorCode.message_too_large,
                f"{message.type} message of {size} bytes exceeds the {self.settings.max_message_bytes}-byte limit",
                context_id=getattr(message, "context_id", None),
            )
        return message

    async def _send_json(self, message) -> None:
        async with self._send_lock:
            await self._send_text_locked(message.encode())

    async def _send_text_locked(self, text: str) -> None:
        if self._handed_over:
            raise _ClientGone()
        self._blocked_since = time.monotonic()
        try:
            await self.ws.send_text(text)
        except (WebSocketDisconnect, RuntimeError, OSError) as exc:
            raise _ClientGone() from exc
        finally:
            self._blocked_since = None

    async def _send_bytes_locked(self, data: bytes) -> None:
        if self._handed_over:
            raise _ClientGone()
        self._blocked_since = time.monotonic()
        try:
            await self.ws.send_bytes(data)
        except (WebSocketDisconnect, RuntimeError, OSError) as exc:
            raise _ClientGone() from exc
        finally:
            self._blocked_since = None

    async def _report(self, error: ProtocolError) -> None:
        """A non-fatal error: tell the client, keep going."""
        self.metrics.errors_total.labels(error.code.value).inc()
        await self._send_json(error.to_message())

    async def _fail(self, error: ProtocolError) -> None:
        """A fatal error: tell the client and close with the error's close code."""
        self.metrics.errors_total.labels(error.code.value).inc()
        if self.ws.application_state != WebSocketState.CONNECTED:
            return
        with contextlib.suppress(Exception):
            async with self._send_lock:
                await self.ws.send_text(error.to_message().encode())
                await self.ws.close(int(error.close or CloseCode.policy), reason=error.code.value)

    # -------------------------------------------------------------- handshake

    async def _handshake(self) -> bool:
        """Wait for a valid session.config. Returns False if the client left."""
        deadline = time.monotonic() + self.settings.config_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise asyncio.TimeoutError
                raw = await self._receive_text(remaining)
                message = self._parse(raw)
            except asyncio.TimeoutError:  # the builtin TimeoutError only from Python 3.11
                raise ProtocolError(
                    ErrorCode.config_required,
                    f"no session.config received within {self.settings.config_timeout_s:g} s",
                    close=CloseCode.policy,
                ) from None
            except _ClientGone:
                return False
            except ProtocolError as error:
                if error.close is not None:
                    raise
                await self._report(error)
                continue
            try:
                if isinstance(message, SessionConfig):
                    await self._apply_config(message)
                    return True
                if isinstance(message, Ping):
                    await self._send_json(Pong(id=message.id))
                elif isinstance(message, SessionResume):
                    await self._resume(message)
                    return True
                else:
                    raise ProtocolError(
                        ErrorCode.config_required,
                        f"send session.config before {message.type}; this message was not processed",
                        context_id=getattr(message, "context_id", None),
                    )
            except ProtocolError as error:
                if error.close is not None:
                    raise
                await self._report(error)

    async def _resume(self, message: SessionResume) -> None:
        """Take the session over (from a dead connection, or a live one elsewhere: the newest connection
        wins) and rebuild it from the store: the client has every byte before (sentence_index,
        bytes_received); everything after it is replayed from the log or re-synthesized."""
        session_id = message.session_id
        record = await self.store.claim(session_id, self.owner)
        if record is None:
            raise ProtocolError(
                ErrorCode.session_not_found,
                f"session {session_id!r} is unknown, finished or expired; send session.config to start a new session",
            )
        try:
            pieces = await self.store.replay(session_id, message.sentence_index, message.bytes_received)
            config = self._resolve(SessionConfig.model_validate(record.config))
            ends = _ends_with_a_message(record)
            if message.ends_received is not None and message.ends_received > len(ends):
                raise ReplayOutOfRange(f"only {len(ends)} utterance.done/session.done were ever sent")
        except ReplayOutOfRange as exc:
            await self.store.detach(session_id, owner=self.owner)
            raise ProtocolError(
                ErrorCode.resume_out_of_range,
                f"cannot resume session {session_id} at sentence {message.sentence_index} byte"
                f" {message.bytes_received}: {exc}",
            ) from None
        except ProtocolError:
            await self.store.detach(session_id, owner=self.owner)
            raise
        self.session_id = session_id
        self.config = config
        await self._send_json(
            SessionStarted(
                session_id=session_id,
                sample_rate=config.output_rate,
                format=config.response_format,
                voices=[v.id for v in self.backend.voices()],
                voice=config.voice,
                inputs_received=record.inputs_received,
            )
        )
        await self._rebuild(record, pieces, message)

    async def _rebuild(self, record: SessionRecord, pieces, position: SessionResume) -> None:
        """Queue what the client is owed, in the original send order, and reopen open utterances."""
        assert self.config is not None
        sentence_index, byte_offset = position.sentence_index, position.bytes_received
        self._inputs = record.inputs_received
        sentences = sorted(record.sentences.values(), key=lambda s: s.index)
        self.next_sentence_index = len(sentences)
        numbers = [s.utterance for s in sentences] + [m.utterance for m in record.markers.values()]
        numbers += [u.utterance for u in record.open_utterances.values()]
        self._utterance_count = max(numbers, default=0)
        self._marker_count = max(record.markers, default=0)
        self.uses_contexts = record.uses_contexts or any(
            c is not None
            for c in [*(s.context_id for s in sentences), *(m.context_id for m in record.markers.values()),
                      *record.open_utterances]
        )
        utterances: dict[int, Utterance] = {}

        def utterance(number: int, context_id: str | None) -> Utterance:
            if number not in utterances:
                utterances[number] = Utterance(
                    context_id, number,
                    SentenceSegmenter(self.config.message.split_granularity, language=self.config.message.language),
                )
            return utterances[number]

        for sentence in sentences:
            utterance(sentence.utterance, sentence.context_id).sentences += 1
        replay: dict[int, list[bytes]] = {}
        for piece in pieces:
            replay.setdefault(piece.sentence_index, []).append(piece.data)
        # Send order: a marker recorded after N sentences goes before sentence N.
        owed: list[tuple[tuple[int, int], SentenceJob | UtteranceEnd | SessionEnd]] = []
        now = time.monotonic()
        for sentence in sentences:
            if sentence.index < sentence_index or sentence.state == "cancelled":
                continue
            delivered = byte_offset if sentence.index == sentence_index else 0
            logged = replay.get(sentence.index, [])
            job = SentenceJob(
                index=sentence.index,
                text=sentence.text,
                utterance=utterance(sentence.utterance, sentence.context_id),
                config=self.config,
                released_at=now,
                first_of_utterance=False,
                replay=logged,
                skip_bytes=delivered + sum(map(len, logged)),
                needs_synthesis=sentence.state != "done",
            )
            job.bytes_sent = delivered
            self._pending_chars += len(job.text)
            owed.append(((sentence.index, 1), job))
        if position.ends_received is not None:
            # The client counted the utterance ends it got; they go out in marker order, so it has the
            # first `ends_received` of those that make a message, and is owed the rest.
            with_message = _ends_with_a_message(record, self.uses_contexts)
            owed_markers = with_message[position.ends_received :]
        else:
            # Without the count (older clients), by position: markers go out after sentence `after - 1`, so
            # one the client's position lies before is owed even if it was sent; at the position itself,
            # only if unsent.
            owed_markers = [
                m for m in record.markers.values()
                if m.after > sentence_index or (m.after == sentence_index and byte_offset == 0 and not m.sent)
            ]
        for marker in owed_markers:
            item = (
                SessionEnd(number=marker.number, after=marker.after)
                if marker.session_end
                else UtteranceEnd(
                    utterance(marker.utterance, marker.context_id), by_close=marker.by_close, number=marker.number,
                    after=marker.after,
                )
            )
            owed.append(((marker.after, 0), item))
        if any(isinstance(item, SessionEnd) for _, item in owed):
            self._closing = True
        for _, item in sorted(owed, key=lambda pair: (pair[0], getattr(pair[1], "number", 0))):
            self._queue.append(item)
        for open_utterance in record.open_utterances.values():
            reopened = utterance(open_utterance.utterance, open_utterance.context_id)
            self._open[open_utterance.context_id] = reopened
            self._release(reopened, reopened.segmenter.push(open_utterance.text))
        await self._commit(counted=False)
        self._fill_pipeline()
        self._queue_changed.set()

    def _resolve(self, message: SessionConfig) -> ResolvedConfig:
        voice = resolve_voice(self.backend, self.settings, message.voice)
        fmt = message.response_format or "pcm"
        if fmt not in audio.FORMATS:
            raise ProtocolError(
                ErrorCode.unsupported_format,
                f"response_format {fmt!r} is not supported; choose one of {', '.join(audio.FORMATS)}",
            )
        if message.stream_audio and fmt not in STREAMING_FORMATS:
            raise ProtocolError(
                ErrorCode.unsupported_format,
                f"stream_audio needs one of {', '.join(STREAMING_FORMATS)}; {fmt!r} is sent whole per sentence"
                " with stream_audio false",
            )
        rate = message.sample_rate
        if rate is None:
            rate = 8000 if fmt in ("mulaw", "alaw") else self.backend.sample_rate
        if rate not in audio.SAMPLE_RATES and rate != self.backend.sample_rate:
            raise ProtocolError(
                ErrorCode.unsupported_format,
                f"sample_rate {rate} is not supported; choose one of {', '.join(map(str, audio.SAMPLE_RATES))}",
            )
        return ResolvedConfig(
            message=message,
            voice=voice,
            response_format=fmt,
            stream_audio=message.stream_audio,
            source_rate=self.backend.sample_rate,
            output_rate=rate,
        )

    async def _apply_config(self, message: SessionConfig) -> None:
        if self.config is not None and self._open:
            raise ProtocolError(
                ErrorCode.config_locked,
                "session.config is allowed only between utterances; finish (input.done) or cancel open ones first",
            )
        resolved = self._resolve(message)
        first = self.config is None
        self.config = resolved
        if first:
            self.session_id = uuid.uuid4().hex
            await self.store.create(self.session_id, resolved.snapshot(), owner=self.owner)
        else:
            self._staged.config = resolved.snapshot()
        await self._send_json(
            SessionStarted(
                session_id=self.session_id,
                sample_rate=resolved.output_rate,
                format=resolved.response_format,
                voices=[v.id for v in self.backend.voices()],
                voice=resolved.voice,
            )
        )

    # -------------------------------------------------------------- reading

    async def _read_loop(self) -> None:
        while not self._closing:
            idle_for = time.monotonic() - self._last_activity
            timeout = max(0.05, self.settings.idle_timeout_s - idle_for)
            try:
                raw = await self._receive_text(timeout)
            except asyncio.TimeoutError:
                if self.busy:
                    self._last_activity = time.monotonic()
                elif time.monotonic() - self._last_activity >= self.settings.idle_timeout_s:
                    raise ProtocolError(
                        ErrorCode.idle_timeout,
                        f"no message for {self.settings.idle_timeout_s:g} s; closing the session",
                        close=CloseCode.normal,
                    ) from None
                continue
            except ProtocolError as error:  # a binary frame: refused, and that counts as handling it
                self._last_activity = time.monotonic()
                await self._commit(counted=True)
                await self._report(error)
                continue
            self._last_activity = time.monotonic()
            try:
                message = self._parse(raw)
                if isinstance(message, Ping):  # not an input: it acknowledges the inputs before it
                    await self._send_json(Pong(id=message.id, inputs_received=self._inputs))
                    continue
                await self._dispatch(message)
            except ProtocolError as error:
                if error.close is not None:
                    raise
                await self._commit(counted=True)  # refused inputs count too: resending them cannot help
                await self._report(error)
            else:
                await self._commit(counted=True)

    async def _commit(self, *, counted: bool) -> None:
        """Write what handling the current message changed - and, when `counted`, that one more input was
        handled - in one store call, then queue its sentences and utterance ends (nothing makes audio or
        goes out before it is recorded). A crash before the write loses the message and all its effects
        together: the client's resume sees the old count and sends it again."""
        changes, items = self._staged, self._staged_items
        self._staged, self._staged_items = SessionChanges(), []
        if counted:
            changes.inputs_received = self._inputs + 1
        if changes:
            await self.store.apply(self.session_id, changes, owner=self.owner)
        if counted:
            self._inputs += 1
        for item in items:
            self._enqueue(item)

    async def _dispatch(self, message) -> None:
        context_id = getattr(message, "context_id", None)
        if context_id is not None and not self.uses_contexts:
            self.uses_contexts = True
            self._staged.uses_contexts = True  # decides utterance.done vs session.done after a resume
        if isinstance(message, InputText):
            await self._on_text(message)
        elif isinstance(message, InputFlush):
            await self._on_flush(message.context_id)
        elif isinstance(message, InputDone):
            await self._on_done(message.context_id)
        elif isinstance(message, InputCancel):
            await self._on_cancel(message.context_id)
        elif isinstance(message, SessionConfig):
            await self._apply_config(message)
        elif isinstance(message, SessionClose):
            await self._on_close()
        elif isinstance(message, SessionResume):
            raise ProtocolError(ErrorCode.invalid_message, "session.resume is only valid as a connection's first message")

    def _utterance(self, context_id: str | None) -> Utterance:
        utterance = self._open.get(context_id)
        if utterance is None:
            assert self.config is not None
            self._utterance_count += 1
            utterance = Utterance(
                context_id=context_id,
                number=self._utterance_count,
                segmenter=SentenceSegmenter(self.config.message.split_granularity, language=self.config.message.language),
            )
            self._open[context_id] = utterance
        return utterance

    def _buffered_chars(self) -> int:
        return self._pending_chars + sum(u.segmenter.buffered_chars for u in self._open.values())

    async def _on_text(self, message: InputText) -> None:
        if self._closing:
            raise ProtocolError(ErrorCode.invalid_message, "the session is closing", context_id=message.context_id)
        limit = self.settings.max_buffered_chars
        if self._buffered_chars() + len(message.text) > limit:
            raise ProtocolError(
                ErrorCode.text_too_long,
                f"this input.text ({len(message.text)} characters) was not accepted: the session would hold more"
                f" than {limit} characters not yet spoken; wait for audio or send input.flush",
                context_id=message.context_id,
            )
        if message.context_id not in self._open and len(self._open) >= self.settings.max_open_contexts:
            raise ProtocolError(
                ErrorCode.invalid_message,
                f"this input.text was not accepted: {len(self._open)} contexts are open, the limit is"
                f" {self.settings.max_open_contexts}; end some with input.done or input.cancel",
                context_id=message.context_id,
            )
        if self.admission is not None and message.text:
            await self.admission.charge_chars(self.principal, len(message.text), context_id=message.context_id)
        utterance = self._utterance(message.context_id)
        self._release(utterance, utterance.segmenter.push(message.text))
        self._record_open_text(utterance)

    def _record_open_text(self, utterance: Utterance) -> None:
        """Accepted text not yet released as a sentence, so that a resume elsewhere still speaks it."""
        self._staged.open_text[utterance.context_id] = OpenUtterance(
            utterance.context_id, utterance.number, utterance.segmenter.buffered_text
        )

    async def _on_flush(self, context_id: str | None) -> None:
        utterance = self._open.get(context_id)
        if utterance is not None:
            self._release(utterance, utterance.segmenter.flush())
            self._record_open_text(utterance)

    async def _on_done(self, context_id: str | None, by_close: bool = False) -> None:
        utterance = self._open.pop(context_id, None)
        if utterance is None:
            # input.done with no text: the utterance is empty, but the client still gets its answer.
            assert self.config is not None
            self._utterance_count += 1
            utterance = Utterance(context_id, self._utterance_count, SentenceSegmenter("none"))
        else:
            self._release(utterance, utterance.segmenter.flush())
        self._marker_count += 1
        marker = UtteranceEnd(utterance, by_close=by_close, number=self._marker_count)
        self._record_marker(marker)
        self._staged.open_text[context_id] = None
        self._staged_items.append(marker)

    async def _on_close(self) -> None:
        for context_id in list(self._open):
            await self._on_done(context_id, by_close=True)
        self._closing = True
        self._marker_count += 1
        end = SessionEnd(number=self._marker_count)
        self._record_marker(end)
        self._staged_items.append(end)

    def _record_marker(self, item: UtteranceEnd | SessionEnd) -> None:
        item.after = self.next_sentence_index
        utterance = item.utterance if isinstance(item, UtteranceEnd) else None
        self._staged.markers.append(
            MarkerRecord(
                number=item.number,
                after=item.after,
                context_id=utterance.context_id if utterance else None,
                utterance=utterance.number if utterance else 0,
                total_sentences=utterance.sentences if utterance else 0,
                by_close=isinstance(item, UtteranceEnd) and item.by_close,
                session_end=isinstance(item, SessionEnd),
            )
        )

    def _release(self, utterance: Utterance, sentences: list[str]) -> None:
        """Make sentences of released text; they are recorded and queued by `_commit`."""
        assert self.config is not None and self.session_id is not None
        now = time.monotonic()
        for text in sentences:
            if not text.strip():
                continue
            job = SentenceJob(
                index=self.next_sentence_index,
                text=text,
                utterance=utterance,
                config=self.config,
                released_at=now,
                first_of_utterance=utterance.sentences == 0,
            )
            self.next_sentence_index += 1
            utterance.sentences += 1
            self._pending_chars += len(text)
            # Recorded before the sentence can produce audio, so the store always knows what a byte belongs to.
            self._staged.sentences.append(
                SentenceRecord(job.index, text, utterance.context_id, utterance=utterance.number)
            )
            self._staged_items.append(job)

    def _enqueue(self, item: SentenceJob | UtteranceEnd | SessionEnd) -> None:
        self._queue.append(item)
        self._fill_pipeline()
        self._queue_changed.set()

    # -------------------------------------------------------------- cancel

    async def _on_cancel(self, context_id: str | None) -> None:
        """Barge-in: everything of this context (its open utterance and any finished ones still queued)
        stops now. Answered by context.cancelled even when nothing was left to cancel."""
        open_utterance = self._open.pop(context_id, None)
        if open_utterance is not None:
            open_utterance.cancelled = True
            self._staged.open_text[context_id] = None
        async with self._send_lock:
            # Holding the send lock: the sender is between frames, and from here on it sees the flag.
            items = [self._current, *self._queue]
            for item in items:
                if isinstance(item, (SentenceJob, UtteranceEnd)) and item.utterance.context_id == context_id:
                    item.utterance.cancelled = True
            stopped = [item for item in items if isinstance(item, SentenceJob) and item.cancelled and not item.finished]
            for job in stopped:
                self._stop_job(job)
            # Utterance ends not sent yet are owed no more (the one being sent now may be among them).
            dropped_markers = [
                item for item in items if isinstance(item, UtteranceEnd) and item.utterance.cancelled and not item.sent
            ]
            self._queue = deque(
                item for item in self._queue
                if not (isinstance(item, (SentenceJob, UtteranceEnd)) and item.utterance.cancelled)
            )
            current = self._current
            if isinstance(current, SentenceJob) and current in stopped and current.started_sending:
                # Its audio.start went out: close it, with the bytes actually sent.
                await self._send_text_locked(self._audio_done(current, error=False, cancelled=True).encode())
            first_unsent = stopped[0].index if stopped else None
            await self._send_text_locked(ContextCancelled(context_id=context_id, sentence_index=first_unsent).encode())
        for job in stopped:
            self._staged.states[job.index] = "cancelled"
        for marker in dropped_markers:  # owed no more: a resume must not send them
            self._staged.markers.append(_sent_marker(marker, cancelled=True))
        self._fill_pipeline()
        self._queue_changed.set()

    def _stop_job(self, job: SentenceJob) -> None:
        job.finished = True
        self._pending_chars -= len(job.text)
        self._drop_queued(job)
        if job.task is not None and not job.task.done():
            job.task.cancel()
        job.chunks.put_nowait(_CANCELLED)
        self.metrics.sentences_total.labels("cancelled").inc()

    # -------------------------------------------------------------- synthesis

    def _fill_pipeline(self) -> None:
        """Start synthesis for the sentences waiting to be sent, in order: at most `synthesis_concurrency`
        at a time (sentence N+1 starts as soon as N is made, while N is still being sent), and never more
        than 1 + `lookahead_sentences` sentences made or in the making ahead of the one being sent."""
        if self._stopping:
            return
        window = 1 + self.settings.lookahead_sentences
        running = sum(1 for task in self._synthesis if not task.done())
        for item in [self._current, *self._queue]:
            if window == 0 or running >= self.settings.synthesis_concurrency:
                break
            if isinstance(item, SentenceJob) and not item.cancelled and not item.finished and item.needs_synthesis:
                window -= 1
                if item.task is None:
                    item.task = asyncio.create_task(self._synthesize(item), name=f"synth-{self.session_id}-{item.index}")
                    self._synthesis.add(item.task)
                    item.task.add_done_callback(self._synthesis_ended)
                    running += 1

    def _synthesis_ended(self, task: asyncio.Task) -> None:
        self._synthesis.discard(task)
        self._fill_pipeline()

    async def _synthesize(self, job: SentenceJob) -> None:
        config = job.config
        request = SynthesisRequest(
            text=job.text,
            voice=config.voice,
            language=config.message.language,
            instructions=config.message.instructions,
            seed=config.message.seed,
            max_new_tokens=config.message.max_new_tokens,
            chunk_schedule=config.message.effective_chunk_schedule,
            utterance_key=f"{self.session_id}/{job.utterance.number}",
            request_id=f"{self.session_id}/{job.index}",
            extra=config.message.backend_extra(),
        )
        monitor = self.admission.monitor if self.admission is not None else None
        bytes_per_second = 2 * self.backend.sample_rate
        try:
            async with contextlib.aclosing(self.backend.synthesize(request)) as stream:
                if monitor is not None:
                    monitor.stream_started()
                try:
                    while True:
                        # Back-pressure: no more is pulled from the backend while the sender is behind.
                        while not self._has_room(job):
                            self._audio_taken.clear()
                            await self._audio_taken.wait()
                        pulled_at = time.monotonic()
                        try:
                            chunk = await anext(stream)
                        except StopAsyncIteration:
                            break
                        if chunk.pcm and not job.finished:
                            if monitor is not None:
                                monitor.produced(len(chunk.pcm) / bytes_per_second, time.monotonic() - pulled_at)
                            job.queued_bytes += len(chunk.pcm)
                            self._queued_audio += len(chunk.pcm)
                            job.chunks.put_nowait(chunk.pcm)
                finally:
                    if monitor is not None:
                        monitor.stream_ended()
            job.chunks.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # reported by the sender, in order
            job.chunks.put_nowait(exc)

    def _has_room(self, job: SentenceJob) -> bool:
        """May `job` pull another chunk? The sentence being sent (the head) may hold up to the bound on its
        own; sentences made ahead only while the whole session holds less, so look-ahead never starves
        the head and a session's unsent audio stays within about twice the bound."""
        bound = self.settings.max_queued_audio_s * 2 * self.backend.sample_rate
        current = self._current
        if isinstance(current, SentenceJob) and not current.finished:
            head = current
        else:  # between items: the first sentence still to be sent
            head = next((i for i in self._queue if isinstance(i, SentenceJob) and not i.finished), None)
        return job.queued_bytes < bound if job is head else self._queued_audio < bound

    def _take_audio(self, job: SentenceJob, size: int) -> None:
        job.queued_bytes -= size
        self._queued_audio -= size
        self._audio_taken.set()

    def _drop_queued(self, job: SentenceJob) -> None:
        """The job's unsent chunks will never be taken (cancelled, failed or finished)."""
        self._queued_audio -= job.queued_bytes
        job.queued_bytes = 0
        self._audio_taken.set()

    async def _watch_consumer(self) -> None:
        """Ends the session (by raising _SlowConsumer) once a write has waited slow_consumer_timeout_s
        for the socket to accept it: the client stopped reading, and only its buffers are held."""
        limit = self.settings.slow_consumer_timeout_s
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            since = self._blocked_since
            if since is not None and time.monotonic() - since >= limit:
                raise _SlowConsumer()

    async def _close_slow_consumer(self) -> None:
        """Stop the blocked sender (releasing the send lock), tell the client why if its socket takes
        it within a second, else drop the connection. The session stays in the store: resumable."""
        limit = self.settings.slow_consumer_timeout_s
        log.warning("session %s: the client read nothing for %g s; closing it (resumable)", self.session_id, limit)
        self._stopping = True
        for task in (self._sender, self._reader):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        error = ProtocolError(
            ErrorCode.slow_consumer,
            f"the client read no audio for {limit:g} s; session {self.session_id} is closed and can be resumed"
            " with session.resume",
            close=CloseCode.try_again_later,
        )
        try:
            await asyncio.wait_for(self._fail(error), 1.0)
        except asyncio.TimeoutError:  # counted by _fail already
            _abort_transport(self.ws)

    # -------------------------------------------------------------- sending

    async def _send_loop(self) -> None:
        while True:
            while not self._queue:
                self._queue_changed.clear()
                await self._queue_changed.wait()
            item = self._queue.popleft()
            self._current = item
            self._audio_taken.set()  # a new head may pull again
            try:
                if isinstance(item, SentenceJob):
                    try:
                        await self._send_sentence(item)
                    finally:
                        self._drop_queued(item)
                elif isinstance(item, UtteranceEnd):
                    await self._send_utterance_end(item)
                else:
                    await self._send_session_end()
                    return
            finally:
                self._current = None
                self._last_activity = time.monotonic()
            self._fill_pipeline()

    def _audio_done(self, job: SentenceJob, *, error: bool, cancelled: bool = False) -> AudioDone:
        return AudioDone(
            sentence_index=job.index,
            total_bytes=job.bytes_sent,
            error=error,
            context_id=job.utterance.context_id,
            duration_ms=round(job.source_samples * 1000 / job.config.source_rate, 1),
            cancelled=True if cancelled else None,
        )

    async def _send_frames(self, job: SentenceJob, data: bytes, frame_bytes: int, *, record: bool = True) -> bool:
        """Send encoded audio, split into frames, each recorded in the store before it goes on the socket
        (so the store holds every byte a client can have; `record` False for replayed audio). False if the
        sentence was cancelled meanwhile."""
        for start in range(0, len(data), frame_bytes):
            frame = data[start : start + frame_bytes]
            if record:
                await self.store.append_audio(self.session_id, job.index, frame, owner=self.owner)
            async with self._send_lock:
                if job.cancelled:
                    return False
                await self._send_bytes_locked(frame)
                if job.bytes_sent == 0 and job.first_of_utterance:
                    self.metrics.ttfa_seconds.labels("websocket").observe(time.monotonic() - job.released_at)
                job.bytes_sent += len(frame)
            self.metrics.audio_bytes_total.labels("websocket").inc(len(frame))
        return True

    async def _send_new_audio(self, job: SentenceJob, data: bytes, frame_bytes: int) -> bool:
        """Send freshly encoded audio, minus the bytes a resumed sentence already delivered or replayed."""
        if job.skip_bytes:
            dropped = min(job.skip_bytes, len(data))
            job.skip_bytes -= dropped
            data = data[dropped:]
        return not data or await self._send_frames(job, data, frame_bytes)

    async def _send_sentence(self, job: SentenceJob) -> None:
        config = job.config
        encoder = audio.StreamEncoder(config.response_format if config.stream_audio else "pcm", config.source_rate, config.output_rate)
        # Whole samples per frame, at most max_frame_ms of audio.
        frame_bytes = max(1, config.output_rate * self.settings.max_frame_ms // 1000) * encoder.bytes_per_sample
        async with self._send_lock:
            if job.cancelled:
                return
            await self._send_text_locked(
                AudioStart(
                    sentence_index=job.index,
                    sentence_text=job.text,
                    format=config.response_format,
                    sample_rate=config.output_rate,
                    context_id=job.utterance.context_id,
                ).encode()
            )
            job.started_sending = True
        if job.replay:
            for piece in job.replay:
                if not await self._send_frames(job, piece, frame_bytes, record=False):
                    return
            if not job.needs_synthesis:
                bps = encoder.bytes_per_sample
                job.source_samples = job.bytes_sent // bps * config.source_rate // config.output_rate
        if job.needs_synthesis:
            await self.store.set_sentence_state(self.session_id, job.index, "speaking", owner=self.owner)
        whole: list[bytes] = []
        failure: BaseException | None = None
        while job.needs_synthesis:
            item = await job.chunks.get()
            if item is _CANCELLED or job.cancelled:
                return
            if item is _END:
                break
            if isinstance(item, BaseException):
                failure = item
                break
            self._take_audio(job, len(item))
            job.source_samples += len(item) // 2
            encoded = encoder.encode(item)
            if config.stream_audio:
                if encoded and not await self._send_new_audio(job, encoded, frame_bytes):
                    return
            else:
                whole.append(encoded)
        tail = encoder.flush() if job.needs_synthesis else b""
        if config.stream_audio:
            if tail and not await self._send_new_audio(job, tail, frame_bytes):
                return
        elif failure is None and job.needs_synthesis:
            pcm = b"".join(whole) + tail
            if config.response_format == "wav":
                data = audio.wav_bytes(pcm, config.output_rate)
            elif config.response_format == "pcm":
                data = pcm
            else:
                file_encoder = audio.StreamEncoder(config.response_format, config.output_rate, config.output_rate)
                data = file_encoder.encode(pcm) + file_encoder.flush()
            if data and not await self._send_new_audio(job, data, max(len(data), 1)):
                return
        async with self._send_lock:
            if job.cancelled:
                return
            job.finished = True
            self._pending_chars -= len(job.text)
            if failure is not None:
                error = _synthesis_error(failure, job)
                self.metrics.errors_total.labels(error.code.value).inc()
                await self._send_text_locked(error.to_message().encode())
            await self._send_text_locked(self._audio_done(job, error=failure is not None).encode())
        outcome = "failed" if failure is not None else "done"
        self.metrics.sentences_total.labels(outcome).inc()
        await self.store.set_sentence_state(self.session_id, job.index, outcome, owner=self.owner)

    async def _send_utterance_end(self, marker: UtteranceEnd) -> None:
        async with self._send_lock:
            if marker.utterance.cancelled:
                return
            if self.uses_contexts or marker.utterance.context_id is not None:
                message = UtteranceDone(context_id=marker.utterance.context_id, total_sentences=marker.utterance.sentences)
            elif marker.by_close:
                return  # session.close answers with one session.done for everything
            else:
                message = SessionDone(total_sentences=self.next_sentence_index)
            await self._send_text_locked(message.encode())
            marker.sent = True
        await self.store.add_marker(self.session_id, _sent_marker(marker), owner=self.owner)

    async def _send_session_end(self) -> None:
        async with self._send_lock:
            await self._send_text_locked(SessionDone(total_sentences=self.next_sentence_index).encode())
            with contextlib.suppress(Exception):
                await self.ws.close(CloseCode.normal)
        if self.session_id is not None:
            await self.store.delete(self.session_id, owner=self.owner)


def _sent_marker(marker: UtteranceEnd, *, cancelled: bool = False) -> MarkerRecord:
    """The store's record of an utterance end that went out (or, cancelled, is owed no more at all)."""
    return MarkerRecord(
        number=marker.number,
        after=-1 if cancelled else marker.after,
        context_id=marker.utterance.context_id,
        utterance=marker.utterance.number,
        total_sentences=marker.utterance.sentences,
        by_close=marker.by_close,
        sent=True,
    )


def _ends_with_a_message(record: SessionRecord, uses_contexts: bool | None = None) -> list[MarkerRecord]:
    """The session's utterance ends that are (or will be) sent as a message, in send order: not cancelled,
    and not an input.done ended by session.close in a session without contexts (its session.done is
    session.close's own). As `_send_utterance_end` decides."""
    if uses_contexts is None:
        uses_contexts = record.uses_contexts or any(
            c is not None
            for c in [*(s.context_id for s in record.sentences.values()),
                      *(m.context_id for m in record.markers.values()), *record.open_utterances]
        )
    return [
        m for m in sorted(record.markers.values(), key=lambda m: m.number)
        if m.after >= 0 and (m.session_end or uses_contexts or m.context_id is not None or not m.by_close)
    ]


def _abort_transport(websocket: WebSocket) -> None:
    """Drop the TCP connection under a WebSocket whose peer reads nothing (a close frame could never be
    written); the server's WebSocket protocol puts the means in the scope (gateway.limits)."""
    abort = websocket.scope.get("voxgate.abort")
    if abort is not None:
        abort()
    else:
        log.warning("cannot abort the connection of a slow consumer: the server offers no way")


def resolve_voice(backend: Synthesizer, settings: GatewaySettings, voice: str | None) -> str:
    """The backend's id for a requested voice (case-insensitive); the configured default when None."""
    voice = voice or settings.voice or backend.default_voice
    for known in backend.voices():
        if known.id == voice or known.id.lower() == voice.lower():
            return known.id
    if backend.has_voice(voice):
        return voice
    names = ", ".join(v.id for v in backend.voices())
    raise ProtocolError(ErrorCode.unknown_voice, f"unknown voice {voice!r}; available: {names}")


def _synthesis_error(failure: BaseException, job: SentenceJob) -> ProtocolError:
    if isinstance(failure, UnknownVoiceError):
        code, message = ErrorCode.unknown_voice, str(failure)
    elif isinstance(failure, SynthesisError):
        code, message = ErrorCode.synthesis_failed, str(failure)
    else:
        log.error("synthesis of sentence %d failed", job.index, exc_info=failure)
        code, message = ErrorCode.synthesis_failed, f"synthesis failed: {type(failure).__name__}"
    if isinstance(failure, BackendOverloadedError):
        code = ErrorCode.overloaded
    return ProtocolError(
        code,
        f"sentence {job.index} ({job.text!r}) could not be synthesized: {message}",
        context_id=job.utterance.context_id,
        sentence_index=job.index,
    )

