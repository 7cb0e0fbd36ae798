"""LiveKit Agents scenarios against a live gateway; run in the livekit venv (tests/adapter_env.py).

    python livekit_scenarios.py WS_URL SCENARIOS_JSON

Drives voxgate_livekit.TTS the way livekit-agents' voice pipeline does (`tts_node`: one `stream()` per
reply, `push_text` per LLM token, `end_input()`, frames read until the end; interruption = `aclose()`),
plus `synthesize()` and the error paths. Prints one JSON object: scenario -> observations.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import sys
import time
import traceback

from livekit.agents import APIConnectOptions, APIError

from voxgate_livekit import TTS


def llm_tokens(text: str) -> list[str]:
    return re.findall(r"\s*[^\s.,!?;:]+|[.,!?;:]", text)


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


async def scenario_stream(url: str, replies: list[str]) -> dict:
    """Replies spoken one stream each, as the agent does, on the TTS's one shared session."""
    tts = TTS(url=url, voice="tone-mid")
    metrics = []
    tts.on("metrics_collected", lambda m: metrics.append(m.ttfb))
    out = []
    session_ids = []
    try:
        for text in replies:
            frames, events = [], []
            async with tts.stream() as stream:
                reader = asyncio.create_task(read_stream(stream, frames, events))
                for token in llm_tokens(text):
                    stream.push_text(token)
                    await asyncio.sleep(0.002)
                stream.end_input()
                await asyncio.wait_for(reader, 30)
            session_ids.append(tts._shared.session.session_id)
            out.append(describe(frames, events))
    finally:
        await tts.aclose()
    return {"replies": out, "session_ids": session_ids, "ttfb_s": metrics}


async def scenario_voice_change(url: str, reply: str) -> dict:
    """update_options() between replies: the next reply is spoken with the new voice."""
    tts = TTS(url=url, voice="tone-low")
    out = []
    try:
        for voice in (None, "tone-high"):
            if voice:
                tts.update_options(voice=voice)
            frames, events = [], []
            async with tts.stream() as stream:
                reader = asyncio.create_task(read_stream(stream, frames, events))
                stream.push_text(reply)
                stream.end_input()
                await asyncio.wait_for(reader, 30)
            out.append(describe(frames, events))
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

        next_frames, next_events = [], []
        async with tts.stream() as stream2:
            reader2 = asyncio.create_task(read_stream(stream2, next_frames, next_events))
            stream2.push_text(next_reply)
            stream2.end_input()
            await asyncio.wait_for(reader2, 30)
        return {
            "interrupted": interrupted,
            "closed_at": closed_at,
            "contexts_left": cancelled_contexts,
            "next": describe(next_frames, next_events),
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
        next_frames, next_events = [], []
        async with tts.stream() as stream2:
            reader2 = asyncio.create_task(read_stream(stream2, next_frames, next_events))
            stream2.push_text(next_reply)
            stream2.end_input()
            await asyncio.wait_for(reader2, 30)
        return {
            "reply": describe(frames, events),
            "raised": raised,
            "error_events": list(recoverable),
            "reconnects": session.reconnects,
            "next": describe(next_frames, next_events),
            "session_ids": [first_session, tts._shared.session.session_id],
        }
    finally:
        await tts.aclose()


async def scenario_errors(url: str, closed_url: str) -> dict:
    """How failures reach the framework: which are retried and which end the request at once."""
    results = {}
    fast = APIConnectOptions(max_retry=2, retry_interval=0.05, timeout=5)

    # A voice the gateway does not have: refused in the handshake (unknown_voice), never retried.
    tts = TTS(url=url, voice="no-such-voice")
    recoverable = watch_errors(tts)
    try:
        async with tts.stream(conn_options=fast) as stream:
            stream.push_text("Hello there.")
            stream.end_input()
            async for _ in stream:
                pass
        results["stream_unknown_voice"] = {"raised": None}
    except APIError as exc:
        results["stream_unknown_voice"] = {"raised": error_info(exc), "error_events": list(recoverable)}
    # The same through HTTP: a 400 answer.
    recoverable = watch_errors(tts)
    try:
        await tts.synthesize("Hello there.", conn_options=fast).collect()
        results["synthesize_unknown_voice"] = {"raised": None}
    except APIError as exc:
        results["synthesize_unknown_voice"] = {"raised": error_info(exc), "error_events": list(recoverable)}
    await tts.aclose()

    # Nothing listening: a connection error, retried max_retry times before giving up.
    tts = TTS(url=closed_url, voice="tone-mid")
    recoverable = watch_errors(tts)
    try:
        async with tts.stream(conn_options=fast) as stream:
            stream.push_text("Hello there.")
            stream.end_input()
            async for _ in stream:
                pass
        results["stream_no_gateway"] = {"raised": None}
    except APIError as exc:
        results["stream_no_gateway"] = {"raised": error_info(exc), "error_events": list(recoverable)}
    recoverable = watch_errors(tts)
    try:
        await tts.synthesize("Hello there.", conn_options=fast).collect()
        results["synthesize_no_gateway"] = {"raised": None}
    except APIError as exc:
        results["synthesize_no_gateway"] = {"raised": error_info(exc), "error_events": list(recoverable)}
    await tts.aclose()
    return results


SCENARIOS = {
    "stream": scenario_stream,
    "synthesize": scenario_synthesize,
    "cancel": scenario_cancel,
    "errors": scenario_errors,
    "voice_change": scenario_voice_change,
    "resume": scenario_drop,
    "fresh_session": scenario_drop,  # the same drop, on a gateway that has forgotten the session
}


async def main(url: str, plan: dict) -> dict:
    results = {}
    for name, kwargs in plan.items():
        try:
            target = kwargs.pop("gateway_url", url)  # a scenario may need a differently configured gateway
            results[name] = await asyncio.wait_for(SCENARIOS[name](target, **kwargs), 60)
        except BaseException:
            results[name] = {"error": traceback.format_exc()}
    return results


if __name__ == "__main__":
    print("RESULTS " + json.dumps(asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))))
