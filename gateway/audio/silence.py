"""The silence at the end of a stream of s16le PCM, held back so that the stream's end can drop it.

A backend that synthesizes whole units (Piper) ends each unit with the silence of a sentence's end (120-230
ms). Where the gateway cut a sentence early to speak sooner (gateway/session/segmenter.py,
`first_unit_in_sentence`), that silence would be heard as a break inside the sentence: the first unit's
audio passes through `TrailingSilence`, which lets through all but its trailing silent frames and, at the
end, keeps only `keep_s` of them. Audible audio is never delayed: only frames under the threshold are held,
until audible audio follows them (sent then) or the stream ends (mostly dropped).
"""

from __future__ import annotations

import numpy as np

FRAME_S = 0.010
THRESHOLD_DBFS = -40.0
KEEP_S = 0.020


class TrailingSilence:
    def __init__(self, sample_rate: int, *, keep_s: float = KEEP_S, threshold_dbfs: float = THRESHOLD_DBFS) -> None:
        self.frame = max(1, round(sample_rate * FRAME_S))
        self.keep = round(sample_rate * keep_s)
        self.threshold = 32768 * 10 ** (threshold_dbfs / 20)
        self.emitted = 0  # samples let through so far
        self._held = np.zeros(0, dtype=np.int16)

    def feed(self, pcm: bytes) -> bytes:
        """What of the stream so far may go out now: all but its trailing silent frames."""
        samples = np.concatenate([self._held, np.frombuffer(pcm, dtype="<i2")])
        cut = len(samples)
        while cut >= self.frame:  # whole frames from the end, while they are silent
            frame = samples[cut - self.frame: cut].astype(np.float64)
            if float(np.sqrt(np.mean(frame * frame))) >= self.threshold:
                break
            cut -= self.frame
        self._held = samples[cut:]
        self.emitted += cut
        return samples[:cut].astype("<i2").tobytes()

    def end(self, at_least: int = 0) -> bytes:
        """The stream ended: `keep_s` of the held silence, and more if needed for the audio to reach
        `at_least` samples (the end of its last timed word)."""
        keep = max(self.keep, at_least - self.emitted)
        tail = self._held[:max(0, keep)]
        self._held = self._held[:0]
        self.emitted += len(tail)
        return tail.astype("<i2").tobytes()
