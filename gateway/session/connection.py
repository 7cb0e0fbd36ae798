"""One streaming session per WebSocket: the protocol's state machine.

`StreamingSession` (this module) is the connection's lifecycle, the handshake and `session.config`, and
the reading and routing of client messages: text, flush and done go to their context's `Utterance`
(gateway/session/data.py), which owns what becomes of its text (its segmenter, its sentence still being
written, the sentences it releases); cancel and close are the session's. It holds its parts, each with its
own module and its own tests:
- `SpeechPipeline` (gateway/session/pipeline.py): the send queue, synthesis of queued sentences with
  back-pressure, and the sender that puts audio and utterance ends on the socket in order;
- `Resumer` (gateway/session/resume.py): `session.resume`, taking a session over from the store and
  rebuilding it;
- `SocketWriter` (gateway/session/writer.py): every socket write, under one lock.
The data they share (`SessionInfo`, resolved config, utterances, send-queue items) is in
gateway/session/data.py.

Ownership of tasks (all created and ended by `StreamingSession.run`): the reader (`_read_loop`) parses
client messages, hands each to its utterance and queues the sentences they make once recorded; it never
waits on synthesis. The sender (`SpeechPipeline.send_loop`), the lease renewal and the slow-consumer watchdog
(`SocketWriter.watch`); the synthesis tasks belong to the pipeline.

Every write to the socket takes the writer's lock, and a sentence's frames are sent only while it is not
cancelled, checked under that lock: after `input.cancel` has taken the lock and marked a context
cancelled, not one more byte of it goes out. Sentence indices count from 0 across the session.

Resume (issue 5): everything the client has sent and everything owed to it is written to the store
before it matters (what each client input changed, with the count of inputs handled, in one write
before its sentences can make audio; each audio frame before it goes on the socket; utterance ends), so
a connection to any replica can rebuild the session from the store. Each connection writes with its own
`owner` token; a resume elsewhere takes the session over and this connection's next write or lease
renewal raises LeaseLost, which ends it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from tts_backend.base import Synthesizer, TextStream

from ..audio import encoders
from ..audio import pcm as audio
from ..auth import Principal
from ..compat import VoiceChoice, option_warnings, resolve_voice, timestamp_transport
from ..limits import Admission, AdmissionClaim
from ..logs import session_id_var
from ..metrics import GatewayMetrics
from ..pronunciation.markup import ends_inside_markup
from ..pronunciation.registry import PronunciationRegistry
from ..protocol import (
    DEFAULT_SAMPLE_RATE,
    HANDSHAKE_MESSAGES,
    TELEPHONY_SAMPLE_RATE,
    CloseCode,
    ContextCancelled,
    ErrorCode,
    InputCancel,
    InputDone,
    InputFlush,
    InputText,
    Ping,
    PRONUNCIATION_MESSAGES,
    Pong,
    PronunciationAdd,
    PronunciationAnswer,
    PronunciationList,
    ProtocolError,
    SessionClose,
    SessionConfig,
    SessionResume,
    SessionStarted,
    SpokenWord,
    VoiceAdd,
    VoiceAdded,
    VoiceList,
    VoiceListed,
    parse_client_message,
)
from ..settings import GatewaySettings
from ..store.base import LeaseLost, MarkerRecord, SentenceRecord, SessionChanges, SessionStore
from ..voices import VoiceRegistry
from .data import (
    INLINE_PROMPT_KEY,
    PRONUNCIATION_RULES_KEY,
    ClientGone,
    ResolvedConfig,
    SentenceJob,
    SessionEnd,
    SessionInfo,
    SlowConsumer,
    TextPush,
    Utterance,
    UtteranceEnd,
    sent_marker,
)
from .pipeline import SpeechPipeline, audio_done
from .resume import Resumer, rebuild
from .segmenter import SentenceSegmenter
from .writer import SocketWriter

log = logging.getLogger("voxgate.session")

# split_granularity "token" on a backend that synthesizes whole units only (Piper): an utterance's first unit
# ends at a clause mark, before a word that starts a phrase, or after this many words, whichever comes first
# (gateway/session/segmenter.py), so its first audio waits for a few words, not a whole sentence (Piper on a
# CPU: 74 ms for 9 characters, 436 ms for 57). A cut inside the sentence drops the first unit's trailing
# silence (audio/silence.py), so the join is not heard as a break (bench/first_unit_pause.py).
FIRST_UNIT_WORDS = 4


def new_segmenter(config: ResolvedConfig, max_unit_chars: int) -> SentenceSegmenter:
    """The segmenter of a new utterance: the session's granularity and language, and units no longer than
    one synthesis call may be (`max_unit_chars`)."""
    granularity, first_unit_words = config.message.split_granularity, 0
    if granularity == "token" and not config.text_streaming:
        # The backend needs whole units: sentences, the first one cut short to start speaking sooner.
        granularity, first_unit_words = "sentence", FIRST_UNIT_WORDS
    markup_on = config.message.text_markup is not None
    return SentenceSegmenter(granularity, language=config.message.language,
                             keeps_together=ends_inside_markup if markup_on else None,
                             max_unit_chars=max_unit_chars, first_unit_words=first_unit_words)


class StagedInput:
    """What handling the current client message changed: the store's changes and the items to queue after
    them, until `StreamingSession._commit` writes the changes in one store call and then queues the items
    (nothing makes audio or goes out before it is recorded). The session's utterances make their sentences
    through it: it is their `SentenceSink` (gateway/session/data.py)."""

    def __init__(self, info: SessionInfo, pipeline: SpeechPipeline,
                 config: Callable[[], ResolvedConfig | None]) -> None:
        self.info = info
        self.pipeline = pipeline
        self._config = config  # the session's, when a sentence is made (session.config may change it)
        self.changes = SessionChanges()
        self.items: list[SentenceJob | UtteranceEnd | SessionEnd | TextPush] = []

    def take(self) -> tuple[SessionChanges, list[SentenceJob | UtteranceEnd | SessionEnd | TextPush]]:
        """What is staged, leaving nothing."""
        changes, items = self.changes, self.items
        self.changes, self.items = SessionChanges(), []
        return changes, items

    @property
    def text_streaming(self) -> bool:
        config = self._config()
        return config is not None and config.text_streaming

    def new_sentence(self, utterance: Utterance, text: str, *, first: bool, trim_tail: bool,
                     open_text: bool) -> SentenceJob:
        config = self._config()
        assert config is not None and self.info.session_id is not None
        job = SentenceJob(index=self.info.sentences_released, text=text, utterance=utterance, config=config,
                          released_at=time.monotonic(), first_of_utterance=first, trim_tail=trim_tail,
                          text_stream=TextStream(text) if open_text else None)
        self.info.sentences_released += 1
        # Recorded before the sentence can produce audio, so the store always knows what a byte belongs to.
        self.changes.sentences.append(SentenceRecord(job.index, text, utterance.context_id, utterance=utterance.number))
        self.items.append(job)
        return job

    def grew(self, job: SentenceJob, added: str, *, finish: bool) -> None:
        if added:
            self.changes.sentence_texts.append(
                SentenceRecord(job.index, job.text, job.utterance.context_id, utterance=job.utterance.number))
        self.items.append(TextPush(job, added, finish=finish))

    def count_text(self, job: SentenceJob, chars: int) -> None:
        self.pipeline.count_text(job, chars)

    def record_open_text(self, utterance: Utterance) -> None:
        self.changes.open_text[utterance.context_id] = utterance.open_text()


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
        admission_claim: AdmissionClaim | None = None,
        principal: Principal | None = None,
        voices: VoiceRegistry | None = None,
        pronunciations: PronunciationRegistry | None = None,
    ) -> None:
        self.ws = websocket
        self.settings = settings
        self.backend = backend
        self.store = store
        self.metrics = metrics
        self.admission = admission
        self.principal = principal or Principal()
        self.voices = voices or VoiceRegistry(backend, store, settings)
        self.pronunciations = pronunciations or PronunciationRegistry(store)

        self.info = SessionInfo(owner=uuid.uuid4().hex)  # owner: this connection's lease token in the store
        self.writer = SocketWriter(websocket)
        self.pipeline = SpeechPipeline(
            self.writer, store, self.info, backend=backend, settings=settings, metrics=metrics,
            monitor=admission.monitor if admission is not None else None, admission_claim=admission_claim,
        )
        self.resumer = Resumer(store, owner=self.info.owner, key_id=self.principal.key_id,
                               resolve=self._recorded_config)
        self.config: ResolvedConfig | None = None
        self._utterance_count = 0
        self._open: dict[str | None, Utterance] = {}  # context id -> utterance still taking text
        self._closing = False  # session.close received
        self._last_activity = time.monotonic()
        self._sender: asyncio.Task | None = None
        self._reader: asyncio.Task | None = None
        self._marker_count = 0
        # Client inputs (every message after the handshake but ping) handled and recorded in the store,
        # acknowledged by `inputs_received`; what handling the current one changed, written with its count.
        self._inputs = 0
        self.staged = StagedInput(self.info, self.pipeline, lambda: self.config)
        self._input_recorded = False  # the message being handled was already counted (input.cancel)
        self._lease: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        self._store_lost = False  # the session stopped because its store cannot be reached

    @property
    def session_id(self) -> str | None:
        return self.info.session_id

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
                self._sender = asyncio.create_task(self.pipeline.send_loop(), name=f"sender-{self.session_id}")
                self._reader = asyncio.create_task(self._read_loop(), name=f"reader-{self.session_id}")
                self._lease = asyncio.create_task(self._keep_lease(), name=f"lease-{self.session_id}")
                self._watchdog = asyncio.create_task(self.writer.watch(self.settings.slow_consumer_timeout_s),
                                                     name=f"watchdog-{self.session_id}")
                done, _ = await asyncio.wait(
                    {self._reader, self._sender, self._lease, self._watchdog}, return_when=asyncio.FIRST_COMPLETED
                )
                if self._watchdog in done:
                    self._watchdog.result()  # only ends by SlowConsumer
                if self._lease in done:
                    self._lease.result()  # only ends by LeaseLost (or a store failure)
                if self._reader in done:
                    self._reader.result()  # raises the fatal error or ClientGone, if any
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
        except SlowConsumer:
            await self._close_slow_consumer()
        except (ClientGone, WebSocketDisconnect):
            pass
        except Exception:
            lost = await self.store.unavailable()  # the commonest cause: Redis gone (bounded wait)
            if lost is None:
                log.exception("session %s failed", self.session_id)
                await self._fail(ProtocolError(ErrorCode.internal, "internal error", close=CloseCode.internal))
            else:  # one line, no traceback: the same cause would fill the log once per open session
                self._store_lost = True
                log.error("session %s stopped: %s", self.session_id, lost)
                await self._fail(ProtocolError(ErrorCode.store_unavailable, f"{lost}; retry shortly",
                                               close=CloseCode.try_again_later))
        finally:
            await self._shutdown()
            self.metrics.sessions_active.dec()
            if self.session_id is not None:
                log.info("session ended", extra={"sentences": self.info.sentences_released})

    async def _shutdown(self) -> None:
        self.pipeline.stop()  # no new synthesis from here on
        tasks = [t for t in [self._reader, self._sender, self._lease, self._watchdog] if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        await self.pipeline.close()
        if self._sender is not None and self._sender.done() and not self._sender.cancelled() and not self._store_lost:
            error = self._sender.exception()
            if error is not None and not isinstance(error, (ClientGone, WebSocketDisconnect)):
                log.error("sender of session %s failed: %r", self.session_id, error)
        if self.session_id is not None and not self._store_lost:
            try:
                await self.store.detach(self.session_id, owner=self.info.owner)
            except Exception as exc:  # the store is unreachable: the session expires there on its own
                log.warning("could not detach session %s: %r", self.session_id, exc)
        if self.ws.application_state == WebSocketState.CONNECTED:
            try:  # bounded: a socket that accepts nothing cannot hold us
                await asyncio.wait_for(self.ws.close(CloseCode.normal), self.settings.close_timeout_s)
            except asyncio.TimeoutError:
                self.writer.abort()
            except Exception:  # noqa: BLE001 - the client is gone already
                pass

    async def _close_slow_consumer(self) -> None:
        """Stop the blocked sender (releasing the writer's lock), tell the client why if its socket takes
        it within a second, else drop the connection. The session stays in the store: resumable."""
        limit = self.settings.slow_consumer_timeout_s
        log.warning("session %s: the client read nothing for %g s; closing it (resumable)", self.session_id, limit)
        self.pipeline.stop()
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
            self.writer.abort()

    @property
    def busy(self) -> bool:
        """Audio is being made or sent: the idle timeout does not run."""
        return self.pipeline.busy

    @property
    def between_utterances(self) -> bool:
        """No utterance takes text and no audio is owed: a drain can hand the session over now."""
        return not self._open and not self.busy

    async def _keep_lease(self) -> None:
        """Renew this connection's lease (and the session's expiry) while it is open; LeaseLost ends it."""
        while True:
            await asyncio.sleep(self.settings.session_lease_s / 3)
            await self.store.renew(self.session_id, self.info.owner)

    async def hand_over(self) -> None:
        """Drain: send nothing more and close with 1012 and the session id as the reason, so that the
        client resumes on another replica. What it has not received is in the store."""
        async with self.writer.lock:
            if await self.writer.hand_over_locked(CloseCode.service_restart, self.session_id or ""):
                self.pipeline.stop()

    # -------------------------------------------------------------- socket I/O

    async def _receive_text(self, timeout: float) -> str:
        """The next text frame. Raises asyncio.TimeoutError, ClientGone, or ProtocolError for binary frames."""
        message = await asyncio.wait_for(self.ws.receive(), timeout)
        if message["type"] == "websocket.disconnect":
            raise ClientGone()
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
        if size > self.settings.max_message_bytes and not isinstance(message, HANDSHAKE_MESSAGES):
            raise ProtocolError(
                ErrorCode.message_too_large,
                f"{message.type} message of {size} bytes exceeds the {self.settings.max_message_bytes}-byte limit",
                context_id=getattr(message, "context_id", None),
            )
        return message

    async def _send_json(self, message) -> None:
        await self.writer.send_text(message.encode())

    async def _report(self, error: ProtocolError) -> None:
        """A non-fatal error: tell the client, keep going."""
        self.metrics.errors_total.labels(error.code.value).inc()
        await self._send_json(error.to_message())

    async def _fail(self, error: ProtocolError) -> None:
        """A fatal error: tell the client and close with the error's close code. A client that reads
        nothing cannot be told (the writes wait for buffer space, or for the send lock of a sender that
        waits for it): after close_timeout_s the connection is dropped, so the session ends anyway."""
        self.metrics.errors_total.labels(error.code.value).inc()
        if self.ws.application_state != WebSocketState.CONNECTED:
            return

        async def tell_and_close() -> None:
            async with self.writer.lock:
                await self.ws.send_text(error.to_message().encode())
                await self.ws.close(int(error.close or CloseCode.policy), reason=error.code.value)

        try:
            await asyncio.wait_for(tell_and_close(), self.settings.close_timeout_s)
        except asyncio.TimeoutError:
            log.info("session %s: the client reads nothing; dropping the connection (%s)", self.session_id,
                     error.code.value)
            self.writer.abort()
        except Exception:  # noqa: BLE001 - the client is gone already
            pass

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
            except ClientGone:
                return False
            except ProtocolError as error:
                if error.close is None and error.message_type == "session.config":
                    error.close = CloseCode.policy  # a refused first config ends the connection (below)
                if error.close is not None:
                    raise
                await self._report(error)
                continue
            try:
                if isinstance(message, SessionConfig):
                    try:
                        await self._apply_config(message)
                    except ProtocolError as error:
                        # As vLLM-Omni does: a session that cannot start is answered and closed at once,
                        # not left waiting for another config while the client's text is refused.
                        error.close = error.close or CloseCode.policy
                        raise
                    return True
                if isinstance(message, (VoiceList, VoiceAdd)):
                    await self._on_voice_message(message)
                elif isinstance(message, PRONUNCIATION_MESSAGES):
                    await self._on_pronunciation_message(message)
                elif isinstance(message, Ping):
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
        """Take the session over from the store (gateway/session/resume.py), tell the client, and start
        from what it is owed: the items queued in send order, its open utterances taking text again."""
        resumed = await self.resumer.take_over(message)
        self.info.session_id = message.session_id
        self.config = resumed.config
        await self._send_json(
            SessionStarted(
                session_id=self.session_id,
                sample_rate=resumed.config.output_rate,
                format=resumed.config.response_format,
                voices=[v.id for v in self.backend.voices()],
                voice=resumed.config.voice,
                inputs_received=resumed.record.inputs_received,
            )
        )
        rebuilt = rebuild(resumed, message, self._new_utterance)
        self._inputs = rebuilt.inputs_received
        self.info.sentences_released = rebuilt.sentences_released
        self.info.uses_contexts = rebuilt.uses_contexts
        self._utterance_count = rebuilt.utterance_count
        self._marker_count = rebuilt.marker_count
        self._closing = self._closing or rebuilt.closing
        for job in rebuilt.unspoken:
            self.pipeline.count_text(job, len(job.text))
        self.pipeline.enqueue(*rebuilt.owed)
        for utterance, text in rebuilt.reopened:
            self._open[utterance.context_id] = utterance
            await utterance.resume(text, self.settings.max_synthesis_chars)
        await self._commit(counted=False)
        self.pipeline.refill()

    async def _on_voice_message(self, message: VoiceList | VoiceAdd) -> None:
        """Baseten's voice catalogue messages (LiveKit's Baseten plugin sends them): voice.list is answered
        with the backend's voices and the cloned voices this key may use; voice.add clones and registers
        one (gateway/voices.py), refused with voice_cloning_unsupported where the backend cannot clone."""
        if isinstance(message, VoiceList):
            uploaded = await self.voices.list_voices(self.principal)
            presets = [v.id for v in self.backend.voices()]
            await self._send_json(VoiceListed(voices=presets + [v["name"] for v in uploaded], uploaded_voices=uploaded))
            return
        if not self.backend.can_clone:
            raise ProtocolError(
                ErrorCode.voice_cloning_unsupported,
                f"voice.add: the {self.backend.name} backend cannot clone voices; use one of its voices"
                f" ({', '.join(v.id for v in self.backend.voices())})",
            )
        if not message.audio_data:
            raise ProtocolError(ErrorCode.invalid_reference_audio, "voice.add needs audio_data (base64 audio)")
        voice = await self.voices.add(self.principal, message.name, message.audio_data, consent=message.consent,
                                      ref_text=message.ref_text, x_vector_only=bool(message.x_vector_only_mode))
        await self._send_json(VoiceAdded(voice=voice))

    async def _on_pronunciation_message(self, message) -> None:
        """pronunciation.add/.list/.delete: this key's dictionaries (gateway/pronunciation/registry.py)."""
        registry = self.pronunciations
        if isinstance(message, PronunciationAdd):
            meta = await registry.add(self.principal, message.name, message.entries)
            answer = PronunciationAnswer(type=message.type, dictionary=meta)
        elif isinstance(message, PronunciationList):
            answer = PronunciationAnswer(type=message.type, dictionaries=await registry.list(self.principal))
        else:
            await registry.delete(self.principal, message.name)
            answer = PronunciationAnswer(type=message.type, deleted=message.name)
        await self._send_json(answer)

    async def _resolved(self, message: SessionConfig, *, admitted: bool) -> ResolvedConfig:
        """The session's config, with its cloned voice when it names one (registered, or its ref_audio) and
        its pronunciation. `admitted`: the session's admission counts a clone of its ref_audio (its first
        config); a later config's clone is a request of its own (rate, overload)."""
        pronouncer = await self.pronunciations.pronouncer(self.principal, message.pronunciations, message.text_markup)
        cloned = await self.voices.voice_for(
            self.principal, voice=message.voice, ref_audio=message.ref_audio, ref_text=message.ref_text,
            x_vector_only=message.x_vector_only_mode, task_type=message.task_type, admitted=admitted)
        if cloned is None:
            return dataclasses.replace(self._resolve(message), pronouncer=pronouncer)
        return dataclasses.replace(self._resolve(message, VoiceChoice(cloned.name)), voice_prompt=cloned.prompt,
                                   own_clip=message.ref_audio is not None, pronouncer=pronouncer)

    async def _recorded_config(self, recorded: dict) -> ResolvedConfig:
        """The config the session was recorded with (ResolvedConfig.snapshot). A voice cloned from the
        session's own clip comes back as its recorded prompt: a resume does not clone again."""
        recorded = dict(recorded)
        prompt = recorded.pop(INLINE_PROMPT_KEY, None)
        rules = recorded.pop(PRONUNCIATION_RULES_KEY, None)
        message = SessionConfig.model_validate(recorded)
        if rules is not None:
            pronouncer = await self.pronunciations.recorded(rules, message.text_markup)
            return dataclasses.replace(await self._recorded_voice(message, prompt), pronouncer=pronouncer)
        return await self._recorded_voice(message, prompt)

    async def _recorded_voice(self, message: SessionConfig, prompt: str | None) -> ResolvedConfig:
        if prompt is None:  # a preset or registered voice (found again by name)
            return await self._resolved(message, admitted=True)
        try:
            voice_prompt = base64.b64decode(prompt, validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise KeyError("unusable voice prompt in the session's record") from None
        return dataclasses.replace(self._resolve(message, VoiceChoice(message.voice or "ref_audio")),
                                   voice_prompt=voice_prompt, own_clip=True)

    def _resolve(self, message: SessionConfig, choice: VoiceChoice | None = None) -> ResolvedConfig:
        cloned = choice is not None
        choice = choice or resolve_voice(self.backend, self.settings, message.voice)
        fmt = message.response_format or "pcm"
        rate = message.sample_rate
        if rate is None:
            rate = TELEPHONY_SAMPLE_RATE if fmt in ("mulaw", "alaw") else DEFAULT_SAMPLE_RATE
        try:
            rate = encoders.check_output(fmt, rate, self.backend.sample_rate)
        except audio.UnsupportedFormatError as unsupported:
            raise ProtocolError(ErrorCode.unsupported_format, str(unsupported)) from None
        options = message.model_dump()
        honours = self.backend.honours
        non_streaming = message.non_streaming_mode
        auto_voice = (message.voice is None and message.ref_audio is None and not cloned
                      and (message.language or "auto").lower() == "auto")
        return ResolvedConfig(
            message=message,
            voice=choice.voice,
            auto_voice=auto_voice,
            response_format=fmt,
            stream_audio=message.stream_audio,
            source_rate=self.backend.sample_rate,
            output_rate=rate,
            warnings=(*choice.warnings, *option_warnings(self.backend, options)),
            timestamps=timestamp_transport(self.backend, options),
            text_streaming=message.split_granularity == "token" and "text_streaming" in honours and not non_streaming,
            streaming_text=None if non_streaming is None or "text_mode" not in honours else not non_streaming,
        )

    async def _apply_config(self, message: SessionConfig) -> None:
        if self.config is not None and self._open:
            raise ProtocolError(
                ErrorCode.config_locked,
                "session.config is allowed only between utterances; finish (input.done) or cancel open ones first",
            )
        first = self.config is None
        resolved = await self._resolved(message, admitted=first)
        self.config = resolved
        if first:
            self.info.session_id = uuid.uuid4().hex
            await self.store.create(self.session_id, resolved.snapshot(), owner=self.info.owner,
                                    key_id=self.principal.key_id)
        else:
            self.staged.changes.config = resolved.snapshot()
        await self._send_json(
            SessionStarted(
                session_id=self.session_id,
                sample_rate=resolved.output_rate,
                format=resolved.response_format,
                voices=[v.id for v in self.backend.voices()],
                voice=resolved.voice,
                warnings=list(resolved.warnings) or None,
            )
        )

    # -------------------------------------------------------------- reading

    def _last_active(self) -> float:
        """When the client last sent a message or the sender last finished an item: the idle timeout's start."""
        return max(self._last_activity, self.pipeline.last_sent_at)

    async def _read_loop(self) -> None:
        while not self._closing:
            await self._end_open_sentences()  # (after every message: those that are not text do not delay it)
            now = time.monotonic()
            idle_until = self._last_active() + self.settings.idle_timeout_s
            waits = [deadline for _, deadline, _ in self._sentences_waiting_for_text()]
            timeout = max(0.05, min([idle_until, *waits]) - now)
            try:
                raw = await self._receive_text(timeout)
            except asyncio.TimeoutError:
                if self.busy:
                    self._last_activity = time.monotonic()
                elif time.monotonic() - self._last_active() >= self.settings.idle_timeout_s:
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
            self._input_recorded = False  # set by a handler that records its input itself
            try:
                message = self._parse(raw)
                if isinstance(message, Ping):  # not an input: it acknowledges the inputs before it
                    await self._send_json(Pong(id=message.id, inputs_received=self._inputs))
                    continue
                await self._dispatch(message)
            except ProtocolError as error:
                if error.close is not None:
                    raise
                await self._commit(counted=not self._input_recorded)  # refused inputs count too
                await self._report(error)
            else:
                await self._commit(counted=not self._input_recorded)

    async def _commit(self, *, counted: bool) -> None:
        """Write what handling the current message changed - and, when `counted`, that one more input was
        handled - in one store call, then queue its sentences and utterance ends (nothing makes audio or
        goes out before it is recorded). A crash before the write loses the message and all its effects
        together: the client's resume sees the old count and sends it again."""
        changes, items = self.staged.take()
        if counted:
            changes.inputs_received = self._inputs + 1
        if changes:
            await self.store.apply(self.session_id, changes, owner=self.info.owner)
        if counted:
            self._inputs += 1
        for item in items:
            if isinstance(item, TextPush):
                item.apply()
            else:
                self.pipeline.enqueue(item)

    async def _dispatch(self, message) -> None:
        context_id = getattr(message, "context_id", None)
        if context_id is not None and not self.info.uses_contexts:
            self.info.uses_contexts = True
            self.staged.changes.uses_contexts = True  # decides utterance.done vs session.done after a resume
        if isinstance(message, InputText):
            await self._on_text(message)
        elif isinstance(message, InputFlush):
            await self._on_flush(message.context_id)
        elif isinstance(message, InputDone):
            await self._on_done(message.context_id)
        elif isinstance(message, InputCancel):
            await self._on_cancel(message.context_id, message.played_ms)
        elif isinstance(message, SessionConfig):
            await self._apply_config(message)
        elif isinstance(message, SessionClose):
            await self._on_close()
        elif isinstance(message, (VoiceList, VoiceAdd)):
            await self._on_voice_message(message)
        elif isinstance(message, PRONUNCIATION_MESSAGES):
            await self._on_pronunciation_message(message)
        elif isinstance(message, SessionResume):
            raise ProtocolError(ErrorCode.invalid_message, "session.resume is only valid as a connection's first message")

    def _utterance(self, context_id: str | None) -> Utterance:
        utterance = self._open.get(context_id)
        if utterance is None:
            self._utterance_count += 1
            utterance = self._new_utterance(context_id, self._utterance_count)
            self._open[context_id] = utterance
        return utterance

    def _new_utterance(self, context_id: str | None, number: int) -> Utterance:
        assert self.config is not None
        return Utterance(context_id, number, new_segmenter(self.config, self.settings.max_synthesis_chars),
                         sink=self.staged)

    def _buffered_chars(self) -> int:
        return self.pipeline.pending_chars + sum(u.buffered_chars for u in self._open.values())

    async def _on_text(self, message: InputText) -> None:
        if self._closing:
            raise ProtocolError(ErrorCode.invalid_message, "the session is closing", context_id=message.context_id)
        limit = self.settings.max_buffered_chars
        if len(message.text) > limit:
            raise ProtocolError(
                ErrorCode.text_too_long,
                f"this input.text ({len(message.text)} characters) was not accepted: it is longer than the"
                f" {limit} characters a session may hold not yet spoken; send it in smaller pieces",
                context_id=message.context_id,
            )
        if self._buffered_chars() + len(message.text) > limit:
            # The same text fits once audio has gone out (or a flush has released what waits for a
            # sentence end): retryable, unlike the text_too_long of a message that can never fit.
            raise ProtocolError(
                ErrorCode.text_too_long,
                f"this input.text ({len(message.text)} characters) was not accepted: the session would hold more"
                f" than {limit} characters not yet spoken; send it again after audio has gone out or after"
                " input.flush",
                context_id=message.context_id, retryable=True,
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
        await self._utterance(message.context_id).take(message.text)

    async def _on_flush(self, context_id: str | None) -> None:
        utterance = self._open.get(context_id)
        if utterance is not None:
            utterance.flush()

    async def _on_done(self, context_id: str | None, by_close: bool = False) -> None:
        limit = self.settings.max_pending_ends
        if not by_close and self.pipeline.ends_queued >= limit:  # session.close ends at most max_open_contexts
            raise ProtocolError(
                ErrorCode.rate_limited,
                f"this input.done was not accepted: {self.pipeline.ends_queued} utterance ends are waiting for audio not"
                f" yet sent, the limit is {limit}; the utterance stays open with its text, send input.done again"
                " once audio has gone out",
                context_id=context_id,
            )
        utterance = self._open.pop(context_id, None)
        if utterance is None:
            # input.done with no text: the utterance is empty, but the client still gets its answer.
            assert self.config is not None
            self._utterance_count += 1
            utterance = Utterance(context_id, self._utterance_count, SentenceSegmenter("none"))
        else:
            utterance.finish()
        self._marker_count += 1
        marker = UtteranceEnd(utterance, by_close=by_close, number=self._marker_count)
        self._record_marker(marker)
        self.staged.changes.open_text[context_id] = None
        self.staged.items.append(marker)

    async def _on_close(self) -> None:
        for context_id in list(self._open):
            await self._on_done(context_id, by_close=True)
        self._closing = True
        self._marker_count += 1
        end = SessionEnd(number=self._marker_count)
        self._record_marker(end)
        self.staged.items.append(end)

    def _record_marker(self, item: UtteranceEnd | SessionEnd) -> None:
        item.after = self.info.sentences_released
        utterance = item.utterance if isinstance(item, UtteranceEnd) else None
        self.staged.changes.markers.append(
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

    # -------------------------------------------------------------- sentences waiting for text

    def _sentences_waiting_for_text(self):
        """The open sentences whose synthesis runs, holding a backend slot, while they wait for the client's
        text: (utterance, when it is ended at the words it has, whether another context waits behind it)."""
        for utterance in self._open.values():
            waiting = utterance.waits_for_text(self.pipeline, self.settings.idle_timeout_s)
            if waiting is not None:
                yield utterance, *waiting

    async def _end_open_sentences(self) -> None:
        """End sentences still being written at the words they have, the text after them starting the next
        sentence: those whose synthesis failed (their error names their words; what follows is spoken or
        named in an error of its own), and those that waited for text too long: a sentence may not hold a
        backend slot (nor the session's other contexts) while no text comes; they get a warning."""
        failed = [u for u in self._open.values() if u.open_job is not None and u.open_job.synthesis_failed]
        for utterance in failed:
            await utterance.end_open_sentence()
        now, ended = time.monotonic(), bool(failed)
        for utterance, deadline, blocking in list(self._sentences_waiting_for_text()):
            if deadline > now:
                continue
            waited = now - utterance.open_job.progress_at
            reason = "while another context's audio waited behind it" if blocking else "holding a synthesis slot"
            await utterance.end_open_sentence(warning=(
                f"sentence {utterance.open_job.index} was ended at the words it had: it waited {waited:.1f} s for"
                f" more text {reason}; text sent later is spoken as the next sentence"))
            ended = True
        if ended:
            await self._commit(counted=False)

    # -------------------------------------------------------------- cancel

    @staticmethod
    def _spoken_before_cut(utterances: list[Utterance], cut: SentenceJob | None,
                           played_ms: float | None) -> list[SpokenWord]:
        """The words of the cut utterances whose audio went out in full: those of their sentences sent
        whole, then those of the sentence cut while being sent, from the bytes it had sent; of those, with
        the client's playback position, the ones it played. The position counts from the start of the first
        cut utterance's audio, the utterances' audio end to end."""
        spoken: list[SpokenWord] = []
        offset_s = 0.0
        for utterance in utterances:
            words = list(utterance.spoken)
            if cut is not None and cut.utterance is utterance:
                words.extend(w.model_copy(update={"sentence_index": cut.index}) for w in cut.spoken_words())
            played_s = None if played_ms is None else played_ms / 1000 - offset_s
            spoken.extend(utterance.heard(words, played_s, cut))
            offset_s += utterance.audio_s
        return spoken

    async def _on_cancel(self, context_id: str | None, played_ms: float | None = None) -> None:
        """Barge-in: everything of this context (its open utterance and any finished ones still queued)
        stops now. Answered by context.cancelled even when nothing was left to cancel."""
        open_utterance = self._open.pop(context_id, None)
        if open_utterance is not None:
            open_utterance.cancelled = True
            self.staged.changes.open_text[context_id] = None
        async with self.writer.lock:
            # Holding the writer's lock: the sender is between frames, and from here on it sees the flag.
            cut = self.pipeline.cut(context_id)
            if open_utterance is not None:
                cut.utterances[open_utterance.number] = open_utterance
            for job in cut.stopped:
                self.staged.changes.states[job.index] = "cancelled"
            for marker in cut.dropped_ends:  # owed no more: a resume must not send them
                self.staged.changes.markers.append(sent_marker(marker, cancelled=True))
            # Recorded (with the input count) before the client hears of it: a resume after its
            # context.cancelled never speaks the cancelled sentences again.
            await self._commit(counted=True)
            self._input_recorded = True
            if cut.interrupted is not None:
                # Its audio.start went out: close it, with the bytes actually sent.
                await self.writer.send_text_locked(audio_done(cut.interrupted, error=False, cancelled=True).encode())
            first_unsent = cut.stopped[0].index if cut.stopped else None
            cancelled = ContextCancelled(context_id=context_id, sentence_index=first_unsent)
            if self.config is not None and self.config.timestamps is not None:
                if played_ms is not None and not cut.utterances and cut.finished is not None:
                    # Nothing of the context was left to cut, but the client says how far it has played:
                    # the utterance it may still be hearing is the one whose words it asks about (a fast voice
                    # sends a whole reply well ahead of playback).
                    cut.utterances[cut.finished.number] = cut.finished
                utterances = [cut.utterances[n] for n in sorted(cut.utterances)]
                cancelled.spoken_words = self._spoken_before_cut(utterances, cut.interrupted, played_ms)
                cancelled.spoken_text = " ".join(w.word for w in cancelled.spoken_words)
            await self.writer.send_text_locked(cancelled.encode())
        self.pipeline.refill()
