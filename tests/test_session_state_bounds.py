"""Bounded session state (issue 12, item 8): sentence records of finished or cancelled sentences are
pruned, a resume still replays byte-exactly what the replay log covers, a resume reads only the part of
the log it replays, and `context_id` has a length limit."""

from __future__ import annotations

import contextlib
import json

import pytest
import redis
import websockets

from gateway.store.base import MAX_ENDS_KEPT
from tests.gateway_server import HeldSynthesizer, running_gateway
from tests.redis_fixtures import REDIS_URL, RedisProxy, redis_prefix  # noqa: F401 (fixture)
from tests.resume_fixtures import Listener, config_message, start_session, uninterrupted_pcm

# ~99 KB of short sentences: one input.text releases about 9,000 sentences.
FLOOD_TEXT = "Go on now. " * 9000


def sentence_records(server, session_id: str) -> tuple[int, int | None]:
    """(sentence records, bytes of the session's text/state/bytes hashes in Redis; None in memory)."""
    store = server.gateway.store
    if server.settings.store == "memory":
        return len(server.call(store.get, session_id).sentences), None
    keys = store.keys(session_id)
    client = redis.Redis.from_url(REDIS_URL)
    records = client.hlen(keys[2])
    memory = sum(client.memory_usage(key, samples=0) or 0 for key in keys[2:5])
    return records, memory


def marker_records(server, session_id: str) -> tuple[int, int | None]:
    """(utterance-end records, bytes of the session's markers hash in Redis; None in memory)."""
    store = server.gateway.store
    if server.settings.store == "memory":
        return len(server.call(store.get, session_id).markers), None
    key = store.keys(session_id)[5]
    client = redis.Redis.from_url(REDIS_URL)
    return client.hlen(key), client.memory_usage(key, samples=0) or 0


@pytest.mark.parametrize("store", ["memory", "redis"])
@pytest.mark.parametrize("ended", [False, True], ids=["open", "ended"])
async def test_a_text_and_cancel_flood_leaves_few_sentence_records(store, ended, redis_prefix):  # noqa: F811
    """8 x (99 KB input.text + input.cancel), each utterance still open or ended by input.done: an end
    cancelled before it went out is never sent, so its record goes too."""
    with running_gateway(backend="synthetic", store=store, redis_key_prefix=redis_prefix) as server:
        listener = Listener()
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await ws.send(config_message())
            await listener.receive(ws, "session.started")
            for _ in range(8):
                await ws.send(json.dumps({"type": "input.text", "text": FLOOD_TEXT, "context_id": "c"}))
                if ended:
                    await ws.send(json.dumps({"type": "input.done", "context_id": "c"}))
                await ws.send(json.dumps({"type": "input.cancel", "context_id": "c"}))
                await listener.receive(ws, "context.cancelled")
            records, memory = sentence_records(server, listener.session_id)
            ends, _ = marker_records(server, listener.session_id)
            # Sentence indices go on from the count of sentences released, pruned or not.
            await ws.send(json.dumps({"type": "input.text", "text": "The end.", "context_id": "d"}))
            await ws.send(json.dumps({"type": "input.done", "context_id": "d"}))
            end = await listener.receive(ws, "audio.start")
            await listener.receive(ws, "utterance.done")
    print(f"{store}: after 8 x (99 KB input.text + input.cancel): {end['sentence_index']} sentences released,"
          f" {records} records, {memory} bytes in the sentence hashes")
    # The flood happened (without input.done the last "Go on now." of each stays open).
    assert end["sentence_index"] == 8 * (9000 if ended else 8999)
    assert ends == 0  # before: 8 records of ends never sent
    assert not any(m["type"] == "utterance.done" and m["context_id"] == "c" for m in listener.messages)
    # Only sentences whose audio the replay log still holds are kept (here the cancels come before any
    # audio); without pruning every released sentence stays (before: 71,992 records, 16.8 MB).
    assert records < 200
    # Redis 7.0 does not shrink a hash's table after HDEL: input.done released 9,000 sentences into it at
    # once, and it keeps the table of that size (about 148 KB) with 8 records in it.
    assert memory is None or memory < (256 if ended else 64) * 1024


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_a_pruned_session_resumes_byte_exact_where_its_log_reaches(store, redis_prefix):  # noqa: F811
    """A replay log of 40 KB (under 1 s of audio) over 12 sentences of 150 KB each: the records of the
    early sentences are pruned, the session still resumes byte-exactly from a position the log holds, a
    position before it is resume_out_of_range, and the next sentence index is still right."""
    text = " ".join(f"Sentence number {n} is spoken a little while here." for n in range(12))
    options = dict(store=store, redis_key_prefix=redis_prefix, replay_log_bytes=40_000)
    with running_gateway(backend="synthetic", **options) as server:
        reference = await uninterrupted_pcm(server.ws_url, text)
        listener = Listener()
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await start_session(ws, listener, text, done=False)
            await ws.send(json.dumps({"type": "input.flush"}))
            while listener.last_done < 11:
                await listener.receive(ws, "audio.done")
        record = server.call(server.gateway.store.get, listener.session_id)
        assert len(record.sentences) <= 2  # only what the log holds
        # The client lost the last 30,000 bytes: replayed from the log, byte for byte.
        last = listener.audio[11]
        kept = len(last) - 30_000
        listener.audio[11] = last[:kept]
        listener.open_sentence, listener.last_done = 11, 10
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await ws.send(listener.resume_message())
            started = await listener.receive(ws, ("session.started", "error"))
            assert started["type"] == "session.started", started
            await ws.send(json.dumps({"type": "input.done"}))
            done = await listener.receive(ws, ("session.done", "error"))
        assert done == {"type": "session.done", "total_sentences": 12}
        assert listener.pcm() == reference
        for index, received in [(0, 0), (9, 0), (10, 0)]:  # pruned, or older than the log
            async with websockets.connect(server.ws_url, max_size=None) as ws:
                await ws.send(json.dumps({"type": "session.resume", "session_id": listener.session_id,
                                          "sentence_index": index, "bytes_received": received}))
                error = json.loads(await ws.recv())
                assert error["code"] == "resume_out_of_range", error


