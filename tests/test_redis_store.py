"""RedisSessionStore against a real Redis: the same records, replay and bounds as the memory store,
plus leases (a takeover fences the old owner out), expiry and the one-round-trip append."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from gateway.store.redis import RedisSessionStore
from gateway.store.base import MAX_ENDS_KEPT, AppendMismatch, LeaseLost, MarkerRecord, ReplayOutOfRange
from gateway.store.memory import MemorySessionStore
from gateway.store.factory import create_store
from tests.redis_fixtures import REDIS_URL, redis_cluster, redis_prefix  # noqa: F401 (fixture)


@pytest.fixture(params=["memory", "redis", "cluster"])
async def make_store(request, redis_prefix):  # noqa: F811
    stores = []

    async def make(**options):
        if request.param == "memory":
            store = MemorySessionStore(**options)
        elif request.param == "cluster":
            store = RedisSessionStore(request.getfixturevalue("redis_cluster").url, key_prefix=redis_prefix,
                                      cluster=True, **options)
        else:
            store = RedisSessionStore(REDIS_URL, key_prefix=redis_prefix, **options)
        await store.start()
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.stop()


async def filled(store, owner=None):
    await store.create("s1", {"voice": "v"}, owner=owner)
    for index, text in enumerate(["Zero.", "One.", "Two."]):
        await store.add_sentence("s1", index, text, None, utterance=1, owner=owner)
        await store.set_sentence_state("s1", index, "speaking", owner=owner)
        for piece in range(3):
            await store.append_audio("s1", index, bytes([index * 10 + piece]) * 100, offset=piece * 100, owner=owner)
        await store.set_sentence_state("s1", index, "done", owner=owner)
    return store


async def test_records_sentences_markers_open_text(make_store):
    store = await filled(await make_store(), owner="a")
    await store.add_marker("s1", MarkerRecord(number=1, after=3, context_id="c", utterance=1, total_sentences=3), owner="a")
    await store.set_open_text("s1", "c", 2, "Half a sent", owner="a")
    await store.set_open_text("s1", None, 3, "x", owner="a")
    await store.set_open_text("s1", None, 3, None, owner="a")
    record = await store.get("s1")
    assert record.config == {"voice": "v"} and record.owner == "a" and record.attached
    assert [(s.text, s.state, s.bytes_sent, s.utterance) for s in record.sentences.values()] == [
        ("Zero.", "done", 300, 1), ("One.", "done", 300, 1), ("Two.", "done", 300, 1)
    ]
    assert record.markers[1].after == 3 and record.markers[1].context_id == "c" and not record.markers[1].sent
    assert list(record.open_utterances) == ["c"] and record.open_utterances["c"].text == "Half a sent"


async def test_utterance_end_records_are_pruned_in_send_order(make_store):
    """Both stores alike: a cancelled end goes at once; past MAX_ENDS_KEPT the oldest sent ends go, counted
    in ends_pruned (never twice: a pruned end written again is not kept), and the numbering survives."""
    store = await make_store()
    await store.create("s1", {})
    await store.add_marker("s1", MarkerRecord(number=1, after=0, context_id="c", utterance=1, total_sentences=0))
    await store.add_marker("s1", MarkerRecord(number=1, after=-1, context_id="c", utterance=1, total_sentences=0,
                                              sent=True))  # cancelled before it went out
    for number in range(2, MAX_ENDS_KEPT + 12):
        end = MarkerRecord(number=number, after=0, context_id=None, utterance=number, total_sentences=0)
        await store.add_marker("s1", end)
        end.sent = True
        await store.add_marker("s1", end)
    record = await store.get("s1")
    assert len(record.markers) == MAX_ENDS_KEPT and min(record.markers) == 12
    assert (record.ends_pruned, record.last_marker, record.last_utterance) == (10, MAX_ENDS_KEPT + 11, MAX_ENDS_KEPT + 11)
    await store.add_marker("s1", MarkerRecord(number=5, after=0, context_id=None, utterance=5, total_sentences=0,
                                              sent=True))  # a late update of a pruned end
    record = await store.get("s1")
    assert 5 not in record.markers and record.ends_pruned == 10


async def test_replay_exact_bytes_and_bounds(make_store):
    store = await filled(await make_store(replay_log_bytes=450))
    assert [(p.sentence_index, p.offset, len(p.data)) for p in await store.replay("s1", 1, 250)] == [
        (1, 250, 50), (2, 0, 100), (2, 100, 100), (2, 200, 100)
    ]
    assert (await store.replay("s1", 1, 250))[0].data == bytes([12]) * 50
    assert await store.replay("s1", 3, 0) == []  # right after everything
    for position in [(0, 0), (1, 150), (2, 301), (4, 0), (3, 1)]:
        with pytest.raises(ReplayOutOfRange):
            await store.replay("s1", *position)


async def test_an_append_delivered_twice_changes_nothing(make_store):
    """An append names its offset in the sentence: one delivered again (a retry after the connection broke
    before the reply came) is recorded once; one past the recorded bytes is refused."""
    store = await make_store()
    await store.create("s1", {}, owner="a")
    await store.add_sentence("s1", 0, "Zero.", None, owner="a")
    for offset, data in [(0, b"a" * 10), (0, b"a" * 10), (10, b"b" * 5), (0, b"a" * 10), (10, b"b" * 5)]:
        await store.append_audio("s1", 0, data, offset=offset, owner="a")
    assert (await store.get("s1")).sentences[0].bytes_sent == 15
    assert b"".join(p.data for p in await store.replay("s1", 0, 0)) == b"a" * 10 + b"b" * 5
    with pytest.raises(AppendMismatch):
        await store.append_audio("s1", 0, b"c", offset=16, owner="a")


async def test_replay_log_is_capped_in_time(make_store):
    """Old audio leaves the log (memory: on the next append; Redis: on the next lease renewal)."""
    store = await make_store(replay_log_s=0.2)
    await store.create("s1", {}, owner="a")
    await store.add_sentence("s1", 0, "Zero.", None, owner="a")
    await store.append_audio("s1", 0, b"a" * 10, offset=0, owner="a")
    await asyncio.sleep(0.3)
    await store.append_audio("s1", 0, b"b" * 10, offset=10, owner="a")
    await store.renew("s1", "a")
    assert [p.data for p in await store.replay("s1", 0, 10)] == [b"b" * 10]
    with pytest.raises(ReplayOutOfRange):
        await store.replay("s1", 0, 0)


async def test_claim_takes_the_lease_over_and_fences_the_old_owner(make_store):
    store = await filled(await make_store(), owner="old")
    record = await store.claim("s1", "new")
    assert record is not None and record.owner == "new" and record.attached
    for write in (
        store.append_audio("s1", 2, b"late", offset=300, owner="old"),
        store.set_sentence_state("s1", 2, "failed", owner="old"),
        store.renew("s1", "old"),
    ):
        with pytest.raises(LeaseLost):
            await write
    await store.detach("s1", owner="old")  # a no-op: the old owner no longer holds it
    assert (await store.get("s1")).attached
    await store.append_audio("s1", 2, b"more", offset=300, owner="new")
    assert (await store.get("s1")).sentences[2].bytes_sent == 304
    await store.detach("s1", owner="new")
    record = await store.get("s1")
    assert not record.attached and record.owner is None
    assert await store.claim("gone", "x") is None
    await store.delete("s1", owner="new")
    assert await store.get("s1") is None
    with pytest.raises(LeaseLost):
        await store.renew("s1", "new")


async def test_redis_keys_expire_after_the_ttl_and_renew_extends_it(redis_prefix):  # noqa: F811
    store = RedisSessionStore(REDIS_URL, ttl_s=0.5, key_prefix=redis_prefix, lease_s=5)
    await store.start()
    try:
        await filled(store, owner="a")
        client = aioredis.Redis.from_url(REDIS_URL)
        keys = [k.decode() for k in await client.keys(f"{redis_prefix}*")]
        assert sorted(k.rsplit(":", 1)[1] for k in keys) == sorted(
            ["meta", "lease", "text", "state", "bytes", "log", "logend"]
        )
        assert all(k.startswith(redis_prefix + "{s1}:") for k in keys)
        for _ in range(3):
            await asyncio.sleep(0.3)
            await store.renew("s1", "a")
        assert await store.get("s1") is not None  # 0.9 s in, kept alive by renewals
        await asyncio.sleep(0.7)
        assert await store.get("s1") is None
        assert [k for k in await client.keys(f"{redis_prefix}*") if not k.endswith(b":lease")] == []
        await client.aclose()
    finally:
        await store.stop()


async def test_a_redis_append_is_one_round_trip(redis_prefix):  # noqa: F811
    store = RedisSessionStore(REDIS_URL, key_prefix=redis_prefix)
    await store.start()
    try:
        await store.create("s1", {}, owner="a")
        await store.add_sentence("s1", 0, "Zero.", None, owner="a")
        calls = []
        connection_class = store.redis.connection_pool.connection_class
        original = connection_class.send_packed_command

        async def counting(self, command, *args, **kwargs):
            calls.append(command)
            return await original(self, command, *args, **kwargs)

        connection_class.send_packed_command = counting
        try:
            await store.append_audio("s1", 0, b"x" * 4800, offset=0, owner="a")
        finally:
            connection_class.send_packed_command = original
        assert len(calls) == 1
    finally:
        await store.stop()


async def test_unreachable_redis_fails_at_start_with_a_clear_error():
    store = create_store("redis", ttl_s=1, replay_log_bytes=1, redis_url="redis://127.0.0.1:1/0")
    with pytest.raises(RuntimeError, match="does not answer"):
        await store.start()


async def test_a_resume_check_reads_the_log_as_its_record_saw_it(redis_prefix):  # noqa: F811
    """A resume checks its position before it takes the session over, while the owner may still be
    appending: the replay holds exactly the bytes the record it read knows of, not the newer ones."""
    store = RedisSessionStore(REDIS_URL, key_prefix=redis_prefix)
    await store.start()
    try:
        await filled(store, owner="a")
        record = await store.get("s1")
        await store.append_audio("s1", 2, b"n" * 30, offset=300, owner="a")  # the live owner goes on
        pieces = await store.replay("s1", 2, 200, record=record)
        assert [(p.sentence_index, p.offset, len(p.data)) for p in pieces] == [(2, 200, 100)]
    finally:
        await store.stop()


async def test_a_spoken_sentence_keeps_its_codes_bounded_until_it_ends(make_store):
    """Issue 33: the codes of a sentence's delivered audio, with the byte they resume at, kept while it is
    spoken, idempotent and bounded like the audio, and dropped when it ends (the same in every store)."""
    store = await make_store()
    await store.create("s1", {"voice": "v"}, owner="a")
    await store.add_sentence("s1", 0, "Zero and more.", None, owner="a")
    await store.set_sentence_state("s1", 0, "speaking", owner="a")
    frame = bytes(range(32))
    await store.append_audio("s1", 0, b"\1" * 400, offset=0, owner="a")
    await store.append_codes("s1", 0, frame, offset=0, at=300, limit=128, owner="a")
    await store.append_codes("s1", 0, frame, offset=0, at=300, limit=128, owner="a")  # delivered twice
    await store.append_codes("s1", 0, frame[::-1] * 2, offset=32, at=400, limit=128, owner="a")
    sentence = (await store.get("s1")).sentences[0]
    assert (sentence.codes, sentence.codes_at) == (frame + frame[::-1] * 2, 400)
    for offset, at, limit in ((128, 400, 256), (96, 401, 256), (96, 400, 100)):  # a gap, past the audio, the bound
        with pytest.raises(AppendMismatch):
            await store.append_codes("s1", 0, frame, offset=offset, at=at, limit=limit, owner="a")
    with pytest.raises(LeaseLost):
        await store.append_codes("s1", 0, frame, offset=96, at=400, limit=256, owner="b")
    await store.append_codes("s1", 7, frame, offset=0, at=0, limit=256, owner="a")  # no such sentence: nothing
    await store.set_sentence_state("s1", 0, "done", owner="a")
    sentence = (await store.get("s1")).sentences[0]
    assert (sentence.codes, sentence.codes_at, sentence.bytes_sent) == (b"", 0, 400)
    await store.append_codes("s1", 0, frame, offset=0, at=0, limit=256, owner="a")  # finished: keeps none
    assert (await store.get("s1")).sentences[0].codes == b""
