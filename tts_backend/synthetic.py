"""A synthetic backend: deterministic tones shaped like speech, paced like a real-time TTS engine.

It exists for gateway tests and load benchmarks (named as such wherever it is used): it needs no model,
its output for a given (text, voice, seed) is byte-for-byte reproducible, and its pacing can be set to
mimic an engine that produces audio faster than real time after a first-chunk latency.

Word timings are exact by construction: the audio of a text is spread evenly over its characters, so
the word at characters [a, b) of a text of L characters in n samples is samples [a*n//L, b*n//L).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import deque
from collections.abc import AsyncIterator

import numpy as np

from .base import AudioChunk, SynthesisRequest, Synthesizer, UnknownVoiceError, Voice, WordTiming, split_words

_VOICES = {
    "tone-low": 140.0,
    "tone-mid": 200.0,
    "tone-high": 260.0,
}


class SyntheticSynthesizer(Synthesizer):
    """Deterministic speech-like tones.

    chars_per_second: how much audio a text yields (15 chars/s is a natural speaking rate).
    chunk_ms: audio per chunk. first_chunk_delay_s: latency before the first chunk.
    speed: how many times faster than real time chunks are produced after the first (0 = no pacing).
    capacity: at most this many streams produce at once (None = no limit); a further stream waits, first
    come first served, for a slot before its first chunk, as a request waits for a GPU engine's KV slot.
    A slot is held from the first chunk's preparation (first_chunk_delay_s included) until the stream
    ends, is closed (aclose) or its task is cancelled.
    """

    name = "synthetic"
    honours = frozenset({"seed", "word_timestamps"})

    def __init__(
        self,
        sample_rate: int = 24000,
        chars_per_second: float = 15.0,
        chunk_ms: int = 80,
        first_chunk_delay_s: float = 0.0,
        speed: float = 0.0,
        capacity: int | None = None,
    ) -> None:
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"capacity must be a whole number of streams >= 1, got {capacity!r}")
        self.sample_rate = sample_rate
        self.chars_per_second = chars_per_second
        self.chunk_samples = max(1, sample_rate * chunk_ms // 1000)
        self.first_chunk_delay_s = first_chunk_delay_s
        self.speed = speed
        self._capacity = capacity
        self._producing = 0  # streams holding a slot
        self._waiting: deque[asyncio.Future] = deque()  # streams waiting for one, oldest first
        # Rendered waveforms by (voice, seed, text): load tests repeat sentences, and rendering one takes
        # milliseconds of this process's CPU, which a real backend spends on its GPU instead.
        self._rendered: dict[tuple[str, int | None, str], np.ndarray] = {}

    def capacity(self) -> int | None:
        return self._capacity

    def queued(self) -> int:
        """Streams waiting for a slot (always 0 without a capacity)."""
        return sum(1 for waiter in self._waiting if not waiter.done())

    def load(self) -> float:
        """Streams producing / capacity (0 without a capacity)."""
        return self._producing / self._capacity if self._capacity else 0.0

    async def _take_slot(self) -> None:
        if self._producing < self._capacity and not self._waiting:
            self._producing += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            await waiter  # _give_slot hands its slot over: _producing already counts this stream
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._give_slot()  # handed over just as it was cancelled: pass it on
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._waiting.remove(waiter)
            raise

    def _give_slot(self) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on; _producing stays
                return
        self._producing -= 1

    def voices(self) -> list[Voice]:
        return [Voice(id=v, name=v, language="en", description=f"synthetic {f:.0f} Hz tone") for v, f in _VOICES.items()]

    def render(self, request: SynthesisRequest) -> np.ndarray:
        """The whole waveform for a request as int16 samples."""
        if request.voice not in _VOICES:
            raise UnknownVoiceError(f"unknown voice {request.voice!r}")
        text = request.text.strip()
        key = (request.voice, request.seed, text)
        if key in self._rendered:
            return self._rendered[key]
        n = max(self.chunk_samples, int(len(text) / self.chars_per_second * self.sample_rate))
        digest = hashlib.sha256(f"{request.voice}|{request.seed}|{text}".encode()).digest()
        rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
        t = np.arange(n) / self.sample_rate
        base = _VOICES[request.voice] * (1.0 + 0.1 * rng.random())
        # One "syllable" every ~200 ms: a pitch wobble under a raised-cosine envelope.
        syllable = 0.2
        phase = (t % syllable) / syllable
        envelope = 0.5 - 0.5 * np.cos(2 * np.pi * phase)
        pitch = base * (1.0 + 0.05 * np.sin(2 * np.pi * 3.0 * t))
        wave = np.sin(2 * np.pi * np.cumsum(pitch) / self.sample_rate) * envelope * 0.5
        samples = np.round(wave * 32767).astype("<i2")
        if len(self._rendered) >= 256:
            self._rendered.pop(next(iter(self._rendered)))
        self._rendered[key] = samples
        return samples

    def word_timings(self, text: str, num_samples: int) -> tuple[WordTiming, ...]:
        """Where each word of `text` (as rendered: stripped) lies in its `num_samples` of audio."""
        text = text.strip()
        return tuple(WordTiming(word, a * num_samples // len(text), b * num_samples // len(text))
                     for word, a, b in split_words(text))

    async def synthesize(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        self.refuse_voice_prompt(request)
        samples = self.render(request)
        words = self.word_timings(request.text, len(samples)) if request.word_timestamps else ()
        if self._capacity is not None:
            await self._take_slot()
        try:
            if self.first_chunk_delay_s:
                await asyncio.sleep(self.first_chunk_delay_s)
            for start in range(0, len(samples), self.chunk_samples):
                piece = samples[start : start + self.chunk_samples]
                if start and self.speed:
                    await asyncio.sleep(len(piece) / self.sample_rate / self.speed)
                else:
                    await asyncio.sleep(0)  # a cancellation point between chunks, like a real engine
                yield AudioChunk(piece.tobytes(), words if start == 0 else ())
        finally:
            if self._capacity is not None:
                self._give_slot()
