"""The Qwen3 engine behind the real gateway: a WebSocket client gets the engine's audio, sentence by sentence.

Tiny random checkpoint on the CPU, greedy decoding (so the audio is reproducible without a seed), each
request capped at the frames its text takes at 15 characters per second (random weights never stop).
"""

from __future__ import annotations

import json

import numpy as np
import websockets

from tests.gateway_server import running_gateway
from tests.qwen3_fixtures import tiny_custom_voice  # noqa: F401 - session fixture
from tts_backend.base import SynthesisRequest
from tts_backend.registry import create_backend

OPTIONS = {"max_active": 4, "max_len": 256, "greedy": True, "frame_cap_chars_per_second": 15}
TEXT = "Good morning, this is the engine. It speaks in sentences!"


async def test_websocket_audio_is_what_the_engine_makes(tiny_custom_voice):
    with running_gateway("qwen3", model=str(tiny_custom_voice), device="cpu", backend_options=OPTIONS,
                         ready_timeout_s=120) as server:
        async with websockets.connect(server.ws_url) as ws:
            await ws.send(json.dumps({"type": "session.config", "voice": "ryan", "stream_audio": True}))
            await ws.send(json.dumps({"type": "input.text", "text": TEXT}))
            await ws.send(json.dumps({"type": "input.done"}))
            messages = []
            while True:
                message = await ws.recv()
                messages.append(message if isinstance(message, bytes) else json.loads(message))
                if isinstance(messages[-1], dict) and messages[-1]["type"] in ("session.done", "error"):
                    break
    assert messages[-1]["type"] == "session.done"
    sentences, audio, current = [], {}, None
    for m in messages:
        if isinstance(m, bytes):
            audio[current] += m
        elif m["type"] == "audio.start":
            current = m["sentence_index"]
            sentences.append(m["sentence_text"])
            audio[current] = b""
    assert len(sentences) == 2
    direct = create_backend("qwen3", model=str(tiny_custom_voice), device="cpu", **OPTIONS)
    await direct.start()
    try:
        for index, text in enumerate(sentences):
            want = b"".join([c.pcm async for c in direct.synthesize(SynthesisRequest(text=text, voice="ryan"))])
            got, expected = np.frombuffer(audio[index], "<i2"), np.frombuffer(want, "<i2")
            # Same codes; the codec's fp32 rounding may move a sample by one step when the gateway's pipelined
            # sentences were decoded in one batch.
            assert len(got) == len(expected) > 0
            assert np.abs(got.astype(np.int32) - expected).max() <= 1
    finally:
        await direct.stop()
