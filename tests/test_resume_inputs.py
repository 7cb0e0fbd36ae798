"""Resume without lost input or repeated utterance ends, across real `voxgate serve --store redis`
processes (synthetic backend, deterministic):

- input the client sent on a socket whose replica then died never reached the session: the resume's
  `session.started` says how many inputs the session has (`inputs_received`), the client sends the rest
  again, and all the text is spoken - byte for byte what an uninterrupted run gives;
- an utterance.done / session.done sent but lost exactly at the client's resume position comes again
  once after the resume (`ends_received` says how many the client has), never twice."""

from __future__ import annotations

import json

import pytest
import websockets

from tests.redis_fixtures import REDIS_URL, redis_prefix  # noqa: F401 (fixture)
from tests.resume_fixtures import PACED, Listener, OneWayOutage, config_message, gateways, uninterrupted_pcm

FIRST = "The first sentence reaches the replica in time. The second one does too, and it is long. Then"
LOST = [" a tail arrives that the dying replica never reads.", " And one more sentence after it."]


def resume_message(listener: Listener, ends_received: int) -> str:
    return json.dumps({**json.loads(listener.resume_message()), "ends_received": ends_received})


async def receive_into_sentence(ws, listener: Listener, index: int, min_bytes: int = 4 * 1920) -> None:
    while not (listener.open_sentence == index and len(listener.audio[index]) >= min_bytes):
        listener.feed(await ws.recv())


async def messages_until_pong(ws, listener: Listener) -> list[dict]:
    """Everything the gateway sends before it answers a ping (what a resume queued comes first)."""
    before = len(listener.messages)
    await ws.send(json.dumps({"type": "ping", "id": "probe"}))
    await listener.receive(ws, "pong")
    return listener.messages[before:-1]


async def test_input_sent_to_a_dying_replica_is_sent_again_and_all_spoken(redis_prefix):  # noqa: F811
    with gateways(REDIS_URL, redis_prefix, 2, *PACED) as (a, b):
        reference = await uninterrupted_pcm(b.ws_url, FIRST + "".join(LOST))
        listener = Listener()
        async with OneWayOutage(a.port) as outage:
            ws = await websockets.connect(outage.ws_url, max_size=None)
            await ws.send(config_message())
            await listener.receive(ws, "session.started")
            await ws.send(json.dumps({"type": "input.text", "text": FIRST}))
            await receive_into_sentence(ws, listener, 1)
            # The replica stops hearing the client, which does not know and sends the rest of its turn.
            outage.drop_client_bytes = True
            unheard = [json.dumps({"type": "input.text", "text": text}) for text in LOST]
            unheard.append(json.dumps({"type": "input.done"}))
            for message in unheard:
                await ws.send(message)
            await outage.wait_dropped(sum(map(len, unheard)))
            a.kill()
            outage.cut()
            await listener.receive_until_closed(ws)
        ws = await websockets.connect(b.ws_url, max_size=None)
        await ws.send(resume_message(listener, ends_received=0))
        started = await listener.receive(ws, ("session.started", "error"))
        assert started["type"] == "session.started", started
        assert started["inputs_received"] == 1  # only the first input.text: send the others again
        for message in unheard:
            await ws.send(message)
        done = await listener.receive(ws, "session.done")
        await ws.send(json.dumps({"type": "ping", "id": 7}))
        pong = await listener.receive(ws, "pong")
        await ws.close()
    assert pong == {"type": "pong", "id": 7, "inputs_received": 1 + len(unheard)}
    assert done["total_sentences"] == 4
    assert [m["type"] for m in listener.messages].count("session.done") == 1
    assert listener.pcm() == reference


