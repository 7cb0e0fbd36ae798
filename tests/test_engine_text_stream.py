"""Text pushed while the Qwen3 engine speaks (issue 21), on the CPU with a tiny random checkpoint.

The property that matters: what is said never changes, only when. For a seed, a text that arrives in
pieces gives exactly the codes (and so the audio) of the same text sent whole in streaming-text mode.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.qwen3_fixtures import tiny_custom_voice  # noqa: F401 - session fixture
from tts_backend.base import SynthesisRequest
from tts_backend.registry import create_backend

TEXT = "Hello world, this is a small test of the engine."


async def started(path, **options):
    backend = create_backend("qwen3", model=str(path), device="cpu", max_active=4, max_len=256, **options)
    await backend.start()
    return backend


async def audio_of(backend, request) -> np.ndarray:
    return np.frombuffer(b"".join([c.pcm async for c in backend.synthesize(request)]), "<i2")


def reference_audio(model, text, voice, seed, max_new_tokens, streaming_text) -> np.ndarray:
    codes = model.synthesize_codes(text, speaker=voice, seed=seed, max_new_tokens=max_new_tokens,
                                   non_streaming_mode=not streaming_text)
    wav = model.codec.decode(codes.T[None].contiguous())[0].float().numpy()
    return (np.clip(wav, -1, 1) * 32767).round().astype(np.int16)


def same_audio(got: np.ndarray, want: np.ndarray) -> bool:
    return len(got) == len(want) > 0 and int(np.abs(got.astype(np.int32) - want).max()) <= 1


@pytest.mark.parametrize("server_default", [False, True])
async def test_the_text_mode_is_chosen_per_request(tiny_custom_voice, server_default):
    backend = await started(tiny_custom_voice, streaming_text=server_default, trim_leading_silence=False)
    try:
        assert "text_mode" in backend.honours
        for choice in (None, True, False):
            request = SynthesisRequest(text=TEXT, voice="ryan", seed=3, max_new_tokens=20, streaming_text=choice)
            got = await audio_of(backend, request)
            mode = server_default if choice is None else choice
            assert same_audio(got, reference_audio(backend.model, TEXT, "ryan", 3, 20, mode))
            assert not same_audio(got, reference_audio(backend.model, TEXT, "ryan", 3, 20, not mode))
    finally:
        await backend.stop()
