"""Twilio Media Streams <-> Voxgate: agent text in, 20 ms mu-law media frames out, paced in real time.

One `Call` per Twilio WebSocket. It owns (and cancels when the call ends) four kinds of tasks:
- the Twilio reader (the connection handler itself): `connected`, `start`, `media`, `mark`, `dtmf`, `stop`;
- the Voxgate pump: reads the call's Voxgate session (mu-law 8 kHz) and cuts its audio into 160-byte
  frames on the outbound queue, followed by a `mark` after each sentence;
- the pacer: sends the outbound queue to Twilio one frame per 20 ms (a small lead ahead of real time, so
  network jitter does not starve Twilio's player, but never a flood);
- the application's `on_call` coroutine and any `stream()` token feeders.

Each `say`/`stream` is one Voxgate context; `interrupt()` (barge-in) drops the queued frames, sends Twilio
`clear` and Voxgate `input.cancel` for the contexts still speaking.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable
from http import HTTPStatus
from typing import Any, Protocol

import voxgate_client as vg

from .bargein import EnergyBargeIn
from .twilio import (
    FRAME_BYTES,
    FRAME_MS,
    Connected,
    Dtmf,
    Mark,
    Media,
    Start,
    Stop,
    TwilioProtocolError,
    Unknown,
    clear_message,
    connect_stream_twiml,
    mark_message,
    media_message,
    parse_twilio_message,
    signature_is_valid,
)

log = logging.getLogger("voxgate.telephony")

FRAME_S = FRAME_MS / 1000
MULAW_SILENCE = bytes([vg.MULAW_SILENCE])


class TwilioSocket(Protocol):
    """What the bridge needs from the WebSocket Twilio connected to (a `websockets` connection fits)."""

    async def send(self, message: str) -> None: ...

    async def recv(self) -> str | bytes: ...

    async def close(self, code: int = 1000, reason: str = "") -> None: ...


class Speech:
    """One agent utterance on a call: one Voxgate context, a mark after each of its sentences."""

    def __init__(self, call: "Call", context_id: str) -> None:
        self.call = call
        self.context_id = context_id
        self.sentences: list[str] = []
        self.marks_queued: list[str] = []
        self.marks_played: list[str] = []
        self.synthesized = False  # Voxgate sent utterance.done: every sentence's audio is queued
        self.interrupted = False
        self.cancel_confirmed = False  # the gateway answered input.cancel with context.cancelled
        self.errors: list[vg.Error] = []
        self.feeder: asyncio.Task[None] | None = None  # stream(): the task sending tokens
        self._played: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    @property
    def finished(self) -> bool:
        return self._played.done()

    async def played(self, timeout_s: float | None = None) -> bool:
        """Wait until Twilio has played all of it (True) or it was interrupted or the call ended (False)."""
        return await asyncio.wait_for(asyncio.shield(self._played), timeout_s)

    def _update(self) -> None:
        if self._played.done():
            return
        if self.interrupted:
            self._played.set_result(False)
        elif self.synthesized and set(self.marks_queued) <= set(self.marks_played):
            self._played.set_result(True)

    def _end(self) -> None:
        if not self._played.done():
            self._played.set_result(False)

    def __repr__(self) -> str:
        state = "interrupted" if self.interrupted else "played" if self.finished else "speaking"
        return f"Speech({self.context_id!r}, {state}, sentences={len(self.sentences)})"


@dataclasses.dataclass
class _Frame:
    context_id: str
    payload: bytes


@dataclasses.dataclass
class _Mark:
    context_id: str
    name: str


class Call:
    """One Twilio call (one Media Stream) bridged to one Voxgate session."""

    def __init__(self, bridge: "TwilioBridge", socket: TwilioSocket, start: Start) -> None:
        self.bridge = bridge
        self.socket = socket
        self.stream_sid = start.stream_sid
        self.call_sid = start.call_sid
        self.account_sid = start.account_sid
        self.custom_parameters = start.custom_parameters
        self.media_format = start.media_format
        self.session: vg.Session | None = None
        self.speeches: dict[str, Speech] = {}
        self.frames_sent = 0
        self.marks_sent: list[str] = []
        self.marks_received: list[str] = []
        self.inbound_frames = 0
        self.clears_sent = 0
        self.ended = asyncio.Event()
        self._outbound: deque[_Frame | _Mark] = deque()
        self._outbound_ready = asyncio.Event()
        self._remainder = b""  # mu-law bytes of the current sentence not yet filling a whole frame
        self._stopped_contexts: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._barge_in = bridge.barge_in_factory() if bridge.barge_in_factory else None

    # ------------------------------------------------------------------------------------ application API

    @property
    def speaking(self) -> bool:
        """Audio is queued, or sent but not yet reported played by Twilio, or still being synthesized."""
        return any(not s.finished for s in self.speeches.values())

    async def say(self, text: str) -> Speech:
        """Speak `text` (one utterance). Returns at once; `await speech.played()` to wait for playback."""
        speech = self._new_speech()
        assert self.session is not None
        await self.session.send_text(text, context_id=speech.context_id)
        await self.session.done(context_id=speech.context_id)
        return speech

    async def stream(self, tokens: Iterable[str] | AsyncIterable[str]) -> Speech:
        """Speak text as it arrives (e.g. LLM tokens); sentences start playing before the text ends."""
        speech = self._new_speech()
        speech.feeder = self._spawn(self._feed(speech, tokens), "feeder")
        return speech

    async def _feed(self, speech: Speech, tokens: Iterable[str] | AsyncIterable[str]) -> None:
        assert self.session is not None
        try:
            await self.session.stream_text(tokens, context_id=speech.context_id, done=False)
        finally:
            # Also when the token source fails: what it produced is spoken and the utterance ends,
            # rather than staying open on the gateway. Not after an interrupt or the end of the call.
            if not speech.interrupted and not self.ended.is_set():
                with contextlib.suppress(vg.VoxgateError):
                    await self.session.done(context_id=speech.context_id)

    async def interrupt(self) -> list[Speech]:
        """Barge-in: stop every speech still speaking. Twilio gets `clear` (its buffer is dropped),
        Voxgate gets `input.cancel` for each context, queued frames are discarded."""
        active = [s for s in self.speeches.values() if not s.finished]
        if not active and not self._outbound:
            return []
        for speech in active:
            speech.interrupted = True
            self._stopped_contexts.add(speech.context_id)
            if speech.feeder is not None:
                speech.feeder.cancel()
        self._outbound.clear()
        self._remainder = b""
        await self._send_to_twilio(clear_message(self.stream_sid))
        self.clears_sent += 1
        for speech in active:
            speech._update()
            if self.session is not None and not self.session.closed:
                with contextlib.suppress(vg.VoxgateError):
                    await self.session.cancel(context_id=speech.context_id)
        return active

    def _new_speech(self) -> Speech:
        if self.ended.is_set():
            raise RuntimeError(f"call {self.call_sid} has ended")
        speech = Speech(self, f"{self.call_sid}-{uuid.uuid4().hex[:8]}")
        self.speeches[speech.context_id] = speech
        return speech

    # ---------------------------------------------------------------------------------------- lifecycle

    def _spawn(self, coroutine: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coroutine)
        task.set_name(f"call-{self.call_sid}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("call %s: task %s failed", self.call_sid, task.get_name(), exc_info=task.exception())

    async def _open(self) -> None:
        config = dataclasses.replace(
            self.bridge.config, response_format="mulaw", sample_rate=8000, stream_audio=True
        )
        voice = self.custom_parameters.get("voice")
        if voice:
            config = dataclasses.replace(config, voice=voice)
        self.session = await vg.connect(self.bridge.gateway_url, config, **self.bridge.client_options)
        self._spawn(self._pump(), "voxgate-pump")
        self._spawn(self._pace(), "pacer")
        if self.bridge.on_call is not None:
            self._spawn(self.bridge.on_call(self), "app")

    async def _close(self) -> None:
        self.ended.set()
        for speech in self.speeches.values():
            speech._end()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.session is not None:
            await self.session.abort()

    # ---------------------------------------------------------------------------------- Twilio -> bridge

    async def _on_media(self, media: Media) -> None:
        self.inbound_frames += 1
        if self.bridge.on_inbound_audio is not None:
            await _maybe_await(self.bridge.on_inbound_audio(self, media.payload))
        if self._barge_in is not None and self._barge_in.feed(media.payload) and self.speaking:
            log.info("call %s: caller speech detected, interrupting", self.call_sid)
            await self.interrupt()

    async def _on_mark(self, mark: Mark) -> None:
        """Twilio echoes a mark once the audio before it has played (or at once, after a clear)."""
        self.marks_received.append(mark.name)
        context_id = mark.name.rpartition(":")[0]
        speech = self.speeches.get(context_id)
        if speech is not None:
            speech.marks_played.append(mark.name)
            speech._update()
        if self.bridge.on_mark is not None:
            await _maybe_await(self.bridge.on_mark(self, mark.name))

    # ------------------------------------------------------------------------------- Voxgate -> Twilio

    def _enqueue(self, item: _Frame | _Mark) -> None:
        self._outbound.append(item)
        self._outbound_ready.set()

    async def _pump(self) -> None:
        assert self.session is not None
        async for event in self.session.events(until_done=False):
            context_id = getattr(event, "context_id", None)
            speech = self.speeches.get(context_id) if context_id is not None else None
            if speech is None:
                if isinstance(event, vg.Error):
                    log.warning("call %s: gateway error %s: %s", self.call_sid, event.code, event.message)
                continue
            stopped = context_id in self._stopped_contexts
            if isinstance(event, vg.AudioStart):
                speech.sentences.append(event.sentence_text)
                self._remainder = b""
            elif isinstance(event, vg.AudioChunk):
                if stopped:
                    continue
                data = self._remainder + event.data
                whole = len(data) - len(data) % FRAME_BYTES
                for start in range(0, whole, FRAME_BYTES):
                    self._enqueue(_Frame(context_id, data[start : start + FRAME_BYTES]))
                self._remainder = data[whole:]
            elif isinstance(event, vg.AudioDone):
                if event.sentence_text and speech.sentences:  # the whole sentence (token splitting)
                    speech.sentences[-1] = event.sentence_text
                if stopped:
                    continue
                if self._remainder:  # the sentence's last partial frame, padded with silence
                    self._enqueue(_Frame(context_id, self._remainder.ljust(FRAME_BYTES, MULAW_SILENCE)))
                    self._remainder = b""
                name = f"{context_id}:{event.sentence_index}"
                speech.marks_queued.append(name)
                self._enqueue(_Mark(context_id, name))
            elif isinstance(event, vg.UtteranceDone):
                speech.synthesized = True
                speech._update()
            elif isinstance(event, vg.ContextCancelled):
                speech.cancel_confirmed = True
                speech.interrupted = True
                speech._update()
            elif isinstance(event, vg.Error):
                speech.errors.append(event)
                log.warning("call %s: %s for %s: %s", self.call_sid, event.code, context_id, event.message)
        for speech in self.speeches.values():
            speech._end()

    async def _pace(self) -> None:
        """Send queued frames at 20 ms intervals, `lead_s` ahead of real time. After a gap in the audio
        (nothing queued when the next frame was due) the clock restarts, so late audio is never flooded."""
        loop = asyncio.get_running_loop()
        lead_s = self.bridge.lead_ms / 1000
        next_at: float | None = None
        while True:
            if not self._outbound:
                self._outbound_ready.clear()
                await self._outbound_ready.wait()
                continue
            item = self._outbound[0]
            if isinstance(item, _Frame):
                now = loop.time()
                if next_at is None or now > next_at + lead_s:  # Twilio has played all it had
                    next_at = now - lead_s
                if next_at > now:
                    await asyncio.sleep(next_at - now)
                    continue  # re-check: an interrupt may have emptied the queue while we slept
                self._outbound.popleft()
                await self._send_to_twilio(media_message(self.stream_sid, item.payload))
                self.frames_sent += 1
                next_at += FRAME_S
            else:
                self._outbound.popleft()
                await self._send_to_twilio(mark_message(self.stream_sid, item.name))
                self.marks_sent.append(item.name)

    async def _send_to_twilio(self, message: str) -> None:
        await self.socket.send(message)


async def _maybe_await(value: Any) -> None:
    if inspect.isawaitable(value):
        await value


class TwilioBridge:
    """A Twilio Media Streams server that speaks agent text through a Voxgate gateway.

    gateway_url: the Voxgate gateway (`ws://host:port`). config: session settings (voice, language,
    seed, ...); the bridge always asks for mu-law at 8000 Hz. A call's `customParameters.voice`
    (`<Parameter name="voice" value="..."/>` in the TwiML) overrides the voice.
    on_call: `async def on_call(call)`, run once the stream starts, cancelled when the call ends.
    on_inbound_audio(call, mulaw_bytes), on_dtmf(call, digit), on_mark(call, name): optional callbacks
    (plain or async). barge_in_factory: makes a per-call detector with `feed(mulaw) -> bool` (e.g.
    `EnergyBargeIn`); caller speech while the agent speaks then interrupts it. lead_ms: how far ahead
    of real time frames may be sent; it absorbs network and scheduling jitter and costs nothing on
    barge-in, because `clear` drops whatever Twilio holds. client_options: passed to `voxgate_client.connect` (api_key, ...).
    """

    def __init__(
        self,
        gateway_url: str,
        *,
        config: vg.SessionConfig | None = None,
        on_call: Callable[[Call], Awaitable[None]] | None = None,
        on_inbound_audio: Callable[[Call, bytes], Any] | None = None,
        on_dtmf: Callable[[Call, str], Any] | None = None,
        on_mark: Callable[[Call, str], Any] | None = None,
        barge_in_factory: Callable[[], EnergyBargeIn] | None = None,
        lead_ms: int = 100,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        self.gateway_url = gateway_url
        self.config = config or vg.SessionConfig()
        self.on_call = on_call
        self.on_inbound_audio = on_inbound_audio
        self.on_dtmf = on_dtmf
        self.on_mark = on_mark
        self.barge_in_factory = barge_in_factory
        self.lead_ms = lead_ms
        self.client_options = dict(client_options or {})
        self.calls: dict[str, Call] = {}
        self._calls_changed = asyncio.Event()

    # ---------------------------------------------------------------------------- by call sid, in-process

    def call(self, call_sid: str) -> Call:
        try:
            return self.calls[call_sid]
        except KeyError:
            raise KeyError(f"no active call {call_sid!r}") from None

    async def wait_for_call(self, call_sid: str | None = None, timeout_s: float | None = None) -> Call:
        """The call with this sid (or the first active one) once its stream has started."""

        async def wait() -> Call:
            while True:
                event = self._calls_changed
                for sid, call in self.calls.items():
                    if call_sid is None or sid == call_sid:
                        return call
                await event.wait()

        return await asyncio.wait_for(wait(), timeout_s)

    async def say(self, call_sid: str, text: str) -> Speech:
        return await self.call(call_sid).say(text)

    async def stream(self, call_sid: str, tokens: Iterable[str] | AsyncIterable[str]) -> Speech:
        return await self.call(call_sid).stream(tokens)

    async def interrupt(self, call_sid: str) -> list[Speech]:
        return await self.call(call_sid).interrupt()

    def _changed(self) -> None:
        self._calls_changed.set()
        self._calls_changed = asyncio.Event()

    # ------------------------------------------------------------------------------- one Twilio socket

    async def handle(self, socket: TwilioSocket) -> None:
        """Serve one Twilio Media Stream until `stop` or until the socket closes."""
        call: Call | None = None
        try:
            while True:
                try:
                    raw = await socket.recv()
                except Exception as exc:  # the socket closed (ConnectionClosed or the framework's equivalent)
                    log.info("twilio socket closed: %r", exc)
                    return
                try:
                    message = parse_twilio_message(raw)
                except TwilioProtocolError as exc:
                    log.warning("ignoring a malformed Twilio message: %s", exc)
                    continue
                if isinstance(message, Connected):
                    log.debug("twilio connected: protocol %s %s", message.protocol, message.version)
                elif isinstance(message, Start):
                    if call is not None:
                        log.warning("second start on one stream ignored")
                        continue
                    if message.media_format.encoding != "audio/x-mulaw" or message.media_format.sample_rate != 8000:
                        log.warning("unexpected media format %s; Twilio streams are mu-law 8 kHz", message.media_format)
                    call = Call(self, socket, message)
                    try:
                        await call._open()
                    except (vg.VoxgateError, OSError) as exc:
                        log.error("call %s: cannot open a Voxgate session: %s", message.call_sid, exc)
                        await call._close()
                        await socket.close(1011, "speech gateway unavailable")
                        return
                    self.calls[call.call_sid] = call
                    self._changed()
                elif call is None:
                    log.warning("Twilio %s before start ignored", type(message).__name__)
                elif isinstance(message, Media):
                    await call._on_media(message)
                elif isinstance(message, Mark):
                    await call._on_mark(message)
                elif isinstance(message, Dtmf):
                    if self.on_dtmf is not None:
                        await _maybe_await(self.on_dtmf(call, message.digit))
                elif isinstance(message, Stop):
                    return
                elif isinstance(message, Unknown):
                    log.debug("unknown Twilio event %r ignored", message.event)
        finally:
            if call is not None:
                await call._close()
                if self.calls.get(call.call_sid) is call:
                    del self.calls[call.call_sid]
                self._changed()

    async def serve(
        self,
        host: str = "0.0.0.0",
        port: int = 8080,
        *,
        stream_path: str = "/twilio",
        twiml_path: str = "/twiml",
        public_url: str | None = None,
        auth_token: str | None = None,
    ):
        """Listen for Twilio. `GET {twiml_path}` answers TwiML pointing Twilio at `{stream_path}` (on
        `public_url`, e.g. `wss://example.ngrok.app`, or this request's Host); configure the Twilio
        number's voice webhook as HTTP GET to that URL. With `auth_token` (the Twilio account's), every
        request must carry a valid `X-Twilio-Signature` for its public URL, or it is refused with 403.
        Returns the `websockets` server."""
        from websockets.asyncio.server import serve

        def public_base(request) -> str:
            return (public_url or f"wss://{request.headers.get('Host', f'{host}:{port}')}").rstrip("/")

        def process_request(connection, request):
            path = request.path.split("?", 1)[0]
            if path not in (twiml_path, stream_path):
                return connection.respond(HTTPStatus.NOT_FOUND, f"not found; Twilio streams connect to {stream_path}\n")
            base = public_base(request)
            if auth_token is not None:
                # Twilio signs the URL it requested: https:// for the webhook, wss:// for the stream.
                scheme_base = base.replace("wss://", "https://", 1) if path == twiml_path else base
                if not signature_is_valid(auth_token, scheme_base + request.path, request.headers.get("X-Twilio-Signature")):
                    log.warning("refused a request to %s without a valid X-Twilio-Signature", path)
                    return connection.respond(HTTPStatus.FORBIDDEN, "invalid X-Twilio-Signature\n")
            if path == twiml_path:
                response = connection.respond(HTTPStatus.OK, connect_stream_twiml(base + stream_path))
                del response.headers["Content-Type"]
                response.headers["Content-Type"] = "text/xml"
                return response
            return None

        # Twilio does not use permessage-deflate, and base64 mu-law barely compresses: leave it off.
        return await serve(self.handle, host, port, process_request=process_request, compression=None)