@pytest.mark.parametrize("store", ["memory", "redis"])
@pytest.mark.parametrize("context_id", [None, "c"])
@pytest.mark.parametrize("spoken", [True, False], ids=["spoken", "empty"])
async def test_a_flood_of_short_utterances_leaves_few_end_records(store, context_id, spoken, redis_prefix):  # noqa: F811
    """300 x (input.text + input.done) with a replay log of 20 KB (a few utterances' audio): the records of
    ends sent before the log's audio are pruned. 1,500 x input.done without text (no audio ever): the
    oldest sent ends past MAX_ENDS_KEPT are. Either way ends_received still gets exactly the ends the
    client lacks: none, the last one, or resume_out_of_range for ends no longer kept."""
    utterances = 300 if spoken else MAX_ENDS_KEPT + 500
    end_type = "session.done" if context_id is None else "utterance.done"
    # All sent at once: none may be refused for waiting behind the others (max_pending_ends).
    options = dict(store=store, redis_key_prefix=redis_prefix, replay_log_bytes=20_000, max_pending_ends=utterances)
    with running_gateway(backend="synthetic", **options) as server:
        listener = Listener()
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await ws.send(config_message())
            await listener.receive(ws, "session.started")
            for _ in range(utterances):
                if spoken:
                    await ws.send(json.dumps({"type": "input.text", "text": "Go on.", "context_id": context_id}))
                await ws.send(json.dumps({"type": "input.done", "context_id": context_id}))
            for _ in range(utterances):
                await listener.receive(ws, end_type)
        records, memory = marker_records(server, listener.session_id)
        print(f"{store}, context {context_id}, spoken {spoken}: after {utterances} utterances:"
              f" {records} end records, {memory} bytes in the markers hash")
        # Without pruning every end stays (300 records and about 60 KB in Redis; 1,500 and 310 KB), for as
        # long as the session.
        if spoken:
            assert records < 30 and (memory is None or memory < 8 * 1024)
        else:
            assert records <= MAX_ENDS_KEPT and (memory is None or memory < 250 * 1024)
        assert listener.last_done == (utterances - 1 if spoken else -1)

        async def resume(ends_received: int) -> list[dict]:
            """A resume at the client's position counting `ends_received` ends; what it is sent."""
            resumed = Listener(session_id=listener.session_id, last_done=listener.last_done)
            message = json.loads(listener.resume_message()) | {"ends_received": ends_received}
            async with websockets.connect(server.ws_url, max_size=None) as ws:
                await ws.send(json.dumps(message))
                first = await resumed.receive(ws, ("session.started", "error"))
                if first["type"] == "error":
                    return [first]
                await ws.send(json.dumps({"type": "ping", "id": "p"}))  # after anything the resume sends
                await resumed.receive(ws, "pong")
            return [m for m in resumed.messages if m["type"] not in ("session.started", "pong")]

        assert await resume(utterances) == []
        assert [m["type"] for m in await resume(utterances - 1)] == [end_type]
        [refused] = await resume(0)
        assert refused["code"] == "resume_out_of_range" and "no longer kept" in refused["message"], refused
        assert (await resume(utterances + 1))[0]["code"] == "resume_out_of_range"
        # The session goes on numbering after the pruned ends: one more utterance, one more end.
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            resumed = Listener(session_id=listener.session_id, last_done=listener.last_done)
            await ws.send(json.dumps(json.loads(listener.resume_message()) | {"ends_received": utterances}))
            await resumed.receive(ws, "session.started")
            await ws.send(json.dumps({"type": "input.text", "text": "The end.", "context_id": context_id}))
            await ws.send(json.dumps({"type": "input.done", "context_id": context_id}))
            end = await resumed.receive(ws, end_type)
        assert resumed.last_done == (utterances if spoken else 0)
        assert end.get("total_sentences") == (1 if context_id or not spoken else utterances + 1), end


