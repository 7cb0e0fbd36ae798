"""LiveKit Agents scenarios against a live gateway; run in the livekit venv (tests/adapter_env.py).

    python livekit_scenarios.py WS_URL SCENARIOS_JSON   (see scenario_runner.py)

Drives voxgate_livekit.TTS the way livekit-agents' voice pipeline does (`tts_node`: one `stream()` per
reply, `push_text` per LLM token, `end_input()`, frames read until the end; interruption = `aclose()`),
plus `synthesize()` and the error paths.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

from livekit.agents import APIConnectOptions, APIError
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT
from scenario_runner import llm_tokens, main

from voxgate_livekit import TTS


def describe(frames: list, events: list) -> dict:
    return {
        "bytes": sum(len(f.data.tobytes()) for f in frames),
        "sha256": hashlib.sha256(b"".join(f.data.tobytes() for f in frames)).hexdigest(),
        "samples": sum(f.samples_per_channel for f in frames),
        "frames": len(frames),
        "whole_samples": all(len(f.data.tobytes()) == 2 * f.samples_per_channel * f.num_channels for f in frames),
        "sample_rates": sorted({f.sample_rate for f in frames}),
        "channels": sorted({f.num_channels for f in frames}),
        "segments": sorted({e.segment_id for e in events}),
        "finals": sum(1 for e in events if e.is_final),
    }


def error_info(exc: BaseException) -> dict:
    return {
        "type": type(exc).__name__,
        "retryable": getattr(exc, "retryable", None),
        "status": getattr(exc, "status_code", None),
        "message": str(exc),
    }


def watch_errors(tts: TTS) -> list[bool]:
    """The `recoverable` flag of every error event the TTS emits from now on (one list per watcher)."""
    recoverable: list[bool] = []
    tts.on("error", lambda ev: recoverable.append(ev.recoverable))
    return recoverable


async def read_stream(stream, frames: list, events: list, first_audio: asyncio.Event | None = None) -> None:
    async for ev in stream:
        frames.append(ev.frame)
        events.append(ev)
        if first_audio is not None:
            first_audio.set()


async def stream_reply(tts: TTS, tokens: list[str], token_delay_s: float = 0.0) -> tuple[list, list]:
    """One reply as the agent speaks it: a stream pushed `tokens`, then ended, and read to its end; its
    frames and events."""
    frames, events = [], []
    async with tts.stream() as stream:
        reader = asyncio.create_task(read_stream(stream, frames, events))
        for token in tokens:
            stream.push_text(token)
            if token_delay_s:
                await asyncio.sleep(token_delay_s)
        stream.end_input()
        await asyncio.wait_for(reader, 30)
    return frames, events


async def speak(tts: TTS, tokens: list[str], token_delay_s: float = 0.0) -> dict:
    return describe(*await stream_reply(tts, tokens, token_delay_s))


async def refusal(tts: TTS, request: str, conn_options: APIConnectOptions) -> dict:
    """A `stream()` or `synthesize()` request that cannot succeed: what it raised and the error events seen."""
    recoverable = watch_errors(tts)
    try:
        if request == "stream":
            async with tts.stream(conn_options=conn_options) as stream:
                stream.push_text("Hello there.")
                stream.end_input()
                async for _ in stream:
                    pass
        else:
            await tts.synthesize("Hello there.", conn_options=conn_options).collect()
        return {"raised": None}
    except APIError as exc:
        return {"raised": error_info(exc), "error_events": list(recoverable)}


async def scenario_stream(url: str, replies: list[str]) -> dict:
    """Replies spoken one stream each, as the agent does, on the TTS's one shared session."""
    tts = TTS(url=url, voice="tone-mid")
    metrics = []
    tts.on("metrics_collected", lambda m: metrics.append(m.ttfb))
    out = []
    session_ids = []
    try:
        for text in replies:
            out.append(await speak(tts, llm_tokens(text), token_delay_s=0.002))
            session_ids.append(tts._shared.session.session_id)
        session = tts._shared.session
        granularity = {"split_granularity": session.config.split_granularity, "text_streaming": session.text_streaming,
                       "warnings": [w.get("field") for w in session.started.warnings]}
    finally:
        await tts.aclose()
    return {"replies": out, "session_ids": session_ids, "ttfb_s": metrics, **granularity}


async def scenario_voice_change(url: str, reply: str) -> dict:
    """update_options() between replies: the next reply is spoken with the new voice."""
    tts = TTS(url=url, voice="tone-low")
    out = []
    try:
        for voice in (None, "tone-high"):
            if voice:
                tts.update_options(voice=voice)
            out.append(await speak(tts, [reply]))
    finally:
        await tts.aclose()
    return {"replies": out}


async def scenario_synthesize(url: str, text: str) -> dict:
    """The chunked path: POST /v1/audio/speech."""
    tts = TTS(url=url, voice="tone-mid")
    try:
        frames, events = [], []
        async with tts.synthesize(text) as chunked:
            await asyncio.wait_for(read_stream(chunked, frames, events), 30)
        return describe(frames, events)
    finally:
        await tts.aclose()


