"""session.resume across real `voxgate serve --store redis` processes (synthetic backend, deterministic):
a replica SIGKILLed mid-sentence, a plain network drop, a resume on the same replica, a takeover of a
session still attached elsewhere, and the protocol's errors. Audio must equal an uninterrupted run byte
for byte."""

from __future__ import annotations

import json

import pytest
import websockets

from tests.redis_fixtures import REDIS_URL, redis_cluster, redis_prefix, redis_target  # noqa: F401 (fixture)
from tests.resume_fixtures import (
    PACED,
    Listener,
    config_message,
    gateways,
    receive_into_sentence,
    resume,
    start_session,
    uninterrupted_pcm,
)

TEXT = (
    "The first sentence is spoken without any trouble at all. "
    "The second sentence is where the replica will be lost. "
    "A third sentence was probably synthesized ahead already. "
    "And the fourth one closes the turn."
)


async def test_replica_killed_mid_sentence_resumes_on_the_other_byte_for_byte(redis_target, redis_prefix):  # noqa: F811
    with gateways(redis_target.url, redis_prefix, 2, *PACED, *redis_target.flags) as (a, b):
        reference = await uninterrupted_pcm(b.ws_url, TEXT)
        listener = Listener()
        ws = await websockets.connect(a.ws_url, max_size=None)
        await start_session(ws, listener, TEXT)
        await receive_into_sentence(ws, listener, 1)
        a.kill()
        closed = await listener.receive_until_closed(ws)
        assert closed.rcvd is None  # no close frame: the replica died
        # Killed while the client was in sentence 1; frames already in the socket buffers still arrive, so
        # on a loaded machine the position may have moved on a little.
        index, received = listener.position()
        assert index >= 1 and listener.audio[1]
        ws = await resume(b.ws_url, listener)
        done = await listener.receive(ws, "session.done")
        await ws.close()
    assert done["total_sentences"] == 4
    assert sorted(listener.audio) == [0, 1, 2, 3]
    assert listener.pcm() == reference
    starts = [m["sentence_index"] for m in listener.messages if m["type"] == "audio.start"]
    # Every sentence opened once, and the interrupted one once more with its original index.
    expected_starts = sorted([0, 1, 2, 3] + ([index] if received > 0 else []))
    assert sorted(starts) == expected_starts and starts == sorted(starts)


async def test_network_drop_then_resume_elsewhere_and_keep_talking(redis_prefix):  # noqa: F811
    """The client's socket drops; the session continues on the other replica, including text that was
    accepted but not yet a sentence, and new text sent after the resume."""
    with gateways(REDIS_URL, redis_prefix, 2, *PACED) as (a, b):
        first, tail = "One short sentence comes first. Then a second, longer sentence follows it here.", " Half a"
        rest = " sentence was pending. And one more."
        reference = await uninterrupted_pcm(b.ws_url, first + tail + rest)
        listener = Listener()
        ws = await websockets.connect(a.ws_url, max_size=None)
        await start_session(ws, listener, first + tail, done=False)
        await receive_into_sentence(ws, listener, 1)
        await ws.close()  # the network fails; the gateway keeps the session in Redis
        ws = await resume(b.ws_url, listener)
        await ws.send(json.dumps({"type": "input.text", "text": rest}))
        await ws.send(json.dumps({"type": "input.done"}))
        done = await listener.receive(ws, "session.done")
        await ws.close()
    assert done["total_sentences"] == 4
    texts = [m["sentence_text"] for m in listener.messages if m["type"] == "audio.start"]
    assert texts[-2:] == ["Half a sentence was pending.", "And one more."]
    assert listener.pcm() == reference


async def test_resume_on_the_same_replica_between_sentences(redis_prefix):  # noqa: F811
    with gateways(REDIS_URL, redis_prefix, 1, *PACED) as (a,):
        reference = await uninterrupted_pcm(a.ws_url, TEXT)
        listener = Listener()
        ws = await websockets.connect(a.ws_url, max_size=None)
        await start_session(ws, listener, TEXT)
        await listener.receive(ws, "audio.done")  # exactly between sentence 0 and 1
        await ws.close()
        assert listener.position() == (1, 0)
        ws = await resume(a.ws_url, listener)
        await listener.receive(ws, "session.done")
        # The same position again (the client lost nothing since): replayed from the log only.
        listener.audio = {i: data for i, data in listener.audio.items() if i < 3}
        listener.open_sentence, listener.last_done = None, 2
        await ws.close()
        ws = await resume(a.ws_url, listener)
        done = await listener.receive(ws, "session.done")
        await ws.close()
    assert done["total_sentences"] == 4
    assert listener.pcm() == reference


