"""The engine's profiling counters (EngineStats, Engine.stats_snapshot) against what the runner test double saw.

The scripted runner records every call, so the batch-size histograms, codec frame counts and per-rule counts
can be checked against an independent record; its step delay gives the runner sections a known lower bound.
"""

from __future__ import annotations

import asyncio
import collections
import time

import pytest

from tests.engine_fixtures import ManualClock, Script, ScriptedRunnerTestDouble
from tts_backend.engine.engine import Engine, EngineConfig
from tts_backend.engine.request import Stage
from tts_backend.engine.scheduler import SchedulerConfig

STAGE_OF_CALL = {"prefill": "PREFILL", "frame": "FRAME", "codec": "CODEC"}


def seconds_total(snapshot: dict) -> float:
    stages = snapshot["stages"].values()
    return (sum(s["runner_s"] + s["post_s"] for s in stages) + snapshot["schedule_s"] + snapshot["idle_s"]
            + snapshot["outside_step_s"] + snapshot["startup_s"])


@pytest.mark.parametrize("codec_polls", [0, 3])
async def test_histograms_and_rules_match_the_runners_calls(codec_polls):
    runner = ScriptedRunnerTestDouble(max_slots=4, step_delay_s=0.002, codec_polls=codec_polls)
    config = EngineConfig(scheduler=SchedulerConfig(
        max_active=4, max_batch={Stage.PREFILL: 2, Stage.FRAME: 3, Stage.CODEC: 2}))
    engine = Engine(runner, config, clock=ManualClock())
    engine.start_inline()
    before = engine.stats_snapshot()
    streams = [engine.submit(Script(frames), seed=1, max_frames=10_000) for frames in (3, 7, 11, 16, 5)]
    rules: collections.Counter = collections.Counter()
    while (batch := engine.step()) is not None:
        rules[(batch.rule, batch.stage.name)] += 1
    after = engine.stats_snapshot()
    for s in streams:
        assert b"".join([c async for c in s])

    sizes = collections.defaultdict(collections.Counter)
    frames = collections.Counter()
    for stage, ids, codec_frames in runner.calls:
        sizes[STAGE_OF_CALL[stage]][len(ids)] += 1
        if stage == "codec":
            frames[codec_frames] += 1
    # Several batch sizes and codec frame counts occur, so a histogram keyed wrongly would not match.
    assert len(sizes["FRAME"]) > 1 and len(frames) > 1
    for name, stage in after["stages"].items():
        assert stage["batch_sizes"] == dict(sizes[name])
        assert stage["batches"] == sum(sizes[name].values())
        assert stage["items"] == sum(size * n for size, n in sizes[name].items())
    assert after["codec_frames"] == dict(frames)
    assert {(rule, stage): n for rule, by_stage in after["rules"].items() for stage, n in by_stage.items()} \
        == dict(rules)
    assert after["decisions"] == len(runner.calls) == sum(rules.values())
    assert after["completed"] == 5
    # Every codec batch was collected; launch to collect is at least the launch's 2 ms, and with polls the
    # batch stayed in flight across generation batches. The double measures no device time.
    codec = after["codec"]
    assert codec["collected"] == after["stages"]["CODEC"]["batches"] == frames.total()
    assert codec["in_flight_s"] >= 0.002 * codec["collected"] * 0.99
    assert codec["timed"] == 0 and codec["device_s"] == 0.0
    assert (runner.codec_polled_early > 0) == (codec_polls > 0)

    # Wall-time sections: the runner double sleeps 2 ms per call, so each stage's runner seconds are at
    # least that many calls' worth; every moment between the snapshots is in exactly one section.
    for name, stage in after["stages"].items():
        assert stage["runner_s"] - before["stages"][name]["runner_s"] >= 0.002 * stage["batches"] * 0.99
    wall = after["time_s"] - before["time_s"]
    assert seconds_total(after) - seconds_total(before) == pytest.approx(wall, rel=1e-6)
    assert after["idle_s"] == 0.0  # inline: nobody waits on the wake event


