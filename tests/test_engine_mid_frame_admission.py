"""Arrivals admitted inside a frame (issue 29): the engine takes in what was submitted while a frame's Talker
step ran, prefills the fresh arrivals there, and their predictor runs in that frame's, so their first frame
comes one frame sooner than if the next frame had been decided without them.

With the scripted runner: the calls, what is and is not taken in mid-frame (a cancel or text waits for the next
turn), the scheduler's holds (gathering under load, an urgent frame, no room), a failed prefill. With the real
Qwen3 runner on the tiny checkpoint: a request admitted mid-frame speaks its own generation."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests import engine_fixtures
from tests.engine_fixtures import SPF, collect, run_until_idle, submit
from tests.qwen3_fixtures import tiny_custom_voice  # noqa: F401 - session fixture
from tts_backend.base import SynthesisError, SynthesisRequest
from tts_backend.engine.engine import Engine
from tts_backend.engine.request import Phase, RequestState, Stage
from tts_backend.engine.scheduler import Scheduler, SchedulerConfig


class Arrivals:
    """Submits requests "during" the next Talker step of the scripted runner (its on_talker_step hook)."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.pending: list = []  # callables run at the next Talker step
        self.streams: list = []

    def during_next_talker_step(self, action) -> None:
        self.pending.append(action)

    def __call__(self) -> None:
        actions, self.pending = self.pending, []
        for action in actions:
            self.streams.append(action(self.engine))


def make_engine(max_active=4, admits_between=True, **sched):
    arrivals = Arrivals()
    engine, runner, _ = engine_fixtures.make_engine(max_active=max_active, admits_between=admits_between,
                                                    on_talker_step=arrivals, **sched)
    arrivals.engine = engine
    return engine, runner, arrivals


def start_playing(engine, runner, frames=40):
    """One stream A, prefilled and through its first frame; the runner's calls cleared."""
    a = submit(engine, frames)
    engine.step()  # prefill
    engine.step()  # its first frame (predictor only)
    runner.calls.clear()
    return a


async def test_an_arrival_during_the_talker_step_joins_that_frames_predictor():
    engine, runner, arrivals = make_engine()
    a = start_playing(engine, runner)
    arrivals.during_next_talker_step(lambda e: submit(e, 6))
    batch = engine.step()
    (b,) = arrivals.streams
    assert batch.stage is Stage.FRAME and [r.request_id for r in batch.requests] == [a.request_id]
    assert runner.calls == [("frame", [a.request_id], 0), ("prefill", [b.request_id], 0),
                            ("predict", [a.request_id, b.request_id], 0)]
    req_b = engine.scheduler.get(b.request_id)
    assert req_b.frames_generated == 1 and req_b.phase is Phase.NEED_DECODE  # its first frame is made
    assert engine.stats.rules["between"] == {"PREFILL": 1} and engine.stats.batches["PREFILL"] == 2
    run_until_idle(engine)
    # Its Talker stepped for frames 2..6 and once more to sample EOS: the first frame was the predictor's alone.
    assert runner.talker_steps[b.request_id] == 6
    assert len(await collect(b)) == 6 * SPF * 2 and len(await collect(a)) == 40 * SPF * 2
    assert not runner.violations


async def test_without_it_the_arrival_waits_for_the_next_decision():
    for engine, runner, arrivals in (make_engine(admits_between=False), make_engine(admit_mid_frame=False)):
        a = start_playing(engine, runner)
        arrivals.during_next_talker_step(lambda e: submit(e, 6))
        engine.step()
        (b,) = arrivals.streams
        request = engine.scheduler.get(b.request_id)
        if runner.admits_between:  # taken in mid-frame, not prefilled there
            assert [c[0] for c in runner.calls] == ["frame", "predict"] and request.phase is Phase.NEED_PREFILL
        else:  # a runner that never calls admit: taken in at the next turn, as before
            assert [c[0] for c in runner.calls] == ["frame"] and request is None
        batch = engine.step()
        while batch.stage is Stage.CODEC:  # A's first chunk outranks it (rule 3's stage order)
            batch = engine.step()
        assert batch.stage is Stage.PREFILL and batch.rule == "startup"  # a frame later than mid-frame
        run_until_idle(engine)
        assert len(await collect(b)) == 6 * SPF * 2 and len(await collect(a)) == 40 * SPF * 2


async def test_mid_frame_only_submissions_are_taken_cancels_and_texts_wait_their_turn():
    engine, runner, arrivals = make_engine()
    a = start_playing(engine, runner)

    def cancel_a_then_submit(e):
        a.cancel()  # queued before the submit, applied at the next turn: A's frame is not changed under it
        return submit(e, 4)

    arrivals.during_next_talker_step(cancel_a_then_submit)
    engine.step()
    (b,) = arrivals.streams
    assert runner.calls[-1] == ("predict", [a.request_id, b.request_id], 0)
    assert engine.scheduler.get(a.request_id) is not None and a.request_id not in runner.released
    engine.step()  # the next turn takes the cancel
    assert engine.scheduler.get(a.request_id) is None and a.request_id in runner.released
    run_until_idle(engine)
    assert len(await collect(b)) == 4 * SPF * 2
    assert engine.stats.cancelled == 1 and not runner.violations


