"""The first-chunk codec lane (ModelRunner.first_chunk_lane) with a deterministic model-runner test double: a new
request's first chunk runs beside the queued codec batches instead of behind them (no model, no device)."""

from __future__ import annotations

from tests import engine_fixtures
from tests.engine_fixtures import SPF, collect, run_until, run_until_idle, run_with_moving_clock, submit
from tts_backend.engine.request import Phase, RequestState, Stage
from tts_backend.engine.scheduler import Scheduler, SchedulerConfig

LANE = (4, 2)  # the Qwen3 runner's on CUDA: up to 4 requests of 2 frames


def make_engine(max_active=6, codec_depth=2, lane=LANE, **options):
    # Nobody reads the streams here: no back-pressure pause however far ahead of their listeners they get.
    options.setdefault("max_buffered_s", 1e6)
    return engine_fixtures.make_engine(max_active=max_active, codec_depth=codec_depth, first_chunk_lane=lane,
                                       **options)


def state(engine, stream) -> RequestState:
    """The engine's state of a submitted request (the engine takes the submission at its next step)."""
    if engine.scheduler.get(stream.request_id) is None:
        engine.step()
    return engine.scheduler.get(stream.request_id)


def fill_the_codec_queue(engine, runner, streams=2):
    """`streams` playing streams, each with a codec batch in flight that stays there: the queue is full."""
    playing, requests = [], []
    for _ in range(streams):  # one after the other, so that their chunks differ and they decode apart
        playing.append(submit(engine, frames=400))
        requests.append(state(engine, playing[-1]))
        run_until(engine, lambda: requests[-1].playing)
    runner.codec_polls = 1_000_000  # from now on a batch stays in flight until a test lets it go
    run_until(engine, lambda: len(runner.codec_handles) == runner.codec_depth)
    return playing, requests


async def test_a_first_chunk_launches_on_the_lane_while_the_codec_queue_is_full():
    engine, runner, _ = make_engine()
    fill_the_codec_queue(engine, runner)
    queued = list(runner.codec_handles)
    fresh = submit(engine, frames=30)
    req = state(engine, fresh)
    run_until(engine, lambda: runner.lane_handle is not None)
    # Beside the two queued batches, which are still in flight: the new request's first chunk, 2 frames.
    assert runner.codec_handles == queued
    # (The playing streams' own first chunks went on the lane too: the queue had room then.)
    assert runner.lane_launches[-1] == ([fresh.request_id], 2)
    assert runner.calls[-1] == ("codec", [fresh.request_id], 2) and req.codec_busy
    runner.lane_handle.polls_left = 0
    run_until(engine, lambda: req.playing)
    assert req.frames_decoded == 2 and runner.codec_handles == queued  # collected before the older ones
    assert engine.stats.codec_lane_batches == len(runner.lane_launches) == 3
    assert engine.stats_snapshot()["codec"]["lane_batches"] == 3
    for h in runner.codec_handles:
        h.polls_left = 0
    runner.codec_polls = 0
    fresh.cancel()
    engine.stop()
    assert runner.violations == []


async def test_at_most_one_lane_batch_is_in_flight_and_the_next_first_chunks_wait_for_it():
    engine, runner, _ = make_engine(max_active=8)
    fill_the_codec_queue(engine, runner)
    first = submit(engine, frames=30)
    run_until(engine, lambda: runner.lane_handle is not None)
    launched = len(runner.lane_launches)
    lane_batch = runner.lane_handle
    later = [submit(engine, frames=30) for _ in range(3)]
    later_requests = [state(engine, s) for s in later]
    # Their prefills and frames run; their first chunks are ready, but neither queue takes codec work now.
    run_until(engine, lambda: all(r.pending_frames >= 2 for r in later_requests))
    for _ in range(20):
        engine.step()
    assert runner.lane_handle is lane_batch and len(runner.lane_launches) == launched
    assert not any(r.codec_busy for r in later_requests)
    lane_batch.polls_left = 0
    run_until(engine, lambda: len(runner.lane_launches) == launched + 1)
    # The next lane batch carries all three waiting first chunks (up to the lane's 4), 2 frames each.
    assert sorted(runner.lane_launches[-1][0]) == [s.request_id for s in later]
    assert runner.calls[-1][2] == 2
    assert first.request_id not in runner.lane_launches[-1][0]
    runner.codec_polls = 0
    for h in runner.codec_handles + [runner.lane_handle]:
        h.polls_left = 0
    run_until_idle(engine)
    assert runner.violations == [] and engine.stats.completed == 6  # 2 playing, first, 3 later
    for s in [first] + later:
        assert len(await collect(s)) == 30 * SPF * 2


async def _audio_of_a_mixed_workload(lane, codec_polls, codec_depth):
    engine, runner, clock = make_engine(max_active=4, codec_polls=codec_polls, codec_depth=codec_depth, lane=lane)
    scripts = ((13, 0), (25, 3), (7, 5), (40, 1), (19, 0), (9, 0), (30, 2))
    streams = [submit(engine, frames=n, silent_frames=k) for n, k in scripts]
    run_with_moving_clock(engine, clock)
    assert runner.violations == []
    assert engine.stats.completed == len(scripts) and engine.stats.failed == 0
    return [await collect(s) for s in streams], runner, engine


async def test_the_lane_changes_when_audio_is_made_never_what_it_is():
    synchronous, _, _ = await _audio_of_a_mixed_workload(None, codec_polls=0, codec_depth=1)
    laned, runner, engine = await _audio_of_a_mixed_workload(LANE, codec_polls=4, codec_depth=2)
    assert runner.lane_launches and any(queued for _, queued in runner.lane_launches)  # beside queued batches
    assert engine.stats.codec_lane_batches == len(runner.lane_launches)
    assert laned == synchronous and all(laned)