async def test_engine_thread_idle_time_and_open_section_are_counted():
    engine = Engine(ScriptedRunnerTestDouble(max_slots=2, step_delay_s=0.01),
                    EngineConfig(scheduler=SchedulerConfig(max_active=2)))
    engine.start()
    engine.wait_ready(5)
    try:
        before = engine.stats_snapshot()
        await asyncio.sleep(0.3)
        idle = engine.stats_snapshot()
        # Nothing submitted: the thread was (almost) only waiting, and the wait still open at the snapshot
        # is counted up to the snapshot rather than at its end.
        assert idle["idle_s"] - before["idle_s"] == pytest.approx(idle["time_s"] - before["time_s"], rel=0.05)
        assert idle["idle_waits"] > before["idle_waits"]

        stream = engine.submit(Script(6), seed=1, max_frames=100)
        started = time.perf_counter()
        audio = b"".join([c async for c in stream])
        busy = time.perf_counter() - started
        after = engine.stats_snapshot()
        assert audio
        runner_s = sum(s["runner_s"] for s in after["stages"].values()) - \
            sum(s["runner_s"] for s in idle["stages"].values())
        assert runner_s >= 0.01 * (after["decisions"] - idle["decisions"]) * 0.99
        assert runner_s <= busy
        assert seconds_total(after) - seconds_total(before) == pytest.approx(after["time_s"] - before["time_s"],
                                                                             rel=1e-6)
    finally:
        engine.stop()


async def test_first_chunks_are_counted_by_their_latency_from_arrival():
    """Each request's first chunk lands in the bucket of its arrival-to-shipment time on the engine's clock, and
    the exported family is cumulative per bound, as a Prometheus histogram's buckets; later chunks do not count."""
    from tests.engine_fixtures import collect, make_engine, run_until_idle, submit
    from tts_backend.engine.metrics import engine_metrics

    engine, _, clock = make_engine()
    waited = submit(engine, frames=20)
    clock.advance(0.032)  # arrived 32 ms before the engine first steps
    run_until_idle(engine)
    prompt = submit(engine, frames=20)
    run_until_idle(engine)
    assert len(await collect(waited)) > 0 and len(await collect(prompt)) > 0
    counts = engine.stats_snapshot()["first_chunks"]
    assert counts["0.035"] == 1 and counts["0.005"] == 1 and sum(counts.values()) == 2
    exported = {le: value for (le,), value in
                {m.name: dict(m.samples) for m in engine_metrics(engine.stats_snapshot())}["engine_first_chunks"].items()}
    assert exported["0.005"] == 1 and exported["0.03"] == 1 and exported["0.035"] == 2 and exported["+Inf"] == 2


async def test_uncaptured_passes_are_exported_by_kind_only_where_the_runner_captures():
    """The runner's passes that found no captured graph (GraphSet.uncaptured) as a counter by kind on the
    gateway's /metrics, read back as bench/engine_load.py reads it; a runner without graphs (None) exports no
    family."""
    from prometheus_client.parser import text_string_to_metric_families

    from bench.engine_load import engine_breakdown
    from gateway.metrics import GatewayMetrics
    from tests.engine_fixtures import SPF, make_engine, run_until_idle, submit
    from tts_backend.engine.metrics import engine_metrics

    def scrape(engine, uncaptured: dict | None) -> dict:
        text = GatewayMetrics().render(engine_metrics(engine.stats_snapshot(), uncaptured=uncaptured)).decode()
        return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(text) for sample in family.samples}

    engine, _, _ = make_engine()
    assert not any(name.startswith("voxgate_engine_uncaptured") for name, _ in scrape(engine, None))
    before = scrape(engine, {"prefill_rest": 1})
    submit(engine, frames=8, silent_frames=2)
    run_until_idle(engine)  # the engine thread's seconds grow, so the breakdown has a window to divide by
    after = scrape(engine, {"prefill_rest": 4, "resume": 2})
    breakdown = engine_breakdown(before, after)
    assert breakdown["uncaptured"] == {"prefill_rest": 3, "resume": 2}
    # The leading silence it dropped, read the same way: one request, its two silent frames (and the part of
    # the first loud window's hop before the tone's first sample above the threshold, if any).
    trimmed = breakdown["trimmed"]
    assert trimmed["requests"] == 1 and 2 * SPF / 24 <= trimmed["ms_per_trimmed_request"] < 2 * SPF / 24 + 1
