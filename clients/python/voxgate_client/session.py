"""An asyncio Voxgate session: one WebSocket, many utterances, typed events, transparent resume.

Ownership: the session owns one receive task (started once `session.started` arrived) that reads every
frame, updates the resume position, and routes each event to the queue of the context it belongs to (if
the application made a `Context` for it) or to the session's own queue. Application code only sends and
reads queues; it never touches the socket directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from .config import SessionConfig
from .events import (
    AudioChunk,
    AudioDone,
    AudioStart,
    AudioWords,
    ContextCancelled,
    Disconnected,
    Error,
    Event,
    Pong,
    Reconnected,
    SessionDone,
    SessionStarted,
    UtteranceDone,
    Word,
    parse_server_message,
)

DEFAULT_PATH = "/v1/audio/speech/stream"

# Close codes after which resuming cannot help: a normal close, a policy violation (auth, bad handshake),
# a message that was too big.
_FINAL_CLOSE_CODES = {1000, 1008, 1009}
# Error codes that end a session for good even if the socket then drops abnormally.
_FINAL_ERROR_CODES = {"unauthorized", "session_not_found", "resume_out_of_range", "config_required"}
# Every this many unacknowledged inputs the client asks for an acknowledgement (a ping whose pong carries
# `inputs_received`), so the inputs it keeps for a resume stay few.
_ACK_EVERY = 32
_ACK_PING = "voxgate-ack"
# Bytes of one sample in the raw streaming formats, whose duration follows from their byte count.
_SAMPLE_BYTES = {"pcm": 2, "mulaw": 1, "alaw": 1}
# Sentences whose words are remembered to drop repeats (a resume replays a sentence's words again).
_WORD_MEMORY_SENTENCES = 8


class VoxgateError(Exception):
    """The gateway refused something: `code` is the protocol's error code (or `http_<status>`)."""

    def __init__(self, message: str, code: str | None = None, retryable: bool = False) -> None:
        super().__init__(f"{code}: {message}" if code else message)
        self.message = message
        self.code = code
        self.retryable = retryable


class GatewayUnreachable(ConnectionError):
    """Nothing answered at the gateway's address (refused, unreachable, no such host): is the gateway running,
    and on this host and port? An OSError, as the socket's own error was; `code` is `connection_failed`
    (retryable), as the JavaScript client says."""

    code = "connection_failed"
    retryable = True

    def __init__(self, url: str, cause: OSError) -> None:
        reason = os.strerror(cause.errno) if cause.errno else str(cause)
        super().__init__(f"cannot reach the gateway at {url}: {reason} (is `voxgate serve` running there, on this"
                         " port?)")
        self.url = url


class _End:
    """Queue sentinel: no more events will arrive on this queue."""


_END = _End()


async def _read_events(queue: asyncio.Queue[Event | _End], is_last: Callable[[Event], bool]) -> AsyncIterator[Event]:
    """Events from `queue` up to and including the first `is_last` one, or until the queue's end."""
    while True:
        event = await queue.get()
        if isinstance(event, _End):
            queue.put_nowait(event)  # later readers end too
            return
        yield event
        if is_last(event):
            return


