"""The Qwen3 backend with a Base checkpoint: clone_voice and synthesis with a voice prompt, through the backend
interface (tts_backend/base.py) and the batched engine, on the CPU with a tiny random Base checkpoint.

What the engine speaks in a cloned voice must equal the model's own single-request generation in that voice
(tests/test_qwen3_clone_parity.py ties that to the reference qwen-tts), with the codec continuing from the
reference clip in in-context mode.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.qwen3_fixtures import tiny_base, tiny_custom_voice  # noqa: F401 - session fixtures
from tests.test_engine_qwen3 import assert_same_audio, audio_of, started
from tests.test_qwen3_clone_parity import REF_TEXT, _clip
from tts_backend.base import (
    InvalidReferenceAudioError,
    InvalidVoicePromptError,
    ReferenceAudio,
    SynthesisError,
    SynthesisRequest,
    VoiceCloningUnsupportedError,
)
from tts_backend.qwen3.prompt import VoicePrompt
from tts_backend.qwen3.testing.checkpoint import write_checkpoint
from tts_backend.remote import RemoteSynthesizer

TEXT = "Hello there, this is a cloned voice speaking."


def reference(samples: np.ndarray, ref_text: str | None = None) -> ReferenceAudio:
    return ReferenceAudio(samples.astype("<f4").tobytes(), ref_text)


def _model_without_codec(folder):
    from tts_backend.qwen3.generate import Qwen3TTS

    return Qwen3TTS.from_pretrained(folder, "cpu", torch.float32, load_codec=False)


def model_audio(model, request: SynthesisRequest, greedy: bool) -> np.ndarray:
    """The model's own generation in the request's voice, decoded as the reference does (after the reference
    codes in in-context mode), as int16."""
    voice = VoicePrompt.from_bytes(request.voice_prompt, model.identity)
    overrides = {"max_new_tokens": request.max_new_tokens}
    if greedy:
        overrides.update(do_sample=False, subtalker_do_sample=False)
    codes = model.synthesize_codes(request.text, voice=voice, seed=request.seed, **overrides)
    wav = model.codec_stream(voice).decode(codes).numpy()
    return (np.clip(wav, -1, 1) * 32767).round().astype(np.int16)


@pytest.mark.parametrize("greedy,fused", [(True, False), (False, False), (True, True)],
                         ids=["greedy", "sampled", "greedy-fused"])
async def test_cloned_voices_speak_what_the_model_generates_in_them(tiny_base, greedy, fused):
    """fused: engine/fused.py's talker (the GPU fast path; eager here) runs the clone prefill."""
    backend = await started(tiny_base, greedy=greedy, trim_leading_silence=False, runner_options={"fused": fused},
                            sampler="stateless" if fused else "auto")  # the fused path samples statelessly
    try:
        assert backend.engine.runner.fused is fused
        assert backend.can_clone and [v.id for v in backend.voices()] == ["cloned"]
        icl = await backend.clone_voice(reference(_clip(3.21, 1), REF_TEXT), x_vector_only=False)
        xvec = await backend.clone_voice(reference(_clip(2.0, 4)), x_vector_only=True)
        assert not VoicePrompt.from_bytes(icl).x_vector_only and VoicePrompt.from_bytes(xvec).x_vector_only
        requests = [SynthesisRequest(text=TEXT, voice="cloned", seed=5, max_new_tokens=20, voice_prompt=icl),
                    SynthesisRequest(text=TEXT[:30], voice="cloned", seed=6, max_new_tokens=16, voice_prompt=xvec)]
        # One at a time, then both at once: batched prefills keep each voice's vectors and codec state apart.
        primed = backend.engine.runner.primed_codec
        warm_up = set(primed)  # the warm-up request's voice
        alone = [await audio_of(backend, r) for r in requests]
        (key,) = set(primed) - warm_up  # the in-context voice's reference frames went through the codec once
        kept = primed[key]
        together = await asyncio.gather(*(audio_of(backend, r) for r in requests))
        assert set(primed) - warm_up == {key} and primed[key] is kept  # and not again for its next request
        for request, got, got_batched in zip(requests, alone, together):
            want = model_audio(backend.model, request, greedy)
            assert len(got) == len(want) > 0
            assert_same_audio(got, want)
            if greedy:  # sampled rows in a batch draw in another order; greedy ones must not care
                assert_same_audio(got_batched, want)
    finally:
        await backend.stop()


