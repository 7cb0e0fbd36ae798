"""The default CPU voice: Piper with the bundled en_US-joe-medium, alone and through the gateway."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest
import websockets

from tests.gateway_server import audio_by_sentence, receive_until, running_gateway
from tts_backend.base import SynthesisRequest, UnknownVoiceError
from tts_backend.piper import PiperSynthesizer
from tts_backend.registry import create_backend

TEXT = "The quick brown fox jumps over the lazy dog. Piper speaks on the CPU! Does it sound right?"


@pytest.fixture(scope="module")
def piper():
    backend = PiperSynthesizer()
    asyncio.run(backend.start())
    yield backend
    asyncio.run(backend.stop())


async def synthesize(backend, text, voice="en_US-joe-medium", **extra) -> bytes:
    request = SynthesisRequest(text=text, voice=voice, extra=extra)
    return b"".join([chunk.pcm async for chunk in backend.synthesize(request)])


def rms_dbfs(samples: np.ndarray) -> float:
    rms = np.sqrt(np.mean(np.square(samples.astype(np.float64)))) if len(samples) else 0.0
    return 20 * np.log10(max(rms, 1e-9) / 32768)


def test_piper_is_the_default_backend_and_finds_the_bundled_voice(piper):
    from gateway.settings import GatewaySettings

    assert GatewaySettings().backend == "piper"
    assert isinstance(create_backend("piper"), PiperSynthesizer)
    assert [v.id for v in piper.voices()] == ["en_US-joe-medium"]
    assert piper.sample_rate == 22050 and piper.ready
    assert piper.has_voice("joe") and piper.has_voice("EN_US-JOE-MEDIUM") and not piper.has_voice("alloy")


def test_piper_speaks_real_words(piper):
    text = "The quick brown fox jumps over the lazy dog."
    samples = np.frombuffer(asyncio.run(synthesize(piper, text)), dtype="<i2")
    seconds = len(samples) / piper.sample_rate
    # Natural speech runs at roughly 10-20 characters a second.
    assert len(text) / 25 < seconds < len(text) / 8, seconds
    # Loud enough, and voiced through most of it: 20 ms windows above -45 dBFS.
    assert rms_dbfs(samples) > -30
    window = piper.sample_rate // 50
    frames = samples[: len(samples) // window * window].reshape(-1, window)
    voiced = np.mean([rms_dbfs(frame) > -45 for frame in frames])
    assert voiced > 0.6, voiced
    # Words, not a tone: more text gives proportionally more audio, different text different audio.
    longer = np.frombuffer(asyncio.run(synthesize(piper, text + " " + text)), dtype="<i2")
    assert 1.7 < len(longer) / len(samples) < 2.3
    other = asyncio.run(synthesize(piper, "Seven silver swans swam south."))
    assert other != samples.tobytes()[: len(other)]


def test_piper_is_deterministic(piper):
    first = asyncio.run(synthesize(piper, TEXT))
    second = asyncio.run(synthesize(piper, TEXT))
    assert first == second and len(first) > 0


def test_piper_speed_shortens_the_audio(piper):
    normal = asyncio.run(synthesize(piper, "A sentence spoken at two speeds."))
    fast = asyncio.run(synthesize(piper, "A sentence spoken at two speeds.", speed=2.0))
    assert 0.4 < len(fast) / len(normal) < 0.65


def test_piper_unknown_voice(piper):
    async def run():
        return await synthesize(piper, "Hello.", voice="nobody")

    with pytest.raises(UnknownVoiceError):
        asyncio.run(run())


def test_piper_stream_stops_promptly_when_closed(piper):
    """Closing the stream after the first sentence leaves the other sentences unsynthesized."""
    text = " ".join(f"This is sentence number {i} of a long paragraph that keeps going." for i in range(12))

    async def run():
        stream = piper.synthesize(SynthesisRequest(text=text, voice="joe"))
        first = await stream.__anext__()
        t0 = time.monotonic()
        await stream.aclose()
        return first, time.monotonic() - t0

    first, close_s = asyncio.run(run())
    assert len(first.pcm) > 0 and close_s < 0.05


async def test_gateway_streams_piper_audio_byte_identical_to_the_backend(piper):
    """Audio integrity with the real default voice (Piper is deterministic here: noise scales 0), at the
    voice's own rate (the default, 24 kHz, is resampled: test_client_compat.py)."""
    with running_gateway("piper") as server:
        async with websockets.connect(server.ws_url) as ws:
            await ws.send(json.dumps({"type": "session.config", "voice": "joe", "stream_audio": True,
                                      "sample_rate": 22050}))
            for word in TEXT.split(" "):
                await ws.send(json.dumps({"type": "input.text", "text": word + " "}))
            await ws.send(json.dumps({"type": "input.done"}))
            messages = await receive_until(ws, "session.done", timeout=60)
    started = messages[0]
    # "joe" is the short name of en_US-joe-medium: session.started names the voice it resolved to
    assert (started["sample_rate"], started["voice"]) == (22050, "en_US-joe-medium")
    starts = [m for m in messages if isinstance(m, dict) and m["type"] == "audio.start"]
    assert [m["sentence_text"] for m in starts] == [
        "The quick brown fox jumps over the lazy dog.", "Piper speaks on the CPU!", "Does it sound right?"
    ]
    audio = audio_by_sentence(messages)
    for start in starts:
        direct = await synthesize(piper, start["sentence_text"])
        assert audio[start["sentence_index"]] == direct
        assert len(direct) > 22050  # each sentence is real speech, over half a second


def test_http_speech_with_piper(piper):
    with running_gateway("piper") as server:
        wav = httpx.post(server.url + "/v1/audio/speech",
                         json={"model": "voxgate", "input": "Hello from Piper.", "voice": "joe", "response_format": "wav"},
                         timeout=60)
        pcm = httpx.post(server.url + "/v1/audio/speech",
                         json={"input": "Hello from Piper.", "voice": "joe", "response_format": "pcm"}, timeout=60)
    native = asyncio.run(synthesize(piper, "Hello from Piper."))
    assert wav.status_code == 200 and wav.content[:4] == b"RIFF"
    assert wav.content[44:] == native  # wav keeps Piper's own 22.05 kHz
    # Raw pcm is 24 kHz, as OpenAI clients assume: Piper's audio resampled.
    assert pcm.headers["x-sample-rate"] == "24000"
    assert abs(len(pcm.content) // 2 - len(native) // 2 * 24000 / 22050) < 50