async def test_a_failed_mid_frame_prefill_fails_its_requests_and_not_the_frame():
    engine, runner, arrivals = make_engine()
    a = start_playing(engine, runner, frames=8)
    real_prefill = runner.prefill

    def failing_prefill(requests):
        if any(r.request_id != a.request_id for r in requests):
            raise RuntimeError("device fault")
        return real_prefill(requests)

    runner.prefill = failing_prefill
    arrivals.during_next_talker_step(lambda e: submit(e, 4))
    engine.step()
    (b,) = arrivals.streams
    assert runner.calls[-1] == ("predict", [a.request_id], 0)
    with pytest.raises(SynthesisError, match="prefill"):
        await collect(b)
    run_until_idle(engine)
    assert len(await collect(a)) == 8 * SPF * 2
    assert engine.stats.failed == 1


def fresh_request(request_id, arrival):
    return RequestState(request_id=request_id, prompt=None, seed=1, max_frames=100, chunk_schedule=(2, 4, 8, 12),
                        arrival=arrival, sample_rate=24000, samples_per_frame=SPF)


def test_decide_between_admits_fresh_arrivals_first_come_within_the_room():
    scheduler = Scheduler(SchedulerConfig(max_active=8, prefill_gather_s=0.0))
    requests = [fresh_request(i, 100.0 + i / 1000) for i in range(5)]
    for r in requests:
        scheduler.add(r)
    batch = scheduler.decide_between(now=100.01, room=3)
    assert batch.stage is Stage.PREFILL and batch.rule == "between" and batch.requests == requests[:3]
    assert scheduler.decide_between(now=100.01, room=0) is None  # the predictor's batch is full
    assert scheduler.decide_between(now=100.01, room=8, urgent=True) is None  # a stream about to run dry waits
    for r in requests[:3]:
        r.phase = Phase.NEED_CODE_PREDICT  # the engine ran the prefill
    assert scheduler.decide_between(now=100.01, room=8).requests == requests[3:]
    requests[3].cancelled = True
    assert scheduler.decide_between(now=100.01, room=8).requests == requests[4:]
    off = Scheduler(SchedulerConfig(max_active=8, admit_mid_frame=False))
    off.add(fresh_request(9, 100.0))
    assert off.decide_between(now=100.01, room=8) is None


def test_decide_between_gathers_company_under_load_as_decide_does():
    scheduler = Scheduler(SchedulerConfig(max_active=16, prefill_gather_s=0.010, prefill_gather_streams=4))
    stepping = [fresh_request(i, 99.0) for i in range(6)]
    for r in stepping:
        scheduler.add(r)
        r.phase = Phase.NEED_DECODE
        scheduler.changed(r)
    scheduler.decide(now=99.5)  # reads them: 6 streams can step
    arrival = fresh_request(50, 100.0)
    scheduler.add(arrival)
    assert scheduler.decide_between(now=100.002, room=10) is None  # 2 ms old: waits for company
    assert scheduler.decide_between(now=100.011, room=10).requests == [arrival]


async def test_the_qwen3_runner_admits_mid_frame_and_the_arrival_speaks_its_own_generation(tiny_custom_voice):
    from tests.test_engine_qwen3 import assert_same_audio, audio_of, reference_audio, started

    # Without quick start: with it the first request's listener holds a single frame of audio early on, so the
    # frame held here can be an urgent one, and urgent frames admit nothing mid-frame (no "between" rule fired).
    backend = await started(tiny_custom_voice, greedy=True, trim_leading_silence=False, quick_start_below=0)
    engine = backend.engine
    runner = engine.runner
    in_talker, submitted = threading.Event(), threading.Event()
    real_decode, real_submit = runner.decode, engine.submit
    hold = {"armed": False}

    def decode(requests):  # the engine thread, inside a frame's Talker step
        if hold["armed"]:
            hold["armed"] = False
            in_talker.set()
            assert submitted.wait(30), "the second request was never submitted"
        return real_decode(requests)

    def submit(*args, **kwargs):
        stream = real_submit(*args, **kwargs)
        if in_talker.is_set():
            submitted.set()
        return stream

    runner.decode, engine.submit = decode, submit
    try:
        first = SynthesisRequest(text="Hello world, this is a small test.", voice="ryan", seed=3, max_new_tokens=24)
        second = SynthesisRequest(text="And a second voice joins.", voice="vivian", seed=4, max_new_tokens=16)
        hold["armed"] = True
        task_a = asyncio.create_task(audio_of(backend, first))
        await asyncio.to_thread(in_talker.wait, 30)
        got_b = await audio_of(backend, second)
        got_a = await task_a
        assert engine.stats.rules.get("between") == {"PREFILL": 1}
        assert_same_audio(got_a, reference_audio(backend.model, first, greedy=True)[1])
        assert_same_audio(got_b, reference_audio(backend.model, second, greedy=True)[1])
    finally:
        runner.decode, engine.submit = real_decode, real_submit
        await backend.stop()
