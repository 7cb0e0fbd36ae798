"""Quick start (EngineConfig.quick_start_below): while the engine is lightly loaded, a request that names no
chunk schedule ships its first frame alone and then goes on with the default schedule; under load, or when the
caller chose a schedule, nothing changes. The audio is the same audio either way."""

from __future__ import annotations

from tests.engine_fixtures import SPF, collect, make_engine, run_until_idle, submit


def codec_frames(runner, request_id) -> list[int]:
    return [frames for stage, ids, frames in runner.calls if stage == "codec" and request_id in ids]


async def test_a_lightly_loaded_engine_ships_the_first_frame_alone():
    engine, runner, _ = make_engine(max_active=4, quick_start_below=2)
    first = submit(engine, frames=20)
    run_until_idle(engine)
    assert codec_frames(runner, first.request_id) == [1, 2, 4, 8, 5]
    assert len(await collect(first)) == 20 * SPF * 2


async def test_under_load_or_with_a_chosen_schedule_nothing_changes():
    engine, runner, _ = make_engine(max_active=4, quick_start_below=2)
    streams = [submit(engine, frames=20) for _ in range(3)]  # the 2nd and 3rd find 1 and 2 in the engine
    chosen = submit(engine, frames=20, chunk_schedule=(3,))  # a caller's schedule is the caller's
    run_until_idle(engine)
    assert codec_frames(runner, streams[0].request_id)[0] == 1
    assert codec_frames(runner, streams[1].request_id)[0] == 1
    assert codec_frames(runner, streams[2].request_id)[0] == 2
    assert codec_frames(runner, chosen.request_id)[0] == 3
    for s in streams + [chosen]:
        assert len(await collect(s)) == 20 * SPF * 2


async def test_off_by_default_and_a_silent_first_frame_does_not_use_up_the_one_frame_chunk():
    engine, runner, _ = make_engine(max_active=4)
    plain = submit(engine, frames=10)
    run_until_idle(engine)
    assert codec_frames(runner, plain.request_id)[0] == 2
    engine, runner, _ = make_engine(max_active=4, quick_start_below=4)
    quiet = submit(engine, frames=10, silent_frames=1)
    run_until_idle(engine)
    # The silent frame ships nothing, so the next chunk is again the one-frame chunk (the trimmer's rule).
    assert codec_frames(runner, quiet.request_id)[:3] == [1, 1, 2]
    assert len(await collect(quiet)) <= 9 * SPF * 2 + 4