@contextlib.asynccontextmanager
async def spoken_through_a_counting_proxy(redis_prefix: str, sentences: int):  # noqa: F811
    """A gateway whose Redis traffic passes a byte-counting proxy, and a session that has spoken `sentences`
    long sentences to the end; yields (server, listener, proxy)."""
    text = " ".join(f"Sentence number {n} is spoken for a while, and then some more." for n in range(sentences))
    proxy = RedisProxy()
    try:
        with running_gateway(backend="synthetic", store="redis", redis_url=proxy.url, redis_key_prefix=redis_prefix,
                             session_lease_s=60) as server:
            listener = Listener()
            async with websockets.connect(server.ws_url, max_size=None) as ws:
                await start_session(ws, listener, text)
                await listener.receive(ws, "session.done")
            yield server, listener, proxy
    finally:
        proxy.close()


async def test_a_resume_reads_only_the_part_of_the_log_it_replays(redis_prefix):  # noqa: F811
    """3 MB of audio in the replay log; a client that lacks only the last 20,000 bytes resumes. Redis
    sends the gateway little more than those bytes (before: the whole log, every resume)."""
    async with spoken_through_a_counting_proxy(redis_prefix, 20) as (server, listener, proxy):
        logged = sum(map(len, listener.audio.values()))
        assert logged > 3_000_000
        last = max(listener.audio)
        complete = bytes(listener.audio[last])
        listener.audio[last] = listener.audio[last][:-20_000]
        listener.open_sentence, listener.last_done = last, last - 1
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            before = proxy.from_redis
            await ws.send(listener.resume_message())
            await listener.receive(ws, "audio.done")
            read = proxy.from_redis - before
    assert bytes(listener.audio[last]) == complete
    print(f"one resume read {read} bytes from Redis ({logged} bytes in the replay log)")
    assert read < 20_000 + 100_000


async def test_a_resume_reads_the_audio_it_replays_once(redis_prefix):  # noqa: F811
    """A client that lacks its last five sentences (about 1 MB of the log) resumes: Redis sends the
    gateway those bytes once, plus the session's hashes. Before, the position was checked by reading the
    owed audio before the takeover and read again after it: twice the bytes."""
    async with spoken_through_a_counting_proxy(redis_prefix, 12) as (server, listener, proxy):
        last = max(listener.audio)
        lacking = range(last - 4, last + 1)
        complete = {i: bytes(listener.audio.pop(i)) for i in lacking}
        owed = sum(map(len, complete.values()))
        assert owed > 900_000
        listener.last_done = lacking[0] - 1
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            before = proxy.from_redis
            await ws.send(listener.resume_message())
            while listener.last_done < last:
                await listener.receive(ws, "audio.done")
            read = proxy.from_redis - before
    assert {i: bytes(listener.audio[i]) for i in lacking} == complete
    print(f"one resume owed {owed} bytes and read {read} bytes from Redis")
    assert read < owed + 100_000


