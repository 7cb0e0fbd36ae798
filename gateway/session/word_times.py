"""Word timings on their way to a client (issue 16), shared by the WebSocket sender and HTTP speech.

A backend gives WordTimings in its own samples. What the gateway needs of them: keep them monotonic,
tell which of them the audio already sent covers, and express them in seconds of the audio as shipped.
And never wait long for them (issue 32): `WordsWait` bounds the wait for timings that come after the audio.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from tts_backend.base import AudioChunk, WordTiming

from ..protocol import ConfigWarning, SpokenWord

# The words an utterance keeps for context.cancelled's spoken_text: about 15 minutes of speech, far more
# than one turn of an agent says, and a bound on what a context fed text for hours holds.
MAX_SPOKEN_WORDS = 2000


def append_monotonic(kept: list[WordTiming], words) -> None:
    """Add a backend's WordTimings to `kept`, never going back in time (a backend that does is clamped)."""
    for word in words:
        start = max(word.start, kept[-1].start if kept else 0)
        end = max(word.end, start, kept[-1].end if kept else 0)
        kept.append(WordTiming(word.word, start, end))


def count_reached(words: list[WordTiming], sent_samples: int, source_rate: int, output_rate: int) -> int:
    """How many of `words` (backend samples at `source_rate`) end within the first `sent_samples` output
    samples (at `output_rate`): end * output_rate <= sent * source_rate, exactly."""
    reach = sent_samples * source_rate
    count = 0
    while count < len(words) and words[count].end * output_rate <= reach:
        count += 1
    return count


def in_seconds(words: list[WordTiming], source_rate: int, offset_s: float = 0.0) -> list[SpokenWord]:
    """The words with their times in seconds, `offset_s` later (a codec's priming that decoders play)."""
    return [SpokenWord(word=w.word, start=round(offset_s + w.start / source_rate, 6),
                       end=round(offset_s + w.end / source_rate, 6)) for w in words]


def keep_spoken(spoken: list[SpokenWord], words: list[SpokenWord]) -> None:
    """Add a sentence's spoken words to its utterance's, keeping the last MAX_SPOKEN_WORDS."""
    spoken.extend(words)
    if len(spoken) > MAX_SPOKEN_WORDS:
        del spoken[: len(spoken) - MAX_SPOKEN_WORDS]


class WordsWait:
    """A backend's chunks for one request, its wait for word timings after its audio bounded: once a chunk
    says `audio_ended` (base.py: a forced aligner's timings come after the whole sentence), the chunks
    after it get `wait_s` in all. Past that the iteration ends as if the backend had (the caller's
    aclose stops the request, and the aligner's work for it) and `late` is set: the sentence ends with
    all its audio and without its words, a warning (`late_warning`) instead. Only the time spent waiting
    for the backend counts, not the caller's own pauses between chunks (back-pressure)."""

    def __init__(self, chunks: AsyncIterator[AudioChunk], wait_s: float) -> None:
        self._chunks = chunks
        self.wait_s = wait_s
        self._left: float | None = None  # seconds of the wait left, from audio_ended on
        self.late = False

    def __aiter__(self) -> "WordsWait":
        return self

    async def __anext__(self) -> AudioChunk:
        if self.late:
            raise StopAsyncIteration
        if self._left is None:
            chunk = await anext(self._chunks)
        else:
            started = time.monotonic()
            try:
                chunk = await asyncio.wait_for(anext(self._chunks), max(0.0, self._left))
            except asyncio.TimeoutError:
                self.late = True
                raise StopAsyncIteration from None
            self._left -= time.monotonic() - started
        if chunk.audio_ended and self._left is None:
            self._left = self.wait_s
        return chunk

    def late_warning(self, field: str) -> ConfigWarning:
        return ConfigWarning(code="timestamps_late", field=field,
                             message=f"the word timings did not come within {self.wait_s:g} s of the audio's end;"
                                     " they are left out")
