"""Streams whose text is still coming, in the scheduler and the engine loop (issue 21), with the scripted
model-runner test double (no model, no device): a stream whose next text token has not arrived waits
outside the batches, is not decoded, holds back no other stream, is not counted as late by the engine's
making, and joins the next batch as soon as its token comes.
"""

from __future__ import annotations

from tests.engine_fixtures import SPF, Script, collect, make_engine, run_until_idle, submit
from tts_backend.engine.metrics import engine_metrics
from tts_backend.engine.request import Phase, Stage


def open_stream(engine, frames, text_tokens, max_frames=10_000):
    return engine.submit(Script(frames), seed=1, max_frames=max_frames, text_tokens=text_tokens)


def decodes_of(runner, request_id):
    return runner.talker_steps[request_id]


async def test_a_stream_without_its_next_token_waits_outside_the_batch_and_holds_back_no_one():
    engine, runner, clock = make_engine()
    waiting = open_stream(engine, frames=20, text_tokens=2)
    other = submit(engine, frames=20)
    run_until_idle(engine)
    request = engine.scheduler.get(waiting.request_id)
    # Two decode steps had their token; the third frame's step waits. Its frames were decoded anyway.
    assert decodes_of(runner, waiting.request_id) == 2
    assert request.phase is Phase.NEED_DECODE and request.waiting_for_text and not request.done
    assert request.frames_generated == 3 and request.pending_frames == 0
    # The other stream ran to its end meanwhile, in batches the waiting one was not in.
    assert engine.scheduler.get(other.request_id) is None
    assert len(await collect(other)) == 20 * SPF * 2
    snapshot = engine.stats_snapshot()
    assert snapshot["text"]["waits"] == 1 and snapshot["text"]["waiting"] == 1
    clock.advance(2.0)
    assert engine.stats_snapshot()["text"]["wait_s"] >= 2.0

    engine.push_text(waiting.request_id, ["t"] * 3)
    batch = engine.step()
    assert batch.stage is Stage.FRAME and request in batch.requests  # the first decision after its token
    run_until_idle(engine)
    assert decodes_of(runner, waiting.request_id) == 5 and request.waiting_for_text
    engine.push_text(waiting.request_id, ["t", "eos"], final=True)
    run_until_idle(engine)
    assert len(await collect(waiting)) == 20 * SPF * 2
    stats = engine.stats
    assert stats.text_waits == 2 and stats.text_wait_s >= 2.0 and stats.completed == 2


async def test_a_stream_that_gets_its_token_joins_the_batch_of_the_others():
    engine, runner, _ = make_engine()
    waiting = open_stream(engine, frames=30, text_tokens=1)
    run_until_idle(engine)
    busy = submit(engine, frames=30)
    for _ in range(6):  # the other stream is generating now
        engine.step()
    engine.push_text(waiting.request_id, ["t"] * 40, final=True)
    decodes = []
    while len(decodes) < 3:
        batch = engine.step()
        assert batch is not None
        if batch.stage is Stage.FRAME:
            decodes.append({r.request_id for r in batch.requests})
    assert {waiting.request_id, busy.request_id} in decodes  # one batch, not one each
    run_until_idle(engine)
    assert len(await collect(waiting)) == 30 * SPF * 2 and len(await collect(busy)) == 30 * SPF * 2


async def test_silence_while_waiting_for_text_is_not_counted_as_the_engines_lateness():
    engine, runner, clock = make_engine()
    stream = open_stream(engine, frames=12, text_tokens=3)
    run_until_idle(engine)  # 4 frames made and shipped (the first chunk, then what was there), then a wait
    assert engine.stats.text_waits == 1
    clock.advance(5.0)  # the listener ran out of audio long ago: the text is late, not the engine
    engine.push_text(stream.request_id, ["t"] * 20, final=True)
    run_until_idle(engine)
    assert len(await collect(stream)) == 12 * SPF * 2
    stats = engine.stats
    assert stats.text_gaps == 1 and stats.text_gap_s >= 4.0
    assert stats.late_chunks == 0

    # The same silence without a wait for text is the engine's.
    late = submit(engine, frames=12)
    for _ in range(6):
        engine.step()
    clock.advance(5.0)
    run_until_idle(engine)
    assert len(await collect(late)) == 12 * SPF * 2
    assert engine.stats.late_chunks >= 1 and engine.stats.text_gaps == 1
    metrics = {m.name: dict(m.samples) for m in engine_metrics(engine.stats_snapshot())}
    assert metrics["engine_late_chunks"] == {("engine",): engine.stats.late_chunks, ("text",): 1}
    assert metrics["engine_text_waits"] == {(): 1} and metrics["engine_streams_waiting_for_text"] == {(): 0}


async def test_the_frame_cap_of_an_open_text_grows_with_it():
    engine, runner, _ = make_engine()
    stream = open_stream(engine, frames=50, text_tokens=100, max_frames=3)
    run_until_idle(engine)
    request = engine.scheduler.get(stream.request_id)
    assert request.frames_generated == 3 and not request.done and request.waiting_for_text
    engine.push_text(stream.request_id, ["t"], final=False, max_frames=6)
    run_until_idle(engine)
    assert request.frames_generated == 6 and not request.done
    engine.push_text(stream.request_id, ["eos"], final=True)  # the cap stays 6: it ends there
    run_until_idle(engine)
    assert request.done and len(await collect(stream)) == 6 * SPF * 2


async def test_text_for_a_request_that_left_is_ignored_and_cancel_ends_a_wait():
    engine, runner, _ = make_engine()
    stream = open_stream(engine, frames=20, text_tokens=1)
    run_until_idle(engine)
    assert engine.stats_snapshot()["text"]["waiting"] == 1
    stream.cancel()
    run_until_idle(engine)
    assert engine.scheduler.active == 0 and engine.stats_snapshot()["text"]["waiting"] == 0
    engine.push_text(stream.request_id, ["t"], final=True)
    assert run_until_idle(engine) == []
