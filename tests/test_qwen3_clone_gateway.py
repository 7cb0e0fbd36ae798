"""Cloned voices on the WebSocket with the real Qwen3 backend on a tiny random Base checkpoint (CPU), behind a
real gateway. tests/test_voice_clone_qwen3.py covers the HTTP upload and speech (byte for byte against the
backend) and key isolation; this covers the WebSocket's own ways in: `voice.add` (LiveKit's Baseten client's
register_voice), and a session's own `ref_audio` (vLLM-Omni's Base fields) in both modes. The backend decodes
greedily, so the same clip, transcript and text give the same audio whichever way the voice came in, and
x-vector-only mode is another voice.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import wave

import numpy as np
import pytest

from tests.gateway_server import audio_by_sentence, open_session, receive_until, running_gateway
from tests.qwen3_fixtures import tiny_base  # noqa: F401 - session fixture
from tests.test_qwen3_clone_parity import REF_TEXT, _clip
from tts_backend.registry import create_backend

KEY = "key-clone-" + "c" * 20
TEXT = "Hello there, this is a cloned voice."


def wav_bytes(samples: np.ndarray) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes((np.clip(samples, -1, 1) * 32767).round().astype("<i2").tobytes())
    return out.getvalue()


@pytest.fixture(scope="module")
def gateway(tiny_base):
    backend = create_backend("qwen3", model=str(tiny_base), device="cpu", max_active=4, max_len=256, greedy=True,
                             max_new_tokens=16)
    with running_gateway(backend, api_keys=[KEY]) as server:
        yield server


def test_voice_add_and_a_sessions_own_ref_audio_speak_the_same_voice(gateway):
    headers = {"Authorization": f"Bearer {KEY}"}
    clip = wav_bytes(_clip(3.21, 1))

    async def scenario() -> dict[str, bytes]:
        import websockets

        async with websockets.connect(gateway.ws_url, additional_headers=headers) as ws:
            await ws.send(json.dumps({"type": "voice.add", "name": "ben", "consent": "user_consent",
                                      "audio_data": base64.b64encode(clip).decode(), "audio_format": "wav",
                                      "ref_text": REF_TEXT}))
            added = json.loads(await ws.recv())
            assert added["success"] is True, added
        inline = "data:audio/wav;base64," + base64.b64encode(clip).decode()
        audio = {}
        for name, config in (("registered", {"voice": "ben"}),
                             ("inline", {"task_type": "Base", "ref_audio": inline, "ref_text": REF_TEXT}),
                             ("x_vector_only", {"task_type": "Base", "ref_audio": inline, "x_vector_only_mode": True})):
            ws, started, _ = await open_session(gateway.ws_url, {"type": "session.config", "response_format": "pcm",
                                                                 **config}, additional_headers=headers)
            assert ws is not None and not started.get("warnings"), started
            await ws.send(json.dumps({"type": "input.text", "text": TEXT}))
            await ws.send(json.dumps({"type": "input.done"}))
            audio[name] = audio_by_sentence(await receive_until(ws, "session.done", timeout=120))[0]
            await ws.close()
        return audio

    audio = asyncio.run(scenario())
    registered = audio["registered"]
    assert len(registered) > 0 and np.abs(np.frombuffer(registered, "<i2")).max() > 0
    assert audio["inline"] == registered  # the session's own clip and transcript: the same prompt, the same audio
    assert len(audio["x_vector_only"]) > 0 and audio["x_vector_only"] != registered
