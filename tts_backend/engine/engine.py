"""The engine thread: owns the scheduler and the runner, and hands audio to asyncio.

asyncio side -> engine: `submit`, `push_text` and `cancel` put commands on a thread-safe queue and wake the thread.
engine -> asyncio side: each chunk goes into the stream's `asyncio.Queue` through
`loop.call_soon_threadsafe`, so the event loop never blocks on the device and the device never waits on the
event loop. Only the engine thread touches scheduler and runner state.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import itertools
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import numpy as np

from ..base import BackendOverloadedError, SynthesisError
from .request import (
    DEFAULT_CHUNK_SCHEDULE,
    OutputAccounting,
    Phase,
    RequestState,
    Stage,
    quick_start_schedule,
    schedule_pieces,
    validate_schedule,
)
from .runner import CodecHandle, ModelRunner
from .scheduler import Batch, Scheduler, SchedulerConfig
from .silence import LeadingSilenceTrimmer

log = logging.getLogger(__name__)

_END = object()
# Upper bounds (s) of the first-chunk latency counts (EngineStats.first_chunk_counts): 5 ms steps up to 100 ms,
# where the peers' and our TTFA figures lie, coarser beyond.
FIRST_CHUNK_BUCKETS_S = (*(i / 200 for i in range(1, 21)), 0.125, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


@dataclass(frozen=True)
class EngineConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_queued: int = 256  # requests waiting for a slot beyond which submit refuses (overload)
    chunk_schedule: tuple[int, ...] = DEFAULT_CHUNK_SCHEDULE
    # While fewer than this many requests are in the engine (holding a slot or waiting for one), a request whose
    # caller named no chunk schedule ships its first frame alone, then the rest of `chunk_schedule`'s first
    # chunk, then the rest of it (request.quick_start_schedule): its first audio comes a frame sooner (a frame
    # is 5.3-5.5 ms on the H100 at light load), and while the engine is lightly loaded the extra small codec
    # call costs no other stream anything. Under load a first chunk of one frame is one more codec call per
    # request, which the codec cannot spare, except for a request whose text is still being written (submit
    # says why). 0: never, for any request.
    # 16: on the H100 through the gateway, p95 audible TTFA 25.0 / 28.3 / 30.4 -> 16.3 / 22.7 / 28.3 ms at
    # 1 / 10 / 20 RPS, and no loss at 60-100 RPS, where more than 16 are in flight
    # (bench/results/engine_h100.md, 2026-12-07).
    quick_start_below: int = 16
    trim_leading_silence: bool = True
    silence_threshold_dbfs: float = -45.0
    # The engine thread shares the interpreter lock with the event loop. After each device sync it needs the
    # lock back, and CPython hands it over only every switch interval (5 ms by default) while the loop is
    # busy sending audio: up to 5 ms of idle GPU per decision. The engine lowers the interval to this when
    # it starts (process-wide; never raises it). None leaves it alone.
    gil_switch_interval_s: float | None = 0.0005


# Sections of the engine thread's wall time (EngineStats.seconds). Every moment of the thread belongs to
# exactly one section, so the sections add up to the wall time between two snapshots.
_STARTUP = "startup"  # runner.prepare (graph capture)
_SCHEDULE = "schedule"  # host overhead: draining commands and scheduler.decide
_IDLE = "idle"  # waiting on _wake with nothing to run
_OUTSIDE = "outside_step"  # between steps: the run loop's own turn, or the caller's code in inline mode
_RUNNER = {s: f"runner.{s.name}" for s in Stage}  # inside the runner's call for a batch of the stage
# (codec: launching a batch, polling it, and waiting for it when there is nothing else to do; the codec's
# device time overlaps other sections and is counted apart, in EngineStats.codec_device_s)
_POST = {s: f"post.{s.name}" for s in Stage}  # the engine's own work on the batch's results (phases, PCM, finish)


@dataclass
class EngineStats:
    decisions: int = 0
    # The scheduler's own cost: its decide calls (those that found nothing to run included) and the thread's CPU
    # seconds in them. The "schedule" section's wall seconds also hold the command drain and any wait for the
    # interpreter lock, which the event loop's thread holds meanwhile (issue 29's 50 us target is this one's).
    decide_calls: int = 0
    decide_cpu_s: float = 0.0
    batches: dict = field(default_factory=lambda: {s.name: 0 for s in Stage})
    items: dict = field(default_factory=lambda: {s.name: 0 for s in Stage})
    busy_s: float = 0.0  # engine-thread seconds in runner calls plus result handling, all batches
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    batch_sizes: dict = field(default_factory=lambda: {s.name: {} for s in Stage})  # stage -> {size: batches}
    codec_frames: dict = field(default_factory=dict)  # frames per request of a codec batch -> batches
    rules: dict = field(default_factory=dict)  # urgency rule -> {stage: batches}
    seconds: dict = field(default_factory=dict)  # section -> wall seconds of the engine thread
    idle_waits: int = 0
    # Codec batches run beside generation (runner codec_launch/codec_collect): per collected batch, the wall
    # time from launch to collect, and the device time when the runner measures it (CUDA events).
    codec_collected: int = 0
    codec_in_flight_s: float = 0.0
    codec_device_s: float = 0.0
    codec_timed: int = 0  # collected batches whose device time is known
    codec_lane_batches: int = 0  # codec batches launched on the runner's first-chunk lane (of batches["CODEC"])
    # Text streaming: a stream's listener may run out of audio because the engine was late (late_chunks,
    # late_s: the engine's making) or because the stream waited for text (text_gaps, text_gap_s: the
    # caller's). text_waits counts the waits (a stream's next step needed a token not yet pushed) and
    # text_wait_s their stream-seconds, gaps or not.
    late_chunks: int = 0
    late_s: float = 0.0
    # First chunks by how long after the request's arrival they shipped: counts per FIRST_CHUNK_BUCKETS_S
    # upper bound (not cumulative; the last entry counts those above every bound). With the gateway's TTFA
    # and the client's, it tells which part of a request's first audio is the engine's.
    first_chunk_counts: list = field(default_factory=lambda: [0] * (len(FIRST_CHUNK_BUCKETS_S) + 1))
    text_waits: int = 0
    text_wait_s: float = 0.0
    text_gaps: int = 0
    text_gap_s: float = 0.0
    # Leading audio the trimmer dropped as silence before each request's first audible window, and how many
    # requests had some: a frame of it is a frame later first audio (a cloned voice's first frames, say).
    trimmed_requests: int = 0
    trimmed_s: float = 0.0


@dataclass
class _CodecInFlight:
    """A codec batch the runner is working on."""

    batch: Batch
    handle: CodecHandle
    launched: float  # perf_counter when its launch began


class EngineStream:
    """The consumer's end of one request: an async iterator of s16le PCM bytes, or with `chunks()` of
    (PCM, codes) pairs, codes being those of the frames decoded since the previous pair (resume from codes,
    base.py), from a runner that tells them."""

    def __init__(self, engine: Engine, request_id: int, output: OutputAccounting,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._engine = engine
        self._output = output
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._finished = False

    # engine thread
    def _deliver(self, item: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self._engine.cancel(self.request_id)

    # event loop
    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        while True:
            pcm, _ = await self._next_chunk()
            if pcm:
                return pcm

    async def chunks(self) -> AsyncIterator[tuple[bytes, bytes]]:
        """(PCM, codes) pairs; the last may carry codes only (frames whose audio was silence held back)."""
        while True:
            try:
                yield await self._next_chunk()
            except StopAsyncIteration:
                return

    async def _next_chunk(self) -> tuple[bytes, bytes]:
        if self._finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _END:
            self._finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        self._output.consumed_samples += len(item[0]) // 2
        if self._engine._paused_waiting:  # a stream paused by back-pressure may resume now
            self._engine._wake.set()
        return item

    def cancel(self) -> None:
        if not self._finished:
            self._finished = True
            self._engine.cancel(self.request_id)

    def abort(self, error: BaseException) -> None:
        """Event loop: end the request with `error` (the caller found its pushed text unusable): the engine
        cancels it and the consumer's next read raises `error`, after any audio already queued."""
        if not self._finished:
            self._queue.put_nowait(error)
            self._engine.cancel(self.request_id)