async def test_a_failed_lane_batch_fails_its_requests_and_no_other():
    engine, runner, _ = make_engine()
    playing, requests = fill_the_codec_queue(engine, runner)
    runner.lane_fails = 1
    fresh = submit(engine, frames=30)
    req = state(engine, fresh)
    run_until(engine, lambda: runner.lane_handle is not None)
    runner.lane_handle.polls_left = 0
    run_until(engine, lambda: req.done)
    assert engine.stats.failed == 1 and req.slot is None and fresh.request_id in runner.released
    runner.codec_polls = 0
    for h in runner.codec_handles:
        h.polls_left = 0
    again = submit(engine, frames=6)  # the lane takes the next first chunk
    run_until_idle(engine)
    assert [again.request_id] in [ids for ids, _ in runner.lane_launches]
    assert engine.stats.completed == 3 and runner.violations == []
    try:
        await collect(fresh)
        raise AssertionError("the failed request's stream ended without its error")
    except Exception as exc:  # noqa: BLE001 - the engine's SynthesisError
        assert "lane device error" in str(exc)
    assert len(await collect(again)) == 6 * SPF * 2
    for s in playing:
        assert len(await collect(s)) == 400 * SPF * 2


async def test_a_request_cancelled_on_the_lane_keeps_its_slot_until_the_batch_is_collected():
    engine, runner, _ = make_engine()
    fill_the_codec_queue(engine, runner)
    fresh = submit(engine, frames=30)
    req = state(engine, fresh)
    run_until(engine, lambda: runner.lane_handle is not None)
    slot = req.slot
    fresh.cancel()
    engine.step()
    assert req.done and fresh.request_id not in runner.released and slot in runner.codec_in_flight
    runner.lane_handle.polls_left = 0
    run_until(engine, lambda: fresh.request_id in runner.released)
    assert engine.stats.cancelled == 1 and runner.violations == []
    runner.codec_polls = 0
    for h in runner.codec_handles:
        h.polls_left = 0
    engine.stop()
    assert runner.violations == []


def _first_chunk_scene(scheduler: Scheduler, playing: int, fresh: int) -> list[RequestState]:
    """`playing` streams with audio out and 12 frames to decode, and `fresh` ones with their first 2 frames."""
    requests = []
    for i in range(playing + fresh):
        r = RequestState(request_id=i + 1, prompt=None, seed=1, max_frames=1000, chunk_schedule=(2, 4, 12),
                         arrival=float(i), sample_rate=24000, samples_per_frame=SPF)
        scheduler.add(r)
        r.phase = Phase.NEED_DECODE
        if i < playing:
            r.frames_generated, r.frames_decoded, r.chunks_decoded = 30, 18, 2
            r.playback_start, r.output.emitted_samples = 100.0, 18 * SPF
        else:
            r.frames_generated = 2
        scheduler.changed(r)
        requests.append(r)
    return requests


def test_the_scheduler_offers_only_first_chunks_that_fit_the_lane_while_the_queue_is_full():
    config = SchedulerConfig(max_active=16, max_pending_frames=12)  # the playing streams cannot step
    no_lane, queue_full = Scheduler(config), Scheduler(config)
    _first_chunk_scene(no_lane, playing=3, fresh=6)
    requests = _first_chunk_scene(queue_full, playing=3, fresh=6)
    # No lane: no codec work while the queue is full, so the new streams' next frame (rule 3 still).
    batch = no_lane.decide(100.0, codec_in_flight=True)
    assert batch.stage is Stage.FRAME and batch.rule == "startup" and not batch.first_chunk_lane
    batch = queue_full.decide(100.0, codec_in_flight=True, first_chunk_lane=LANE)
    assert batch.stage is Stage.CODEC and batch.first_chunk_lane and batch.rule == "startup"
    assert batch.frames == 2 and [r.request_id for r in batch.requests] == [4, 5, 6, 7]  # the lane's 4, by arrival
    # A codec batch the decision makes anyway goes to the lane only when it fits it: the same scene with the
    # queue free decides as without the lane (6 first chunks, more than the lane takes).
    with_lane, without = Scheduler(config), Scheduler(config)
    _first_chunk_scene(with_lane, playing=3, fresh=6)
    _first_chunk_scene(without, playing=3, fresh=6)
    a = with_lane.decide(100.0, first_chunk_lane=LANE)
    b = without.decide(100.0)
    assert (a.stage, [r.request_id for r in a.requests], a.frames, a.rule) == \
        (b.stage, [r.request_id for r in b.requests], b.frames, b.rule)
    assert not a.first_chunk_lane and not b.first_chunk_lane
    assert requests[0].playing


def test_while_a_playing_stream_needs_its_codec_now_the_lane_takes_no_first_chunk():
    """Rule 1 goes first: a lane batch beside the full queue would only delay the queue that stream waits for."""
    scheduler = Scheduler(SchedulerConfig(max_active=16, max_pending_frames=12))
    requests = _first_chunk_scene(scheduler, playing=3, fresh=2)
    late = requests[0]
    late.output.emitted_samples = 0  # its listener runs out now: its codec work is urgent
    scheduler.changed(late)
    batch = scheduler.decide(100.0, codec_in_flight=True, first_chunk_lane=LANE)
    assert batch.stage is Stage.FRAME and not batch.first_chunk_lane
    # Once it is decoded (here: its audio reaches further), the lane takes the first chunks again.
    late.output.emitted_samples = 18 * SPF
    scheduler.changed(late)
    batch = scheduler.decide(100.0, codec_in_flight=True, first_chunk_lane=LANE)
    assert batch.stage is Stage.CODEC and batch.first_chunk_lane and [r.request_id for r in batch.requests] == [4, 5]
