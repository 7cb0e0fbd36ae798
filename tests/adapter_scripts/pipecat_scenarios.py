"""Pipecat scenarios against a live gateway; run in the pipecat venv (tests/adapter_env.py).

    python pipecat_scenarios.py WS_URL SCENARIOS_JSON   (see scenario_runner.py)

Each scenario builds a real Pipecat pipeline (PipelineWorker + WorkerRunner): the frames an LLM service
would emit (LLMFullResponseStartFrame, LLMTextFrame tokens, LLMFullResponseEndFrame) go into
VoxgateTTSService, and a collector at the end records what comes out.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

from loguru import logger

from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    MetricsFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.metrics.metrics import TTFBMetricsData
from pipecat.pipeline.pipeline import Pipeline
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMAssistantAggregator
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.workers.runner import WorkerRunner
from scenario_runner import llm_tokens, main

from voxgate_client import events as vg
from voxgate_pipecat import VoxgateTTSService


class RecordingTTS(VoxgateTTSService):
    """The service under test, noting the gateway's sentence announcements, the text it was given and cancel
    timings. With `hold_context_cancelled` set, a context.cancelled from the gateway waits for that event
    before the service sees it (a barge-in whose confirmation is slow to come)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.sentences: dict[str, list[str]] = {}
        self.cancel_sent_at: dict[str, float] = {}
        self.texts: dict[str, list[str]] = {}
        self.hold_context_cancelled: asyncio.Event | None = None

    async def _handle_event(self, event):
        # At audio.done: with token splitting audio.start has only the words known when synthesis began.
        if isinstance(event, vg.AudioDone) and event.context_id is not None:
            self.sentences.setdefault(event.context_id, []).append(event.sentence_text)
        if isinstance(event, vg.ContextCancelled) and self.hold_context_cancelled is not None:
            await self.hold_context_cancelled.wait()
        await super()._handle_event(event)

    async def run_tts(self, text: str, context_id: str):
        self.texts.setdefault(context_id, []).append(text)
        async for frame in super().run_tts(text, context_id):
            yield frame

    async def on_audio_context_interrupted(self, context_id: str):
        self.cancel_sent_at[context_id] = time.monotonic()
        await super().on_audio_context_interrupted(context_id)


class Collector(FrameProcessor):
    """End of the pipeline: keeps every frame that reaches it, with its arrival time."""

    def __init__(self):
        super().__init__()
        self.frames: list[tuple[float, Frame]] = []
        self.stopped: dict[str, asyncio.Event] = {}
        self.first_audio = asyncio.Event()

    def stopped_event(self, context_id: str) -> asyncio.Event:
        return self.stopped.setdefault(context_id, asyncio.Event())

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        self.frames.append((time.monotonic(), frame))
        if isinstance(frame, TTSAudioRawFrame):
            self.first_audio.set()
        if isinstance(frame, TTSStoppedFrame) and frame.context_id:
            self.stopped_event(frame.context_id).set()
        await self.push_frame(frame, direction)