class Context:
    """One utterance stream on a shared session, keyed by `context_id` (protocol extension).

    Events carrying this id (audio.start, audio chunks, audio.done, utterance.done, context.cancelled,
    errors) go to this object's queue instead of the session's.
    """

    def __init__(self, session: "Session", context_id: str) -> None:
        self.session = session
        self.context_id = context_id
        self._queue: asyncio.Queue[Event | _End] = asyncio.Queue()
        self.finished = False  # utterance.done or context.cancelled arrived

    async def send_text(self, text: str) -> None:
        await self.session.send_text(text, context_id=self.context_id)

    async def stream_text(self, tokens: Iterable[str] | AsyncIterable[str], *, done: bool = True) -> int:
        return await self.session.stream_text(tokens, context_id=self.context_id, done=done)

    async def flush(self) -> None:
        await self.session.flush(context_id=self.context_id)

    async def done(self) -> None:
        await self.session.done(context_id=self.context_id)

    @property
    def cancelling(self) -> bool:
        """input.cancel was sent and context.cancelled has not arrived yet."""
        return self.context_id in self.session._cancelling

    async def cancel(self, played_ms: float | None = None) -> None:
        """Barge-in: stop this context's audio. Audio already queued here but not yet read is dropped.
        `played_ms`: how much of it was heard (see Session.cancel)."""
        await self.session.cancel(context_id=self.context_id, played_ms=played_ms)

    def events(self) -> AsyncIterator[Event]:
        """This context's events, ending after utterance.done, context.cancelled or a lost connection."""
        return _read_events(
            self._queue, lambda event: isinstance(event, (UtteranceDone, ContextCancelled, Disconnected))
        )

    def __aiter__(self) -> AsyncIterator[Event]:
        return self.events()

    async def audio(self) -> AsyncIterator[bytes]:
        """Just the audio bytes of this context, in order. Raises VoxgateError on a fatal error."""
        async for event in self.events():
            if isinstance(event, AudioChunk):
                yield event.data
            elif isinstance(event, Disconnected) and not self.finished:
                raise VoxgateError(f"connection lost before the utterance finished: {event.reason}", "disconnected")

    async def collect(self) -> bytes:
        """All audio until utterance.done (or cancel)."""
        return b"".join([chunk async for chunk in self.audio()])

    async def speak(self, text: str) -> bytes:
        """Send `text` as a whole utterance (text + input.done) and return its audio."""
        await self.send_text(text)
        await self.done()
        return await self.collect()


# Events that carry a sentence's audio or what it says: dropped for a context this client cancelled.
_AUDIO_EVENTS = (AudioStart, AudioChunk, AudioWords, AudioDone)


def _drop_audio(queue: asyncio.Queue, context_id: str | None) -> None:
    """Remove queued audio events of `context_id`, keeping everything else in order."""
    kept = []
    while not queue.empty():
        event = queue.get_nowait()
        if isinstance(event, _AUDIO_EVENTS) and event.context_id == context_id:
            continue
        kept.append(event)
    for event in kept:
        queue.put_nowait(event)


