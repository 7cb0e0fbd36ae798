"""Caller-speech detection on inbound Twilio audio, for barge-in.

A deliberately simple energy detector: speech is declared after `min_speech_ms` of consecutive 20 ms
frames whose RMS level is above `threshold_dbfs`. Applications with a real VAD pass their own object
with the same `feed(mulaw) -> bool` method (or call `call.interrupt()` from `on_inbound_audio`).
"""

from __future__ import annotations

import math
from array import array

from voxgate_client import mulaw_to_pcm16

from .twilio import FRAME_MS


def frame_dbfs(mulaw: bytes) -> float:
    """RMS level of mu-law audio in dB relative to full scale (-inf for digital silence)."""
    samples = array("h")
    samples.frombytes(mulaw_to_pcm16(mulaw))
    if not samples:
        return float("-inf")
    rms = math.sqrt(sum(s * s for s in samples) / len(samples))
    return 20 * math.log10(rms / 32768) if rms > 0 else float("-inf")


class EnergyBargeIn:
    def __init__(self, threshold_dbfs: float = -30.0, min_speech_ms: int = 100) -> None:
        self.threshold_dbfs = threshold_dbfs
        self.min_frames = max(1, min_speech_ms // FRAME_MS)
        self._loud_frames = 0

    def feed(self, mulaw: bytes) -> bool:
        """Feed one inbound frame; True once (per stretch of speech) when speech has lasted long enough."""
        if frame_dbfs(mulaw) >= self.threshold_dbfs:
            self._loud_frames += 1
            return self._loud_frames == self.min_frames
        self._loud_frames = 0
        return False
