"""Word timings on their way to a client (issue 16), shared by the WebSocket sender and HTTP speech.

A backend gives WordTimings in its own samples. What the gateway needs of them: keep them monotonic,
tell which of them the audio already sent covers, and express them in seconds of the audio as shipped.
And never wait long for them (issue 32): `WordsWait` bounds the wait for timings that come after the audio.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    """One sentence's wait for word timings that come after its audio, bounded: `bound` wraps each backend
    stream of the sentence (one, or one per part of a markup-cut sentence). Once a stream's chunk says
    `audio_ended` (base.py: a forced aligner's timings come after the whole audio), the chunks after it get
    `wait_s` in all. Past that the stream ends as if the backend had ended it (it is closed, which stops the
    request and the aligner's work for it) and `late` is set: the sentence goes on with all its audio and
    without those words, a warning (`late_warning`) instead. Only the time spent waiting for the backend
    counts, not the caller's own pauses between chunks (back-pressure)."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self.late = False

    async def bound(self, chunks: AsyncIterator[AudioChunk]) -> AsyncIterator[AudioChunk]:
        left: float | None = None  # seconds of the wait left, from audio_ended on
        async with contextlib.aclosing(chunks):
            while True:
                started = time.monotonic()
                try:
                    if left is None:
                        chunk = await anext(chunks)
                    else:
                        chunk = await _next_within(chunks, max(0.0, left))
                        left -= time.monotonic() - started
                except StopAsyncIteration:
                    return
                if chunk is None:
                    self.late = True
                    return
                if chunk.audio_ended and left is None:
                    left = self.wait_s
                yield chunk

    def late_warning(self, field: str) -> ConfigWarning:
        return ConfigWarning(code="timestamps_late", field=field,
                             message=f"the word timings did not come within {self.wait_s:g} s of the audio's end;"
                                     " they are left out")


async def _next_within(chunks: AsyncIterator[AudioChunk], timeout_s: float) -> AudioChunk | None:
    """The next chunk, or None when it does not come within `timeout_s` (the pull is cancelled then). A
    backend's own error, a TimeoutError included, is raised as it is."""
    pending = asyncio.ensure_future(anext(chunks))
    try:
        done, _ = await asyncio.wait({pending}, timeout=timeout_s)
    finally:
        if not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pending
    return pending.result() if done else None
