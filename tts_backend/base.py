"""The one interface the gateway sees of speech synthesis.

A backend turns text and a voice into a stream of PCM chunks (signed 16-bit little-endian, mono, at the
backend's `sample_rate`). The gateway knows nothing else of synthesis: the CPU Piper voice, the Qwen3-TTS
GPU engine in this process, and a worker process reached over a local socket all look the same.

Cancellation is cooperative and prompt: a backend must stop producing within one chunk when the consumer
stops iterating (``aclose()`` on the iterator, or cancellation of the task that iterates it).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


class SynthesisError(RuntimeError):
    """A request failed inside the backend; the message is safe to show to the client."""


class UnknownVoiceError(SynthesisError):
    pass


class BackendOverloadedError(SynthesisError):
    """The backend cannot accept more work now; the same request may succeed later."""


@dataclass(frozen=True)
class Voice:
    id: str
    name: str
    language: str = "en"
    description: str = ""


@dataclass(frozen=True)
class SynthesisRequest:
    text: str
    voice: str
    language: str = "Auto"
    instructions: str | None = None
    seed: int | None = None
    max_new_tokens: int | None = None
    # Codec frames per chunk for backends that stream in frames (Qwen3: 80 ms each), e.g. (2, 4, 8, 12).
    chunk_schedule: tuple[int, ...] | None = None
    # Sentences of one utterance share this key, so a backend may keep generation context across them.
    utterance_key: str | None = None
    # A caller-chosen id for logs and tracing; never affects the audio.
    request_id: str = ""
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class AudioChunk:
    pcm: bytes  # s16le mono at the backend's sample_rate; always a whole number of samples

    @property
    def num_samples(self) -> int:
        return len(self.pcm) // 2


class Synthesizer(abc.ABC):
    """A speech backend. One instance serves every session of a gateway process."""

    name: str = "backend"
    sample_rate: int = 24000

    async def start(self) -> None:
        """Load models, warm up. `ready` is true once this returns."""

    async def stop(self) -> None:
        """Release resources; pending streams end."""

    @property
    def ready(self) -> bool:
        return True

    @abc.abstractmethod
    def voices(self) -> list[Voice]: ...

    @property
    def default_voice(self) -> str:
        return self.voices()[0].id

    def has_voice(self, voice: str) -> bool:
        return any(v.id == voice for v in self.voices())

    def load(self) -> float:
        """Fraction of real-time capacity in use (0 idle, 1 saturated); used to refuse sessions early."""
        return 0.0

    @abc.abstractmethod
    def synthesize(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        """Stream the audio for one piece of text. Raises UnknownVoiceError / SynthesisError."""