async def test_python_client_sends_again_what_the_dying_replica_never_read(redis_prefix):  # noqa: F811
    import voxgate_client as vg

    with gateways(REDIS_URL, redis_prefix, 2, *PACED) as (a, b):
        reference = await uninterrupted_pcm(b.ws_url, FIRST + "".join(LOST))
        pcm = bytearray()
        reconnected = None
        async with OneWayOutage(a.port) as outage:
            session = await vg.connect([outage.ws_url, b.ws_url], vg.SessionConfig(voice="tone-mid"),
                                       backoff_initial_s=0.01, keepalive_s=None)
            await session.send_text(FIRST)
            async for event in session.events():
                if isinstance(event, vg.AudioChunk):
                    pcm += event.data
                    if event.sentence_index == 1 and event.offset >= 4 * 1920 and not outage.drop_client_bytes:
                        outage.drop_client_bytes = True
                        for text in LOST:
                            await session.send_text(text)
                        await session.done()
                        await outage.wait_dropped(1)
                        a.kill()
                        outage.cut()
                elif isinstance(event, vg.Reconnected):
                    reconnected = event
                elif isinstance(event, vg.Error):
                    pytest.fail(f"error after failover: {event}")
                elif isinstance(event, vg.SessionDone):
                    break
            assert session.ends_received == 1
            await session.close()
    assert reconnected is not None and reconnected.url == b.ws_url
    assert reconnected.inputs_resent == len(LOST) + 1
    assert bytes(pcm) == reference


async def test_an_utterance_done_lost_at_the_resume_position_comes_again_once(redis_prefix):  # noqa: F811
    with gateways(REDIS_URL, redis_prefix, 2) as (a, b):
        listener = Listener()
        ws = await websockets.connect(a.ws_url, max_size=None)
        await ws.send(config_message())
        await listener.receive(ws, "session.started")
        await ws.send(json.dumps({"type": "input.text", "context_id": "a", "text": "All of turn a."}))
        await ws.send(json.dumps({"type": "input.done", "context_id": "a"}))
        end = await listener.receive(ws, "utterance.done")
        assert end == {"type": "utterance.done", "context_id": "a", "total_sentences": 1}
        a.kill()
        await listener.receive_until_closed(ws)
        # The client has every byte of the last sentence and its audio.done: the position is (1, 0)
        # either way. Without the utterance.done (lost in the network) it is owed it, once.
        assert listener.position() == (1, 0)
        for attempt in range(2):
            async with websockets.connect(b.ws_url, max_size=None) as ws:
                await ws.send(resume_message(listener, ends_received=0))
                await listener.receive(ws, "session.started")
                assert await messages_until_pong(ws, listener) == [end]
        # With it, nothing is owed: it does not come a second time.
        async with websockets.connect(b.ws_url, max_size=None) as ws:
            await ws.send(resume_message(listener, ends_received=1))
            await listener.receive(ws, "session.started")
            assert await messages_until_pong(ws, listener) == []
            # The session goes on: turn b, then its end (the second one) once.
            await ws.send(json.dumps({"type": "input.text", "context_id": "b", "text": "Turn b."}))
            await ws.send(json.dumps({"type": "input.done", "context_id": "b"}))
            await listener.receive(ws, "utterance.done")
        async with websockets.connect(b.ws_url, max_size=None) as ws:
            await ws.send(resume_message(listener, ends_received=1))  # b's end lost too
            await listener.receive(ws, "session.started")
            owed = await messages_until_pong(ws, listener)
            assert [m["type"] for m in owed] == ["utterance.done"] and owed[0]["context_id"] == "b"


async def test_a_session_done_lost_at_the_end_comes_again_once_and_a_count_too_high_is_refused(redis_prefix):  # noqa: F811
    with gateways(REDIS_URL, redis_prefix, 1) as (a,):
        listener = Listener()
        async with websockets.connect(a.ws_url, max_size=None) as ws:
            await ws.send(config_message())
            await listener.receive(ws, "session.started")
            await ws.send(json.dumps({"type": "input.text", "text": "One turn. Two sentences."}))
            await ws.send(json.dumps({"type": "input.done"}))
            done = await listener.receive(ws, "session.done")
        assert listener.position() == (2, 0)
        async with websockets.connect(a.ws_url, max_size=None) as ws:
            await ws.send(resume_message(listener, ends_received=0))
            started = await listener.receive(ws, "session.started")
            assert started["inputs_received"] == 2
            assert await messages_until_pong(ws, listener) == [done]
        async with websockets.connect(a.ws_url, max_size=None) as ws:
            await ws.send(resume_message(listener, ends_received=1))
            await listener.receive(ws, "session.started")
            assert await messages_until_pong(ws, listener) == []
        async with websockets.connect(a.ws_url, max_size=None) as ws:
            await ws.send(resume_message(listener, ends_received=2))
            error = json.loads(await ws.recv())
            assert (error["code"], error["retryable"]) == ("resume_out_of_range", False), error


