"""Synthesis units bounded by how long they are spoken, and WebSocket frames under 1 MiB (issue 25).

Before: 277 characters of 7-digit numbers were one unit (under the 300-character limit), about 100 s of
speech, sent with `stream_audio: false` as one 4.78 MB binary frame, which vLLM-Omni's client (websockets,
max_size 1 MiB by default) dies on. Now a digit counts as the characters it takes to say, so those numbers
are several units; and a sentence sent whole goes in frames of at most 1,000,000 bytes, which the client
joins between audio.start and audio.done as it joins streamed pieces.
"""

from __future__ import annotations

import io
import json
import wave

import pytest
import websockets

from gateway.session.segmenter import DIGIT_SPOKEN_CHARS, SentenceSegmenter, spoken_length, split_to_fit
from tests.gateway_server import receive_until, running_gateway
from tts_backend.base import SynthesisRequest
from tts_backend.synthetic import SyntheticSynthesizer

NUMBERS = " ".join(str(1234567 + i * 1111111) for i in range(35))[:277]  # the issue's 277 characters
MIB = 1 << 20


def test_a_unit_of_numbers_is_bounded_by_its_spoken_length():
    segmenter = SentenceSegmenter("sentence", max_unit_chars=300)
    units = segmenter.push(NUMBERS + " ") + segmenter.flush()
    assert len(NUMBERS) == 277 and len(units) > 1  # before: one unit of 277 characters
    assert all(spoken_length(unit) <= 300 for unit in units)
    assert " ".join(units) == NUMBERS
    assert spoken_length("Call 911.") == len("Call 911.") + 3 * (DIGIT_SPOKEN_CHARS - 1)


def test_flushed_numbers_are_split_by_spoken_length_too():
    pieces = split_to_fit(NUMBERS, 300)
    assert len(pieces) > 1 and all(spoken_length(p) <= 300 for p in pieces)
    assert " ".join(pieces) == NUMBERS
    prose = "word " * 100
    assert [len(p) for p in split_to_fit(prose.strip(), 300)] == [299, 199]  # prose is cut as before


def test_the_http_body_is_split_the_same_way():
    """POST /v1/audio/speech cuts its input with the same segmenter: each synthesis call is bounded."""
    from gateway.http.routes import _sentences
    import asyncio

    units = asyncio.run(_sentences(NUMBERS, "Auto", 300))
    assert len(units) > 1 and all(spoken_length(u) <= 300 for u in units)


async def test_a_long_sentence_sent_whole_comes_in_frames_a_default_websockets_client_takes():
    """stream_audio false, wav at 48 kHz, one 290-character sentence: about 19 s, 1.85 MB of file. A client
    with websockets' default max_size (1 MiB) receives it; every frame is at most 1,000,000 bytes; joined,
    they are the whole wav with its true sizes."""
    text = ("word " * 58).strip() + "."
    expected = SyntheticSynthesizer().render(SynthesisRequest(text=text, voice="tone-mid"))
    with running_gateway("synthetic") as server:
        async with websockets.connect(server.ws_url) as ws:  # max_size: websockets' default, 1 MiB
            assert ws.protocol.max_message_size == MIB
            await ws.send(json.dumps({"type": "session.config", "voice": "tone-mid", "response_format": "wav",
                                      "stream_audio": False, "sample_rate": 48000}))
            await ws.send(json.dumps({"type": "input.text", "text": text}))
            await ws.send(json.dumps({"type": "input.done"}))
            messages = await receive_until(ws, "session.done", timeout=60)
    frames = [m for m in messages if isinstance(m, bytes)]
    assert len(frames) >= 2 and all(len(f) <= 1_000_000 for f in frames)
    data = b"".join(frames)
    (done,) = [m for m in messages if isinstance(m, dict) and m["type"] == "audio.done"]
    assert done["total_bytes"] == len(data) > MIB
    with wave.open(io.BytesIO(data)) as wav:
        assert wav.getframerate() == 48000
        assert wav.getnframes() == pytest.approx(len(expected) * 2, abs=4)


async def test_the_issues_numbers_on_piper_arrive_in_bounded_frames():
    """The issue's case end to end: Piper, stream_audio false (wav), the 277 characters of numbers, a client
    with websockets' default limits: several sentences, none longer than 30 s, every frame under 1 MiB."""
    with running_gateway("piper") as server:
        async with websockets.connect(server.ws_url) as ws:
            await ws.send(json.dumps({"type": "session.config", "response_format": "wav", "stream_audio": False}))
            await ws.send(json.dumps({"type": "input.text", "text": NUMBERS}))
            await ws.send(json.dumps({"type": "input.done"}))
            messages = await receive_until(ws, "session.done", timeout=240)
    starts = [m for m in messages if isinstance(m, dict) and m["type"] == "audio.start"]
    dones = [m for m in messages if isinstance(m, dict) and m["type"] == "audio.done"]
    assert len(starts) > 1 and " ".join(s["sentence_text"] for s in starts) == NUMBERS
    assert all(len(m) < MIB for m in messages if isinstance(m, bytes))
    assert max(d["duration_ms"] for d in dones) < 30_000