async def scenario_cancel(url: str, long_reply: str, next_reply: str) -> dict:
    """Interruption: the stream is closed after its first audio; the next reply still works."""
    tts = TTS(url=url, voice="tone-mid")
    try:
        frames, events = [], []
        first_audio = asyncio.Event()
        stream = tts.stream()
        reader = asyncio.create_task(read_stream(stream, frames, events, first_audio))
        for token in llm_tokens(long_reply):
            stream.push_text(token)
        stream.end_input()
        await asyncio.wait_for(first_audio.wait(), 20)
        closed_at = time.monotonic()
        await stream.aclose()
        reader.cancel()
        session = tts._shared.session
        await asyncio.sleep(0.5)  # let input.cancel / context.cancelled pass
        cancelled_contexts = [cid for cid, ctx in session._contexts.items()]  # forgotten once confirmed
        interrupted = describe(frames, events)
        next_audio = await speak(tts, [next_reply])
        return {
            "interrupted": interrupted,
            "closed_at": closed_at,
            "contexts_left": cancelled_contexts,
            "next": next_audio,
            "same_session": tts._shared.session is session,
            "reconnects": session.reconnects,
        }
    finally:
        await tts.aclose()


async def scenario_drop(url: str, reply: str, next_reply: str) -> dict:
    """The socket drops after the first audio of a reply. With gateway resume the reply's audio is whole;
    when the gateway has forgotten the session the reply fails with a connection error and the next
    reply runs on a fresh session."""
    tts = TTS(url=url, voice="tone-mid")
    recoverable = watch_errors(tts)
    try:
        frames, events = [], []
        first_audio = asyncio.Event()
        raised = None
        async with tts.stream() as stream:
            reader = asyncio.create_task(read_stream(stream, frames, events, first_audio))
            for token in llm_tokens(reply):
                stream.push_text(token)
            stream.end_input()
            await asyncio.wait_for(first_audio.wait(), 20)
            session = tts._shared.session
            await session.drop_connection()
            try:
                await asyncio.wait_for(reader, 30)
            except APIError as exc:
                raised = error_info(exc)
        first_session = session.session_id
        next_audio = await speak(tts, [next_reply])
        return {
            "reply": describe(frames, events),
            "raised": raised,
            "error_events": list(recoverable),
            "reconnects": session.reconnects,
            "next": next_audio,
            "session_ids": [first_session, tts._shared.session.session_id],
        }
    finally:
        await tts.aclose()


async def scenario_errors(url: str, closed_url: str) -> dict:
    """How failures reach the framework: which are retried and which end the request at once."""
    results = {}
    fast = APIConnectOptions(max_retry=2, retry_interval=0.05, timeout=5)

    # A voice the gateway does not have: refused in the handshake (unknown_voice) or with a 400 answer over
    # HTTP, never retried. Nothing listening: a connection error, retried max_retry times before giving up.
    for case, gateway_url, voice in (("unknown_voice", url, "no-such-voice"), ("no_gateway", closed_url, "tone-mid")):
        tts = TTS(url=gateway_url, voice=voice)
        for request in ("stream", "synthesize"):
            results[f"{request}_{case}"] = await refusal(tts, request, fast)
        await tts.aclose()
    return results


def timed_words(events: list) -> list[dict]:
    """The TimedStrings the emitter carried to the framework on the audio frames, with the audio bytes up to
    and including the frame that carried each."""
    out, audio_bytes = [], 0
    for ev in events:
        audio_bytes += len(ev.frame.data.tobytes())
        for timed in ev.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT) or []:
            out.append({"text": str(timed), "start": timed.start_time, "end": timed.end_time,
                        "audio_bytes": audio_bytes})
    return out


async def scenario_word_timestamps(url: str, reply: str, long_reply: str, interrupt_after_words: int) -> dict:
    """A reply's aligned transcript, then a reply interrupted (aclose) once some words have reached the
    framework."""
    tts = TTS(url=url, voice="tone-mid")
    try:
        frames, events = await stream_reply(tts, llm_tokens(reply))
        whole = {**describe(frames, events), "words": timed_words(events)}

        frames, events = [], []
        stream = tts.stream()
        reader = asyncio.create_task(read_stream(stream, frames, events))
        for token in llm_tokens(long_reply):
            stream.push_text(token)
        stream.end_input()
        deadline = time.monotonic() + 20
        while len(timed_words(events)) < interrupt_after_words:
            if time.monotonic() > deadline:
                raise TimeoutError("no aligned transcript for the long reply")
            await asyncio.sleep(0.005)
        await stream.aclose()
        reader.cancel()
        interrupted = {**describe(frames, events), "words": timed_words(events)}
        return {"aligned_transcript": tts.capabilities.aligned_transcript, "whole": whole, "interrupted": interrupted}
    finally:
        await tts.aclose()


async def scenario_pronunciation(url: str, reply: str, chunked: str, pronunciations: list, text_markup: str) -> dict:
    """A reply streamed and a text synthesized over HTTP with pronunciations and markup passed through the
    TTS: the aligned transcript names the reply's written words."""
    tts = TTS(url=url, voice="tone-mid", pronunciations=pronunciations, text_markup=text_markup)
    try:
        _, events = await stream_reply(tts, llm_tokens(reply))
        words = [w["text"] for w in timed_words(events)]
        chunked_frames = []
        async with tts.synthesize(chunked) as synthesis:
            async for ev in synthesis:
                chunked_frames.append(ev.frame)
        return {"words": words, "chunked_bytes": sum(len(f.data.tobytes()) for f in chunked_frames)}
    finally:
        await tts.aclose()


SCENARIOS = {
    "word_timestamps": scenario_word_timestamps,
    "pronunciation": scenario_pronunciation,
    "stream": scenario_stream,
    "synthesize": scenario_synthesize,
    "cancel": scenario_cancel,
    "errors": scenario_errors,
    "voice_change": scenario_voice_change,
    "resume": scenario_drop,
    "fresh_session": scenario_drop,  # the same drop, on a gateway that has forgotten the session
}


if __name__ == "__main__":
    main(SCENARIOS)