class Harness:
    def __init__(self, url: str, sample_rate: int = 24000, assistant: LLMAssistantAggregator | None = None,
                 **tts_options):
        self.tts = RecordingTTS(url=url, settings=VoxgateTTSService.Settings(voice="tone-mid"), **tts_options)
        self.collector = Collector()
        self.worker = PipelineWorker(
            Pipeline([self.tts, self.collector, *([assistant] if assistant else [])]),
            params=PipelineParams(audio_out_sample_rate=sample_rate, enable_metrics=True),
            idle_timeout_secs=None,
            enable_rtvi=False,
        )
        self.runner = WorkerRunner(handle_sigint=False)
        self.started = asyncio.Event()
        self.errors: list[str] = []

        @self.worker.event_handler("on_pipeline_started")
        async def _started(worker, frame):
            self.started.set()

        @self.worker.event_handler("on_pipeline_error")
        async def _error(worker, frame: ErrorFrame):
            self.errors.append(str(frame.error))

    async def __aenter__(self) -> "Harness":
        await self.runner.add_workers(self.worker)
        self.run_task = asyncio.create_task(self.runner.run())
        await asyncio.wait_for(self.started.wait(), 20)
        for _ in range(200):  # setup() connects in the background; wait for the session
            if self.tts.session is not None:
                break
            await asyncio.sleep(0.02)
        return self

    async def __aexit__(self, *exc):
        await self.worker.queue_frame(EndFrame())
        await asyncio.wait_for(self.run_task, 20)

    async def speak_turn(self, text: str, token_delay_s: float = 0.002) -> None:
        """Push one LLM turn token by token, as an LLM service would."""
        await self.worker.queue_frame(LLMFullResponseStartFrame())
        for token in llm_tokens(text):
            await self.worker.queue_frame(LLMTextFrame(token))
            await asyncio.sleep(token_delay_s)
        await self.worker.queue_frame(LLMFullResponseEndFrame())

    def contexts(self) -> list[str]:
        return [f.context_id for _, f in self.collector.frames if isinstance(f, TTSStartedFrame)]

    async def wait_for_contexts(self, n: int, timeout: float = 20) -> list[str]:
        deadline = time.monotonic() + timeout
        while len(self.contexts()) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"expected {n} audio contexts, saw {self.contexts()}")
            await asyncio.sleep(0.01)
        return self.contexts()

    async def spoken_turn(self, index: int) -> dict:
        """The audio of the `index`-th audio context (from 0), once it has stopped."""
        context_id = (await self.wait_for_contexts(index + 1))[index]
        await self.wait_stopped(context_id)
        return {"context_id": context_id, **self.audio_of(context_id)}

    async def wait_stopped(self, context_id: str, timeout: float = 30) -> None:
        await asyncio.wait_for(self.collector.stopped_event(context_id).wait(), timeout)

    def audio_of(self, context_id: str) -> dict:
        frames = [f for _, f in self.collector.frames if isinstance(f, TTSAudioRawFrame) and f.context_id == context_id]
        return {
            "bytes": sum(len(f.audio) for f in frames),
            "sha256": hashlib.sha256(b"".join(f.audio for f in frames)).hexdigest(),
            "frames": len(frames),
            "odd_frames": sum(len(f.audio) % 2 for f in frames),
            "sample_rates": sorted({f.sample_rate for f in frames}),
            "channels": sorted({f.num_channels for f in frames}),
            "sentences": self.tts.sentences.get(context_id, []),
        }

    def ttfb(self) -> list[float]:
        values = []
        for _, frame in self.collector.frames:
            if isinstance(frame, MetricsFrame):
                values += [d.value for d in frame.data if isinstance(d, TTFBMetricsData) and d.value > 0]
        return values


async def scenario_two_turns(url: str, turns: list[str]) -> dict:
    """Two LLM turns, one after the other, on one connection."""
    async with Harness(url) as h:
        session_id = h.tts.session.session_id
        results = []
        for i, text in enumerate(turns):
            await h.speak_turn(text)
            results.append(await h.spoken_turn(i))
        return {
            "turns": results,
            "session_ids": [session_id, h.tts.session.session_id],
            "reconnects": h.tts.session.reconnects,
            "split_granularity": h.tts.session.config.split_granularity,
            "text_streaming": h.tts.session.text_streaming,
            "warnings": [w.get("field") for w in h.tts.session.started.warnings],
            "ttfb_s": h.ttfb(),
            "errors": h.errors,
        }


