"""The backend's cloning interface (tts_backend/base.py): clone_voice -> a voice prompt that a
SynthesisRequest carries, also across the worker socket (framing.py, worker.py, remote.py); and the
refusals of the backends that cannot clone (synthetic, Piper's interface is the same base method).

The cloning backend here is tests/cloning_fixtures.py's PitchCloneSynthesizer (a test backend that
clones a voice's pitch), served by a real WorkerServer on a Unix socket in this process.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.cloning_fixtures import PitchCloneSynthesizer, dominant_hz, tone_clip
from tts_backend.remote import framing
from tts_backend.base import (
    InvalidReferenceAudioError,
    InvalidVoicePromptError,
    ReferenceAudio,
    SynthesisRequest,
    VoiceCloningUnsupportedError,
)
from tts_backend.remote import RemoteSynthesizer
from tts_backend.synthetic import SyntheticSynthesizer
from tts_backend.remote.worker import WorkerServer


def reference(hz: float, ref_text: str | None = "hello there") -> ReferenceAudio:
    return ReferenceAudio(tone_clip(hz, 3.0)[:, 0].astype("<f4").tobytes(), ref_text)


async def collect(backend, request: SynthesisRequest) -> bytes:
    return b"".join([chunk.pcm async for chunk in backend.synthesize(request)])


async def remote_for(backend, tmp_path):
    server = WorkerServer(backend, str(tmp_path / "w.sock"))
    await server.start()
    remote = RemoteSynthesizer(socket=server.socket_path, connect_timeout_s=10, info_refresh_s=60)
    await remote.start()
    return server, remote


async def test_a_prompt_made_through_the_worker_speaks_with_the_reference_voice(tmp_path):
    backend = PitchCloneSynthesizer()
    backend.speaks_only_clones = True  # as a Qwen3 Base checkpoint says
    server, remote = await remote_for(backend, tmp_path)
    try:
        assert remote.can_clone and remote.speaks_only_clones
        prompt = await remote.clone_voice(reference(230.0))
        assert prompt == await backend.clone_voice(reference(230.0))  # the worker's bytes, unchanged
        pcm = await collect(remote, SynthesisRequest("Some words to say.", voice="my-clone", voice_prompt=prompt))
        assert abs(dominant_hz(pcm, remote.sample_rate) - 230.0) < 5
        # the same request without the prompt is an unknown voice; a preset still speaks as before
        pcm = await collect(remote, SynthesisRequest("Some words to say.", voice="preset-low"))
        assert abs(dominant_hz(pcm, remote.sample_rate) - 150.0) < 5
        # the backend's own errors keep their kind across the socket
        with pytest.raises(InvalidReferenceAudioError, match="ref_text"):
            await remote.clone_voice(reference(230.0, ref_text=None))
        assert await remote.clone_voice(reference(230.0, ref_text=None), x_vector_only=True) == prompt
        with pytest.raises(InvalidReferenceAudioError, match="silent"):
            await remote.clone_voice(ReferenceAudio(np.zeros(72000, "<f4").tobytes(), "hi"))
        with pytest.raises(InvalidVoicePromptError):
            await collect(remote, SynthesisRequest("Hi.", voice="x", voice_prompt=b"made elsewhere"))
    finally:
        await remote.stop()
        await server.close()


async def test_backends_that_cannot_clone_refuse_both_ways(tmp_path):
    synthetic = SyntheticSynthesizer()
    assert not synthetic.can_clone
    with pytest.raises(VoiceCloningUnsupportedError):
        await synthetic.clone_voice(reference(200.0))
    with pytest.raises(VoiceCloningUnsupportedError):  # a prompt never speaks with a preset instead
        await collect(synthetic, SynthesisRequest("Hi.", voice="tone-mid", voice_prompt=b"PTCH1xxxxxxxx"))
    server, remote = await remote_for(synthetic, tmp_path)
    try:
        assert not remote.can_clone and not remote.speaks_only_clones
        with pytest.raises(VoiceCloningUnsupportedError):
            await remote.clone_voice(reference(200.0))
        with pytest.raises(VoiceCloningUnsupportedError):
            await collect(remote, SynthesisRequest("Hi.", voice="tone-mid", voice_prompt=b"PTCH1xxxxxxxx"))
    finally:
        await remote.stop()
        await server.close()


def test_a_request_without_a_prompt_has_the_wire_form_it_had():
    request = SynthesisRequest("Hi.", voice="tone-mid")
    assert "voice_prompt" not in framing.request_to_json(request)  # an older worker still serves it
    with_prompt = SynthesisRequest("Hi.", voice="v", voice_prompt=bytes(range(256)))
    assert framing.request_from_json(framing.request_to_json(with_prompt)) == with_prompt
    with pytest.raises(framing.ProtocolError):
        framing.request_from_json({**framing.request_to_json(request), "voice_prompt": "not base64!"})
