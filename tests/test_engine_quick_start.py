"""Quick start (EngineConfig.quick_start_below): while the engine is lightly loaded, a request that names no
chunk schedule ships its first frame alone, then the rest of the default schedule's first chunk, then the rest of
it (so does a request whose text is still being written, at any load); under load, or when the caller
chose a schedule, nothing changes. The audio is the same audio either way, and
a resumed request goes on in the chunks of its first attempt, whichever schedule that took."""

from __future__ import annotations

import itertools

import pytest

from tests.engine_fixtures import SPF, Script, collect, make_engine, run_until_idle, submit
from tts_backend.engine.request import quick_start_schedule, schedule_pieces


def codec_frames(runner, request_id) -> list[int]:
    return [frames for stage, ids, frames in runner.calls if stage == "codec" and request_id in ids]


async def test_a_lightly_loaded_engine_ships_the_first_frame_alone():
    engine, runner, _ = make_engine(max_active=4, quick_start_below=2)
    first = submit(engine, frames=20)
    run_until_idle(engine)
    assert codec_frames(runner, first.request_id) == [1, 1, 4, 8, 6]
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


async def test_text_still_being_written_starts_quick_whatever_the_load():
    # Its second frame waits for the next word anyway, so the first ships alone even in a busy engine.
    engine, runner, _ = make_engine(max_active=4, quick_start_below=2)
    busy = [submit(engine, frames=20) for _ in range(2)]
    streaming = engine.submit(Script(20), seed=1, max_frames=10_000, text_tokens=30)
    complete = submit(engine, frames=20)
    engine.push_text(streaming.request_id, ["t"] * 40, final=True)
    run_until_idle(engine)
    assert codec_frames(runner, streaming.request_id) == [1, 1, 4, 8, 6]
    assert codec_frames(runner, complete.request_id)[0] == 2
    for s in busy + [streaming, complete]:
        assert len(await collect(s)) == 20 * SPF * 2
    # 0 still means never.
    engine, runner, _ = make_engine(max_active=4, quick_start_below=0)
    streaming = engine.submit(Script(20), seed=1, max_frames=10_000, text_tokens=30)
    engine.push_text(streaming.request_id, ["t"] * 40, final=True)
    run_until_idle(engine)
    assert codec_frames(runner, streaming.request_id)[0] == 2


async def test_0_turns_it_off_and_a_silent_first_frame_does_not_use_up_the_one_frame_chunk():
    engine, runner, _ = make_engine(max_active=4, quick_start_below=0)
    plain = submit(engine, frames=10)
    run_until_idle(engine)
    assert codec_frames(runner, plain.request_id)[0] == 2
    engine, runner, _ = make_engine(max_active=4, quick_start_below=4)
    quiet = submit(engine, frames=10, silent_frames=1)
    run_until_idle(engine)
    # The silent frame ships nothing, so the next chunk is again the one-frame chunk (the trimmer's rule).
    assert codec_frames(runner, quiet.request_id)[:4] == [1, 1, 1, 4]
    assert len(await collect(quiet)) <= 9 * SPF * 2 + 4


def test_the_split_schedule_keeps_every_boundary_of_the_plain_one():
    for plain in [(2, 4, 8, 12), (3,), (4, 4), (2,)]:
        quick = quick_start_schedule(plain)
        assert quick[0] == 1 and sum(quick[:2]) == plain[0]
        for frames in range(1, 60):
            ends = set(itertools.accumulate(schedule_pieces(quick, frames)))
            assert set(itertools.accumulate(schedule_pieces(plain, frames))) <= ends
    assert quick_start_schedule((1, 4)) == (1, 4)


@pytest.mark.parametrize("load", [0, 3])
@pytest.mark.parametrize("first_attempt_quick", [True, False])
async def test_a_resumed_request_goes_on_in_the_first_attempts_chunks(first_attempt_quick, load):
    """The first attempt quick-started or not; the engine it resumes on is idle or loaded: the resumed request's
    codec calls after a boundary of the first attempt are the first attempt's."""
    engine, runner, _ = make_engine(max_active=8, quick_start_below=2 if first_attempt_quick else 0)
    whole = submit(engine, frames=40)
    run_until_idle(engine)
    calls = codec_frames(runner, whole.request_id)
    for cut in itertools.accumulate(calls[:-1]):
        engine, runner, _ = make_engine(max_active=8, quick_start_below=2)
        others = [submit(engine, frames=40) for _ in range(load)]
        resumed = engine.submit(Script(40), seed=1, max_frames=10_000, resume=cut, resume_frames=cut)
        run_until_idle(engine)
        assert codec_frames(runner, resumed.request_id) == calls[calls_before(calls, cut):], cut
        for s in others:
            await collect(s)


def calls_before(calls, frames):
    return next(i + 1 for i, end in enumerate(itertools.accumulate(calls)) if end == frames)


def test_the_backend_default_is_the_engines():
    import inspect

    from tts_backend.engine.engine import EngineConfig
    from tts_backend.qwen3_backend import Qwen3Synthesizer

    default = inspect.signature(Qwen3Synthesizer.__init__).parameters["quick_start_below"].default
    assert default == EngineConfig().quick_start_below > 0