async def scenario_interrupt(url: str, long_turn: str, next_turn: str) -> dict:
    """Barge-in after the first audio of a long turn, then a fresh turn on the same socket."""
    async with Harness(url) as h:
        cancelled: list[tuple[str, int, float]] = []

        @h.tts.event_handler("on_context_cancelled")
        async def _cancelled(tts, context_id, late_bytes):
            cancelled.append((context_id, late_bytes, time.monotonic()))

        await h.speak_turn(long_turn)
        await asyncio.wait_for(h.collector.first_audio.wait(), 20)
        interrupted_at = time.monotonic()
        await h.worker.queue_frame(InterruptionFrame())
        for _ in range(500):
            if cancelled:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # anything still coming would arrive by now
        context_id = h.contexts()[0]
        audio_frames = [(t, f) for t, f in h.collector.frames if isinstance(f, TTSAudioRawFrame) and f.context_id == context_id]
        after = [f for t, f in audio_frames if t > interrupted_at]

        await h.speak_turn(next_turn)
        next_audio = await h.spoken_turn(1)
        return {
            "interrupted": {"context_id": context_id, **h.audio_of(context_id)},
            "frames_after_interrupt": len(after),
            "bytes_after_interrupt": sum(len(f.audio) for f in after),
            "cancel_sent_at": h.tts.cancel_sent_at.get(context_id),
            "cancelled": [{"context_id": c, "late_bytes": b, "at": t} for c, b, t in cancelled],
            "stopped_frame_for_interrupted": h.collector.stopped_event(context_id).is_set(),
            "next": next_audio,
            "reconnects": h.tts.session.reconnects,
            "errors": h.errors,
        }


async def scenario_pipeline_cancel(url: str, long_turn: str) -> dict:
    """The whole pipeline is cancelled (CancelFrame) mid-turn: it ends at once, the gateway stops, and the
    session is closed (session.close answered), not left open on the gateway."""
    h = Harness(url)
    await h.__aenter__()
    await h.speak_turn(long_turn)
    await asyncio.wait_for(h.collector.first_audio.wait(), 20)
    session = h.tts.session
    logged: list[str] = []  # Pipecat logs (rather than raises) what fails while a processor cancels
    sink = logger.add(lambda message: logged.append(message.record["message"]), level="ERROR")
    try:
        cancelled_at = time.monotonic()
        await h.worker.cancel()
        await asyncio.wait_for(h.run_task, 20)
    finally:
        logger.remove(sink)
    return {
        "cancelled_at": cancelled_at,
        "finished_after_s": time.monotonic() - cancelled_at,
        "session_closed": session.closed,
        "logged_errors": logged,
        "errors": h.errors,
    }


async def scenario_barge_in_then_next_turn(url: str, long_turn: str, next_turn: str) -> dict:
    """The next turn's text comes while the barge-in's context.cancelled is still on its way (held here until
    the text has gone through): the service must take all of it and speak it."""
    async with Harness(url) as h:
        release = asyncio.Event()
        h.tts.hold_context_cancelled = release
        await h.speak_turn(long_turn)
        await asyncio.wait_for(h.collector.first_audio.wait(), 20)
        await h.worker.queue_frame(InterruptionFrame())
        for _ in range(1000):  # input.cancel is being sent; its answer will be held
            if h.tts.cancel_sent_at:
                break
            await asyncio.sleep(0.01)
        earlier = set(h.tts.texts)
        await h.speak_turn(next_turn)
        expected = " ".join(next_turn.split())

        def taken() -> str:  # the text run_tts got for contexts opened since the barge-in
            return " ".join("".join(t for c, texts in h.tts.texts.items() if c not in earlier for t in texts).split())

        for _ in range(1000):  # every token of the next turn reached run_tts
            if taken() == expected:
                break
            await asyncio.sleep(0.01)
        text_taken_while_cancelling = taken() == expected
        release.set()
        next_audio = await h.spoken_turn(1) if text_taken_while_cancelling else None
        return {
            "cancel_sent": bool(h.tts.cancel_sent_at),
            "text_taken_while_cancelling": text_taken_while_cancelling,
            "next": next_audio,
            "errors": h.errors,
        }


