"""Fixtures for the engine tests: a deterministic model-runner TEST DOUBLE (no model, no device).

`ScriptedRunnerTestDouble` plays back a script per request instead of running a model: the prompt is a
`Script` that says how many frames the request yields before EOS and how many of its first frames are
silent. It records every call so tests can check ordering, batching, slot use and cancellation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tts_backend.engine.request import RequestState
from tts_backend.engine.runner import ModelRunner


@dataclass(frozen=True)
class Script:
    frames: int  # frames before EOS is sampled
    silent_frames: int = 0  # leading frames whose audio is digital silence
    amplitude: float = 0.5


class ManualClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ScriptedRunnerTestDouble(ModelRunner):
    """Deterministic stand-in for the Qwen3 model runner (test double, named as such)."""

    def __init__(self, max_slots: int = 8, samples_per_frame: int = 1920, sample_rate: int = 24000,
                 step_delay_s: float = 0.0) -> None:
        self.max_slots = max_slots
        self.samples_per_frame = samples_per_frame
        self.sample_rate = sample_rate
        self.step_delay_s = step_delay_s
        self.calls: list[tuple[str, list[int], int]] = []  # (stage, request ids, codec frames)
        self.released: list[int] = []
        self.slots_in_use: dict[int, int] = {}  # slot -> request id
        self.prepared = False

    def prepare(self) -> None:
        self.prepared = True

    def _record(self, stage: str, requests: list[RequestState], frames: int = 0) -> None:
        for r in requests:
            owner = self.slots_in_use.setdefault(r.slot, r.request_id)
            assert owner == r.request_id, f"slot {r.slot} used by {owner} and {r.request_id}"
        self.calls.append((stage, [r.request_id for r in requests], frames))
        if self.step_delay_s:
            time.sleep(self.step_delay_s)

    def prefill(self, requests):
        self._record("prefill", requests)

    def code_predict(self, requests):
        self._record("code_predict", requests)

    def decode(self, requests):
        self._record("decode", requests)
        # frames_generated frames exist; EOS is sampled once the script's frames are all made.
        return [r.frames_generated >= r.prompt.frames for r in requests]

    def codec(self, requests, frames):
        self._record("codec", requests, frames)
        out = []
        for r in requests:
            first = r.frames_decoded
            pieces = []
            for f in range(first, first + frames):
                if f < r.prompt.silent_frames:
                    pieces.append(np.zeros(self.samples_per_frame, np.float32))
                else:
                    t = np.arange(self.samples_per_frame) + f * self.samples_per_frame
                    pieces.append((r.prompt.amplitude * np.cos(2 * np.pi * 220 * t / self.sample_rate))
                                  .astype(np.float32))
            out.append(np.concatenate(pieces))
        return out

    def release(self, request):
        self.released.append(request.request_id)
        self.slots_in_use.pop(request.slot, None)

    def stages(self) -> list[str]:
        return [c[0] for c in self.calls]
