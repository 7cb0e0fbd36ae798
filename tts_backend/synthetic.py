"""A synthetic backend: deterministic tones shaped like speech, paced like a real-time TTS engine.

It exists for gateway tests and load benchmarks (named as such wherever it is used): it needs no model,
its output for a given (text, voice, seed) is byte-for-byte reproducible, and its pacing can be set to
mimic an engine that produces audio faster than real time after a first-chunk latency.

Word timings are exact by construction: every character of a text (stripped) gets the same number of
samples, `samples_per_char`, so the word at characters [a, b) is samples [a*s, b*s) for s samples per
character (a*n//L .. b*n//L of a text of L characters in n samples).

Text streaming (`text_stream`, see base.py) is exact by construction too, as it is in the real model's
streaming-text mode: a character's samples depend only on the voice, the seed, the character, its position
and the samples before it (the pitch's phase runs on from them), never on the text after it. So the audio of
a text pushed in pieces is, byte for byte, the audio of the same text sent whole, whatever the pieces and
their timing. A stream speaks its text as far as it has it and waits for more; a word's timing goes out once
the word is complete (a later word has begun, or the text is finished).

Resume from codes (`resume_codes`, see base.py) is exact by construction as well. Each chunk is one "frame"
of CODEBOOKS codes: the sample where the chunk ends (two uint16s) and a digest of (voice, seed, where it
starts, its samples). A request resumed from the codes of the chunks delivered so far checks that every
frame is one this request made (the same samples at the same place, for this voice and seed) and goes on
from where the last one ends: the rest of the uninterrupted run's audio, byte for byte. Codes that are not
this request's are refused (SynthesisError), as a real engine's codes of another sentence would be no
continuation of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import deque
from collections.abc import AsyncIterator

import numpy as np

from .base import (
    AudioChunk,
    SynthesisError,
    SynthesisRequest,
    Synthesizer,
    TextStream,
    UnknownVoiceError,
    Voice,
    WordTiming,
    split_words,
)

_VOICES = {
    "tone-low": 140.0,
    "tone-mid": 200.0,
    "tone-high": 260.0,
}
CODEBOOKS = 16  # as the Qwen3 12 Hz codec has: 32 bytes a frame
_FRAME = np.dtype("<u2")


class SyntheticSynthesizer(Synthesizer):
    """Deterministic speech-like tones.

    chars_per_second: how much audio a text yields (15 chars/s is a natural speaking rate).
    chunk_ms: audio per chunk. first_chunk_delay_s: latency before the first chunk.
    speed: how many times faster than real time chunks are produced after the first (0 = no pacing).
    capacity: at most this many streams produce at once (None = no limit); a further stream waits, first
    come first served, for a slot before its first chunk, as a request waits for a GPU engine's KV slot.
    A slot is held from the first chunk's preparation (first_chunk_delay_s included) until the stream
    ends, is closed (aclose) or its task is cancelled.
    words_delay_s: with word_timestamps, send a (whole, not streamed) text's word timings in one chunk of
    their own this long after its last audio (and after an `audio_ended` chunk), as a backend whose timings
    come from a forced aligner does (qwen3 with `aligner`), instead of with the first audio chunk.
    """

    name = "synthetic"
    honours = frozenset({"seed", "word_timestamps", "text_streaming", "resume_codes"})
    codebooks = CODEBOOKS

    def __init__(
        self,
        sample_rate: int = 24000,
        chars_per_second: float = 15.0,
        chunk_ms: int = 80,
        first_chunk_delay_s: float = 0.0,
        speed: float = 0.0,
        capacity: int | None = None,
        words_delay_s: float | None = None,
    ) -> None:
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"capacity must be a whole number of streams >= 1, got {capacity!r}")
        self.sample_rate = sample_rate
        self.chars_per_second = chars_per_second
        self.chunk_samples = max(1, sample_rate * chunk_ms // 1000)
        self.frame_rate = sample_rate / self.chunk_samples  # one frame of codes a chunk
        # A whole number of samples per character, so a text's audio grows by the same amount with every
        # character and the audio of a prefix is a prefix of the audio (text streaming).
        self.samples_per_char = max(1, round(sample_rate / chars_per_second))
        self.first_chunk_delay_s = first_chunk_delay_s
        self.speed = speed
        self.words_delay_s = words_delay_s
        self._capacity = capacity
        self._producing = 0  # streams holding a slot
        # Streams waiting for one, oldest first: those resumed from codes, then the others (_take_slot).
        self._waiting_resumed: deque[asyncio.Future] = deque()
        self._waiting: deque[asyncio.Future] = deque()
        # Rendered waveforms by (voice, seed, text): load tests repeat sentences, and rendering one takes
        # milliseconds of this process's CPU, which a real backend spends on its GPU instead.
        self._rendered: dict[tuple[str, int | None, str], np.ndarray] = {}

    def capacity(self) -> int | None:
        return self._capacity

    def queued(self) -> int:
        """Streams waiting for a slot (always 0 without a capacity)."""
        return sum(1 for queue in (self._waiting_resumed, self._waiting) for waiter in queue if not waiter.done())

    def load(self) -> float:
        """Streams producing / capacity (0 without a capacity)."""
        return self._producing / self._capacity if self._capacity else 0.0

    async def _take_slot(self, resumed: bool = False) -> None:
        """A place among the capacity, in arrival order, except that a resumed stream (its listener is in the
        middle of a sentence, hearing nothing) goes before the new ones waiting, after the resumed ones."""
        if self._producing < self._capacity and not self._waiting_resumed and not self._waiting:
            self._producing += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        queue = self._waiting_resumed if resumed else self._waiting
        queue.append(waiter)
        try:
            await waiter  # _give_slot hands its slot over: _producing already counts this stream
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._give_slot()  # handed over just as it was cancelled: pass it on
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    queue.remove(waiter)
            raise

    def _give_slot(self) -> None:
        for queue in (self._waiting_resumed, self._waiting):
            while queue:
                waiter = queue.popleft()
                if not waiter.done():
                    waiter.set_result(None)  # the slot passes on; _producing stays
                    return
        self._producing -= 1

    def voices(self) -> list[Voice]:
        return [Voice(id=v, name=v, language="en", description=f"synthetic {f:.0f} Hz tone") for v, f in _VOICES.items()]

    def render(self, request: SynthesisRequest) -> np.ndarray:
        """The whole waveform for a request's text (its text stream's, so far) as int16 samples."""
        return self._render(request.voice, request.seed, request.full_text.strip())

    def _render(self, voice: str, seed: int | None, text: str, keep: bool = True) -> np.ndarray:
        """keep: remember the waveform (not for the growing prefixes of a text stream, which would push
        the whole sentences out)."""
        if voice not in _VOICES:
            raise UnknownVoiceError(f"unknown voice {voice!r}")
        key = (voice, seed, text)
        if key in self._rendered:
            return self._rendered[key]
        n = len(text) * self.samples_per_char
        k = np.arange(n)
        t = k / self.sample_rate
        # Each character's own pitch offset, from (voice, seed, position, character) alone.
        offsets = np.array([self._char_offset(voice, seed, i, c) for i, c in enumerate(text)], dtype=np.float64)
        base = _VOICES[voice] * (1.0 + 0.1 * offsets[k // self.samples_per_char]) if n else np.zeros(0)
        # One "syllable" every ~200 ms: a pitch wobble under a raised-cosine envelope.
        syllable = 0.2
        phase = (t % syllable) / syllable
        envelope = 0.5 - 0.5 * np.cos(2 * np.pi * phase)
        pitch = base * (1.0 + 0.05 * np.sin(2 * np.pi * 3.0 * t))
        # cumsum adds in order, so the phase of a sample depends only on the samples before it.
        wave = np.sin(2 * np.pi * np.cumsum(pitch) / self.sample_rate) * envelope * 0.5
        samples = np.round(wave * 32767).astype("<i2")
        if not keep:
            return samples
        if len(self._rendered) >= 256:
            self._rendered.pop(next(iter(self._rendered)))
        self._rendered[key] = samples
        return samples

    @staticmethod
    def _char_offset(voice: str, seed: int | None, position: int, char: str) -> float:
        digest = hashlib.sha256(f"{voice}|{seed}|{position}|{char}".encode()).digest()
        return int.from_bytes(digest[:4], "little") / 2**32

    @staticmethod
    def frame_codes(voice: str, seed: int | None, start: int, samples: np.ndarray) -> bytes:
        """The codes of one chunk: where it ends, then a digest of what it is (see the module doc)."""
        end = start + len(samples)
        digest = hashlib.sha256(f"{voice}|{seed}|{start}|".encode() + samples.tobytes()).digest()
        words = [end >> 16 & 0xFFFF, end & 0xFFFF, *np.frombuffer(digest[: 2 * (CODEBOOKS - 2)], dtype=_FRAME)]
        return np.array(words, dtype=_FRAME).tobytes()

    def _resume_point(self, request: SynthesisRequest, samples: np.ndarray) -> int:
        """Where a request resumed from `request.resume_codes` goes on: the end of their last frame, once each
        frame is checked to be this request's own within `samples` (module doc). 0 without codes."""
        codes = request.resume_codes
        if not codes:
            return 0
        if len(codes) % (2 * CODEBOOKS):
            raise SynthesisError(f"resume codes: {len(codes)} bytes are not whole frames of {CODEBOOKS} codes")
        frames = np.frombuffer(codes, dtype=_FRAME).reshape(-1, CODEBOOKS)
        start = 0
        for frame in frames:
            end = int(frame[0]) << 16 | int(frame[1])
            if not start < end <= len(samples) or \
                    self.frame_codes(request.voice, request.seed, start, samples[start:end]) != frame.tobytes():
                raise SynthesisError("resume codes: they do not continue this sentence (another text, voice or seed)")
            start = end
        return start

    @staticmethod
    def resume_end(codes: bytes) -> int:
        """The sample where the last frame of `codes` ends (0 for none): how far a stream must have text for."""
        if len(codes) < 2 * CODEBOOKS:
            return 0
        last = np.frombuffer(codes[-2 * CODEBOOKS:], dtype=_FRAME)
        return int(last[0]) << 16 | int(last[1])

    def word_timings(self, text: str, num_samples: int) -> tuple[WordTiming, ...]:
        """Where each word of `text` (as rendered: stripped) lies in its `num_samples` of audio."""
        text = text.strip()
        return tuple(WordTiming(word, a * num_samples // len(text), b * num_samples // len(text))
                     for word, a, b in split_words(text))

    async def synthesize(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        self.refuse_voice_prompt(request)
        if request.text_stream is not None:
            # aclosing: closing this generator closes the inner one at once (its slot is given back then).
            async with contextlib.aclosing(self._synthesize_stream(request, request.text_stream)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        # A long text takes this process's CPU for a while to render (4,000 characters: ~2 s): off the event
        # loop, which every other stream shares.
        samples = await asyncio.to_thread(self.render, request) if len(request.text) > 500 else self.render(request)
        words = self.word_timings(request.text, len(samples)) if request.word_timestamps else ()
        resume_at = self._resume_point(request, samples)
        if self._capacity is not None:
            await self._take_slot(resumed=bool(request.resume_codes))
        try:
            if self.first_chunk_delay_s:
                await asyncio.sleep(self.first_chunk_delay_s)
            for start in range(resume_at, len(samples), self.chunk_samples):
                piece = samples[start : start + self.chunk_samples]
                if start > resume_at and self.speed:
                    await asyncio.sleep(len(piece) / self.sample_rate / self.speed)
                else:
                    await asyncio.sleep(0)  # a cancellation point between chunks, like a real engine
                first = start == resume_at and self.words_delay_s is None
                yield AudioChunk(piece.tobytes(), words if first else (),
                                 codes=self.frame_codes(request.voice, request.seed, start, piece))
            if words and self.words_delay_s is None and resume_at >= len(samples):  # resumed at the very end
                yield AudioChunk(b"", words)
            if words and self.words_delay_s is not None:
                yield AudioChunk(b"", audio_ended=True)
                await asyncio.sleep(self.words_delay_s)
                yield AudioChunk(b"", words)
        finally:
            if self._capacity is not None:
                self._give_slot()

    async def _synthesize_stream(self, request: SynthesisRequest, stream: TextStream) -> AsyncIterator[AudioChunk]:
        """Speak the text as far as it has come: whole chunks while there is audio for them, what is left when
        the stream must wait for text (so the listener is not kept from audio that is already known), the
        rest at the end."""
        if request.voice not in _VOICES:
            raise UnknownVoiceError(f"unknown voice {request.voice!r}")
        if self._capacity is not None:
            await self._take_slot(resumed=bool(request.resume_codes))
        try:
            if self.first_chunk_delay_s:
                await asyncio.sleep(self.first_chunk_delay_s)
            sent = 0  # samples yielded
            words_sent = 0
            first = True
            resume_end = self.resume_end(request.resume_codes)  # resumed: the text must reach it first
            while True:
                finished = stream.finished  # read before the text: text pushed in between is spoken next turn
                text = stream.text
                spoken = text.strip()
                samples = self._render(request.voice, request.seed, spoken, keep=finished)
                if resume_end:
                    if len(samples) < resume_end and not finished:
                        await stream.wait_beyond(len(text))
                        continue
                    sent = self._resume_point(request, samples)
                    resume_end = 0
                words: tuple[WordTiming, ...] = ()
                if request.word_timestamps:
                    # A word is complete once a later word has begun, or the text is finished: until then
                    # punctuation may still join it ("Hello -", see split_words).
                    spans = split_words(spoken)
                    complete = spans if finished else spans[:-1]
                    words = tuple(WordTiming(w, a * self.samples_per_char, b * self.samples_per_char)
                                  for w, a, b in complete[words_sent:])
                    words_sent = len(complete)
                while sent < len(samples):  # all of it: next the stream ends or waits for text
                    piece = samples[sent: sent + self.chunk_samples]
                    if not first and self.speed:
                        await asyncio.sleep(len(piece) / self.sample_rate / self.speed)
                    else:
                        await asyncio.sleep(0)  # a cancellation point between chunks, like a real engine
                    codes = self.frame_codes(request.voice, request.seed, sent, piece)
                    sent += len(piece)
                    first = False
                    yield AudioChunk(piece.tobytes(), words, codes=codes)
                    words = ()
                if words:
                    yield AudioChunk(b"", words)
                if finished:
                    return
                await stream.wait_beyond(len(text))
        finally:
            if self._capacity is not None:
                self._give_slot()