async def test_context_id_has_a_length_limit():
    with running_gateway(backend="synthetic") as server:
        listener = Listener()
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await ws.send(config_message())
            await listener.receive(ws, "session.started")
            for kind in ("input.text", "input.flush", "input.done", "input.cancel"):
                message = {"type": kind, "context_id": "c" * 129}
                if kind == "input.text":
                    message["text"] = "Never spoken."
                await ws.send(json.dumps(message))
                error = await listener.receive(ws, "error")
                assert error["code"] == "invalid_message" and "128" in error["message"], error
                assert "c" * 129 not in json.dumps(error)  # the over-long id is not echoed
            # Non-fatal: the session goes on, and an id of 128 characters is fine.
            await ws.send(json.dumps({"type": "input.text", "text": "Spoken.", "context_id": "c" * 128}))
            await ws.send(json.dumps({"type": "input.done", "context_id": "c" * 128}))
            done = await listener.receive(ws, "utterance.done")
        assert done["context_id"] == "c" * 128 and done["total_sentences"] == 1
        assert [m["sentence_text"] for m in listener.messages if m["type"] == "audio.start"] == ["Spoken."]


@pytest.mark.parametrize("store", ["memory", "redis"])
@pytest.mark.parametrize("contexts", [False, True], ids=["no-context", "contexts"])
@pytest.mark.parametrize("spoken", [True, False], ids=["spoken", "empty"])
async def test_utterance_ends_waiting_behind_held_audio_are_bounded(store, contexts, spoken, redis_prefix):  # noqa: F811
    """While the backend holds the first sentence, 200 input.done (each after a little text, or empty) pile
    up behind it. Before: all queued, with as many end records in the store. Now past max_pending_ends
    each is refused with rate_limited (retryable, its context named), and its utterance stays open with
    its text; once the audio has gone out every accepted end is answered exactly once, in order, and
    input.done sent again is accepted and speaks the text the refused ones left open."""
    limit, flood = 8, 200
    backend = HeldSynthesizer()
    hold = "hold" if contexts else None
    end_type = "utterance.done" if contexts else "session.done"

    def context(i: int) -> str | None:
        return f"c{i}" if contexts else None

    def ends() -> list[dict]:
        return [m for m in listener.messages if m["type"] == end_type]

    async def receive_ends(count: int) -> None:
        while len(ends()) < count:
            await listener.receive(ws, end_type)

    with running_gateway(backend, store=store, redis_key_prefix=redis_prefix, max_pending_ends=limit) as server:
        listener = Listener()
        try:
            async with websockets.connect(server.ws_url, max_size=None) as ws:
                await ws.send(config_message())
                await listener.receive(ws, "session.started")
                await ws.send(json.dumps({"type": "input.text", "text": "Please HOLD this one.", "context_id": hold}))
                await ws.send(json.dumps({"type": "input.done", "context_id": hold}))
                await listener.receive(ws, "audio.start")  # the held sentence: nothing after it goes out
                for i in range(flood):
                    if spoken:
                        await ws.send(json.dumps({"type": "input.text", "text": f"Go on {i}. ", "context_id": context(i)}))
                    await ws.send(json.dumps({"type": "input.done", "context_id": context(i)}))
                await ws.send(json.dumps({"type": "ping", "id": "flooded"}))
                await listener.receive(ws, "pong")  # every input.done above has been handled
                records, memory = marker_records(server, listener.session_id)
                refusals = [m for m in listener.messages if m["type"] == "error"]
                # The held utterance's end and the first limit - 1 of the flood wait; the rest are refused.
                accepted = limit - 1
                assert [(m["code"], m["retryable"], m.get("context_id")) for m in refusals] == [
                    ("rate_limited", True, context(i)) for i in range(accepted, flood)
                ], refusals[:3]
                assert ends() == []
                print(f"{store}, contexts {contexts}, spoken {spoken}: {flood} input.done behind held audio:"
                      f" {len(refusals)} refused, {records} end records ({memory} bytes in Redis)")
                assert records <= limit  # before: one per input.done (201)

                backend.released.set()
                await receive_ends(limit)
                # Sent again once the audio has gone out, in batches the bound admits: all accepted.
                refused = [context(i) for i in range(accepted, flood)]
                if not contexts:
                    refused = [None]  # one open utterance holds the text of every refused one
                while refused:
                    batch, refused = refused[:limit], refused[limit:]
                    for context_id in batch:
                        await ws.send(json.dumps({"type": "input.done", "context_id": context_id}))
                    await receive_ends(len(ends()) + len(batch))
                await ws.send(json.dumps({"type": "ping", "id": "drained"}))
                await listener.receive(ws, "pong")
        finally:
            backend.released.set()
    errors = [m for m in listener.messages if m["type"] == "error"]
    assert len(errors) == flood - accepted  # nothing refused once the ends have gone out
    if contexts:  # each context ended exactly once, in the order its input.done was accepted
        assert [m["context_id"] for m in ends()] == ["hold", *(f"c{i}" for i in range(flood))]
    else:
        assert len(ends()) == limit + 1
    starts = [m for m in listener.messages if m["type"] == "audio.start"]
    spoken_text = " ".join(m["sentence_text"] for m in starts)
    expected = " ".join(["Please HOLD this one.", *(f"Go on {i}." for i in range(flood) if spoken)])
    if contexts:  # sentences of different contexts may interleave: compare per context
        by_context = {m["context_id"]: m["sentence_text"] for m in starts}
        assert len(by_context) == len(starts)
        assert by_context == {"hold": "Please HOLD this one.", **({f"c{i}": f"Go on {i}." for i in range(flood)} if spoken else {})}
    else:
        assert spoken_text == expected  # no text lost to a refusal


