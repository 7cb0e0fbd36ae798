"""Word timings on their way to a client (issue 16), shared by the WebSocket sender and HTTP speech.

A backend gives WordTimings in its own samples. What the gateway needs of them: keep them monotonic,
tell which of them the audio already sent covers, and express them in seconds of the audio as shipped.
"""

from __future__ import annotations

from tts_backend.base import WordTiming

from ..protocol import SpokenWord

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