async def scenario_resume(url: str, text: str, next_turn: str) -> dict:
    """The socket drops in the middle of a turn. With gateway resume the session continues and the turn's
    audio is whole; without it Pipecat's reconnect opens a fresh session. Either way the next turn works."""
    async with Harness(url) as h:
        reconnected = []

        @h.tts.event_handler("on_reconnected")
        async def _reconnected(tts, event):
            reconnected.append(event.attempts)

        session_id = h.tts.session.session_id
        await h.speak_turn(text)
        await asyncio.wait_for(h.collector.first_audio.wait(), 20)
        await h.tts.session.drop_connection()
        context_id = h.contexts()[0]
        try:
            await h.wait_stopped(context_id, timeout=10)
        except asyncio.TimeoutError:
            pass  # the lost session's context was closed without its end
        for _ in range(500):  # a fresh session, if one was needed, is up before the next turn
            if h.tts.session is not None and not h.tts.session.closed:
                break
            await asyncio.sleep(0.01)
        await h.speak_turn(next_turn)
        next_audio = await h.spoken_turn(1)
        return {
            "turn": {"context_id": context_id, **h.audio_of(context_id)},
            "turn_stopped": h.collector.stopped_event(context_id).is_set(),
            "next": next_audio,
            "reconnected": reconnected,
            "session_ids": [session_id, h.tts.session.session_id],
            "errors": h.errors,
        }


async def scenario_speak_frame(url: str, text: str) -> dict:
    """A TTSSpeakFrame (a greeting, say) is an utterance of its own, outside any LLM turn."""
    from pipecat.frames.frames import TTSSpeakFrame

    async with Harness(url) as h:
        await h.worker.queue_frame(TTSSpeakFrame(text))
        return {"utterance": await h.spoken_turn(0), "errors": h.errors}


async def scenario_voice_change(url: str, turns: list[str], voices: list[str]) -> dict:
    """A TTSUpdateSettingsFrame between turns switches the voice for the next turn."""
    from pipecat.frames.frames import TTSUpdateSettingsFrame

    async with Harness(url) as h:
        results = []
        for i, (text, voice) in enumerate(zip(turns, voices)):
            await h.worker.queue_frame(TTSUpdateSettingsFrame(delta=VoxgateTTSService.Settings(voice=voice)))
            await h.speak_turn(text)
            results.append(await h.spoken_turn(i))
        return {"turns": results, "errors": h.errors}


async def scenario_sentence_mode_16k(url: str, text: str) -> dict:
    """Pipecat's own sentence aggregation and a 16 kHz pipeline (the gateway resamples)."""
    from pipecat.services.tts_service import TextAggregationMode

    async with Harness(url, sample_rate=16000, text_aggregation_mode=TextAggregationMode.SENTENCE) as h:
        await h.speak_turn(text)
        return {"turn": await h.spoken_turn(0), "errors": h.errors}


def words_of(h: Harness, context_id: str) -> list[dict]:
    """The TTSTextFrames of a context that reached the end of the pipeline: word and presentation time."""
    return [{"word": f.text, "pts": f.pts} for _, f in h.collector.frames
            if isinstance(f, TTSTextFrame) and f.context_id == context_id]


def assistant_messages(context: LLMContext) -> list[str]:
    return [m["content"] for m in context.get_messages() if m.get("role") == "assistant"]