class Engine:
    def __init__(self, runner: ModelRunner, config: EngineConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.runner = runner
        self.clock = clock  # monotonic seconds; tests substitute a manual clock
        self.config = config or EngineConfig()
        sched_config = self.config.scheduler
        if sched_config.max_active > runner.max_slots:
            raise ValueError(f"max_active {sched_config.max_active} exceeds the runner's {runner.max_slots} slots")
        self.scheduler = Scheduler(sched_config)
        self.stats = EngineStats()
        # The section the engine thread is in and since when (perf_counter); the lock makes a snapshot taken
        # from another thread see each boundary whole (section totals and the open section together).
        self._stats_lock = threading.Lock()
        self._section = _OUTSIDE
        self._section_started = time.perf_counter()
        self._ids = itertools.count(1)
        self._commands: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._ready = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._streams: dict[int, EngineStream] = {}
        self._trimmers: dict[int, LeadingSilenceTrimmer] = {}
        self._startup_error: BaseException | None = None
        self._paused_waiting = False
        self._inline = False
        # The codec batches in flight, oldest first: the runner takes up to `codec_depth` of them and runs
        # them in order, so the codec stream has the next batch queued when one ends instead of idling until
        # the engine's next step boundary (H100, 60 RPS with one at a time: in flight 77 % of the wall time,
        # on the device 40 %).
        self._codecs: collections.deque[_CodecInFlight] = collections.deque()
        self._codec_depth = max(1, runner.codec_depth)
        # The first-chunk batch on the runner's lane (ModelRunner.first_chunk_lane, known once it is prepared),
        # beside `_codecs`: at most one. Its requests are in no other batch in flight, so it is collected
        # whenever it is done.
        self._lane_shape: tuple[int, int] | None = None
        self._lane: _CodecInFlight | None = None
        # When the codec batch now being launched or the oldest in flight began its launch (None: none is), so
        # that a snapshot counts the time the codec had work up to now, as it counts the open section's seconds.
        self._codec_since: float | None = None
        # Streams waiting for text now: request id -> engine clock when the wait began. Written by the
        # engine thread under the stats lock, so a snapshot sees open waits too.
        self._text_waiting: dict[int, float] = {}

    # ---- lifecycle (any thread) -------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        interval = self.config.gil_switch_interval_s
        if interval is not None and interval < sys.getswitchinterval():
            sys.setswitchinterval(interval)
        self._thread = threading.Thread(target=self._run, name="voxgate-engine", daemon=True)
        self._thread.start()

    def start_inline(self) -> None:
        """Prepare the runner on the calling thread and accept work without starting the engine thread;
        the caller then drives `step()` itself (tests, single-threaded tools)."""
        self._enter(_STARTUP)
        self.runner.prepare()
        self._lane_shape = self.runner.first_chunk_lane
        self._enter(_OUTSIDE)
        self._inline = True
        self._ready.set()

    def wait_ready(self, timeout: float | None = None) -> None:
        if not self._ready.wait(timeout):
            raise TimeoutError("engine did not become ready in time")
        if self._startup_error is not None:
            raise SynthesisError(f"engine failed to start: {self._startup_error}") from self._startup_error

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._startup_error is None and not self._stopping

    def stop(self) -> None:
        """Stop the engine thread; it collects its in-flight codec batch and fails what is left. In inline
        mode that shutdown runs here, so call it from the thread that drives `step()`."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        elif self._inline:
            self._inline = False
            self._shutdown()

    def load(self) -> float:
        return min(1.0, len(self._streams) / max(1, self.config.scheduler.max_active))

    @property
    def capacity(self) -> int:
        return self.config.scheduler.max_active

    def waiting(self) -> int:
        """Requests submitted beyond the KV slots: they wait for one to free."""
        return max(0, len(self._streams) - self.config.scheduler.max_active)

    # ---- requests (event-loop thread) -------------------------------------------------------------
    def submit(self, prompt: object, *, seed: int | None, max_frames: int,
               chunk_schedule: tuple[int, ...] | None = None,
               loop: asyncio.AbstractEventLoop | None = None, text_tokens: int | None = None,
               resume: object = None, resume_frames: int = 0) -> EngineStream:
        """text_tokens: None for a complete text; for text still being written (`push_text`), how many text
        tokens the prompt already holds for decode steps to take one by one. resume, resume_frames: continue
        the request after `resume_frames` frames it delivered before (resume from codes, base.py); `resume` is
        what the runner needs for that (the Qwen3 runner: their codes). The stream then yields what the
        uninterrupted request yields after those frames: its counters start where that request's were (frames
        generated and decoded, text tokens taken, and chunks of its schedule where the runner asks:
        ModelRunner.resume_continues_schedule), and no leading silence is trimmed (its audio had started: the
        delivered chunks carried audio)."""
        if not self.ready:
            raise SynthesisError("engine is not ready")
        if len(self._streams) >= self.config.scheduler.max_active + self.config.max_queued:
            raise BackendOverloadedError("engine queue is full")
        if chunk_schedule:
            schedule = validate_schedule(chunk_schedule)
        elif self.config.quick_start_below and (resume_frames or text_tokens is not None
                                                or len(self._streams) < self.config.quick_start_below):
            # A resumed request takes the quick schedule whatever the load: its boundaries include the plain
            # schedule's, so it goes on in the chunks of the first attempt, which may have started quick.
            # So does text still being written: its second frame waits for the next word (25 ms at an LLM's
            # 40 words/s, against a frame's 5-7 ms), so holding the first frame for it costs a word, not a
            # frame. bench/engine_sim.py, the agent workload at 20 / 30 sessions/s with 256 slots: p95 83 /
            # 105 -> 67 / 87 ms, underrunning 4 / 11 -> 0 / 4.
            schedule = validate_schedule(quick_start_schedule(self.config.chunk_schedule))
        else:
            schedule = validate_schedule(self.config.chunk_schedule)
        request = RequestState(
            request_id=next(self._ids),
            prompt=prompt,
            seed=seed,
            max_frames=max(1, int(max_frames)),
            chunk_schedule=schedule,
            arrival=self.clock(),
            sample_rate=self.runner.sample_rate,
            samples_per_frame=self.runner.samples_per_frame,
            text_open=text_tokens is not None,
            text_ready=int(text_tokens or 0),
        )
        if resume_frames:
            frames = int(resume_frames)
            request.resume = resume
            request.frames_generated = request.frames_decoded = request.text_fed = frames
            # The schedule goes on where the uninterrupted request's was (the codec then decodes the frames after
            # the resume point in the calls that request made), or starts again (ModelRunner's choice).
            if self.runner.resume_continues_schedule:
                request.chunks_decoded = len(schedule_pieces(schedule, frames))
        stream = EngineStream(self, request.request_id, request.output, loop or asyncio.get_running_loop())
        self._streams[request.request_id] = stream
        self._commands.append(("submit", request))
        self._wake.set()
        return stream

    def cancel(self, request_id: int) -> None:
        self._commands.append(("cancel", request_id))
        self._wake.set()

    def push_text(self, request_id: int, tokens: list, final: bool = False, max_frames: int | None = None) -> None:
        """More text tokens for a request submitted with `text_tokens` (opaque to the engine: the runner
        takes them, ModelRunner.push_texts); `final`: the text is complete with these (the tokens then carry
        whatever marks its end). max_frames: the request's frame cap, grown with its text. Any thread."""
        self._commands.append(("text", (request_id, list(tokens), bool(final), max_frames)))
        self._wake.set()

    # ---- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        self._enter(_STARTUP)
        try:
            self.runner.prepare()
            self._lane_shape = self.runner.first_chunk_lane
        except BaseException as exc:  # noqa: BLE001 - reported through wait_ready
            log.exception("engine start-up failed")
            self._startup_error = exc
            self._ready.set()
            return
        self._enter(_OUTSIDE)
        self._ready.set()
        while not self._stopping:
            if self.step() is None:
                # Readiness never changes with time alone, except for streams paused by back-pressure,
                # whose consumers wake us as they read; the timeout is a safety net.
                self._paused_waiting = bool(self.scheduler.requests)
                self._enter(_IDLE)
                self.stats.idle_waits += 1
                self._wake.wait(0.05)
                self._wake.clear()
                self._paused_waiting = False
        self._shutdown()

    def _shutdown(self) -> None:
        # The device must be done with the in-flight codec batches before their slots are freed for good.
        while self._codecs or self._lane is not None:
            self._collect_codec(block=True, lane=self._lane is not None)
            self._enter(_OUTSIDE)
        self._fail_all(SynthesisError("engine stopped"))

    def step(self, now: float | None = None) -> Batch | None:
        """One turn: take commands, collect the codec batches the device has finished (oldest first), pick
        one batch and run (or, for the codec, launch) it. Returns the batch, or None when idle.
        Called by the engine thread; tests drive it directly (with a chosen clock) instead of the thread."""
        self._enter(_SCHEDULE)
        self._drain_commands()
        if self._lane is not None:
            self._collect_codec(block=False, lane=True)
            self._enter(_SCHEDULE)
        if self._codecs:
            # Not waiting here even when a stream is about to run dry: its codec is in flight (the audio comes
            # no sooner by waiting) or has to wait for the in-flight batches anyway, and rule 1 picks it in
            # the step that collects them; a generation batch launched meanwhile overlaps the codec.
            while self._codecs and self._collect_codec(block=False):
                pass
            self._enter(_SCHEDULE)
        batch = self._decide(now)
        while batch is None and (self._codecs or self._lane is not None):
            # Only codec batches in flight are left: wait for one rather than spin; its audio may make work
            # ready (the next chunk's codec, or streams that were paused). The lane's first: it is small and its
            # stream has the higher priority, so it is most likely done first.
            self._collect_codec(block=True, lane=self._lane is not None)
            self._enter(_SCHEDULE)
            batch = self._decide(now)
        if batch is not None:
            self._execute(batch, now)
        self._enter(_OUTSIDE)
        return batch

    def _decide(self, now: float | None) -> Batch | None:
        full = len(self._codecs) >= self._codec_depth
        started = time.thread_time()
        if self._lane_shape is None:
            batch = self.scheduler.decide(self._now(now), codec_in_flight=full)
        else:
            lane = self._lane_shape if self._lane is None else None
            batch = self.scheduler.decide(self._now(now), codec_in_flight=full, first_chunk_lane=lane)
        self._count_decide(time.thread_time() - started)
        return batch

    def _count_decide(self, cpu_s: float) -> None:
        with self._stats_lock:
            self.stats.decide_calls += 1
            self.stats.decide_cpu_s += cpu_s

    def _now(self, now: float | None) -> float:
        return self.clock() if now is None else now

    def _drain_commands(self) -> None:
        texts: dict[int, list] = {}  # request id -> [tokens, final, max_frames], this turn's text merged
        while self._commands:
            kind, arg = self._commands.popleft()
            if kind == "submit":
                self._add(arg)
            elif kind == "text":
                request_id, tokens, final, max_frames = arg
                merged = texts.setdefault(request_id, [[], False, None])
                if merged[1]:
                    continue  # text after the final push is ignored, as it is when it comes a turn later
                merged[0].extend(tokens)
                merged[1] = final
                if max_frames is not None:
                    merged[2] = max(merged[2] or 0, int(max_frames))
            elif kind == "cancel":
                request = self.scheduler.get(arg)
                if request is not None and not request.done:  # done: already left, its slot held for a codec batch
                    request.cancelled = True
                    self.stats.cancelled += 1
                    self._finish(request, None)
        if texts:
            self._take_texts(texts)

    def _add(self, request: RequestState) -> None:
        self._trimmers[request.request_id] = LeadingSilenceTrimmer(
            request.sample_rate, self.config.silence_threshold_dbfs
        ) if self.config.trim_leading_silence and request.resume is None else None
        self.scheduler.add(request)

    def _take_submissions(self) -> None:
        """Take in the requests submitted since the turn began, and nothing else: mid-frame, the frame's own
        requests must not change (a cancel or text waits for the next turn, as it would have anyway). A cancel
        or text always comes after the submit of its request, so taking submits first keeps every request's
        own order."""
        commands = self._commands
        if not any(kind == "submit" for kind, _ in list(commands)):
            return
        rest = collections.deque()
        while commands:
            kind, arg = commands.popleft()
            if kind == "submit":
                self._add(arg)
            else:
                rest.append((kind, arg))
        # Commands appended meanwhile by other threads land after `rest` (deque appends are atomic).
        while rest:
            commands.appendleft(rest.pop())

    def _take_texts(self, texts: dict[int, list]) -> None:
        """Every push of the turn, one runner call for all (ModelRunner.push_texts)."""
        taking: list[tuple[RequestState, list, bool, int | None]] = []
        for request_id, (tokens, final, max_frames) in texts.items():
            request = self.scheduler.get(request_id)
            if request is not None and not request.done and request.text_open:
                taking.append((request, tokens, final, max_frames))
        pushes = [(request, tokens) for request, tokens, _, _ in taking if tokens]
        errors = iter(self.runner.push_texts(pushes) if pushes else ())
        for request, tokens, final, max_frames in taking:
            error = next(errors) if tokens else None
            if error is not None:  # e.g. more text than the runner holds: this request fails, no other
                self.stats.failed += 1
                self._finish(request, SynthesisError(str(error)))
                continue
            request.text_ready += len(tokens)
            if max_frames is not None:
                request.max_frames = max(request.max_frames, max_frames)
            if final:
                request.text_open = False
            if request.text_wait_since is not None and not request.waiting_for_text:
                self._end_text_wait(request)
            if not request.text_open and request.phase is Phase.NEED_DECODE \
                    and request.frames_generated >= request.max_frames:
                request.phase = Phase.FINISHED  # it reached its cap while the text was open
                self._complete_finished([request])
            self.scheduler.changed(request)

    def _note_text_waits(self, requests: list[RequestState]) -> None:
        """After a frame: the streams whose next step must wait for text start waiting."""
        for r in requests:
            if r.text_open and r.text_wait_since is None and r.waiting_for_text:
                r.text_wait_since = self.clock()
                r.text_waited = True
                with self._stats_lock:
                    self.stats.text_waits += 1
                    self._text_waiting[r.request_id] = r.text_wait_since

    def _end_text_wait(self, request: RequestState) -> None:
        with self._stats_lock:
            self.stats.text_wait_s += self.clock() - request.text_wait_since
            self._text_waiting.pop(request.request_id, None)
        request.text_wait_since = None

    def _execute(self, batch: Batch, now: float | None = None) -> None:
        if batch.stage is Stage.CODEC:
            self._launch_codec(batch)
            return
        if batch.stage is Stage.PREFILL:
            self._prefill(batch)
            return
        runner = self.runner
        requests = batch.requests
        stage = batch.stage
        post = _POST[stage]
        started = self._enter(_RUNNER[stage])
        between: list[float] = []  # thread seconds of a prefill run inside the frame (its own batch's)
        fresh: list[RequestState] = []

        def admit() -> list[RequestState]:
            fresh.extend(self._prefill_between(batch, now, between))
            return fresh

        try:
            eos = runner.frame(requests, admit)
            self._enter(post)
            for r, stop in zip(requests, eos):
                if r.phase is Phase.NEED_DECODE:
                    r.text_fed += 1  # its Talker step took one text token (or the pad)
                if stop:
                    r.phase = Phase.FINISHED
                    continue
                self._frame_made(r)
            for r in fresh:  # prefilled inside the frame: its predictor made their first frame
                self._frame_made(r)
            self._note_text_waits(requests)
        except Exception as exc:  # a failed batch fails its requests, not the engine
            self._enter(post)
            self._fail_batch(batch, exc)
            if fresh:
                self._fail_batch(Batch(Stage.FRAME, fresh), exc)
            return
        finally:
            elapsed = time.perf_counter() - started - sum(between)
            self.scheduler.observe(stage, elapsed)
            self._count_batch(batch, elapsed)
        self._complete_finished(requests)
        self._complete_finished(fresh)

    @staticmethod
    def _frame_made(r: RequestState) -> None:
        r.frames_generated += 1
        # While its text is open a request's cap may still grow: it waits for text there instead.
        capped = r.frames_generated >= r.max_frames and not r.text_open
        r.phase = Phase.FINISHED if capped else Phase.NEED_DECODE

    def _prefill(self, batch: Batch) -> bool:
        """Run a prefill batch; returns whether it ran (a failed one fails its requests, not the engine)."""
        requests = batch.requests
        post = _POST[Stage.PREFILL]
        resumed = [r.arrival for r in requests if r.resume is not None]
        if resumed:
            # With the runner's own line on the call: how long the resumes' gathering took (a failover's pause
            # is the link's share, this, then the call's).
            now = self.clock()
            log.info("resuming %d requests: they arrived over %.1f ms, the first %.1f ms before their prefill",
                     len(resumed), 1000 * (max(resumed) - min(resumed)), 1000 * (now - min(resumed)))
        started = self._enter(_RUNNER[Stage.PREFILL])
        try:
            eos = self.runner.prefill(requests)
            self._enter(post)
            for r in requests:
                r.phase = Phase.NEED_CODE_PREDICT
            if eos is not None:  # a resumed request may sample EOS right after its delivered frames
                for r, stop in zip(requests, eos):
                    if stop:
                        r.phase = Phase.FINISHED
        except Exception as exc:
            self._enter(post)
            self._fail_batch(batch, exc)
            return False
        finally:
            elapsed = time.perf_counter() - started
            self.scheduler.observe(Stage.PREFILL, elapsed)
            self._count_batch(batch, elapsed)
        self._complete_finished(requests)
        return True

    def _prefill_between(self, frame: Batch, now: float | None, seconds: list[float]) -> list[RequestState]:
        """Called by the runner between a frame's Talker step and its predictor (ModelRunner.frame's `admit`):
        take in what was submitted meanwhile, prefill the fresh arrivals the scheduler admits now
        (Scheduler.decide_between), and hand back those whose predictor joins this frame's. Their prefill is
        a batch of its own in the counters; its thread time goes to `seconds`, not to the frame's cost."""
        started = self._enter(_SCHEDULE)
        self._take_submissions()
        room = self.scheduler.config.max_batch[Stage.FRAME] - len(frame.requests)
        urgent = frame.rule in ("urgent_codec", "urgent_generation")
        cpu = time.thread_time()
        batch = self.scheduler.decide_between(self._now(now), room, urgent)
        self._count_decide(time.thread_time() - cpu)
        prefilled: list[RequestState] = []
        if batch is not None and self._prefill(batch):
            prefilled = [r for r in batch.requests if r.phase is Phase.NEED_CODE_PREDICT and not r.done]
        seconds.append(self._enter(_RUNNER[Stage.FRAME]) - started)
        return prefilled

    def _fail_batch(self, batch: Batch, exc: Exception) -> None:
        log.exception("%s batch failed", batch.stage.name)
        for r in batch.requests:
            if not r.done:
                self.stats.failed += 1
                self._finish(r, SynthesisError(f"synthesis failed in {batch.stage.name.lower()}: {exc}"))

    def _complete_finished(self, requests: list[RequestState]) -> None:
        for r in requests:
            if r.phase is Phase.FINISHED and r.pending_frames == 0 and not r.done:
                self.stats.completed += 1
                self._finish(r, None)

    # ---- the codec: launched, then collected a few steps later ------------------------------------------
    def _launch_codec(self, batch: Batch) -> None:
        """Hand a codec batch to the runner and go on; `_collect_codec` finishes it. A runner that decodes
        synchronously (CPU, or codec_stream off) has the audio ready at once, and it is collected right here,
        exactly as a synchronous codec call was handled."""
        started = self._enter(_RUNNER[Stage.CODEC])
        lane = self._lane_shape is not None and batch.first_chunk_lane
        if not self._codec_busy():
            self._codec_since = started
        try:
            if lane:
                handle = self.runner.codec_launch(batch.requests, batch.frames, lane=True)
            else:
                handle = self.runner.codec_launch(batch.requests, batch.frames)
        except Exception as exc:
            if not self._codec_busy():
                self._codec_since = None
            self._enter(_POST[Stage.CODEC])
            self._fail_batch(batch, exc)
            elapsed = time.perf_counter() - started
            self.scheduler.observe(Stage.CODEC, elapsed)
            self._count_batch(batch, elapsed)
            return
        self._count_batch(batch, time.perf_counter() - started)
        for r in batch.requests:
            r.codec_busy = True
        flight = _CodecInFlight(batch, handle, started)
        if lane:
            with self._stats_lock:
                self.stats.codec_lane_batches += 1
            self._lane = flight
            self._collect_codec(block=False, lane=True)
            return
        self._codecs.append(flight)
        # A runner that decodes synchronously has the audio at once; collected in launch order.
        while self._codecs and self._collect_codec(block=False):
            pass

    def _codec_busy(self) -> bool:
        return bool(self._codecs) or self._lane is not None

    def _collect_codec(self, block: bool, lane: bool = False) -> bool:
        """Take the oldest in-flight codec batch's audio (`lane`: the first-chunk lane's batch) if the device
        has finished it (or wait for it): emit the PCM, advance frames_decoded and chunks_decoded, finish
        requests that are done, and free the slots of requests that left while the batch was in flight.
        Returns whether it was collected."""
        flight = self._lane if lane else self._codecs[0]
        stage = Stage.CODEC
        started = self._enter(_RUNNER[stage])
        batch, requests = flight.batch, flight.batch.requests
        try:
            pieces = self.runner.codec_wait(flight.handle) if block else self.runner.codec_collect(flight.handle)
        except Exception as exc:
            self._drop_flight(lane)
            for r in requests:
                r.codec_busy = False
            self._enter(_POST[stage])
            self._fail_batch(batch, exc)
            self._release_slots(requests)
            self._codec_done(flight, started)
            return True
        if pieces is None:
            self._add_busy(time.perf_counter() - started)
            return False
        self._drop_flight(lane)
        for r in requests:
            r.codec_busy = False
        self._enter(_POST[stage])
        codes = flight.handle.codes or itertools.repeat(b"")
        for r, pcm, frame_codes in zip(requests, pieces, codes):
            if r.done:  # cancelled or failed while in flight; its slot is freed below
                continue
            r.frames_decoded += batch.frames
            self._emit(r, pcm, frame_codes)
            if r.playing:  # a chunk that was all leading silence does not use up a small first size
                r.chunks_decoded += 1
            self.scheduler.changed(r)
        self._release_slots(requests)
        self._complete_finished(requests)
        self._codec_done(flight, started)
        return True

    def _drop_flight(self, lane: bool) -> None:
        if lane:
            self._lane = None
        else:
            self._codecs.popleft()

    def _release_slots(self, requests: list[RequestState]) -> None:
        """Free the slots `_finish` kept for a codec batch that has now been collected."""
        for r in requests:
            if r.done and r.slot is not None:
                self._release_slot(r)

    def _codec_done(self, flight: _CodecInFlight, collect_started: float) -> None:
        finished = time.perf_counter()
        # The scheduler plans with the time from launch to audio (rule 2), which is what a stream waits.
        self.scheduler.observe(Stage.CODEC, finished - flight.launched)
        device_s = flight.handle.device_s
        with self._stats_lock:
            stats = self.stats
            stats.busy_s += finished - collect_started
            stats.codec_collected += 1
            # The wall time the codec had work: batches in flight together count once.
            stats.codec_in_flight_s += finished - max(self._codec_since or flight.launched, flight.launched)
            self._codec_since = finished if self._codec_busy() else None
            if device_s is not None:
                stats.codec_timed += 1
                stats.codec_device_s += device_s

    # ---- statistics -----------------------------------------------------------------------------------
    def _enter(self, section: str) -> float:
        """The engine thread moves to `section`: the time since the last boundary goes to the section it
        leaves. Returns the boundary's perf_counter."""
        now = time.perf_counter()
        with self._stats_lock:
            seconds = self.stats.seconds
            seconds[self._section] = seconds.get(self._section, 0.0) + (now - self._section_started)
            self._section = section
            self._section_started = now
        return now

    def _add_busy(self, seconds: float) -> None:
        with self._stats_lock:
            self.stats.busy_s += seconds

    def _count_batch(self, batch: Batch, elapsed: float) -> None:
        """A decision was made and its batch run (a codec batch: launched), taking `elapsed` thread seconds."""
        name, size = batch.stage.name, len(batch.requests)
        stats = self.stats
        with self._stats_lock:
            stats.busy_s += elapsed
            stats.decisions += 1
            stats.batches[name] += 1
            stats.items[name] += size
            sizes = stats.batch_sizes[name]
            sizes[size] = sizes.get(size, 0) + 1
            if batch.stage is Stage.CODEC:
                stats.codec_frames[batch.frames] = stats.codec_frames.get(batch.frames, 0) + 1
            by_stage = stats.rules.setdefault(batch.rule, {})
            by_stage[name] = by_stage.get(name, 0) + 1

    def stats_snapshot(self) -> dict:
        """The counters and the engine thread's wall seconds per section up to now (the open section
        included), as plain data; two snapshots subtract key by key into the activity between them.
        Safe to call from any thread."""
        with self._stats_lock:
            now = time.perf_counter()
            stats = self.stats
            seconds = dict(stats.seconds)
            seconds[self._section] = seconds.get(self._section, 0.0) + (now - self._section_started)
            waiting = list(self._text_waiting.values())
            clock_now = self.clock()
            return {
                "time_s": now,
                "decisions": stats.decisions,
                "decide_calls": stats.decide_calls,
                "decide_cpu_s": stats.decide_cpu_s,
                "completed": stats.completed,
                "cancelled": stats.cancelled,
                "failed": stats.failed,
                "idle_waits": stats.idle_waits,
                "busy_s": stats.busy_s,
                "late_chunks": stats.late_chunks,
                "late_s": stats.late_s,
                "trimmed": {"requests": stats.trimmed_requests, "seconds": stats.trimmed_s},
                "first_chunks": dict(zip((*map(str, FIRST_CHUNK_BUCKETS_S), "+Inf"), stats.first_chunk_counts)),
                "text": {
                    "waits": stats.text_waits,
                    # Open waits count up to now, as the open section's seconds do.
                    "wait_s": stats.text_wait_s + sum(clock_now - since for since in waiting),
                    "gaps": stats.text_gaps,
                    "gap_s": stats.text_gap_s,
                    "waiting": len(waiting),
                },
                "stages": {
                    s.name: {
                        "batches": stats.batches[s.name],
                        "items": stats.items[s.name],
                        "batch_sizes": dict(stats.batch_sizes[s.name]),
                        "runner_s": seconds.get(_RUNNER[s], 0.0),
                        "post_s": seconds.get(_POST[s], 0.0),
                    }
                    for s in Stage
                },
                "codec_frames": dict(stats.codec_frames),
                "codec": {
                    "collected": stats.codec_collected,
                    "in_flight_s": stats.codec_in_flight_s + (
                        now - self._codec_since if self._codec_since is not None else 0.0),
                    "device_s": stats.codec_device_s,
                    "timed": stats.codec_timed,
                    "lane_batches": stats.codec_lane_batches,
                },
                "rules": {rule: dict(by_stage) for rule, by_stage in stats.rules.items()},
                "schedule_s": seconds.get(_SCHEDULE, 0.0),
                "idle_s": seconds.get(_IDLE, 0.0),
                "outside_step_s": seconds.get(_OUTSIDE, 0.0),
                "startup_s": seconds.get(_STARTUP, 0.0),
                # Gauges read across threads without the scheduler's owner: each is one int read, so at
                # worst a moment old.
                "streams": len(self._streams),
                "slots_in_use": self.scheduler.active,
                "slots": self.config.scheduler.max_active,
            }

    def _emit(self, request: RequestState, pcm: np.ndarray, codes: bytes) -> None:
        trimmer = self._trimmers.get(request.request_id)
        if trimmer is not None and not trimmer.started:
            pcm = trimmer.push(pcm)
            if trimmer.started:
                self._count_trimmed(request, trimmer)
        self._send_audio(request, pcm, codes)

    def _count_trimmed(self, request: RequestState, trimmer: LeadingSilenceTrimmer) -> None:
        """The trimmer found its onset (or the stream ended first): what it dropped is final."""
        if trimmer.trimmed_samples:
            with self._stats_lock:
                self.stats.trimmed_requests += 1
                self.stats.trimmed_s += trimmer.trimmed_samples / request.sample_rate

    def _send_audio(self, request: RequestState, pcm: np.ndarray, codes: bytes = b"") -> None:
        """Ship `pcm` with `codes`, the codes of the frames decoded since the last shipment. A chunk's codes
        never name audio not yet shipped: while the trimmer holds (or drops) a chunk's audio, its codes wait
        with the request and go with the next audio that ships, or with the end (_finish)."""
        if pcm.size == 0:
            if codes:
                request.held_codes += codes
            return
        if request.held_codes:
            codes, request.held_codes = request.held_codes + codes, b""
        data = (np.clip(pcm, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()
        now = self.clock()
        if request.playback_start is None:
            request.playback_start = now
            with self._stats_lock:
                self.stats.first_chunk_counts[bisect.bisect_left(FIRST_CHUNK_BUCKETS_S, now - request.arrival)] += 1
            if request.resume is not None:
                # A failover's or hand-over's listener waits for this chunk: with the gathering line before the
                # resume call and the gateway's pause, it splits the pause between the engine and the links.
                log.info("resumed request %d shipped its first chunk %.1f ms after its arrival", request.request_id,
                         1000 * (now - request.arrival))
        else:
            late = now - (request.playback_start + request.output.emitted_samples / request.sample_rate)
            if late > 0:
                with self._stats_lock:
                    if request.text_waited:
                        # The listener ran out while the stream waited for text: the caller's silence. Its
                        # playback starts again now, as the first chunk's did, so the stream is not treated
                        # as late (urgent) for ever after.
                        self.stats.text_gaps += 1
                        self.stats.text_gap_s += late
                        request.playback_start += late
                    else:
                        self.stats.late_chunks += 1
                        self.stats.late_s += late
        request.text_waited = request.text_wait_since is not None
        request.output.emitted_samples += len(data) // 2
        stream = self._streams.get(request.request_id)
        if stream is not None:
            stream._deliver((data, codes))

    def _finish(self, request: RequestState, error: BaseException | None) -> None:
        """Done, failed or cancelled: end the consumer's stream and free the slot, at once unless the
        in-flight codec batch covers it. That batch still reads and writes the slot's codec state on the
        device, and a new request's prefill resets that state on the main stream; freeing the slot only
        after the batch is collected (the host saw it complete) orders the two without a stream wait."""
        if request.done:
            return
        request.done = True
        self.scheduler.changed(request)
        if request.text_wait_since is not None:
            self._end_text_wait(request)
        trimmer = self._trimmers.pop(request.request_id, None)
        if error is None and not request.cancelled and trimmer is not None and not trimmer.started:
            self._send_audio(request, trimmer.flush())
            self._count_trimmed(request, trimmer)
        if not request.codec_busy:
            self._release_slot(request)
        stream = self._streams.pop(request.request_id, None)
        if stream is not None and not request.cancelled:
            if error is None and request.held_codes:  # frames whose audio was all trimmed: the end carries them
                stream._deliver((b"", request.held_codes))
            stream._deliver(error if error is not None else _END)

    def _release_slot(self, request: RequestState) -> None:
        if request.slot is not None:
            try:
                self.runner.release(request)
            except Exception:  # noqa: BLE001 - releasing must never take the engine down
                log.exception("runner release failed")
        self.scheduler.remove(request)

    def _fail_all(self, error: BaseException) -> None:
        self._drain_commands()
        for request in self.scheduler.requests:
            self._finish(request, error)
        for stream in list(self._streams.values()):
            stream._deliver(error)
        self._streams.clear()
