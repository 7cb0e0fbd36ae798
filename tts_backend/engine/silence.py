"""Leading-silence trimming: audio before the speech onset is never shipped ahead of speech.

Onset is measured the way the benchmark measures audible time to first audio (bench/README.md): the start
of the first of two consecutive 20 ms windows (10 ms hop, DC removed) whose RMS is at least -45 dBFS.
Shipping starts at that window, so the listener's first window is already audible. An optional pre-roll
keeps a little audio before it; it defaults to none because every millisecond of it is added to the
audible time to first audio.
"""

from __future__ import annotations

import numpy as np


def find_onset(samples: np.ndarray, sample_rate: int, threshold_dbfs: float = -45.0,
               window_ms: float = 20.0, hop_ms: float = 10.0) -> int | None:
    """Index of the first window of two consecutive loud windows, or None. `samples` are floats in [-1, 1]."""
    window = int(sample_rate * window_ms / 1000)
    hop = int(sample_rate * hop_ms / 1000)
    if len(samples) < window + hop:
        return None
    count = (len(samples) - window) // hop + 1
    starts = np.arange(count) * hop
    frames = np.lib.stride_tricks.sliding_window_view(samples.astype(np.float64), window)[starts]
    frames = frames - frames.mean(axis=1, keepdims=True)
    rms = np.sqrt(np.mean(frames * frames, axis=1))
    loud = rms >= 10.0 ** (threshold_dbfs / 20.0)
    both = np.flatnonzero(loud[:-1] & loud[1:])
    return int(starts[both[0]]) if both.size else None


class LeadingSilenceTrimmer:
    """Holds audio back until the onset is found; after that passes everything through unchanged."""

    def __init__(self, sample_rate: int, threshold_dbfs: float = -45.0, preroll_ms: float = 0.0) -> None:
        self.sample_rate = sample_rate
        self.threshold_dbfs = threshold_dbfs
        self.preroll = int(sample_rate * preroll_ms / 1000)
        # A window pair spans 30 ms: keep that much of the held silence so a pair straddling two chunks
        # is still seen, plus the pre-roll.
        self._keep = int(sample_rate * 0.030) + self.preroll
        self._held = np.zeros(0, dtype=np.float32)
        self.started = False
        self.trimmed_samples = 0  # silence dropped, for tracing

    def push(self, samples: np.ndarray) -> np.ndarray:
        """Returns the audio to ship now (possibly empty)."""
        if self.started:
            return samples
        buffer = np.concatenate([self._held, samples]) if self._held.size else samples
        onset = find_onset(buffer, self.sample_rate, self.threshold_dbfs)
        if onset is None:
            keep = min(len(buffer), self._keep)
            self.trimmed_samples += len(buffer) - keep
            self._held = buffer[len(buffer) - keep:]
            return samples[:0]
        self.started = True
        # The onset window may start with silence (one loud sample can make a window loud): begin at its
        # first sample above the threshold amplitude, so no silence at all goes out ahead of speech.
        window = buffer[onset:onset + int(self.sample_rate * 0.020)]
        above = np.flatnonzero(np.abs(window) >= 10.0 ** (self.threshold_dbfs / 20.0))
        onset += int(above[0]) if above.size else 0
        start = max(0, onset - self.preroll)
        self.trimmed_samples += start
        self._held = self._held[:0]
        return buffer[start:]

    def flush(self) -> np.ndarray:
        """At the end of a stream that never became loud: ship the held tail so the stream is not empty
        (quiet audio is still the audio the text produced)."""
        held, self._held = self._held, self._held[:0]
        self.started = True
        return held
