"""Scheduler and engine-loop behaviour with a deterministic model-runner test double (no model, no device).

Most tests drive `Engine.step()` directly with a manual clock, so each decision is observable; the last
ones run the real engine thread and the asyncio bridge.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.engine_fixtures import (
    SPF,
    Script,
    ScriptedRunnerTestDouble,
    collect,
    make_engine,
    run_until,
    run_until_idle,
    run_with_moving_clock,
    submit,
)
from tts_backend.base import BackendOverloadedError, SynthesisError
from tts_backend.engine.engine import Engine, EngineConfig
from tts_backend.engine.request import Phase, Stage
from tts_backend.engine.scheduler import SchedulerConfig
from tts_backend.engine.silence import LeadingSilenceTrimmer, find_onset


async def test_one_request_follows_chunk_schedule_and_ends_at_eos():
    engine, runner, _ = make_engine()
    stream = submit(engine, frames=30)
    run_until_idle(engine)
    codec_frames = [c[2] for c in runner.calls if c[0] == "codec"]
    assert codec_frames == [2, 4, 8, 12, 4]  # grows, then the remainder once generation finished
    stages = runner.stages()
    assert stages[:2] == ["prefill", "frame"]
    # 30 frames, then a 31st whose Talker step samples EOS; the first frame only predicts (prefill sampled c0).
    assert stages.count("frame") == 31 and runner.talker_steps[stream.request_id] == 30
    audio = await collect(stream)
    assert len(audio) == 30 * SPF * 2
    assert runner.released == [stream.request_id]
    assert engine.scheduler.active == 0


async def test_frame_cap_and_per_request_schedule_override():
    engine, runner, _ = make_engine()
    stream = submit(engine, frames=100, max_frames=7, chunk_schedule=(3,))
    run_until_idle(engine)
    assert [c[2] for c in runner.calls if c[0] == "codec"] == [3, 3, 1]
    assert runner.talker_steps[stream.request_id] == 6
    assert len(await collect(stream)) == 7 * SPF * 2


async def test_compatible_work_is_batched_anchor_plus_fill():
    engine, runner, _ = make_engine()
    streams = [submit(engine, frames=5) for _ in range(3)]
    ids = [s.request_id for s in streams]
    first = engine.step()
    assert first.stage is Stage.PREFILL and [r.request_id for r in first.requests] == ids
    second = engine.step()
    assert second.stage is Stage.FRAME and len(second.requests) == 3
    run_until_idle(engine)
    # Codec calls batch requests that decode the same number of frames.
    codec_calls = [c for c in runner.calls if c[0] == "codec"]
    assert codec_calls[0][1] == ids and codec_calls[0][2] == 2
    for s in streams:
        assert len(await collect(s)) == 5 * SPF * 2


async def test_batch_cap_splits_work():
    engine, runner, _ = make_engine(max_active=6, max_batch={Stage.PREFILL: 2, Stage.FRAME: 4, Stage.CODEC: 3})
    streams = [submit(engine, frames=3) for _ in range(6)]
    run_until_idle(engine)
    for stage, ids, _ in runner.calls:
        assert len(ids) <= {"prefill": 2, "frame": 4, "codec": 3}[stage]
    assert sum(len(ids) for stage, ids, _ in runner.calls if stage == "prefill") == 6
    for s in streams:
        assert len(await collect(s)) == 3 * SPF * 2


async def test_new_request_outranks_playing_stream_with_slack():
    engine, runner, clock = make_engine()
    a = submit(engine, frames=200)
    engine.step()
    req_a = engine.scheduler.get(a.request_id)
    # A plays 2 s of audio ahead of its clock: lots of slack.
    run_until(engine, lambda: req_a.output.emitted_samples >= 26 * SPF)
    b = submit(engine, frames=5)
    batch = engine.step()
    assert batch.rule == "startup" and batch.stage is Stage.PREFILL
    assert [r.request_id for r in batch.requests] == [b.request_id]


async def test_late_codec_of_playing_stream_outranks_new_request():
    engine, runner, clock = make_engine()
    a = submit(engine, frames=200)
    engine.step()
    req_a = engine.scheduler.get(a.request_id)
    # Playing, with the next chunk's frames generated: its codec work is ready (schedule 2, 4, 8, 12, 12, ...).
    run_until(engine, lambda: req_a.playing and req_a.pending_frames >= (2, 4, 8, 12)[min(req_a.chunks_decoded, 3)])
    submit(engine, frames=5)
    clock.advance(10.0)  # A's audio has run out
    batch = engine.step()
    assert batch.rule == "urgent_codec" and batch.stage is Stage.CODEC
    assert [r.request_id for r in batch.requests] == [a.request_id]


async def test_pressing_then_round_robin():
    engine, runner, clock = make_engine()
    a = submit(engine, frames=400)
    engine.step()
    req_a = engine.scheduler.get(a.request_id)
    run_until(engine, lambda: req_a.playing)
    batch = engine.step()
    assert batch.rule == "pressing"  # 160 ms of audio: inside the 1 s lead
    run_until(engine, lambda: req_a.output.emitted_samples > 3 * 24000)  # 3 s ahead now
    rules = {engine.step().rule for _ in range(10)}
    assert rules == {"round_robin"}
    clock.advance(2.5)  # within 1 s of running out again
    assert engine.step().rule in ("pressing", "urgent_codec")


async def test_cancel_frees_the_slot_at_once():
    engine, runner, _ = make_engine(max_active=1)
    a = submit(engine, frames=50)
    b = submit(engine, frames=3)
    batch = engine.step()
    assert [r.request_id for r in batch.requests] == [a.request_id]
    assert engine.scheduler.get(b.request_id).phase is Phase.WAITING
    a.cancel()
    batch = engine.step()
    assert runner.released == [a.request_id]
    assert batch.stage is Stage.PREFILL and [r.request_id for r in batch.requests] == [b.request_id]
    assert engine.scheduler.get(a.request_id) is None
    run_until_idle(engine)
    assert len(await collect(b)) == 3 * SPF * 2
    assert [chunk async for chunk in a] == []  # a cancelled stream just ends
    assert engine.stats.cancelled == 1


async def test_overload_is_refused_with_a_clear_error():
    engine, _, _ = make_engine(max_active=1, max_queued=1)
    submit(engine, frames=3)
    submit(engine, frames=3)
    with pytest.raises(BackendOverloadedError):
        submit(engine, frames=3)


async def test_back_pressure_pauses_a_stream_whose_consumer_stopped_reading():
    engine, runner, _ = make_engine(max_buffered_s=0.5)
    a = submit(engine, frames=100)
    run_until_idle(engine)  # idles although A is not finished: its buffer is full
    req_a = engine.scheduler.get(a.request_id)
    assert req_a is not None and not req_a.done
    buffered = req_a.output.buffered_samples
    assert 0.5 * 24000 <= buffered <= 0.5 * 24000 + 12 * SPF
    total = 0
    finished = False
    for _ in range(10_000):  # read what is buffered, let the engine resume, repeat
        await asyncio.sleep(0)
        while not a._queue.empty():
            try:
                total += len(await a.__anext__())
            except StopAsyncIteration:
                finished = True
        if finished:
            break
        engine.step()
    assert finished and total == 100 * SPF * 2


async def test_leading_silence_is_not_shipped_ahead_of_speech():
    engine, runner, _ = make_engine()
    stream = submit(engine, frames=10, silent_frames=3)
    run_until_idle(engine)
    # The all-silent first chunk does not use up the small first size: the next chunk is small again.
    assert [c[2] for c in runner.calls if c[0] == "codec"] == [2, 2, 4, 2]
    audio = np.frombuffer(await collect(stream), "<i2").astype(np.float32) / 32767
    assert find_onset(audio, 24000) == 0  # the very first window is already audible
    assert 7 * SPF <= len(audio) <= 7 * SPF + 2  # no silence kept ahead of the tone
    # The engine counts what it dropped (voxgate_engine_trimmed_*): one request, its three silent frames.
    trimmed = engine.stats_snapshot()["trimmed"]
    assert trimmed["requests"] == 1
    assert trimmed["seconds"] * 24000 == pytest.approx(10 * SPF - len(audio), abs=1)
    loud = submit(engine, frames=4)
    run_until_idle(engine)
    assert len(await collect(loud)) and engine.stats_snapshot()["trimmed"] == trimmed  # nothing dropped: not counted


def test_trimmer_finds_onset_across_chunk_boundaries_and_flushes_quiet_streams():
    sr = 24000
    trimmer = LeadingSilenceTrimmer(sr)
    silence = np.zeros(1000, np.float32)
    tone = (0.3 * np.sin(np.arange(4800) * 0.2)).astype(np.float32)
    assert trimmer.push(silence).size == 0
    assert trimmer.push(tone[:100]).size == 0  # too short to prove onset
    out = trimmer.push(tone[100:])
    assert 4790 <= out.size <= 4800 and trimmer.started
    quiet = LeadingSilenceTrimmer(sr)
    assert quiet.push(np.zeros(5000, np.float32)).size == 0
    assert quiet.flush().size > 0


async def test_engine_thread_serves_concurrent_streams_and_cancellation():
    runner = ScriptedRunnerTestDouble(max_slots=4, step_delay_s=0.0005)
    engine = Engine(runner, EngineConfig(scheduler=SchedulerConfig(max_active=4)))
    engine.start()
    try:
        await asyncio.to_thread(engine.wait_ready, 10)
        frames = [5, 9, 14, 20, 3, 7]
        streams = [engine.submit(Script(n), seed=None, max_frames=1000) for n in frames]
        victim = engine.submit(Script(500), seed=None, max_frames=1000)

        async def read_some_then_cancel():
            got = 0
            async for chunk in victim:
                got += len(chunk)
                if got >= 6 * SPF * 2:
                    victim.cancel()
                    break
            return got

        results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams), read_some_then_cancel()), 30)
        for n, audio in zip(frames, results[:-1]):
            assert len(audio) == n * SPF * 2
        for _ in range(200):
            if victim.request_id in runner.released:
                break
            await asyncio.sleep(0.005)
        assert victim.request_id in runner.released
        assert engine.scheduler.active == 0 or all(r.done for r in engine.scheduler.requests)
        # The victim stopped long before its 500 frames.
        assert runner.talker_steps[victim.request_id] < 100
    finally:
        engine.stop()


def _set_costs(engine, frame_stage_s: float, codec_s: float) -> None:
    for _ in range(200):  # the scheduler's cost estimates are moving averages
        engine.scheduler.observe(Stage.FRAME, 2 * frame_stage_s)
        engine.scheduler.observe(Stage.CODEC, codec_s)


@pytest.mark.parametrize("step_cost_s, expected_rule", [(0.02, "urgent_generation"), (0.001, "startup")])
async def test_playing_stream_that_would_underrun_outranks_new_requests(step_cost_s, expected_rule):
    engine, runner, clock = make_engine()
    a = submit(engine, frames=200)
    engine.step()
    req_a = engine.scheduler.get(a.request_id)
    run_until(engine, lambda: req_a.playing)  # 2 frames = 160 ms of audio out; the next chunk needs 4 more
    assert req_a.pending_frames == 0
    _set_costs(engine, step_cost_s, 0.01)
    b = submit(engine, frames=5)
    batch = engine.step()
    assert batch.rule == expected_rule
    if expected_rule == "urgent_generation":
        # 4 frames x (20 + 20) ms + codec cannot fit in A's 160 ms unless A's generation runs now.
        assert [r.request_id for r in batch.requests][0] == a.request_id
        assert batch.stage is Stage.FRAME
    else:
        assert [r.request_id for r in batch.requests] == [b.request_id]


def test_more_streams_than_the_largest_frame_bucket_go_new_then_earliest_deadline():
    """The one case where a frame batch leaves streams out: more can step than the cap. Then the rules order
    them -- a stream with no audio yet anchors (rule 3), then the fill order: earliest deadline first."""
    from tts_backend.engine.request import RequestState
    from tts_backend.engine.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(max_active=6, max_batch={Stage.PREFILL: 2, Stage.FRAME: 3,
                                                                   Stage.CODEC: 2}))
    requests = []
    for request_id, seconds_left in enumerate((1.5, 0.4, 2.5, 0.9, 3.0, None), start=1):
        r = RequestState(request_id=request_id, prompt=None, seed=1, max_frames=1000, chunk_schedule=(2, 4, 8, 12),
                         arrival=float(request_id), sample_rate=24000, samples_per_frame=SPF)
        scheduler.add(r)
        r.phase = Phase.NEED_DECODE
        r.frames_generated = r.frames_decoded = 0 if seconds_left is None else 14  # nothing for the codec
        if seconds_left is not None:
            r.chunks_decoded = 3
            r.output.emitted_samples = 14 * SPF
            r.playback_start = 100.0 + seconds_left - 14 * SPF / 24000
        requests.append(r)
    batch = scheduler.decide(now=100.0)
    assert batch.stage is Stage.FRAME and batch.rule == "startup"
    assert [r.request_id for r in batch.requests] == [6, 2, 4]
    # Without the new one, the earliest deadline anchors (pressing) and the next earliest follow.
    scheduler.remove(requests[-1])
    batch = scheduler.decide(now=100.0)
    assert batch.stage is Stage.FRAME and batch.rule == "pressing"
    assert [r.request_id for r in batch.requests] == [2, 4, 1]


def test_a_codec_batch_takes_streams_that_are_ahead_but_never_shrinks_a_chunk():
    from tts_backend.engine.request import RequestState
    from tts_backend.engine.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(max_active=4))

    def playing(request_id, generated, decoded, chunks):
        r = RequestState(request_id=request_id, prompt=None, seed=1, max_frames=1000, chunk_schedule=(2, 4, 8, 12),
                         arrival=float(request_id), sample_rate=24000, samples_per_frame=SPF)
        scheduler.add(r)
        r.phase = Phase.NEED_DECODE
        r.frames_generated, r.frames_decoded, r.chunks_decoded = generated, decoded, chunks
        r.playback_start = 0.0
        r.output.emitted_samples = decoded * SPF
        return r

    anchor = playing(1, generated=10, decoded=2, chunks=2)  # next chunk 8 frames, 8 ready, runs dry at 0.16 s
    ahead = playing(2, generated=16, decoded=6, chunks=1)  # next chunk 4 frames, 10 ready: ships 8 now
    short = playing(3, generated=12, decoded=6, chunks=1)  # next chunk 4 frames, only 6 ready: cannot ship 8
    large = playing(4, generated=26, decoded=14, chunks=3)  # next chunk 12 frames: never cut to 8
    batch = scheduler.decide(now=0.15)
    assert batch.stage is Stage.CODEC and batch.rule == "urgent_codec" and batch.frames == 8
    assert batch.requests == [anchor, ahead]
    assert short not in batch.requests and large not in batch.requests


# ---- the codec in flight: launched, generation runs meanwhile, collected a few steps later ------------------

async def test_generation_runs_while_a_codec_batch_is_in_flight_and_one_codec_batch_at_a_time():
    engine, runner, _ = make_engine(codec_polls=3)
    streams = [submit(engine, frames=n) for n in (9, 17, 30)]
    saw_in_flight = False
    for _ in range(10_000):
        if engine.step() is None:
            break
        saw_in_flight |= bool(runner.codec_in_flight)
    assert saw_in_flight and runner.codec_polled_early > 0
    assert "frame" in runner.during_codec
    assert "codec" not in runner.during_codec  # never a second codec batch while one is in flight
    assert runner.violations == []
    assert len(runner.codec_collected) == runner.stages().count("codec")
    for n, s in zip((9, 17, 30), streams):
        assert len(await collect(s)) == n * SPF * 2
    assert engine.stats.completed == 3 and engine.stats.failed == 0


async def _audio_of_a_mixed_workload(codec_polls, codec_depth=1):
    engine, runner, clock = make_engine(max_active=3, codec_polls=codec_polls, codec_depth=codec_depth)
    streams = [submit(engine, frames=n, silent_frames=k) for n, k in ((13, 0), (25, 3), (7, 5), (40, 1), (19, 0))]
    run_with_moving_clock(engine, clock)
    assert runner.violations == []
    return [await collect(s) for s in streams], runner


async def test_asynchronous_codec_audio_is_byte_identical_to_the_synchronous_path():
    synchronous, sync_runner = await _audio_of_a_mixed_workload(codec_polls=0)
    asynchronous, async_runner = await _audio_of_a_mixed_workload(codec_polls=4)
    assert sync_runner.during_codec == [] and async_runner.during_codec  # the two paths did differ
    assert all(synchronous) and asynchronous == synchronous


async def test_two_codec_batches_in_flight_give_the_same_audio_collected_in_launch_order():
    synchronous, _ = await _audio_of_a_mixed_workload(codec_polls=0)
    queued, runner = await _audio_of_a_mixed_workload(codec_polls=4, codec_depth=2)
    launches = [c for c in runner.calls if c[0] == "codec"]
    # Two were in flight at once at some point (the second launched before the first was collected).
    assert runner.during_codec.count("codec") > 0
    assert runner.codec_collected == [ids for _, ids, _ in launches]  # collected in launch order
    assert queued == synchronous and runner.violations == []


async def test_with_only_codec_batches_in_flight_the_engine_waits_for_them_in_turn_not_idles():
    """Two batches in flight, and the only work left is the second batch's streams' next codec call: the
    engine waits for the first, finds nothing ready, then waits for the second -- it does not report idle."""
    engine, runner, _ = make_engine(max_active=2, codec_polls=1_000_000, codec_depth=2, schedule=(2,))
    a = submit(engine, frames=2)  # one chunk, then done
    run_until(engine, lambda: len(runner.codec_handles) == 1)
    b = submit(engine, frames=4)  # two chunks: its second waits for its first batch to be collected
    run_until(engine, lambda: len(runner.codec_handles) == 2)
    assert [list(h.slots.values()) for h in runner.codec_handles] == [[a.request_id], [b.request_id]]
    run_until_idle(engine)
    assert engine.stats.completed == 2 and runner.violations == []
    assert runner.codec_collected == [[a.request_id], [b.request_id], [b.request_id]]
    assert len(await collect(a)) == 2 * SPF * 2 and len(await collect(b)) == 4 * SPF * 2


async def test_a_slot_cancelled_while_its_codec_batch_is_in_flight_is_freed_only_once_collected():
    engine, runner, _ = make_engine(max_active=2, codec_polls=6)
    a = submit(engine, frames=300)
    submit(engine, frames=300)  # C: generation work while A's codec batch is in flight
    b = submit(engine, frames=3)  # waits for a slot
    engine.step()
    req_a, req_b = engine.scheduler.get(a.request_id), engine.scheduler.get(b.request_id)
    run_until(engine, lambda: req_a.slot in runner.codec_in_flight)
    slot = req_a.slot
    a.cancel()
    engine.step()  # takes the cancel; C's generation goes on beside the in-flight batch
    assert req_a.done and a.request_id not in runner.released
    assert req_b.phase is Phase.WAITING and engine.scheduler.active == 2
    run_until(engine, lambda: a.request_id in runner.released)
    assert runner.codec_collected[-1].count(a.request_id) == 1 and slot not in runner.codec_in_flight
    run_until(engine, lambda: req_b.done)
    assert ("prefill", [b.request_id], 0) in runner.calls and req_b.slot is None
    assert runner.violations == []
    assert len(await collect(b)) == 3 * SPF * 2
    assert engine.stats.cancelled == 1
    a.cancel()  # a second cancel of a request that already left does nothing
    engine.step()
    assert engine.stats.cancelled == 1


async def test_a_stream_running_dry_is_picked_in_the_step_that_collects_the_in_flight_codec():
    engine, runner, clock = make_engine(codec_polls=1_000_000)  # in flight until a test says otherwise
    a = submit(engine, frames=200)
    engine.step()
    req_a = engine.scheduler.get(a.request_id)
    run_until(engine, lambda: req_a.playing and req_a.slot in runner.codec_in_flight and req_a.pending_frames >= 12)
    collected = len(runner.codec_collected)
    runner.codec_handle.polls_left = 2  # the device finishes the batch two polls from now
    clock.advance(10.0)  # A's audio has run out
    batches = []
    while len(runner.codec_collected) == collected:
        batches.append(engine.step())
    # Generation went on while the batch was in flight; the step that collected it picked A's next chunk.
    assert len(batches) == 3 and all(b.stage is not Stage.CODEC for b in batches[:-1])
    assert batches[-1].stage is Stage.CODEC and batches[-1].rule == "urgent_codec"
    assert batches[-1].requests == [req_a]
    assert runner.violations == []


async def test_stop_with_a_codec_batch_in_flight_ends_cleanly_inline():
    engine, runner, _ = make_engine(codec_polls=1_000_000)
    streams = [submit(engine, frames=50) for _ in range(2)]
    run_until(engine, lambda: bool(runner.codec_in_flight))
    in_flight = list(runner.codec_in_flight.values())
    engine.stop()
    assert runner.codec_in_flight == {} and runner.codec_collected[-1] == in_flight
    assert sorted(runner.released) == sorted(s.request_id for s in streams)
    assert runner.violations == [] and engine.scheduler.requests == []
    for s in streams:
        with pytest.raises(SynthesisError, match="engine stopped"):
            await collect(s)


async def test_engine_thread_stops_cleanly_with_a_codec_batch_in_flight():
    runner = ScriptedRunnerTestDouble(max_slots=2, step_delay_s=0.001, codec_polls=1_000_000)
    engine = Engine(runner, EngineConfig(scheduler=SchedulerConfig(max_active=2)))
    engine.start()
    await asyncio.to_thread(engine.wait_ready, 10)
    streams = [engine.submit(Script(400), seed=None, max_frames=1000) for _ in range(2)]
    for _ in range(2000):
        if runner.codec_in_flight:
            break
        await asyncio.sleep(0.001)
    assert runner.codec_in_flight
    await asyncio.to_thread(engine.stop)
    assert engine._thread is None and runner.codec_in_flight == {} and runner.violations == []
    assert sorted(runner.released) == sorted(s.request_id for s in streams)
    for s in streams:
        with pytest.raises(SynthesisError):
            await asyncio.wait_for(collect(s), 5)


def test_the_codec_lead_grows_with_measured_costs():
    """A playing stream's codec turns urgent earlier when codec calls and frames are measured slow: the
    lead covers a codec batch in flight, a generation batch and its own call, never less than the floor."""
    from tts_backend.engine.request import RequestState
    from tts_backend.engine.scheduler import Scheduler

    def scheduler_with_stream():
        scheduler = Scheduler(SchedulerConfig(max_active=2, codec_reserve_s=0.025))
        r = RequestState(request_id=1, prompt=None, seed=1, max_frames=1000, chunk_schedule=(2, 4),
                         arrival=0.0, sample_rate=24000, samples_per_frame=SPF)
        scheduler.add(r)
        r.phase = Phase.NEED_DECODE
        r.frames_generated, r.frames_decoded, r.chunks_decoded = 6, 2, 1  # 4 frames ready to decode
        r.playback_start = 0.0
        r.output.emitted_samples = 2 * SPF  # runs dry at 0.16 s
        return scheduler

    quiet = scheduler_with_stream()
    assert quiet.codec_lead() == pytest.approx(0.025)  # initial cost guesses: the floor
    assert quiet.decide(now=0.12).rule != "urgent_codec"  # 40 ms ahead of running dry: not yet
    busy = scheduler_with_stream()
    for _ in range(50):
        busy.observe(Stage.CODEC, 0.020)
        busy.observe(Stage.FRAME, 0.0062)
    assert busy.codec_lead() == pytest.approx(0.0462, abs=1e-3)
    batch = busy.decide(now=0.12)
    assert batch.stage is Stage.CODEC and batch.rule == "urgent_codec"


# ---- codec volume: bulk calls when nothing is urgent, and first chunks do not take every codec turn ----------

def _scheduler_with_playing_streams(specs, **config):
    """specs: (generated, decoded, chunks_decoded, seconds of audio left) per stream, all playing."""
    from tts_backend.engine.request import RequestState
    from tts_backend.engine.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(max_active=len(specs) + 2, **config))
    streams = []
    for i, (generated, decoded, chunks, left_s) in enumerate(specs, start=1):
        r = RequestState(request_id=i, prompt=None, seed=1, max_frames=1000, chunk_schedule=(2, 4, 8, 12),
                         arrival=float(i), sample_rate=24000, samples_per_frame=SPF)
        scheduler.add(r)
        r.phase = Phase.NEED_DECODE
        r.frames_generated, r.frames_decoded, r.chunks_decoded = generated, decoded, chunks
        r.output.emitted_samples = decoded * SPF
        r.playback_start = 100.0 + left_s - decoded * SPF / 24000  # runs dry left_s after t=100
        streams.append(r)
    return scheduler, streams


def test_a_codec_call_nothing_urgent_waits_for_decodes_the_count_that_moves_the_most_frames():
    # Stream 1 runs dry first but has only its 4-frame chunk; three others are 12 or more frames ahead.
    scheduler, (first, *ahead) = _scheduler_with_playing_streams(
        [(10, 6, 1, 0.5), (40, 14, 3, 3.0), (38, 14, 3, 3.2), (30, 6, 2, 3.4)])
    for _ in range(50):  # a frame measured slow enough that the streams' frames are not urgent
        scheduler.observe(Stage.FRAME, 0.004)
    batch = scheduler.decide(now=100.0)
    assert batch.stage is Stage.CODEC and batch.rule == "pressing"
    # 12 frames for the three that can take them (36 frames) beats 4 frames for all four (16).
    assert batch.frames == 12 and batch.requests == ahead and first not in batch.requests


def test_an_urgent_codec_call_still_decodes_its_anchors_chunk():
    scheduler, (first, *ahead) = _scheduler_with_playing_streams(
        [(10, 6, 1, 0.01), (40, 14, 3, 3.0), (38, 14, 3, 3.2)])
    batch = scheduler.decide(now=100.0)
    assert batch.rule == "urgent_codec" and batch.frames == 4 and batch.requests[0] is first


def test_after_a_first_chunk_a_lagging_codec_decodes_in_bulk_before_the_next_first_chunk():
    from tts_backend.engine.request import RequestState

    # Three playing streams lag: 30 frames generated and not decoded (max_pending 48: half is 24).
    scheduler, lagging = _scheduler_with_playing_streams([(44, 14, 3, 2.0), (40, 10, 3, 2.2), (42, 12, 3, 2.4)])

    def new_stream(request_id):
        r = RequestState(request_id=request_id, prompt=None, seed=1, max_frames=1000,
                         chunk_schedule=(2, 4, 8, 12), arrival=50.0 + request_id, sample_rate=24000,
                         samples_per_frame=SPF)
        scheduler.add(r)
        r.phase, r.frames_generated = Phase.NEED_DECODE, 2  # its first chunk is ready
        return r

    first = new_stream(10)
    batch = scheduler.decide(now=100.0)
    assert batch.rule == "startup" and batch.stage is Stage.CODEC and batch.requests == [first]
    first.frames_decoded, first.chunks_decoded, first.playback_start = 2, 1, 100.0  # the engine collected it
    first.output.emitted_samples = 2 * SPF
    scheduler.changed(first)
    second = new_stream(11)
    batch = scheduler.decide(now=100.001)
    assert batch.rule == "bulk_codec" and batch.frames == 12 and set(batch.requests) == set(lagging)
    batch = scheduler.decide(now=100.002)  # a bulk call is in; the next first chunk goes first again
    assert batch.rule == "startup" and batch.requests == [second]


def test_first_chunks_keep_every_codec_turn_while_the_codec_keeps_up():
    scheduler, playing = _scheduler_with_playing_streams([(20, 14, 3, 2.0)])  # 6 frames undecoded: no lag
    from tts_backend.engine.request import RequestState

    for request_id in (10, 11):
        r = RequestState(request_id=request_id, prompt=None, seed=1, max_frames=1000,
                         chunk_schedule=(2, 4, 8, 12), arrival=50.0 + request_id, sample_rate=24000,
                         samples_per_frame=SPF)
        scheduler.add(r)
        r.phase, r.frames_generated = Phase.NEED_DECODE, 2 if request_id == 10 else 1
    first = scheduler.get(10)
    assert scheduler.decide(now=100.0).requests == [first]
    first.frames_decoded, first.chunks_decoded, first.playback_start = 2, 1, 100.0
    first.output.emitted_samples = 2 * SPF
    second = scheduler.get(11)
    second.frames_generated = 2
    for r in (first, second):  # changed outside a batch: told, as the engine tells it (Scheduler.changed)
        scheduler.changed(r)
    batch = scheduler.decide(now=100.001)
    assert batch.rule == "startup" and batch.requests == [second]


def test_fresh_arrivals_are_gathered_for_one_prefill_only_while_many_streams_step():
    from tts_backend.engine.request import RequestState

    def scheduler_with(stepping):
        scheduler, _ = _scheduler_with_playing_streams([(8, 8, 2, 5.0)] * stepping,
                                                       prefill_gather_s=0.010, prefill_gather_streams=4)
        r = RequestState(request_id=99, prompt=None, seed=1, max_frames=1000, chunk_schedule=(2, 4, 8, 12),
                         arrival=100.0, sample_rate=24000, samples_per_frame=SPF)
        scheduler.add(r)
        return scheduler, r

    busy, fresh = scheduler_with(stepping=6)
    batch = busy.decide(now=100.002)  # 2 ms old, 6 streams can step: they step, the arrival waits for company
    assert batch.stage is Stage.FRAME and fresh not in batch.requests
    batch = busy.decide(now=100.011)  # older than the gathering time: admitted
    assert batch.stage is Stage.PREFILL and batch.requests == [fresh]
    light, fresh = scheduler_with(stepping=2)  # light load: admitted at once
    batch = light.decide(now=100.002)
    assert batch.stage is Stage.PREFILL and batch.requests == [fresh]


def _resume_request(request_id: int, arrival: float):
    from tts_backend.engine.request import RequestState

    return RequestState(request_id=request_id, prompt=None, seed=1, max_frames=1000, chunk_schedule=(2, 4, 8, 12),
                         arrival=arrival, sample_rate=24000, samples_per_frame=SPF, resume=object())


def test_a_failovers_resumes_are_gathered_into_one_prefill_while_other_work_runs():
    # A worker's death sends its streams to another within a few ms: each resume pass is a pause for its
    # listeners, so the first waits (resume_gather_s after the latest, resume_gather_most_s after the first)
    # for the rest, at light load too, as long as something else can run meanwhile.
    from tts_backend.engine.scheduler import Scheduler

    def scheduler_with(stepping, **config):
        config = {"resume_gather_s": 0.004, "resume_gather_most_s": 0.012, **config}
        scheduler = Scheduler(SchedulerConfig(max_active=stepping + 8, **config))
        for i in range(1, stepping + 1):
            r = _resume_request(i, float(i))
            r.resume = None
            scheduler.add(r)
            r.phase = Phase.NEED_DECODE
            r.frames_generated = r.frames_decoded = 8
            r.chunks_decoded = 2
            r.output.emitted_samples = 8 * SPF
            r.playback_start = 105.0 - 8 * SPF / 24000  # 5 s of audio left at t=100: nothing urgent
        return scheduler

    scheduler = scheduler_with(stepping=2)  # light load: a fresh arrival would be admitted at once
    first = _resume_request(50, 100.000)
    scheduler.add(first)
    batch = scheduler.decide(now=100.001)  # the frame runs; the resume waits for company
    assert batch.stage is Stage.FRAME and first not in batch.requests
    second = _resume_request(51, 100.003)
    scheduler.add(second)
    batch = scheduler.decide(now=100.005)  # 2 ms after the latest: still gathering
    assert batch.stage is Stage.FRAME
    batch = scheduler.decide(now=100.0071)  # 4 ms after the latest: both in one pass
    assert batch.stage is Stage.PREFILL and batch.requests == [first, second]

    trickle = scheduler_with(stepping=2)  # resumes that keep coming: held at most resume_gather_most_s
    held = [_resume_request(60 + i, 100.0 + 0.003 * i) for i in range(5)]
    for i, r in enumerate(held[:4]):
        trickle.add(r)
        batch = trickle.decide(now=r.arrival + 0.001)
        assert batch.stage is Stage.FRAME, i
    trickle.add(held[4])
    batch = trickle.decide(now=100.0121)  # the latest came 0.1 ms ago, the first 12.1 ms ago
    assert batch.stage is Stage.PREFILL and batch.requests == held

    full = scheduler_with(stepping=2)  # a full prefill batch goes at once
    burst = [_resume_request(70 + i, 100.0) for i in range(8)]
    for r in burst:
        full.add(r)
    batch = full.decide(now=100.0005)
    assert batch.stage is Stage.PREFILL and batch.requests == burst

    alone = scheduler_with(stepping=0)  # nothing else to run: held, the engine would only idle
    lone = _resume_request(80, 100.0)
    alone.add(lone)
    batch = alone.decide(now=100.0005)
    assert batch.stage is Stage.PREFILL and batch.requests == [lone]

    off = scheduler_with(stepping=2, resume_gather_s=0.0)
    lone = _resume_request(81, 100.0)
    off.add(lone)
    batch = off.decide(now=100.0005)
    assert batch.stage is Stage.PREFILL and batch.requests == [lone]


def test_a_resumed_request_takes_the_next_free_slot_before_new_ones():
    from tts_backend.engine.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(max_active=1))
    holder = _resume_request(1, 100.0)
    holder.resume = None
    scheduler.add(holder)
    assert holder.slot is not None
    fresh, resumed, later_fresh, later_resumed = (
        _resume_request(2, 100.1), _resume_request(3, 100.2), _resume_request(4, 100.3), _resume_request(5, 100.4))
    fresh.resume = later_fresh.resume = None
    for r in (fresh, resumed, later_fresh, later_resumed):
        scheduler.add(r)
        assert r.slot is None
    admitted = []
    for _ in range(4):
        current = next(r for r in (holder, fresh, resumed, later_fresh, later_resumed)
                       if r.slot is not None and r.request_id not in admitted)
        admitted.append(current.request_id)
        scheduler.remove(current)
    assert admitted == [1, 3, 5, 2]  # the resumed ones first, in their order, then the new ones in theirs


def test_resumes_are_gathered_mid_frame_too():
    # decide_between admits fresh arrivals inside a frame; a resume is held there as between frames.
    from tts_backend.engine.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(max_active=8, resume_gather_s=0.004, resume_gather_most_s=0.012))
    first = _resume_request(1, 100.0)
    scheduler.add(first)
    assert scheduler.decide_between(now=100.001, room=8) is None
    batch = scheduler.decide_between(now=100.0041, room=8)
    assert batch.stage is Stage.PREFILL and batch.requests == [first]