class Session:
    """A connected Voxgate session. Create it with `voxgate_client.connect(...)`."""

    def __init__(
        self,
        urls: Sequence[str],
        config: SessionConfig,
        *,
        api_key: str | None = None,
        api_key_header: str | None = "Authorization",
        api_key_query: str | None = None,
        resume: bool = True,
        max_reconnect_attempts: int = 6,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 2.0,
        open_timeout_s: float = 10.0,
        keepalive_s: float | None = 10.0,
        extra_headers: dict[str, str] | None = None,
    ) -> None:
        if not urls:
            raise ValueError("at least one gateway URL is needed")
        self.urls = [_with_default_path(u) for u in urls]
        self.config = config
        self.api_key = api_key
        self.api_key_header = api_key_header
        self.api_key_query = api_key_query
        self.resume_enabled = resume
        self.max_reconnect_attempts = max_reconnect_attempts
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.open_timeout_s = open_timeout_s
        self.keepalive_s = keepalive_s
        self.extra_headers = dict(extra_headers or {})

        self.started: SessionStarted | None = None
        self._ws: ClientConnection | None = None
        self._url_index = 0
        self._connected = asyncio.Event()
        self._queue: asyncio.Queue[Event | _End] = asyncio.Queue()
        self._contexts: dict[str, Context] = {}
        self._pings: dict[str, asyncio.Future[float]] = {}
        self._receiver: asyncio.Task[None] | None = None
        self._keepalive: asyncio.Task[None] | None = None
        self._closing = False  # the application asked to close: a dropped socket is not resumed
        self._ended = False  # no further events will arrive
        self._final_error: Error | None = None
        # Contexts (None: the context-less utterance) whose input.cancel was sent and whose
        # context.cancelled has not arrived: their audio still in flight is dropped on arrival.
        self._cancelling: set[str | None] = set()

        # Resume position: the sentence being received and how many of its bytes arrived.
        self.bytes_received: dict[int, int] = {}
        self._open_sentence: tuple[int, str | None] | None = None  # (sentence_index, context_id)
        self._last_done_sentence = -1
        self.reconnects = 0
        # Resume without loss: every input message (all but ping) sent since the gateway last said how
        # many it has (`inputs_received`), numbered from 1 per session, to send again after a resume; and
        # the utterance.done/session.done messages received, so that a resume sends the missing ones only.
        self._inputs_sent = 0
        self._unacked: deque[tuple[int, str]] = deque()
        self.ends_received = 0

        # Word timing: seconds of audio of each open utterance (by context) in its finished sentences, its
        # sentences, where each one's audio starts within its utterance, and the words given out per sentence.
        self._utterance_seconds: dict[str | None, float] = {}
        self._utterance_sentences: dict[str | None, list[int]] = {}
        self._sentence_starts: dict[int, float] = {}
        self._sentence_formats: dict[int, AudioStart] = {}
        self._words_given: OrderedDict[int, set[tuple[str, float]]] = OrderedDict()

    # ------------------------------------------------------------------------------------------ properties

    @property
    def session_id(self) -> str | None:
        return self.started.session_id if self.started else None

    @property
    def sample_rate(self) -> int | None:
        return self.started.sample_rate if self.started else None

    @property
    def format(self) -> str | None:
        return self.started.format if self.started else None

    @property
    def voices(self) -> list[str]:
        return list(self.started.voices) if self.started else []

    @property
    def text_streaming(self) -> bool:
        """Whether the gateway starts each sentence's synthesis at its first words: `split_granularity`
        "token" was asked for and session.started did not answer that it splits at sentences instead."""
        if self.started is None or self.config.split_granularity != "token":
            return False
        return not any(w.get("field") == "split_granularity" for w in self.started.warnings)

    @property
    def url(self) -> str:
        return self.urls[self._url_index]

    @property
    def closed(self) -> bool:
        return self._ended

    def resume_position(self) -> tuple[int, int]:
        """(sentence_index, bytes_received): the first byte of audio this client does not have."""
        if self._open_sentence is not None:
            index = self._open_sentence[0]
            return index, self.bytes_received.get(index, 0)
        return self._last_done_sentence + 1, 0

    # ----------------------------------------------------------------------------------------- connecting

    def _request(self, url: str) -> tuple[str, dict[str, str]]:
        headers = dict(self.extra_headers)
        if self.api_key:
            if self.api_key_query:
                parts = urlsplit(url)
                query = "&".join(q for q in (parts.query, urlencode({self.api_key_query: self.api_key})) if q)
                url = urlunsplit(parts._replace(query=query))
            if self.api_key_header:
                value = f"Bearer {self.api_key}" if self.api_key_header.lower() == "authorization" else self.api_key
                headers[self.api_key_header] = value
        return url, headers

    async def _open(self, url: str) -> ClientConnection:
        target, headers = self._request(url)
        try:
            return await ws_connect(
                target,
                additional_headers=headers,
                open_timeout=self.open_timeout_s,
                max_size=32 * 1024 * 1024,
                compression=None,  # audio does not compress; deflate would only cost CPU on both ends
                ping_interval=20,
                ping_timeout=20,
            )
        except InvalidStatus as exc:
            status = exc.response.status_code
            body = exc.response.body.decode("utf-8", "replace") if exc.response.body else ""
            code, message, retryable = f"http_{status}", body or f"HTTP {status}", status in (429, 503)
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                detail = json.loads(body)
                detail = detail.get("error", detail) if isinstance(detail, dict) else detail
                if isinstance(detail, dict):
                    code = detail.get("code", code)
                    message = detail.get("message", detail.get("detail", message))
                    retryable = detail.get("retryable", retryable)
            if status == 404:
                path = urlsplit(url).path
                message = (f"{message} (nothing serves a WebSocket at {path}: the gateway's is {DEFAULT_PATH}; give"
                           " connect() the gateway's address, e.g. ws://HOST:PORT, and the path is added)")
            raise VoxgateError(str(message), code, bool(retryable)) from None
        except OSError as exc:  # refused, unreachable: say where, and what to check
            raise GatewayUnreachable(_without_query(url), exc) from exc

    async def _start(self) -> None:
        """Connect to the first URL that accepts the session (replicas are tried in order when one is
        unreachable or answers with a retryable refusal such as `overloaded`)."""
        for index in range(len(self.urls)):
            self._url_index = index
            last = index == len(self.urls) - 1
            try:
                await self._handshake()
                return
            except VoxgateError as exc:
                if last or not exc.retryable:
                    raise
            except (OSError, asyncio.TimeoutError):
                if last:
                    raise

    async def _handshake(self) -> None:
        """Open the socket, send session.config, wait for session.started, start the receive task."""
        ws = await self._open(self.url)
        try:
            # A gateway that refuses at once (auth, limits) sends its error and closes, possibly before
            # our config arrives: the error is still read below.
            with contextlib.suppress(ConnectionClosed):
                await ws.send(json.dumps(self.config.to_message()))
            raw = await asyncio.wait_for(ws.recv(), self.open_timeout_s)
        except ConnectionClosed as exc:
            await ws.close()
            reason = exc.rcvd.reason if exc.rcvd else ""
            raise VoxgateError(
                f"gateway closed the connection during the handshake ({exc})", reason or "closed"
            ) from None
        except BaseException:
            await ws.close()
            raise
        event = parse_server_message(json.loads(raw)) if isinstance(raw, str) else None
        if isinstance(event, Error):
            await ws.close()
            raise VoxgateError(event.message, event.code, event.retryable)
        if not isinstance(event, SessionStarted):
            await ws.close()
            raise VoxgateError(f"expected session.started, got {raw!r:.200}", "invalid_message")
        self.started = event
        self._queue.put_nowait(event)
        self._ws = ws
        self._connected.set()
        self._receiver = asyncio.create_task(self._receive_forever(), name=f"voxgate-receive-{event.session_id}")
        if self.keepalive_s:
            self._keepalive = asyncio.create_task(self._keepalive_forever(), name="voxgate-keepalive")

    async def _reconnect(self) -> bool:
        """Reattach with session.resume after an unexpected drop. Returns False if every attempt failed."""
        delay = self.backoff_initial_s
        last_error = ""
        for attempt in range(1, self.max_reconnect_attempts + 1):
            await asyncio.sleep(delay)
            delay = min(self.backoff_max_s, delay * 2)
            self._url_index = (self._url_index + (attempt > 1)) % len(self.urls)
            try:
                ws = await self._open(self.url)
            except VoxgateError as exc:
                if not exc.retryable and not (exc.code or "").startswith("http_5"):
                    self._final_error = Error(message=exc.message, code=exc.code, retryable=exc.retryable)
                    return False
                last_error = str(exc)
                continue
            except (OSError, asyncio.TimeoutError, InvalidHandshake) as exc:  # e.g. a balancer with no replica
                last_error = repr(exc)
                continue
            sentence_index, bytes_received = self.resume_position()
            try:
                await ws.send(
                    json.dumps(
                        {
                            "type": "session.resume",
                            "session_id": self.session_id,
                            "sentence_index": sentence_index,
                            "bytes_received": bytes_received,
                            "ends_received": self.ends_received,
                        }
                    )
                )
                raw = await asyncio.wait_for(ws.recv(), self.open_timeout_s)
                event = parse_server_message(json.loads(raw)) if isinstance(raw, str) else None
                if isinstance(event, Error):
                    await ws.close()
                    if event.code in _FINAL_ERROR_CODES or not event.retryable:
                        self._final_error = event
                        return False
                    last_error = f"{event.code}: {event.message}"
                    continue
                if not isinstance(event, SessionStarted):
                    await ws.close()
                    last_error = f"expected session.started, got {raw!r:.200}"
                    continue
                self.started = event
                resent = await self._resend_inputs(ws, event.inputs_received)
            except (ConnectionClosed, asyncio.TimeoutError) as exc:
                last_error = repr(exc)
                continue
            # No await between the last resend and this: later inputs go to the new socket, in order.
            self._ws = ws
            self.reconnects += 1
            self._connected.set()
            self._queue.put_nowait(
                Reconnected(
                    session_id=self.session_id or "",
                    sentence_index=sentence_index,
                    bytes_received=bytes_received,
                    attempts=attempt,
                    url=self.url,
                    inputs_resent=resent,
                )
            )
            return True
        self._final_error = Error(message=f"could not resume: {last_error}", code="disconnected", retryable=True)
        return False

    def _acknowledged(self, inputs_received: int) -> None:
        while self._unacked and self._unacked[0][0] <= inputs_received:
            self._unacked.popleft()

    async def _resend_inputs(self, ws: ClientConnection, inputs_received: int | None) -> int:
        """Send the inputs the gateway never got (those after `inputs_received`) again, in order, on the
        resumed socket. Also those that `send_json` puts on the dead socket meanwhile. Returns how many."""
        if inputs_received is None:  # a gateway without input acknowledgement: nothing can be resent
            self._unacked.clear()
            return 0
        self._acknowledged(inputs_received)
        resent_up_to, resent = inputs_received, 0
        while True:
            pending = [(number, text) for number, text in self._unacked if number > resent_up_to]
            if not pending:
                return resent
            for number, text in pending:
                await ws.send(text)
                resent_up_to, resent = number, resent + 1

    # ------------------------------------------------------------------------------------------ receiving

    async def _receive_forever(self) -> None:
        code: int | None = None
        reason = ""
        try:
            while True:
                assert self._ws is not None
                try:
                    async for frame in self._ws:
                        self._handle_frame(frame)
                        if self._final_error is not None:
                            # e.g. a resume the gateway refused: this socket has no session any more
                            await self._ws.close(1000, self._final_error.code or "")
                            break
                    code, reason = self._ws.close_code, self._ws.close_reason or ""
                except ConnectionClosed as exc:
                    code = exc.rcvd.code if exc.rcvd else None
                    reason = exc.rcvd.reason if exc.rcvd else str(exc)
                self._connected.clear()
                if not self._should_resume(code):
                    break
                if not await self._reconnect():
                    if self._final_error is not None:
                        self._route(self._final_error)
                        reason = self._final_error.message
                    break
        finally:
            self._finish(code, reason)

    def _should_resume(self, code: int | None) -> bool:
        if self._closing or not self.resume_enabled or self.session_id is None:
            return False
        if self._final_error is not None:
            return False
        return code not in _FINAL_CLOSE_CODES

    def _finish(self, code: int | None, reason: str) -> None:
        if self._ended:
            return
        self._ended = True
        self._connected.set()  # wake senders so they fail instead of waiting forever
        for future in self._pings.values():
            if not future.done():
                future.set_exception(VoxgateError("connection closed before pong", "disconnected"))
        end = Disconnected(code=code, reason=reason)
        self._queue.put_nowait(end)
        self._queue.put_nowait(_END)
        for context in self._contexts.values():
            context._queue.put_nowait(end)
            context._queue.put_nowait(_END)
        if self._keepalive:
            self._keepalive.cancel()

    def _handle_frame(self, frame: str | bytes) -> None:
        if isinstance(frame, bytes):
            if self._open_sentence is None:
                # The protocol forbids audio outside audio.start/audio.done; surface it rather than guess.
                self._route(Error(message=f"{len(frame)} audio bytes outside a sentence", code="client_protocol"))
                return
            index, context_id = self._open_sentence
            offset = self.bytes_received.get(index, 0)
            self.bytes_received[index] = offset + len(frame)
            self._route(AudioChunk(data=frame, sentence_index=index, offset=offset, context_id=context_id))
            return
        try:
            data = json.loads(frame)
        except ValueError:
            self._route(Error(message=f"gateway sent invalid JSON: {frame[:200]!r}", code="client_protocol"))
            return
        event = parse_server_message(data)
        if isinstance(event, SessionStarted):
            # A resumed connection may announce the session again; keep the newest details, emit once.
            self.started = event
            return
        if isinstance(event, AudioStart):
            repeated = event.sentence_index in self.bytes_received
            self._open_sentence = (event.sentence_index, event.context_id)
            self.bytes_received.setdefault(event.sentence_index, 0)
            if repeated:  # the same sentence continuing after a resume: seamless for the reader
                return
            self._sentence_starts[event.sentence_index] = self._utterance_seconds.get(event.context_id, 0.0)
            self._utterance_sentences.setdefault(event.context_id, []).append(event.sentence_index)
            self._sentence_formats[event.sentence_index] = event
        elif isinstance(event, AudioWords):
            event = replace(event, words=self._new_words(event.sentence_index, event.words))
            if not event.words:
                return
        elif isinstance(event, AudioDone):
            if event.sentence_text is None and event.sentence_index in self._sentence_formats:
                event = replace(event, sentence_text=self._sentence_formats[event.sentence_index].sentence_text)
            self._open_sentence = None
            self._last_done_sentence = max(self._last_done_sentence, event.sentence_index)
            if event.words:
                # A sync session's words (or ones an async session had not sent yet): an AudioWords first.
                words = self._new_words(event.sentence_index, event.words)
                if words:
                    self._route(AudioWords(event.sentence_index, words, event.context_id))
            self._sentence_finished(event)
        elif isinstance(event, (UtteranceDone, SessionDone)):
            self.ends_received += 1
            self._utterance_ended(getattr(event, "context_id", None))
        elif isinstance(event, Pong):
            if event.inputs_received is not None:
                self._acknowledged(event.inputs_received)
            if event.id == _ACK_PING:
                return
            future = self._pings.pop(str(event.id), None)
            if future is not None:
                if not future.done():
                    future.set_result(asyncio.get_running_loop().time())
                return
        elif isinstance(event, Error) and event.code in _FINAL_ERROR_CODES:
            self._final_error = event
        elif isinstance(event, ContextCancelled):
            self._cancelling.discard(event.context_id)
            if event.spoken_words:
                event = replace(event, spoken_words=[self._in_utterance(w) for w in event.spoken_words])
            self._utterance_ended(event.context_id)
        self._route(event)

    def _new_words(self, sentence_index: int, words: list[Word]) -> list[Word]:
        """`words` not given out before (a resume sends a replayed sentence's words again), each with its
        time within the utterance."""
        given = self._words_given.get(sentence_index)
        if given is None:
            given = self._words_given[sentence_index] = set()
            while len(self._words_given) > _WORD_MEMORY_SENTENCES:
                self._words_given.popitem(last=False)
        fresh = []
        for word in words:
            key = (word.word, word.start)
            if key in given:
                continue
            given.add(key)
            fresh.append(self._in_utterance(replace(word, sentence_index=sentence_index)))
        return fresh

    def _utterance_ended(self, context_id: str | None) -> None:
        self._utterance_seconds.pop(context_id, None)
        for index in self._utterance_sentences.pop(context_id, []):
            self._sentence_starts.pop(index, None)

    def _in_utterance(self, word: Word) -> Word:
        """`word` with its times from the start of its utterance's audio, where its sentence is known."""
        offset = self._sentence_starts.get(word.sentence_index) if word.sentence_index is not None else None
        if offset is None:
            return word
        return replace(word, utterance_start=offset + word.start, utterance_end=offset + word.end)

    def _sentence_finished(self, done: AudioDone) -> None:
        """The utterance's audio grows by this sentence's: its exact duration for the raw formats, the
        gateway's `duration_ms` otherwise."""
        start = self._sentence_formats.pop(done.sentence_index, None)
        offset = self._sentence_starts.get(done.sentence_index)
        if start is None or offset is None:
            return
        sample_bytes = _SAMPLE_BYTES.get(start.format)
        if sample_bytes and start.sample_rate:
            seconds = done.total_bytes / (sample_bytes * max(start.channels, 1) * start.sample_rate)
        elif done.duration_ms is not None:
            seconds = done.duration_ms / 1000
        else:
            return
        self._utterance_seconds[done.context_id] = offset + seconds

    def _route(self, event: Event) -> None:
        context_id = getattr(event, "context_id", None)
        if context_id in self._cancelling and isinstance(event, _AUDIO_EVENTS):
            return  # barge-in: the application already gave up this context's audio
        context = self._contexts.get(context_id) if context_id is not None else None
        if context is not None:
            if isinstance(event, (UtteranceDone, ContextCancelled)):
                context.finished = True
            context._queue.put_nowait(event)
            return
        self._queue.put_nowait(event)

    # -------------------------------------------------------------------------------------------- sending

    async def send_json(self, message: dict[str, Any]) -> None:
        """Send one protocol message, waiting out a reconnect in progress. Inputs (every message but
        ping) are kept until the gateway acknowledges them: one that the network or a dying replica lost
        is sent again after the resume."""
        kept = self.resume_enabled and message.get("type") != "ping"
        text = json.dumps(message)
        while True:
            await self._connected.wait()
            if self._ended:
                raise VoxgateError("session is closed", "closed")
            ws = self._ws
            assert ws is not None
            if kept:
                self._inputs_sent += 1
                self._unacked.append((self._inputs_sent, text))
            try:
                await ws.send(text)
                if kept and self._inputs_sent % _ACK_EVERY == 0:
                    await ws.send(json.dumps({"type": "ping", "id": _ACK_PING}))
                return
            except ConnectionClosed:
                if kept and not self._ended:
                    return  # kept: the resume sends it again unless the gateway has it
                # Not sent: the receive task notices the drop and resumes (or ends the session).
                if not self.resume_enabled or self._ended:
                    raise VoxgateError("connection closed", "closed") from None
                if self._ws is ws:  # still the dead socket: wait for the receive task's verdict
                    self._connected.clear()
                await asyncio.sleep(0)

    async def send_text(self, text: str, context_id: str | None = None) -> None:
        message: dict[str, Any] = {"type": "input.text", "text": text}
        if context_id is not None:
            message["context_id"] = context_id
        await self.send_json(message)

    async def stream_text(
        self,
        tokens: Iterable[str] | AsyncIterable[str],
        context_id: str | None = None,
        *,
        done: bool = True,
    ) -> int:
        """Send tokens as they come (e.g. straight from an LLM), then input.done if `done`.
        Returns the number of characters sent. A plain iterable is read on the event loop: wrap a
        blocking one (a synchronous HTTP stream) in an async generator that uses `asyncio.to_thread`."""
        if isinstance(tokens, str):
            tokens = [tokens]
        sent = 0
        if isinstance(tokens, AsyncIterable):
            async for token in tokens:
                if token:
                    await self.send_text(token, context_id)
                    sent += len(token)
        else:
            for token in tokens:
                if token:
                    await self.send_text(token, context_id)
                    sent += len(token)
        if done:
            await self.done(context_id)
        return sent

    async def _send_control(self, kind: str, context_id: str | None, **fields: Any) -> None:
        message: dict[str, Any] = {"type": kind}
        if context_id is not None:
            message["context_id"] = context_id
        message.update({name: value for name, value in fields.items() if value is not None})
        await self.send_json(message)

    async def flush(self, context_id: str | None = None) -> None:
        await self._send_control("input.flush", context_id)

    async def done(self, context_id: str | None = None) -> None:
        await self._send_control("input.done", context_id)

    async def cancel(self, context_id: str | None = None, played_ms: float | None = None) -> None:
        """Barge-in: input.cancel for `context_id` (None: the context-less utterance). Its audio that is
        queued here but not yet read is dropped, and so is any still in flight until context.cancelled.
        `played_ms`: how much of the context's audio the listener has heard (the player's position, from
        the start of the utterance's audio); context.cancelled's spoken_text is then what was heard,
        otherwise what the gateway had sent, which a backend faster than real time sends long before it
        plays."""
        if played_ms is not None and not played_ms >= 0:
            raise ValueError(f"played_ms must be a number >= 0, not {played_ms!r}")
        self._cancelling.add(context_id)
        context = self._contexts.get(context_id) if context_id is not None else None
        _drop_audio(context._queue if context is not None else self._queue, context_id)
        await self._send_control("input.cancel", context_id, played_ms=played_ms)

    async def reconfigure(self, config: SessionConfig) -> None:
        """Send a new session.config (allowed between utterances only)."""
        self.config = config
        await self.send_json(config.to_message())

    async def ping(self, timeout_s: float = 5.0) -> float:
        """Round trip time in seconds of a protocol-level ping."""
        loop = asyncio.get_running_loop()
        ping_id = uuid.uuid4().hex[:12]
        future: asyncio.Future[float] = loop.create_future()
        self._pings[ping_id] = future
        sent_at = loop.time()
        try:
            await self.send_json({"type": "ping", "id": ping_id})
            return await asyncio.wait_for(future, timeout_s) - sent_at
        finally:
            self._pings.pop(ping_id, None)

    async def send_ping(self, ping_id: Any = None) -> None:
        """Send a ping without waiting; its Pong shows up in `events()`."""
        await self.send_json({"type": "ping", "id": ping_id})

    async def _keepalive_forever(self) -> None:
        """Protocol pings keep the gateway's idle timeout from closing a session that is only listening."""
        assert self.keepalive_s
        while not self._ended:
            await asyncio.sleep(self.keepalive_s)
            with contextlib.suppress(VoxgateError, asyncio.TimeoutError):
                await self.ping()

    # --------------------------------------------------------------------------------------- contexts/events

    def context(self, context_id: str | None = None) -> Context:
        """A Context for `context_id` (a fresh random id if None); its events leave the session queue."""
        context_id = context_id or uuid.uuid4().hex[:16]
        if context_id not in self._contexts:
            self._contexts[context_id] = Context(self, context_id)
        return self._contexts[context_id]

    def forget_context(self, context_id: str) -> None:
        """Stop routing `context_id` to its Context (after it finished); later events go to the session."""
        self._contexts.pop(context_id, None)

    def events(self, *, until_done: bool = True) -> AsyncIterator[Event]:
        """Events not claimed by a Context, in arrival order. Ends after session.done (if `until_done`) or
        when the connection is gone for good (a final `Disconnected` event)."""
        return _read_events(
            self._queue,
            lambda event: (until_done and isinstance(event, SessionDone)) or isinstance(event, Disconnected),
        )

    def __aiter__(self) -> AsyncIterator[Event]:
        """`async for event in session` is `session.events()`."""
        return self.events()

    async def audio(self) -> AsyncIterator[bytes]:
        """Audio bytes of the context-less utterance until session.done / utterance.done."""
        async for event in self.events():
            if isinstance(event, AudioChunk):
                yield event.data
            elif isinstance(event, Error) and self._final_error is event:
                raise VoxgateError(event.message, event.code, event.retryable)
            elif isinstance(event, (UtteranceDone, ContextCancelled)) and event.context_id is None:
                return
            elif isinstance(event, Disconnected):
                raise VoxgateError(f"connection lost before the utterance finished: {event.reason}", "disconnected")

    async def speak(self, text: str) -> bytes:
        """Speak `text` as one utterance without contexts (vLLM-Omni style: text, input.done) and return
        all of its audio once session.done arrives."""
        await self.send_text(text)
        await self.done()
        return b"".join([chunk async for chunk in self.audio()])

    # ------------------------------------------------------------------------------------------- closing

    async def close(self, timeout_s: float = 10.0) -> None:
        """session.close: let the gateway finish what is open, then close the socket."""
        if self._ended:
            return
        self._closing = True
        with contextlib.suppress(VoxgateError, ConnectionClosed):
            await asyncio.wait_for(self._send_control("session.close", None), timeout_s)
        if self._receiver is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._receiver), timeout_s)
            except asyncio.TimeoutError:
                pass
        await self.abort()

    async def abort(self) -> None:
        """Close the socket now without session.close and without resuming."""
        self._closing = True
        if self._ws is not None:
            await self._ws.close()
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receiver
        if self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive
        self._finish(None, "closed by the client")

    async def drop_connection(self) -> None:
        """Close the current socket as if the network failed (for tests and failover drills): with resume
        enabled the session reconnects and resumes on its own."""
        if self._ws is not None:
            self._connected.clear()
            await self._ws.close(code=4000, reason="client dropped the connection")

    async def __aenter__(self) -> "Session":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if exc_info[0] is None:
            await self.close()
        else:
            await self.abort()


