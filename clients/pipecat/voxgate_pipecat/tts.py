"""`VoxgateTTSService`: a Pipecat TTS service on `WebsocketTTSService`, speaking through one Voxgate session.

How Pipecat's TTS hooks map onto the Voxgate protocol (protocol.md):

| Pipecat (pipecat-ai 1.14)                         | Voxgate                                           |
|---------------------------------------------------|---------------------------------------------------|
| audio context of one LLM turn (its `context_id`)  | a `context_id` on the shared session              |
| `run_tts(text, context_id)`                       | `input.text` (token mode) or text + `input.flush` |
| `flush_audio(context_id)` at the end of the turn  | `input.done`, answered by `utterance.done`        |
| `on_audio_context_interrupted(context_id)`        | `input.cancel`, answered by `context.cancelled`   |
| the receive loop                                  | `voxgate_client` events of the session            |
| `add_word_timestamps` (with `word_timestamps`)    | `audio.words`: each word once its audio was sent  |

Audio is 16-bit PCM at the pipeline's output rate (or `sample_rate`): the gateway resamples, so no
resampling happens here. The session asks for word timestamps (unless `word_timestamps=False`) and each
word reaches Pipecat through `add_word_timestamps`, timed from the start of its context's audio, so Pipecat
pushes a `TTSTextFrame` per word in step with playback, and after a barge-in the assistant's context holds
exactly the words whose audio this service had received. A dropped connection is resumed by
`voxgate_client` (session.resume) with every audio context kept; only when resuming fails does Pipecat's
reconnect open a fresh session, closing the contexts of the lost one as it does for any provider.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from loguru import logger
from pipecat.frames.frames import CancelFrame, ErrorFrame, Frame, TTSAudioRawFrame, TTSStoppedFrame
from pipecat.processors.frame_processor import FrameProcessorSetup
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TextAggregationMode, WebsocketTTSService
from pipecat.transcriptions.language import Language
from pipecat.utils.types import NOT_GIVEN, NotGiven, is_given

import voxgate_client
from voxgate_client import events as vg

# Qwen3-TTS names its languages in English words; other backends ignore or map them. Codes that are not
# listed are sent as they are, and the gateway answers an unknown one with an error.
_LANGUAGE_NAMES = {
    "en": "English",
    "zh": "Chinese",
    "de": "German",
    "it": "Italian",
    "pt": "Portuguese",
    "es": "Spanish",
    "ja": "Japanese",
    "ko": "Korean",
    "fr": "French",
    "ru": "Russian",
}

# Settings that live in Voxgate's session.config, so changing one means a new session.config.
_SESSION_FIELDS = ("voice", "model", "language", "instructions", "seed")


def _given(value: Any) -> Any:
    return value if is_given(value) else None


def language_to_voxgate_language(language: Language | str) -> str:
    code = str(getattr(language, "value", language))
    return _LANGUAGE_NAMES.get(code.split("-")[0].split("_")[0].lower(), code)


@dataclass
class VoxgateTTSSettings(TTSSettings):
    """Runtime-updatable settings (`TTSUpdateSettingsFrame`). `voice`, `model` and `language` come from
    `TTSSettings`.

    Parameters:
        instructions: Style instructions for backends that take them (Qwen3-TTS instruct models).
        seed: Sampling seed, for reproducible audio.
    """

    instructions: str | None | NotGiven = field(default_factory=lambda: NOT_GIVEN)
    seed: int | None | NotGiven = field(default_factory=lambda: NOT_GIVEN)


class VoxgateTTSService(WebsocketTTSService):
    """Streams an agent's text to a Voxgate gateway and its audio back into the pipeline.

    One WebSocket session serves every turn; each turn is its own Voxgate context, so a barge-in cancels
    exactly that turn's audio on the gateway and the next turn starts at once on the same socket.

    Example::

        tts = VoxgateTTSService(
            url="ws://localhost:8000",
            settings=VoxgateTTSService.Settings(voice="tone-mid"),
        )

    Args:
        url: Gateway URL (`ws://host:port`; the stream path is added) or a list of replicas to resume on.
        api_key: Sent as `Authorization: Bearer ...` when the gateway requires keys.
        sample_rate: Output rate; default the pipeline's `audio_out_sample_rate`. The gateway resamples.
        settings: Voice, model, language, instructions, seed (runtime-updatable).
        split_granularity: Gateway splitting: `token` (default: each sentence's synthesis starts at its
            first words where the gateway's backend can take text while it speaks, so with `TOKEN`
            aggregation nothing waits for a sentence's end; elsewhere the gateway splits at sentences and
            warns in session.started), `sentence`, `clause` or `none`.
        chunk_schedule: Codec frames per audio chunk (Qwen3 backends), e.g. `[2, 4, 8, 12]`.
        pronunciations: Pronunciation dictionary entries (`{"text": "Voxgate", "say": "vox gate"}`) and names
            of dictionaries registered with the key, passed to the gateway (docs/pronunciation.md); word
            timestamps and the transcript keep the words as written.
        text_markup: `"ssml"`: the LLM's text is read as the gateway's markup subset (`<spell>`, `<sub>`,
            `<break time="300ms"/>`, ...); without it `<` is just text.
        word_timestamps: Ask the gateway for word timestamps (`timestamp_type: "word"`, sent as soon as
            each word's audio is out) and report them with Pipecat's word-timestamp hooks. Without them, or
            when the gateway's backend gives none (session.started warns `timestamps_unsupported`), each
            sentence's text is pushed at once.
        text_aggregation_mode: `TOKEN` (default) sends LLM tokens as they come and lets the gateway
            split sentences, which it does as soon as one is certainly complete; `SENTENCE` lets Pipecat
            aggregate and flushes each sentence at once.
        max_reconnect_attempts: How often `voxgate_client` tries to resume a dropped session.
        session_options: Further `voxgate_client.Session` options (e.g. `keepalive_s`).
    """

    Settings = VoxgateTTSSettings
    _settings: VoxgateTTSSettings

    def __init__(
        self,
        *,
        url: str | list[str] = "ws://127.0.0.1:8000",
        api_key: str | None = None,
        sample_rate: int | None = None,
        settings: VoxgateTTSSettings | None = None,
        split_granularity: str | None = "token",
        chunk_schedule: list[int] | None = None,
        word_timestamps: bool = True,
        pronunciations: list[dict[str, Any] | str] | None = None,
        text_markup: str | None = None,
        text_aggregation_mode: TextAggregationMode | None = None,
        max_reconnect_attempts: int = 6,
        session_options: dict[str, Any] | None = None,
        **kwargs,
    ):
        default_settings = self.Settings(model=None, voice=None, language=None, instructions=None, seed=None)
        if settings is not None:
            default_settings.apply_update(settings)
        super().__init__(
            text_aggregation_mode=text_aggregation_mode or TextAggregationMode.TOKEN,
            # Without word timestamps the text is pushed per sentence; with them, per word as it is played.
            push_text_frames=not word_timestamps,
            push_start_frame=True,  # the base opens the audio context, starts TTFB, sends TTSStartedFrame
            pause_frame_processing=False,  # every audio chunk names its context
            sample_rate=sample_rate,
            settings=default_settings,
            **kwargs,
        )
        self._urls = [url] if isinstance(url, str) else list(url)
        self._api_key = api_key
        self._split_granularity = split_granularity
        self._chunk_schedule = list(chunk_schedule) if chunk_schedule else None
        self._word_timestamps = word_timestamps
        self._pronunciations = list(pronunciations) if pronunciations else None
        self._text_markup = text_markup
        self._session_options = {"max_reconnect_attempts": max_reconnect_attempts, **(session_options or {})}
        self._session: voxgate_client.Session | None = None
        self._receive_task: asyncio.Task | None = None
        self._config_dirty = False
        # Contexts this service cancelled, with the audio bytes that still arrived for each before the
        # gateway confirmed (context.cancelled): the barge-in cost, reported by `on_context_cancelled`.
        # Not named `_cancelling`: Pipecat's FrameProcessor owns that name, a flag it sets on CancelFrame
        # and reads in queue_frame (a non-empty dict there dropped every frame queued during a barge-in).
        self._late_bytes_of_cancelled: dict[str, int] = {}
        # Contexts the gateway holds open for this service: text sent, no utterance.done or context.cancelled
        # yet. A pipeline cancel stops these whether or not Pipecat still lists an audio context for them.
        self._open_contexts: set[str] = set()
        self._register_event_handler("on_context_cancelled")
        self._register_event_handler("on_reconnected")

    # ------------------------------------------------------------------------------------ Pipecat hooks

    def can_generate_metrics(self) -> bool:
        return True

    def language_to_service_language(self, language: Language) -> str | None:
        return language_to_voxgate_language(language)

    @property
    def session(self) -> voxgate_client.Session | None:
        """The live Voxgate session (None while disconnected)."""
        return self._session

    async def setup(self, setup: FrameProcessorSetup):
        await super().setup(setup)
        await self._connect()

    async def _connect(self):
        await super()._connect()
        await self._connect_websocket()
        if self._session is not None and self._receive_task is None:
            self._receive_task = self.create_task(self._receive_task_handler(self._report_error))

    async def _disconnect(self):
        await super()._disconnect()
        if self._receive_task is not None:
            await self.cancel_task(self._receive_task)
            self._receive_task = None
        await self._disconnect_websocket()

    def _session_config(self) -> voxgate_client.SessionConfig:
        s = self._settings
        return voxgate_client.SessionConfig(
            voice=_given(s.voice),
            model=_given(s.model),
            language=_given(s.language),
            instructions=_given(s.instructions),
            seed=_given(s.seed),
            response_format="pcm",  # Pipecat audio frames are 16-bit PCM
            sample_rate=self.sample_rate or None,
            stream_audio=True,
            split_granularity=self._split_granularity,
            chunk_schedule=self._chunk_schedule,
            timestamp_type="word" if self._word_timestamps else None,
            timestamp_transport_strategy="async" if self._word_timestamps else None,
            pronunciations=self._pronunciations,
            text_markup=self._text_markup,
        )

    async def _connect_websocket(self):
        if self._session is not None and not self._session.closed:
            return
        try:
            logger.debug(f"{self}: connecting to Voxgate at {self._urls[0]}")
            self._session = await voxgate_client.connect(
                self._urls, self._session_config(), api_key=self._api_key, **self._session_options
            )
            self._config_dirty = False
            # Text goes out per word as it plays when words come timed, else per sentence.
            self._push_text_frames = not self._words_timed(self._session)
            await self._call_event_handler("on_connected")
        except voxgate_client.VoxgateError as e:
            self._session = None
            # A refusal that retrying cannot fix (bad key, unknown voice, bad format) ends the service's
            # usefulness; the reconnect loop stops on it instead of hammering the gateway.
            await self.push_error(
                error_msg=f"Voxgate refused the session: {e}", exception=e,
                force_treat_as_permanent=not e.retryable,
            )
            await self._call_event_handler("on_connection_error", str(e))
        except (OSError, asyncio.TimeoutError) as e:
            self._session = None
            await self.push_error(error_msg=f"Voxgate connection failed: {e}", exception=e)
            await self._call_event_handler("on_connection_error", str(e))

    def _words_timed(self, session: voxgate_client.Session) -> bool:
        """Whether the session's words come with timestamps: asked for, and not refused by the backend."""
        warnings = session.started.warnings if session.started else []
        return self._word_timestamps and not any(w.get("code") == "timestamps_unsupported" for w in warnings)

    async def cancel(self, frame: CancelFrame):
        """A cancelled pipeline wants no more audio: the gateway stops every open context at once, so the
        session.close that follows has nothing left to finish (a bare socket drop would instead leave the
        session running on the gateway, waiting to be resumed)."""
        session = self._session
        if session is not None and not session.closed:
            for context_id in dict.fromkeys([*self.get_audio_contexts(), *sorted(self._open_contexts)]):
                try:
                    await session.cancel(context_id=context_id)
                except voxgate_client.VoxgateError:
                    break
        await super().cancel(frame)

    async def _disconnect_websocket(self):
        session, self._session = self._session, None
        self._late_bytes_of_cancelled.clear()
        self._open_contexts.clear()
        try:
            await self.stop_all_metrics()
            if session is not None:
                logger.debug(f"{self}: disconnecting from Voxgate")
                # The gateway finishes what is open first: nothing after stop() (playback drained) or
                # cancel() (contexts cancelled).
                await session.close(timeout_s=2.0)
        except Exception as e:
            logger.warning(f"{self}: error closing the Voxgate session: {e}")
        finally:
            await self._call_event_handler("on_disconnected")

    async def _verify_connection(self) -> bool:
        if self._session is None or self._session.closed:
            return False
        try:
            await self._session.ping(timeout_s=5.0)
            return True
        except Exception as e:
            logger.error(f"{self}: connection verification failed: {e}")
            return False

    async def _receive_messages(self):
        """Route the session's events into Pipecat audio contexts. Returns when the session has ended
        for good (resume failed), which makes the base class reconnect with a fresh session."""
        session = self._session
        if session is None:
            raise ConnectionError("no Voxgate session")
        async for event in session.events(until_done=False):
            await self._handle_event(event)

    async def _handle_event(self, event: vg.Event):
        context_id = getattr(event, "context_id", None)
        if isinstance(event, vg.AudioChunk):
            if context_id in self._late_bytes_of_cancelled:
                self._late_bytes_of_cancelled[context_id] += len(event.data)
            elif context_id is not None and self.audio_context_available(context_id):
                frame = TTSAudioRawFrame(
                    audio=event.data, sample_rate=self.sample_rate, num_channels=1, context_id=context_id
                )
                await self.append_to_audio_context(context_id, frame)
        elif isinstance(event, vg.AudioWords):
            # Times from the start of the context's audio, which is where Pipecat starts its word clock
            # (the context's first audio frame). Pipecat drops words of a context that is no longer playing.
            if context_id is not None:
                await self.add_word_timestamps([(w.word, w.utterance_start) for w in event.words], context_id)
        elif isinstance(event, vg.UtteranceDone):
            self._open_contexts.discard(context_id)
            if context_id is not None and self.audio_context_available(context_id):
                await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
                await self.remove_audio_context(context_id)
        elif isinstance(event, vg.ContextCancelled):
            self._open_contexts.discard(context_id)
            late_bytes = self._late_bytes_of_cancelled.pop(context_id, 0)
            await self._call_event_handler("on_context_cancelled", context_id, late_bytes)
        elif isinstance(event, vg.Error):
            await self._handle_gateway_error(event)
        elif isinstance(event, vg.Reconnected):
            logger.info(f"{self}: resumed Voxgate session {event.session_id} after {event.attempts} attempt(s)")
            await self._call_event_handler("on_reconnected", event)
        elif isinstance(event, vg.Disconnected):
            logger.warning(f"{self}: Voxgate session ended ({event.code}): {event.reason}")

    async def _handle_gateway_error(self, error: vg.Error):
        message = f"Voxgate error {error.code}: {error.message}"
        context_id = error.context_id
        if context_id is not None and self.audio_context_available(context_id) and error.sentence_index is None:
            # The context's text was refused (not one sentence failing): it will get no utterance.done.
            self._open_contexts.discard(context_id)
            await self.append_to_audio_context(context_id, ErrorFrame(error=message))
            await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
            await self.remove_audio_context(context_id)
            return
        await self.push_error(error_msg=message)

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Send text for `context_id`; its audio arrives on the receive task."""
        try:
            if self._session is None or self._session.closed:
                await self._connect()
            session = self._session
            if session is None:
                yield ErrorFrame(error="Voxgate is not connected")
                return
            if self._config_dirty:
                await self._apply_session_config(session)
            self._open_contexts.add(context_id)
            await session.send_text(text, context_id=context_id)
            if not self._is_streaming_tokens:
                # Pipecat already cut a whole sentence: have the gateway speak it now rather than wait for
                # the next sentence to prove this one complete.
                await session.flush(context_id=context_id)
            await self.start_tts_usage_metrics(text)
            yield None
        except voxgate_client.VoxgateError as e:
            yield ErrorFrame(error=f"Voxgate send failed: {e}")
            yield TTSStoppedFrame(context_id=context_id)

    async def flush_audio(self, context_id: str | None = None):
        """End of the turn's text: the gateway speaks what is buffered and answers `utterance.done`."""
        flush_id = context_id or self.get_active_audio_context_id()
        if not flush_id or self._session is None:
            return
        try:
            await self._session.done(context_id=flush_id)
        except voxgate_client.VoxgateError as e:
            await self.push_error(error_msg=f"Voxgate input.done failed: {e}", exception=e)

    async def on_audio_context_interrupted(self, context_id: str):
        """Barge-in: the gateway stops generating this context at once and drops its unsent audio."""
        await self.stop_all_metrics()
        if self._session is not None and not self._session.closed:
            self._late_bytes_of_cancelled[context_id] = 0
            try:
                await self._session.cancel(context_id=context_id)
            except voxgate_client.VoxgateError as e:
                self._late_bytes_of_cancelled.pop(context_id, None)
                logger.warning(f"{self}: input.cancel for {context_id} failed: {e}")
        await super().on_audio_context_interrupted(context_id)

    async def _update_settings(self, delta: VoxgateTTSSettings) -> dict[str, Any]:
        """Session settings change with a new session.config, which the gateway takes only between
        utterances: the turn in progress is ended here and its remaining text opens a fresh context."""
        changed = await super()._update_settings(delta)
        if not changed.keys() & set(_SESSION_FIELDS):
            return changed
        if self._turn_context_id:
            await self._push_sequencer_frames(
                await self._aggregated_frame_sequencer.finalize(self._turn_context_id), self._turn_context_id
            )
            if self.audio_context_available(self._turn_context_id):
                await self.flush_audio(context_id=self._turn_context_id)
            self._turn_context_id = None  # else create_context_id() hands back the same id (reuse within a turn)
            self._turn_context_id = self.create_context_id()
        self._config_dirty = True
        if self._session is not None and not self._session.closed:
            await self._apply_session_config(self._session)
        return changed

    async def _apply_session_config(self, session: voxgate_client.Session):
        self._config_dirty = False
        try:
            await session.reconfigure(self._session_config())
        except voxgate_client.VoxgateError as e:
            self._config_dirty = True
            await self.push_error(error_msg=f"Voxgate session.config failed: {e}", exception=e)


__all__ = ["VoxgateTTSService", "VoxgateTTSSettings", "language_to_voxgate_language"]