async def test_resume_while_attached_elsewhere_takes_the_session_over(redis_prefix):  # noqa: F811
    """Resuming twice: the newest connection wins; the old one is told and closed (1008), sends no more."""
    with gateways(REDIS_URL, redis_prefix, 2, *PACED) as (a, b):
        reference = await uninterrupted_pcm(b.ws_url, TEXT)
        listener = Listener()
        old = await websockets.connect(a.ws_url, max_size=None)
        await start_session(old, listener, TEXT)
        await receive_into_sentence(old, listener, 1)
        snapshot = Listener(audio={i: bytearray(d) for i, d in listener.audio.items()}, open_sentence=listener.open_sentence,
                            last_done=listener.last_done, session_id=listener.session_id)
        ws = await resume(b.ws_url, snapshot)
        closed_old = Listener(open_sentence=listener.open_sentence, audio=listener.audio)
        closed = await closed_old.receive_until_closed(old)
        done = await snapshot.receive(ws, "session.done")
        await ws.close()
    assert closed.rcvd is not None and closed.rcvd.code == 1008
    errors = [m for m in closed_old.messages if m["type"] == "error"]
    assert errors and errors[-1]["code"] == "session_not_found" and errors[-1]["retryable"] is False
    assert "another connection" in errors[-1]["message"]
    assert done["total_sentences"] == 4 and snapshot.pcm() == reference


async def test_resume_errors_unknown_finished_and_out_of_range(redis_prefix):  # noqa: F811
    with gateways(REDIS_URL, redis_prefix, 1) as (a,):
        async with websockets.connect(a.ws_url, max_size=None) as ws:
            await ws.send(json.dumps({"type": "session.resume", "session_id": "nope", "sentence_index": 0, "bytes_received": 0}))
            error = json.loads(await ws.recv())
            assert (error["code"], error["retryable"]) == ("session_not_found", False)
            await ws.send(config_message())  # the socket is still usable for a new session
            assert json.loads(await ws.recv())["type"] == "session.started"

        listener = Listener()
        async with websockets.connect(a.ws_url, max_size=None) as ws:
            await start_session(ws, listener, "Just one sentence.")
            await listener.receive(ws, "session.done")
        for index, received in [(5, 0), (0, 10**9), (1, 1)]:
            async with websockets.connect(a.ws_url, max_size=None) as ws:
                await ws.send(json.dumps({"type": "session.resume", "session_id": listener.session_id,
                                          "sentence_index": index, "bytes_received": received}))
                error = json.loads(await ws.recv())
                assert error["type"] == "error" and error["code"] == "resume_out_of_range", error
        async with websockets.connect(a.ws_url, max_size=None) as ws:  # the end of everything is in range
            await ws.send(listener.resume_message())
            assert json.loads(await ws.recv())["type"] == "session.started"
            await ws.send(json.dumps({"type": "session.close"}))
            assert json.loads(await ws.recv()) == {"type": "session.done", "total_sentences": 1}
        async with websockets.connect(a.ws_url, max_size=None) as ws:  # session.close finished it
            await ws.send(listener.resume_message())
            assert json.loads(await ws.recv())["code"] == "session_not_found"


async def test_python_client_fails_over_to_the_next_replica_on_its_own(redis_prefix):  # noqa: F811
    """voxgate_client with both replicas' URLs: A dies mid-sentence, the client resumes on B unaided."""
    import voxgate_client as vg

    with gateways(REDIS_URL, redis_prefix, 2, *PACED) as (a, b):
        reference = await uninterrupted_pcm(b.ws_url, TEXT)
        pcm = bytearray()
        reconnected = None
        async with vg.connect([a.ws_url, b.ws_url], vg.SessionConfig(voice="tone-mid"), backoff_initial_s=0.01) as session:
            await session.send_text(TEXT)
            await session.done()
            async for event in session.events():
                if isinstance(event, vg.AudioChunk):
                    pcm += event.data
                    if a.process.poll() is None and event.sentence_index == 1 and event.offset >= 4 * 1920:
                        a.kill()
                elif isinstance(event, vg.Reconnected):
                    reconnected = event
                elif isinstance(event, vg.Error):
                    pytest.fail(f"error after failover: {event}")
                elif isinstance(event, vg.SessionDone):
                    break
    assert reconnected is not None and reconnected.url == b.ws_url and reconnected.sentence_index == 1
    assert bytes(pcm) == reference
