"""Fixtures for the engine tests: a deterministic model-runner TEST DOUBLE (no model, no device).

`ScriptedRunnerTestDouble` plays back a script per request instead of running a model: the prompt is a
`Script` that says how many frames the request yields before EOS and how many of its first frames are
silent. It records every call so tests can check ordering, batching, slot use and cancellation.

Its codec batches tell codes as a GPU runner's do (CodecHandle.codes): one code a frame, the frame's index.

Its codec is asynchronous when `codec_polls` > 0: `codec_collect` answers None that many times before the
audio is there, as a GPU runner's does while the codec stream works; `codec_depth` batches may be in flight,
finished in launch order. It asserts the rules of the codec interface: at most `codec_depth` batches in flight,
collected oldest first, a request in at most one, and no slot of an in-flight batch released or reused. The engine
turns a runner's exception into a failed batch, so a broken rule is also kept in `violations` for the test.

With `first_chunk_lane` (most requests, frames each) it offers the first-chunk lane (ModelRunner.first_chunk_lane):
a batch launched with `lane=True` is in flight beside the others and may be collected before them; it asserts
at most one such batch, of that shape at most, every request in it with no audio out yet.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tts_backend.engine.engine import Engine, EngineConfig
from tts_backend.engine.request import Phase, RequestState
from tts_backend.engine.runner import CodecHandle, ModelRunner
from tts_backend.engine.scheduler import SchedulerConfig

SPF = 1920  # samples per frame of the test double's audio (the Qwen3 codec's, 80 ms at 24 kHz)


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


@dataclass(eq=False)
class _ScriptedCodecHandle(CodecHandle):
    audio: list[np.ndarray] | None = None  # what the batch decodes, made at launch
    polls_left: int = 0
    slots: dict | None = None  # slot -> request id
    frame_codes: list[bytes] | None = None  # what `codes` becomes once collected


class ScriptedRunnerTestDouble(ModelRunner):
    """Deterministic stand-in for the Qwen3 model runner (test double, named as such)."""

    def __init__(self, max_slots: int = 8, samples_per_frame: int = SPF, sample_rate: int = 24000,
                 step_delay_s: float = 0.0, codec_polls: int = 0, codec_depth: int = 1,
                 first_chunk_lane: tuple[int, int] | None = None, admits_between: bool = False,
                 on_talker_step: Callable[[], None] | None = None) -> None:
        self.max_slots = max_slots
        # Whether `frame` calls the engine's `admit` between the Talker step and the predictor, as the Qwen3
        # runner does; then its calls read ("frame", ...) for the Talker step, the prefill, ("predict", ids).
        self.admits_between = admits_between
        self.on_talker_step = on_talker_step  # runs "during" the Talker step (a test submits from it)
        self.samples_per_frame = samples_per_frame
        self.sample_rate = sample_rate
        self.step_delay_s = step_delay_s
        self.calls: list[tuple[str, list[int], int]] = []  # (stage, request ids, codec frames)
        self.talker_steps: collections.Counter = collections.Counter()  # request id -> Talker steps in frames
        self.released: list[int] = []
        self.slots_in_use: dict[int, int] = {}  # slot -> request id
        self.prepared = False
        self.codec_polls = codec_polls
        self.codec_depth = codec_depth
        self.codec_handles: list[_ScriptedCodecHandle] = []  # launched, uncollected, oldest first
        self.first_chunk_lane = first_chunk_lane
        self.lane_handle: _ScriptedCodecHandle | None = None  # the first-chunk lane's batch in flight
        self.lane_launches: list[tuple[list[int], int]] = []  # (request ids, bulk batches in flight then)
        self.lane_fails = 0  # the next this many lane batches raise when collected (a device error)
        self.codec_handle: _ScriptedCodecHandle | None = None  # the newest (a test may change its polls_left)
        self.codec_collected: list[list[int]] = []  # request ids of each collected codec batch
        self.during_codec: list[str] = []  # stages of the calls made while a codec batch was in flight
        self.codec_polled_early = 0  # collects that found the batch unfinished
        self.violations: list[str] = []

    @property
    def codec_in_flight(self) -> dict[int, int]:
        """slot -> request id, over the launched, uncollected batches."""
        handles = self.codec_handles + ([self.lane_handle] if self.lane_handle is not None else [])
        return {slot: rid for h in handles for slot, rid in h.slots.items()}

    def _check(self, ok: bool, message: str) -> None:
        if not ok:
            self.violations.append(message)
            raise AssertionError(message)

    def prepare(self) -> None:
        self.prepared = True

    def _record(self, stage: str, requests: list[RequestState], frames: int = 0) -> None:
        if self.codec_in_flight:
            self.during_codec.append(stage)
        for r in requests:
            if stage == "prefill":
                self._check(r.slot not in self.codec_in_flight, f"slot {r.slot} reused while its codec batch is in flight")
            owner = self.slots_in_use.setdefault(r.slot, r.request_id)
            self._check(owner == r.request_id, f"slot {r.slot} used by {owner} and {r.request_id}")
        self.calls.append((stage, [r.request_id for r in requests], frames))
        if self.step_delay_s:
            time.sleep(self.step_delay_s)

    def prefill(self, requests):
        self._record("prefill", requests)
        # A request resumed after its script's last frame samples EOS at once (RequestState.resume is opaque to
        # the engine: here it is the frame count, which the engine has put in frames_generated).
        if any(r.resume is not None for r in requests):
            return [r.resume is not None and r.frames_generated >= r.prompt.frames for r in requests]
        return None

    def frame(self, requests, admit=None):
        self._record("frame", requests)
        stepping = [r for r in requests if r.phase is Phase.NEED_DECODE]
        self.talker_steps.update(r.request_id for r in stepping)
        # frames_generated frames exist; a Talker step samples EOS once the script's frames are all made.
        stops = [r.phase is Phase.NEED_DECODE and r.frames_generated >= r.prompt.frames for r in requests]
        if self.on_talker_step is not None:
            self.on_talker_step()
        if self.admits_between and admit is not None:
            fresh = admit()
            for r in fresh:
                self._check(r.phase is Phase.NEED_CODE_PREDICT, f"request {r.request_id} admitted unprefilled")
            self.calls.append(("predict", [r.request_id for r, stop in zip(requests, stops) if not stop]
                               + [r.request_id for r in fresh], 0))
        return stops

    def push_text(self, request, tokens):
        # Text is opaque here (the script says when EOS comes); the engine counts the tokens.
        self.calls.append(("text", [request.request_id], len(tokens)))

    def codec_launch(self, requests, frames, **lane):
        if lane:
            return self._lane_launch(requests, frames, **lane)
        self._check(len(self.codec_handles) < self.codec_depth,
                    f"a codec batch launched while {self.codec_depth} are in flight")
        self.codec_handle = self._codec_handle(requests, frames)
        self.codec_handles.append(self.codec_handle)
        return self.codec_handle

    def _codec_handle(self, requests, frames) -> _ScriptedCodecHandle:
        busy = self.codec_in_flight
        self._check(all(r.slot not in busy for r in requests), "a request in two codec batches in flight")
        self._record("codec", requests, frames)
        audio = [self._audio(r, frames) for r in requests]
        handle = _ScriptedCodecHandle(len(requests), frames, audio=audio, polls_left=self.codec_polls,
                                      slots={r.slot: r.request_id for r in requests})
        # One code a frame, its index: the codes a stream's chunks carry, joined, count its frames in order.
        handle.frame_codes = [
            np.arange(r.frames_decoded, r.frames_decoded + frames, dtype="<u2").tobytes() for r in requests]
        return handle

    def _lane_launch(self, requests, frames, lane):
        self._check(lane is True and self.first_chunk_lane is not None, "a lane launch on a runner without one")
        self._check(self.lane_handle is None, "a first-chunk batch launched while one is in flight")
        most, lane_frames = self.first_chunk_lane
        self._check(len(requests) <= most and frames == lane_frames,
                    f"{len(requests)} x {frames} frames on a lane of {most} x {lane_frames}")
        self._check(all(r.playback_start is None for r in requests), "a playing stream on the first-chunk lane")
        self.lane_launches.append(([r.request_id for r in requests], len(self.codec_handles)))
        self.lane_handle = self._codec_handle(requests, frames)
        return self.lane_handle

    def codec_collect(self, handle):
        if handle.pcm is None:
            if handle.polls_left > 0:
                handle.polls_left -= 1
                self.codec_polled_early += 1
                return None
            if handle is self.lane_handle:
                self.lane_handle = None
                if self.lane_fails:
                    self.lane_fails -= 1
                    raise RuntimeError("lane device error")
                handle.pcm = handle.audio
                handle.codes = handle.frame_codes
                self.codec_collected.append(list(handle.slots.values()))
                return handle.pcm
            self._check(self.codec_handles[:1] == [handle], "a codec batch collected before an older one")
            handle.pcm = handle.audio
            handle.codes = handle.frame_codes
            self.codec_collected.append(list(handle.slots.values()))
            self.codec_handles.remove(handle)
            if self.codec_handle is handle:
                self.codec_handle = None
        return handle.pcm

    def codec_wait(self, handle):
        handle.polls_left = 0
        return self.codec_collect(handle)

    def _audio(self, r: RequestState, frames: int) -> np.ndarray:
        pieces = []
        for f in range(r.frames_decoded, r.frames_decoded + frames):
            if f < r.prompt.silent_frames:
                pieces.append(np.zeros(self.samples_per_frame, np.float32))
            else:
                t = np.arange(self.samples_per_frame) + f * self.samples_per_frame
                pieces.append((r.prompt.amplitude * np.cos(2 * np.pi * 220 * t / self.sample_rate))
                              .astype(np.float32))
        return np.concatenate(pieces)

    def release(self, request):
        self._check(request.slot not in self.codec_in_flight,
                    f"slot {request.slot} released while its codec batch is in flight")
        self.released.append(request.request_id)
        self.slots_in_use.pop(request.slot, None)

    def stages(self) -> list[str]:
        return [c[0] for c in self.calls]


# -- an engine on the test double, stepped by the test ---------------------------------------------------


def make_engine(max_active=4, schedule=(2, 4, 8, 12), max_queued=16, codec_polls=0, codec_depth=1,
                first_chunk_lane=None, admits_between=False, on_talker_step=None, quick_start_below=0, **sched):
    """An Engine on a ScriptedRunnerTestDouble and a ManualClock, started inline so that the test runs each
    `engine.step()`; `sched` are SchedulerConfig fields, the rest the runner's and the engine's. Returns
    (engine, runner, clock)."""
    clock = ManualClock()
    runner = ScriptedRunnerTestDouble(max_slots=max_active, codec_polls=codec_polls, codec_depth=codec_depth,
                                      first_chunk_lane=first_chunk_lane, admits_between=admits_between,
                                      on_talker_step=on_talker_step)
    config = EngineConfig(
        scheduler=SchedulerConfig(max_active=max_active, **sched), chunk_schedule=schedule, max_queued=max_queued,
        quick_start_below=quick_start_below,
    )
    engine = Engine(runner, config, clock=clock)
    engine.start_inline()
    return engine, runner, clock


def submit(engine, frames, max_frames=10_000, silent_frames=0, chunk_schedule=None):
    return engine.submit(Script(frames, silent_frames), seed=1, max_frames=max_frames,
                         chunk_schedule=chunk_schedule)


def run_until_idle(engine, limit=10_000):
    """Step until the engine has nothing to do; the batches it ran, in order."""
    batches = []
    for _ in range(limit):
        batch = engine.step()
        if batch is None:
            return batches
        batches.append(batch)
    raise AssertionError("engine never went idle")


def run_with_moving_clock(engine, clock, limit=10_000):
    """Step until the engine goes idle (or `limit` steps), moving the clock 50 ms on after every 7th step: deadlines
    come and go, so the urgency rules take part."""
    for i in range(limit):
        if engine.step() is None:
            break
        if i % 7 == 0:
            clock.advance(0.05)


def run_until(engine, predicate, limit=10_000):
    for _ in range(limit):
        if predicate():
            return
        assert engine.step() is not None, "went idle before the condition held"
    raise AssertionError("condition never held")


async def collect(stream) -> bytes:
    return b"".join([chunk async for chunk in stream])
