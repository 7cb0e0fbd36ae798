"""Cloned voices end to end with the backend that really clones: the Qwen3 backend with a tiny random Base
checkpoint (tests/qwen3_fixtures.py) on the CPU, behind a real gateway, reached over HTTP and the WebSocket
with two API keys. The registry's prompt is the backend's own (computed once, stored as is), and what the
gateway speaks in the registered voice is what the backend speaks with that prompt.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import websockets

from gateway.audio.reference import decode_clip
from gateway.auth import Principal, key_fingerprint
from tests.cloning_fixtures import encode_clip
from tests.gateway_server import audio_by_sentence, open_session, receive_until, running_gateway
from tests.qwen3_fixtures import single_torch_thread, tiny_base  # noqa: F401 - fixtures
from tests.test_qwen3_clone_parity import REF_TEXT, _clip
from tts_backend.base import REFERENCE_SAMPLE_RATE, ReferenceAudio, SynthesisRequest
from tts_backend.registry import create_backend

KEY_A, KEY_B = "qwen3-key-a-" + "a" * 16, "qwen3-key-b-" + "b" * 16
TEXT = "Hello there, this is a cloned voice."


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_base_checkpoint_clones_registers_and_speaks_through_the_gateway(tiny_base):
    backend = create_backend("qwen3", model=str(tiny_base), device="cpu", max_active=4, max_len=256)
    wav = encode_clip(_clip(3.21, 1)[:, None], 24000, "wav")
    with running_gateway(backend, api_keys=[KEY_A, KEY_B], ready_timeout_s=600) as server:
        url = server.url
        assert httpx.get(url + "/v1/audio/voices", headers=auth(KEY_A)).json()["voice_cloning"] is True
        made = httpx.post(url + "/v1/audio/voices", headers=auth(KEY_A), timeout=120,
                          data={"name": "anna", "consent": "rec-3", "ref_text": REF_TEXT},
                          files={"audio_sample": ("anna.wav", wav, "audio/wav")})
        assert made.status_code == 200, made.text

        # The stored prompt is the backend's prompt for the decoded clip, byte for byte.
        reference = ReferenceAudio(decode_clip(wav, 3.0, 30.0, REFERENCE_SAMPLE_RATE).astype("<f4").tobytes(), REF_TEXT)
        direct = server.call(backend.clone_voice, reference, False, timeout=120)
        stored = server.call(server.gateway.voices.find, Principal(key_id=key_fingerprint(KEY_A)), "anna")
        assert stored.prompt == direct

        body = {"input": TEXT, "voice": "anna", "response_format": "pcm", "seed": 7, "max_new_tokens": 12}
        spoken = httpx.post(url + "/v1/audio/speech", headers=auth(KEY_A), json=body, timeout=120)
        assert spoken.status_code == 200, spoken.text

        async def backend_audio() -> bytes:
            request = SynthesisRequest(TEXT, voice="anna", seed=7, max_new_tokens=12, voice_prompt=direct)
            return b"".join([chunk.pcm async for chunk in backend.synthesize(request)])

        want = server.call(backend_audio, timeout=120)
        assert len(spoken.content) == len(want) > 0
        assert np.array_equal(np.frombuffer(spoken.content, "<i2"), np.frombuffer(want, "<i2"))

        # Key B: the name does not exist; and this backend speaks only clones, so no fallback either.
        refused = httpx.post(url + "/v1/audio/speech", headers=auth(KEY_B), json=body, timeout=60)
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "voice_not_found"
        no_voice = httpx.post(url + "/v1/audio/speech", headers=auth(KEY_A), timeout=60,
                              json={k: v for k, v in body.items() if k != "voice"})
        assert no_voice.json()["error"]["code"] == "voice_not_found"

        async def over_the_websocket() -> bytes:
            async with websockets.connect(server.ws_url, additional_headers=auth(KEY_A)) as ws:
                await ws.send(json.dumps({"type": "voice.list"}))
                listed = json.loads(await ws.recv())
                assert [v["name"] for v in listed["uploaded_voices"]] == ["anna"]
            ws, started, _ = await open_session(server.ws_url, {
                "type": "session.config", "voice": "anna", "task_type": "Base", "response_format": "pcm",
                "seed": 7, "max_new_tokens": 12}, additional_headers=auth(KEY_A))
            assert started["voice"] == "anna" and not started.get("warnings")
            await ws.send(json.dumps({"type": "input.text", "text": TEXT}))
            await ws.send(json.dumps({"type": "input.done"}))
            audio = audio_by_sentence(await receive_until(ws, "session.done", timeout=120))[0]
            await ws.close()
            return audio

        assert len(asyncio.run(over_the_websocket())) > 0
