"""A test-only backend that really clones, for the voice registry's tests: fast, and its voices can be told
apart from their audio (the tiny random Qwen3 Base checkpoint clones too, but its voices sound alike).

PitchCloneSynthesizer implements the cloning interface of tts_backend/base.py honestly, on a voice's
one measurable trait: `clone_voice` estimates the fundamental frequency of the reference audio
(autocorrelation) and its prompt is that pitch; a request that carries the prompt speaks a tone at it.
So a test can tell which voice spoke from the audio alone (`dominant_hz`), and a prompt that never
went through clone_voice cannot be faked by the gateway. Named as a test backend wherever used.

Reference clips for the tests: `tone_clip` (any rate, mono or stereo) and `encode_clip` (wav, flac,
mp3 or ogg (opus) bytes, encoded with PyAV).
"""

from __future__ import annotations

import asyncio
import base64
import io
import struct
from collections.abc import AsyncIterator

import av
import numpy as np

from tts_backend.base import (
    REFERENCE_SAMPLE_RATE,
    AudioChunk,
    InvalidReferenceAudioError,
    InvalidVoicePromptError,
    ReferenceAudio,
    SynthesisRequest,
    Synthesizer,
    UnknownVoiceError,
    Voice,
)

_MAGIC = b"PTCH1"
_PRESETS = {"preset-low": 150.0}


def dominant_hz(pcm: bytes | np.ndarray, sample_rate: int) -> float:
    """The strongest frequency of s16le bytes (or float samples), from their spectrum."""
    samples = np.frombuffer(pcm, "<i2").astype(np.float64) if isinstance(pcm, bytes) else np.asarray(pcm, np.float64)
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.argmax(spectrum) * sample_rate / len(samples))


def estimate_pitch(samples: np.ndarray, sample_rate: int) -> float:
    """Fundamental frequency from the autocorrelation peak between 60 and 500 Hz."""
    frame = samples[: sample_rate]  # one second is plenty for a steady voice
    frame = frame - frame.mean()
    corr = np.correlate(frame, frame, "full")[len(frame) - 1:]
    lo, hi = sample_rate // 500, sample_rate // 60
    lag = lo + int(np.argmax(corr[lo:hi]))
    return sample_rate / lag


class PitchCloneSynthesizer(Synthesizer):
    """Test backend: clones a voice's pitch (see the module doc). `clones` counts clone_voice calls, so a
    test can check that a registered voice's prompt is computed once."""

    name = "pitch-clone-test"
    honours = frozenset({"voice_cloning"})

    def __init__(self, chunk_ms: int = 80) -> None:
        self.sample_rate = REFERENCE_SAMPLE_RATE
        self.chunk_samples = self.sample_rate * chunk_ms // 1000
        self.clones = 0

    def voices(self) -> list[Voice]:
        return [Voice(id=v, name=v, description=f"test tone {hz:.0f} Hz") for v, hz in _PRESETS.items()]

    async def clone_voice(self, reference: ReferenceAudio, x_vector_only: bool = False) -> bytes:
        samples = np.frombuffer(reference.samples, "<f4")
        if not x_vector_only and not (reference.ref_text or "").strip():
            raise InvalidReferenceAudioError("ref_text is required unless x_vector_only_mode is set")
        if np.sqrt(np.mean(np.square(samples, dtype=np.float64))) < 1e-3:
            raise InvalidReferenceAudioError("the reference audio is silent")
        self.clones += 1
        pitch = await asyncio.to_thread(estimate_pitch, samples, REFERENCE_SAMPLE_RATE)
        return _MAGIC + struct.pack("<d", pitch)

    def pitch_of(self, request: SynthesisRequest) -> float:
        if request.voice_prompt is None:
            if request.voice not in _PRESETS:
                raise UnknownVoiceError(f"unknown voice {request.voice!r}")
            return _PRESETS[request.voice]
        prompt = request.voice_prompt
        if len(prompt) != len(_MAGIC) + 8 or not prompt.startswith(_MAGIC):
            raise InvalidVoicePromptError("not a voice prompt of the pitch-clone test backend")
        return struct.unpack("<d", prompt[len(_MAGIC):])[0]

    async def synthesize(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        pitch = self.pitch_of(request)
        n = max(self.chunk_samples, len(request.text.strip()) * self.sample_rate // 15)
        wave = 0.5 * np.sin(2 * np.pi * pitch * np.arange(n) / self.sample_rate)
        pcm = np.round(wave * 32767).astype("<i2")
        for start in range(0, n, self.chunk_samples):
            await asyncio.sleep(0)
            yield AudioChunk(pcm[start:start + self.chunk_samples].tobytes())


def tone_clip(hz: float, seconds: float, sample_rate: int = 24000, channels: int = 1) -> np.ndarray:
    """A voice-like clip: a tone with its second harmonic, float32, shape (samples, channels)."""
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    wave = (0.4 * np.sin(2 * np.pi * hz * t) + 0.2 * np.sin(2 * np.pi * 2 * hz * t)).astype(np.float32)
    return np.repeat(wave[:, None], channels, axis=1)


_CODECS = {"wav": ("wav", "pcm_s16le", "s16"), "flac": ("flac", "flac", "s16"),
           "mp3": ("mp3", "libmp3lame", "fltp"), "ogg": ("ogg", "libopus", "s16")}


def encode_clip(samples: np.ndarray, sample_rate: int, container: str) -> bytes:
    """`samples` (float32, (n, channels)) as a file of `container` (wav, flac, mp3, ogg)."""
    fmt, codec, sample_format = _CODECS[container]
    channels = samples.shape[1]
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as file:
        stream = file.add_stream(codec, rate=sample_rate, layout="stereo" if channels == 2 else "mono")
        if sample_format == "s16":
            data = np.round(np.clip(samples, -1, 1) * 32767).astype("<i2").reshape(1, -1)
        else:
            data = np.ascontiguousarray(samples.T.astype(np.float32))
        frame = av.AudioFrame.from_ndarray(data, format=sample_format, layout=stream.layout.name)
        frame.sample_rate = sample_rate
        for packet in stream.encode(frame):
            file.mux(packet)
        for packet in stream.encode(None):
            file.mux(packet)
    return out.getvalue()


def clip(hz: float, seconds: float = 4.0, rate: int = 24000, channels: int = 1, container: str = "wav") -> bytes:
    """A tone clip encoded in `container`: what a client uploads as reference audio in the tests."""
    return encode_clip(tone_clip(hz, seconds, rate, channels), rate, container)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
