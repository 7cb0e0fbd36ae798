"""The scheduler keeps readiness between decisions (`_Readiness`) instead of a pass over every slot holder per
decision; that must change no decision. Each test runs one workload twice, once under the scheduler as it was
(tests/scheduler_reference.py) and once under the current one, and compares every decision: stage, requests in
order, codec frames and rule, and the clock and codec state it was asked at.

- the real engine with the scripted runner (tests/engine_fixtures.py) under random workloads: arrivals, chunk
  schedules, text pushed while it is spoken (streams waiting for text), cancels, consumers that stop reading
  (back-pressure), an asynchronous codec one or two batches deep, and a clock that jumps so that every urgency
  rule takes part;
- bench/engine_sim.py's loaded engine (128 slots, Poisson arrivals, the agent workload's word-by-word text),
  without host time, so that a run is deterministic.
"""

from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace

import pytest

from tests import scheduler_reference
from tests.engine_fixtures import ManualClock, Script, ScriptedRunnerTestDouble
from tts_backend.engine import engine as engine_module
from tts_backend.engine import scheduler as current
from tts_backend.engine.engine import Engine, EngineConfig
from tts_backend.engine.request import Stage


def recording(base: type) -> type:
    """`base` with every decision written to the class's `log`."""

    class Recording(base):
        log: list = []

        def decide(self, now, codec_in_flight=False):
            batch = super().decide(now, codec_in_flight)
            self.log.append((now, codec_in_flight) if batch is None else (
                now, codec_in_flight, batch.stage, [r.request_id for r in batch.requests], batch.frames,
                batch.rule))
            return batch

        if not hasattr(base, "changed"):
            def changed(self, request):  # the reference re-reads every holder at every decision
                pass

        if not hasattr(base, "decide_between"):
            def decide_between(self, now, room, urgent=False):  # the reference admits between frames only
                return None

    Recording.log = []
    return Recording


def decisions_under(base: type, monkeypatch, workload) -> list:
    scheduler_class = recording(base)
    with monkeypatch.context() as patch:
        patch.setattr(engine_module, "Scheduler", scheduler_class)
        workload()
    return scheduler_class.log


def scripted_workload(seed: int):
    """A random workload through the real engine, driven step by step with a manual clock that the engine's
    batch timings (Scheduler.observe) read too."""

    def run() -> None:
        rng = random.Random(seed)
        clock = ManualClock()
        max_active = rng.choice((3, 6, 12))
        codec_depth = rng.choice((1, 2))
        runner = ScriptedRunnerTestDouble(max_slots=max_active, codec_polls=rng.choice((0, 2, 5)),
                                          codec_depth=codec_depth)
        batch_caps = {Stage.PREFILL: rng.choice((2, 8)), Stage.FRAME: rng.choice((4, max_active)),
                      Stage.CODEC: rng.choice((3, 16))}
        config = EngineConfig(scheduler=current.SchedulerConfig(
            max_active=max_active, max_batch=batch_caps, max_buffered_s=rng.choice((0.5, 10.0)),
            max_pending_frames=rng.choice((8, 48)), prefill_gather_streams=rng.choice((2, 24))))
        saved_time = engine_module.time
        engine_module.time = SimpleNamespace(perf_counter=clock, monotonic=clock, time=time.time, sleep=time.sleep,
                                             thread_time=time.thread_time)
        loop = asyncio.new_event_loop()
        try:
            engine = Engine(runner, config, clock=clock)
            engine.start_inline()
            streams, open_texts, readers = [], [], {}
            for step in range(1500):
                if rng.random() < 0.06 and len(streams) < 40:
                    text = rng.random() < 0.4
                    stream = engine.submit(Script(rng.randint(1, 60), rng.choice((0, 0, 3))), seed=1,
                                           max_frames=rng.choice((10_000, rng.randint(2, 40))),
                                           chunk_schedule=rng.choice((None, (2, 4, 8, 12), (3,), (1, 5))),
                                           loop=loop, text_tokens=rng.randint(0, 4) if text else None)
                    streams.append(stream)
                    readers[stream.request_id] = rng.random() < 0.8  # some stop reading for a while
                    if text:
                        open_texts.append(stream.request_id)
                for request_id in list(open_texts):
                    if rng.random() < 0.15:
                        final = rng.random() < 0.1
                        engine.push_text(request_id, ["w"] * rng.randint(1, 3), final=final,
                                         max_frames=rng.choice((None, rng.randint(5, 80))))
                        if final:
                            open_texts.remove(request_id)
                if streams and rng.random() < 0.01:
                    rng.choice(streams).cancel()
                for stream in streams:  # the consumers read what was delivered (or not)
                    if rng.random() < 0.05:
                        readers[stream.request_id] = not readers[stream.request_id]
                    while readers[stream.request_id] and not stream._queue.empty():
                        item = stream._queue.get_nowait()
                        if isinstance(item, tuple):
                            stream._output.consumed_samples += len(item[0]) // 2
                clock.advance(rng.choice((0.0, 0.002, 0.005, 0.02)) if rng.random() < 0.97
                              else rng.uniform(0.2, 3.0))
                engine.step()
            assert runner.violations == []
        finally:
            engine_module.time = saved_time
            loop.close()

    return run


@pytest.mark.parametrize("seed", range(12))
def test_random_engine_workloads_decide_as_the_reference(monkeypatch, seed):
    workload = scripted_workload(seed)
    reference = decisions_under(scheduler_reference.Scheduler, monkeypatch, workload)
    now = decisions_under(current.Scheduler, monkeypatch, workload)
    rules = {d[5] for d in reference if len(d) > 2}
    assert len(reference) > 500 and len(rules) >= 3, rules  # the workload reached several rules
    for i, (expected, got) in enumerate(zip(reference, now)):
        assert got == expected, f"decision {i} differs"
    assert len(now) == len(reference)


@pytest.mark.parametrize("agent", [False, True], ids=["arrivals", "agent-text"])
def test_the_simulated_loaded_engine_decides_as_the_reference(monkeypatch, agent):
    pytest.importorskip("torch")  # the simulator's runner module imports torch
    from bench.engine_sim import SimOptions, run_rate

    # Mid-frame admission (Scheduler.decide_between) is policy the reference never had: off in both runs.
    options = SimOptions(warmup=2.0, duration=6.0, seed=3, host_factor=0.0,
                         agent_sentences=3 if agent else 0, scheduler=[("admit_mid_frame", False)])
    rate = 10.0 if agent else 60.0

    def workload() -> None:
        run_rate(rate, options)

    reference = decisions_under(scheduler_reference.Scheduler, monkeypatch, workload)
    now = decisions_under(current.Scheduler, monkeypatch, workload)
    frames = [len(d[3]) for d in reference if len(d) > 2 and d[2] is Stage.FRAME]
    assert len(reference) > 1500 and max(frames) >= 24  # loaded: dozens of streams in a step
    for i, (expected, got) in enumerate(zip(reference, now)):
        assert got == expected, f"decision {i} differs"
    assert len(now) == len(reference)