@pytest.fixture(params=["memory", "redis"])
async def store(request, redis_prefix):  # noqa: F811
    from gateway.store.redis import RedisSessionStore
    from gateway.store.memory import MemorySessionStore

    store = MemorySessionStore() if request.param == "memory" else RedisSessionStore(REDIS_URL, key_prefix=redis_prefix)
    await store.start()
    yield store
    await store.stop()


async def test_one_input_and_its_effects_are_written_together_or_not_at_all(store):
    from gateway.store.base import LeaseLost, MarkerRecord, OpenUtterance, SentenceRecord, SessionChanges

    await store.create("s", {"voice": "v"}, owner="old")
    await store.apply(
        "s",
        SessionChanges(
            sentences=[SentenceRecord(0, "Zero.", "a", utterance=1), SentenceRecord(1, "One.", "a", utterance=1)],
            open_text={"a": OpenUtterance("a", 1, "Two and")},
            inputs_received=1,
            uses_contexts=True,
        ),
        owner="old",
    )
    await store.apply(
        "s",
        SessionChanges(
            config={"voice": "w"}, states={0: "cancelled"}, open_text={"a": None},
            markers=[MarkerRecord(number=1, after=2, context_id="a", utterance=1, total_sentences=2)],
            inputs_received=2,
        ),
        owner="old",
    )
    record = await store.get("s")
    assert (record.inputs_received, record.uses_contexts, record.config) == (2, True, {"voice": "w"})
    # Sentence 0, cancelled before any audio, is dropped (nothing of it is ever spoken or replayed).
    assert [(s.text, s.state, s.bytes_sent) for s in record.sentences.values()] == [("One.", "pending", 0)]
    assert record.released == 2
    assert record.open_utterances == {} and record.markers[1].after == 2
    # A resume elsewhere fences the old owner out: none of its next input lands, not even the count.
    await store.claim("s", "new")
    with pytest.raises(LeaseLost):
        await store.apply(
            "s", SessionChanges(sentences=[SentenceRecord(2, "Lost.", "a")], inputs_received=3), owner="old"
        )
    record = await store.get("s")
    assert record.inputs_received == 2 and sorted(record.sentences) == [1] and record.released == 2


async def test_python_client_gets_each_utterance_end_once_across_resumes(redis_prefix):  # noqa: F811
    """The client counts the ends it got and says so on resume: a drop right after an utterance.done
    does not bring it again; the turns before and after are whole."""
    import voxgate_client as vg

    with gateways(REDIS_URL, redis_prefix, 1) as (a,):
        async with vg.connect(a.ws_url, vg.SessionConfig(voice="tone-mid"), backoff_initial_s=0.01,
                              keepalive_s=None) as session:
            first = session.context("a")
            audio_a = await first.speak("All of turn a.")
            assert session.ends_received == 1 and session.resume_position() == (1, 0)
            await session.drop_connection()
            audio_b = await session.context("b").speak("Turn b comes after the drop.")
            await session.ping()
            assert first._queue.empty()  # no second utterance.done for a
            assert session.reconnects == 1 and session.ends_received == 2
    assert audio_a and audio_b


async def test_a_cancel_the_client_heard_of_is_kept_across_a_resume(redis_prefix):  # noqa: F811
    """input.cancel is recorded (with its count) before context.cancelled goes out: after a resume
    nothing of the cancelled context is spoken or ended, and the cancel is not asked for again."""
    with gateways(REDIS_URL, redis_prefix, 2, *PACED) as (a, b):
        listener = Listener()
        ws = await websockets.connect(a.ws_url, max_size=None)
        await ws.send(config_message())
        await listener.receive(ws, "session.started")
        await ws.send(json.dumps({"type": "input.text", "context_id": "a", "text": FIRST + LOST[0]}))
        await ws.send(json.dumps({"type": "input.done", "context_id": "a"}))
        await receive_into_sentence(ws, listener, 0, min_bytes=1920)
        await ws.send(json.dumps({"type": "input.cancel", "context_id": "a"}))
        await listener.receive(ws, "context.cancelled")
        a.kill()
        await listener.receive_until_closed(ws)
        async with websockets.connect(b.ws_url, max_size=None) as ws:
            await ws.send(resume_message(listener, ends_received=0))
            started = await listener.receive(ws, "session.started")
            assert started["inputs_received"] == 3
            assert await messages_until_pong(ws, listener) == []