def _with_default_path(url: str) -> str:
    """The endpoint for a URL: the gateway's address (`ws://HOST:PORT`, `http://...` too, or an OpenAI
    client's base URL, `http://HOST:PORT/v1`) gets the WebSocket's path."""
    parts = urlsplit(url)
    if parts.scheme in ("http", "https"):
        parts = parts._replace(scheme="ws" if parts.scheme == "http" else "wss")
    if parts.path.rstrip("/") in ("", "/v1"):
        parts = parts._replace(path=DEFAULT_PATH)
    return urlunsplit(parts)


def _without_query(url: str) -> str:
    """`url` less its query, which may hold the API key."""
    return urlunsplit(urlsplit(url)._replace(query=""))


class _Connecting:
    """`await connect(...)` gives a Session; `async with connect(...) as session` also closes it."""

    def __init__(self, session: Session) -> None:
        self._session = session

    def __await__(self):
        return self._connect().__await__()

    async def _connect(self) -> Session:
        await self._session._start()
        return self._session

    async def __aenter__(self) -> Session:
        return await self._connect()

    async def __aexit__(self, *exc_info: object) -> None:
        await self._session.__aexit__(*exc_info)


def connect(
    url: str | Sequence[str],
    config: SessionConfig | None = None,
    **options: Any,
) -> _Connecting:
    """Open a session. `url` is a gateway base URL (`ws://host:port`, the stream path is added) or full
    WebSocket URL, or a list of them (replicas tried in turn when resuming). Options: see `Session`."""
    urls = [url] if isinstance(url, str) else list(url)
    return _Connecting(Session(urls, config or SessionConfig(), **options))