async def scenario_word_timestamps(url: str, turn: str, long_turn: str, interrupt_after_words: int) -> dict:
    """word_timestamps=True: a whole turn's words reach Pipecat through add_word_timestamps; then a turn
    interrupted after some words, and what the assistant's context records as spoken."""
    context = LLMContext()
    async with Harness(url, assistant=LLMAssistantAggregator(context), word_timestamps=True) as h:
        received_words: dict[str, list] = {}

        @h.tts.event_handler("on_context_cancelled")
        async def _cancelled(tts, context_id, late_bytes):
            h.cancelled_context = context_id

        h.cancelled_context = None
        original = h.tts._handle_event

        async def note_words(event):
            if isinstance(event, vg.AudioWords):
                received_words.setdefault(event.context_id, []).extend(
                    {"word": w.word, "start": w.utterance_start, "end": w.utterance_end} for w in event.words)
            await original(event)

        h.tts._handle_event = note_words
        await h.speak_turn(turn)
        whole = await h.spoken_turn(0)
        whole_words = words_of(h, whole["context_id"])
        await h.speak_turn(long_turn)
        long_id = (await h.wait_for_contexts(2))[1]
        deadline = time.monotonic() + 20
        while len(words_of(h, long_id)) < interrupt_after_words:
            if time.monotonic() > deadline:
                raise TimeoutError("no words for the long turn")
            await asyncio.sleep(0.005)
        await h.worker.queue_frame(InterruptionFrame())
        while h.cancelled_context != long_id:
            if time.monotonic() > deadline:
                raise TimeoutError("no context.cancelled")
            await asyncio.sleep(0.01)
        while len(assistant_messages(context)) < 2:  # the interruption reaches the assistant aggregator
            if time.monotonic() > deadline:
                raise TimeoutError(f"no assistant message for the interrupted turn: {assistant_messages(context)}")
            await asyncio.sleep(0.01)
        return {
            "whole": {**whole, "words": whole_words, "received": received_words.get(whole["context_id"], [])},
            "interrupted": {**h.audio_of(long_id), "words": words_of(h, long_id),
                            "received": received_words.get(long_id, [])},
            "assistant_messages": assistant_messages(context),
            "errors": h.errors,
        }


async def assistant_spoke(context: LLMContext, timeout_s: float = 20.0) -> None:
    """Until the assistant aggregator has recorded a message in `context`."""
    deadline = time.monotonic() + timeout_s
    while not assistant_messages(context):
        if time.monotonic() > deadline:
            raise TimeoutError("no assistant message")
        await asyncio.sleep(0.01)


async def scenario_untimed_backend(url: str, turn: str) -> dict:
    """The service's default (word timestamps asked for) on a gateway whose backend gives none: its
    session.started warns timestamps_unsupported, and the text goes out per sentence instead."""
    context = LLMContext()
    async with Harness(url, assistant=LLMAssistantAggregator(context)) as h:
        await h.speak_turn(turn)
        spoken = await h.spoken_turn(0)
        await assistant_spoke(context)
        return {
            "warnings": [w.get("code") for w in h.tts.session.started.warnings],
            "text_frames": [w["word"] for w in words_of(h, spoken["context_id"])],
            "assistant_messages": assistant_messages(context),
            "errors": h.errors,
        }


async def scenario_pronunciation(url: str, turn: str, pronunciations: list, text_markup: str) -> dict:
    """A turn spoken with pronunciations and markup passed through the service: the words Pipecat gets (and
    the assistant's context records) are the turn's written words."""
    context = LLMContext()
    async with Harness(url, assistant=LLMAssistantAggregator(context), word_timestamps=True,
                       pronunciations=pronunciations, text_markup=text_markup) as h:
        await h.speak_turn(turn)
        spoken = await h.spoken_turn(0)
        await assistant_spoke(context)
        return {"words": [w["word"] for w in words_of(h, spoken["context_id"])],
                "assistant_messages": assistant_messages(context), "errors": h.errors}


SCENARIOS = {
    "word_timestamps": scenario_word_timestamps,
    "pronunciation": scenario_pronunciation,
    "untimed_backend": scenario_untimed_backend,
    "two_turns": scenario_two_turns,
    "interrupt": scenario_interrupt,
    "resume": scenario_resume,
    "fresh_session": scenario_resume,  # the same drop, on a gateway that has forgotten the session
    "sentence_mode_16k": scenario_sentence_mode_16k,
    "voice_change": scenario_voice_change,
    "pipeline_cancel": scenario_pipeline_cancel,
    "barge_in_then_next_turn": scenario_barge_in_then_next_turn,
    "speak_frame": scenario_speak_frame,
}


if __name__ == "__main__":
    main(SCENARIOS)