async def test_clone_refusals_are_clear(tiny_base, tiny_custom_voice, tmp_path):
    backend = await started(tiny_base, greedy=True)
    try:
        with pytest.raises(InvalidReferenceAudioError, match="silent"):
            await backend.clone_voice(reference(np.zeros(48000, np.float32)), x_vector_only=True)
        with pytest.raises(InvalidReferenceAudioError, match="transcript"):
            await backend.clone_voice(reference(_clip(1.0, 1)), x_vector_only=False)
        with pytest.raises(InvalidReferenceAudioError, match="too short"):
            await backend.clone_voice(reference(_clip(0.05, 1)), x_vector_only=True)
        with pytest.raises(SynthesisError, match="cloned voices"):
            await audio_of(backend, SynthesisRequest(text=TEXT, voice="cloned"))
        with pytest.raises(InvalidVoicePromptError):
            await audio_of(backend, SynthesisRequest(text=TEXT, voice="cloned", voice_prompt=b"PTCH1\x00\x00"))
        # A prompt made by another Base checkpoint of the same shape (other weights) is refused, not spoken.
        other = _model_without_codec(write_checkpoint(tmp_path / "other-base", "tiny", model_type="base", seed=9))
        foreign = other.clone_prompt(torch.from_numpy(_clip(1.0, 1)), None, True).to_bytes(other.identity)
        with pytest.raises(InvalidVoicePromptError, match="another model"):
            await audio_of(backend, SynthesisRequest(text=TEXT, voice="cloned", voice_prompt=foreign))
    finally:
        await backend.stop()

    custom = await started(tiny_custom_voice, greedy=True)
    try:
        assert not custom.can_clone
        with pytest.raises(VoiceCloningUnsupportedError):
            await custom.clone_voice(reference(_clip(1.0, 1)), x_vector_only=True)
        with pytest.raises(VoiceCloningUnsupportedError):
            await audio_of(custom, SynthesisRequest(text=TEXT, voice="ryan", voice_prompt=foreign))
    finally:
        await custom.stop()



async def test_a_worker_process_clones_and_speaks_in_the_voice(tiny_base, tmp_path):
    """`voxgate worker` with a Base checkpoint: the clone op and a voice prompt cross the worker socket; the
    prompt made there speaks in this process's backend too (same checkpoint, same identity)."""
    socket_path = str(tmp_path / "qwen3-base.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tts_backend.remote.worker", "--socket", socket_path, "--backend", "qwen3",
         "--model", str(tiny_base), "--device", "cpu", "--option", "max_active=2", "--option", "max_len=256"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        remote = RemoteSynthesizer(socket=socket_path, connect_timeout_s=120)
        await remote.start()
        try:
            assert remote.can_clone
            prompt = await remote.clone_voice(reference(_clip(3.21, 1), REF_TEXT), x_vector_only=False)
            request = SynthesisRequest(text=TEXT, voice="cloned", seed=11, max_new_tokens=16, voice_prompt=prompt)
            got = await audio_of(remote, request)
            local = await started(tiny_base)
            try:
                assert prompt == await local.clone_voice(reference(_clip(3.21, 1), REF_TEXT), x_vector_only=False)
                want = await audio_of(local, request)
            finally:
                await local.stop()
            assert len(got) > 0 and np.array_equal(got, want)
        finally:
            await remote.stop()
    finally:
        proc.terminate()
        proc.wait(20)