async def test_cancel_and_resume_keep_the_count_of_waiting_ends():
    """The count of ends waiting is kept by input.cancel (the dropped ends free their places) and by a
    resume (the ends it owes count)."""
    limit = 8
    backend = HeldSynthesizer()

    async def done(ws, listener: Listener, context_id: str) -> dict | None:
        """input.done for `context_id`; its refusal, or None once it is accepted (a ping answered)."""
        await ws.send(json.dumps({"type": "input.done", "context_id": context_id}))
        await ws.send(json.dumps({"type": "ping", "id": context_id}))
        await listener.receive(ws, "pong")
        error = listener.messages[-2]
        return error if error["type"] == "error" else None

    with running_gateway(backend, max_pending_ends=limit) as server:
        listener = Listener()
        try:
            async with websockets.connect(server.ws_url, max_size=None) as ws:
                await ws.send(config_message())
                await listener.receive(ws, "session.started")
                await ws.send(json.dumps({"type": "input.text", "text": "Please HOLD this one.", "context_id": "hold"}))
                await ws.send(json.dumps({"type": "input.done", "context_id": "hold"}))
                await listener.receive(ws, "audio.start")
                for _ in range(limit - 1):
                    assert await done(ws, listener, "a") is None
                assert (await done(ws, listener, "a"))["code"] == "rate_limited"
                await ws.send(json.dumps({"type": "input.cancel", "context_id": "a"}))
                await listener.receive(ws, "context.cancelled")
                for _ in range(limit - 1):  # the places of the cancelled ends are free again
                    assert await done(ws, listener, "b") is None
                assert (await done(ws, listener, "b"))["code"] == "rate_limited"
            # A resume, audio still held: it owes all eight ends, so the next input.done waits for them.
            resumed = Listener(session_id=listener.session_id)
            message = json.loads(listener.resume_message()) | {"ends_received": 0}
            async with websockets.connect(server.ws_url, max_size=None) as ws:
                await ws.send(json.dumps(message))
                await resumed.receive(ws, "session.started")
                refusal = await done(ws, resumed, "c")
                assert refusal is not None and refusal["code"] == "rate_limited", refusal
                backend.released.set()
                for count in (limit, limit + 1):  # the owed ends, then (sent again) that of "c"
                    while sum(m["type"] == "utterance.done" for m in resumed.messages) < count:
                        await resumed.receive(ws, "utterance.done")
                    if count == limit:
                        assert await done(ws, resumed, "c") is None
        finally:
            backend.released.set()
    assert [m["context_id"] for m in resumed.messages if m["type"] == "utterance.done"] == [
        "hold", *["b"] * (limit - 1), "c"]
    assert not any(m["type"] == "utterance.done" for m in listener.messages)
