"""LiveKit Agents' own Baseten Qwen3-TTS client (livekit-plugins-baseten 1.8.9) against a live gateway; run in
the livekit venv (tests/adapter_env.py).

    python baseten_scenarios.py WS_URL PLAN_JSON   (see scenario_runner.py)

`baseten.TTS(model="qwen3-tts")` with nothing but the endpoint, a key and a voice name (which the plugin
requires: on Baseten it names a voice clone), driven as an agent drives it: one `stream()` per reply with
LLM tokens pushed, interruption by `aclose()`, and `synthesize()`. The plugin is used unchanged; only its
keep-alive period is shortened, so that one keep-alive round trip runs within the test, between two replies.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math

from livekit.agents import APIConnectOptions, APIError, utils
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT
from livekit.plugins import baseten
from livekit.plugins.baseten import qwen3_tts
from scenario_runner import llm_tokens, main

KEY = "k-baseten-test"
VOICE = "my-cloned-voice"  # a Baseten voice clone's name: unknown here, spoken by the default voice


class PluginLog(logging.Handler):
    """The plugin's own warnings (e.g. "server sample_rate=..., expected 24000; audio will be mistimed")."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger("livekit.plugins.baseten").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def describe(frames: list) -> dict:
    data = b"".join(f.data.tobytes() for f in frames)
    return {
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "samples": sum(f.samples_per_channel for f in frames),
        "sample_rates": sorted({f.sample_rate for f in frames}),
        "channels": sorted({f.num_channels for f in frames}),
    }


async def reply_frames(tts: baseten.TTS, text: str) -> list:
    """One reply as an agent speaks it (LLM tokens, then the end of input): every audio frame of it."""
    frames = []
    async with tts.stream() as stream:
        for token in llm_tokens(text):
            stream.push_text(token)
        stream.end_input()
        async for event in stream:
            frames.append(event.frame)
    return frames


async def speak(tts: baseten.TTS, text: str) -> dict:
    return describe(await reply_frames(tts, text))


async def scenario_conversation(url: str, replies: list[str], long_reply: str, after_interrupt: str,
                                chunked: str) -> dict:
    """Replies on one reused socket, a keep-alive round trip while it is parked, an interrupted reply and
    the one after it, then synthesize()."""
    log = PluginLog()
    keepalives: list[bool] = []
    keepalive_answered = asyncio.Event()
    async with utils.http_context.open():
        tts = baseten.TTS(model="qwen3-tts", model_endpoint=url, api_key=KEY, voice=VOICE)
        backend = tts._qwen3
        empty_flush = backend._empty_flush

        async def recorded_flush(ws):
            alive = await empty_flush(ws)
            keepalives.append(alive)
            # One round trip is what the scenario checks, and only one may run. The plugin's loop takes the
            # parked socket out for each round trip and a turn starting meanwhile dials a socket of its own
            # (by design), so a loop still ticking every 0.2 s would race each later turn for the socket and
            # now and then make a session more. From here on the loop sleeps until aclose() cancels it.
            qwen3_tts._KEEPALIVE_INTERVAL = math.inf
            keepalive_answered.set()
            return alive

        backend._empty_flush = recorded_flush
        try:
            out: dict = {"replies": [await speak(tts, text) for text in replies]}
            # Keep-alive: the plugin sends an empty input.done on the parked socket and wants session.done.
            qwen3_tts._KEEPALIVE_INTERVAL = 0.2
            backend._keepalive_task.cancel()  # restart it with the short period
            backend._keepalive_task = asyncio.create_task(backend._keepalive_loop())
            await keepalive_answered.wait()
            out["keepalives"] = list(keepalives)
            # The loop parks the socket again as soon as the flush returns, before this task runs (the lock it
            # takes is free: no turn is in flight), so the next reply finds it parked.
            out["parked_after_keepalive"] = backend._warm is not None and not backend._warm.ws.closed
            out["reply_after_keepalive"] = await speak(tts, replies[0])

            # Interruption: the stream is closed after its first audio; the plugin discards that socket.
            frames, first_audio = [], asyncio.Event()
            stream = tts.stream()

            async def read() -> None:
                async for event in stream:
                    frames.append(event.frame)
                    first_audio.set()

            reader = asyncio.create_task(read())
            for token in llm_tokens(long_reply):
                stream.push_text(token)
            stream.end_input()
            await asyncio.wait_for(first_audio.wait(), 30)
            await stream.aclose()
            reader.cancel()
            out["interrupted"] = describe(frames)
            out["after_interrupt"] = await speak(tts, after_interrupt)

            frames = [event.frame async for event in tts.synthesize(chunked)]
            out["synthesize"] = describe(frames)
            out["plugin_warnings"] = log.messages
            return out
        finally:
            await tts.aclose()


async def scenario_refusals(url: str, keyed_url: str) -> dict:
    """A wrong key, on a gateway with keys: the plugin must not retry it. voice.add / voice.list, as the
    plugin's register_voice() and list_voices() send them."""
    out: dict = {}
    async with utils.http_context.open():
        tts = baseten.TTS(model="qwen3-tts", model_endpoint=keyed_url, api_key="wrong-key", voice=VOICE)
        errors: list[bool] = []
        tts.on("error", lambda event: errors.append(event.recoverable))
        try:
            async with tts.stream(conn_options=APIConnectOptions(max_retry=3, retry_interval=0.05)) as stream:
                stream.push_text("Hello there.")
                stream.end_input()
                async for _ in stream:
                    pass
            out["wrong_key"] = {"raised": None}
        except APIError as exc:
            out["wrong_key"] = {"raised": type(exc).__name__, "status": getattr(exc, "status_code", None),
                                "retryable": exc.retryable, "error_events": errors}
        finally:
            await tts.aclose()
    out["voices"] = await baseten.list_voices(model_endpoint=url, api_key=KEY)
    try:
        await baseten.register_voice(model_endpoint=url, name="mine", ref_audio_path=__file__, api_key=KEY)
        out["voice_add"] = None
    except RuntimeError as exc:
        out["voice_add"] = str(exc)
    return out


async def scenario_word_timestamps(url: str, reply: str) -> dict:
    """`word_timestamps=True`: the plugin asks for Baseten's sync word timestamps and forwards each
    sentence's audio.done word_alignment as the timed transcript, carried on the audio frames."""
    async with utils.http_context.open():
        tts = baseten.TTS(model="qwen3-tts", model_endpoint=url, api_key=KEY, voice=VOICE, word_timestamps=True)
        try:
            frames = await reply_frames(tts, reply)
            words = [{"text": str(timed), "start": timed.start_time, "end": timed.end_time}
                     for frame in frames for timed in frame.userdata.get(USERDATA_TIMED_TRANSCRIPT) or []]
            return {"aligned_transcript": tts.capabilities.aligned_transcript, "words": words, **describe(frames)}
        finally:
            await tts.aclose()


SCENARIOS = {
    "conversation": scenario_conversation,
    "refusals": scenario_refusals,
    "word_timestamps": scenario_word_timestamps,
}


if __name__ == "__main__":
    main(SCENARIOS)
