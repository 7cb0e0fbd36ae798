"""Resume on its own (gateway/session/resume.py): `Resumer.take_over` against a memory store holding a
session another connection wrote, and `rebuild` from what it read. No server and no socket: the session's
record is written through the store's interface, as a connection writes it."""

from __future__ import annotations

import pytest

from gateway.protocol import ErrorCode, ProtocolError, SessionResume
from gateway.session.data import SentenceJob, SessionEnd, Utterance, UtteranceEnd
from gateway.session.resume import Resumer, rebuild
from gateway.session.segmenter import SentenceSegmenter
from gateway.store.base import (
    LeaseLost,
    MarkerRecord,
    OpenUtterance,
    SentenceRecord,
    SessionChanges,
)
from gateway.store.memory import MemorySessionStore
from tests.session_parts import resolved_config

SESSION = "s-resumed"
KEY = "key-a"
FIRST, SECOND = b"\x01" * 600 + b"\x02" * 400, b"\x03" * 300


async def written_session(*, closed: bool = False) -> MemorySessionStore:
    """A session as its first connection ("old") left it: utterance 1 (two sentences, the first sent and
    recorded whole, the second partly) ended by input.done, utterance 2 still taking text; 3 inputs handled.
    `closed`: session.close came after, so its session.done is owed too."""
    store = MemorySessionStore()
    await store.create(SESSION, resolved_config().snapshot(), owner="old", key_id=KEY)
    markers = [MarkerRecord(number=1, after=2, context_id=None, utterance=1, total_sentences=2)]
    if closed:
        markers.append(MarkerRecord(number=2, after=2, context_id=None, utterance=0, total_sentences=0,
                                    session_end=True))
    await store.apply(SESSION, SessionChanges(
        sentences=[SentenceRecord(0, "First.", None, utterance=1), SentenceRecord(1, "Second.", None, utterance=1)],
        markers=markers,
        open_text={None: OpenUtterance(None, 2, "Still being", 0)},
        inputs_received=3,
    ), owner="old")
    await store.append_audio(SESSION, 0, FIRST[:600], offset=0, owner="old")
    await store.append_audio(SESSION, 0, FIRST[600:], offset=600, owner="old")
    await store.set_sentence_state(SESSION, 0, "done", owner="old")
    await store.append_audio(SESSION, 1, SECOND, offset=0, owner="old")
    await store.set_sentence_state(SESSION, 1, "speaking", owner="old")
    return store


def resumer(store: MemorySessionStore, key_id: str = KEY) -> Resumer:
    async def resolve(recorded: dict):
        assert recorded == resolved_config().snapshot()  # as the first connection recorded it
        return resolved_config()

    return Resumer(store, owner="new", key_id=key_id, resolve=resolve)


def position(sentence_index: int = 0, bytes_received: int = 600, **fields) -> SessionResume:
    return SessionResume(type="session.resume", session_id=SESSION, sentence_index=sentence_index,
                         bytes_received=bytes_received, **fields)


async def test_take_over_moves_the_lease_and_reads_what_the_client_lacks():
    store = await written_session()
    resumed = await resumer(store).take_over(position())
    assert [(p.sentence_index, p.data) for p in resumed.pieces] == [(0, FIRST[600:]), (1, SECOND)]
    assert resumed.config == resolved_config() and resumed.record.inputs_received == 3
    with pytest.raises(LeaseLost):  # the old connection's next write ends it
        await store.renew(SESSION, "old")
    await store.renew(SESSION, "new")


@pytest.mark.parametrize("refused, code", [
    ({"key_id": "key-b"}, ErrorCode.session_not_found),  # another key is told it does not exist
    ({"session_id": "s-unknown"}, ErrorCode.session_not_found),
    ({"sentence_index": 5}, ErrorCode.resume_out_of_range),  # past what was ever released
    ({"ends_received": 4}, ErrorCode.resume_out_of_range),  # more ends than were ever sent
])
async def test_a_refused_take_over_changes_nothing(refused, code):
    store = await written_session()
    fields = {"sentence_index": refused.get("sentence_index", 0), "bytes_received": 600}
    if "ends_received" in refused:
        fields["ends_received"] = refused["ends_received"]
    message = position(**fields)
    if "session_id" in refused:
        message = message.model_copy(update={"session_id": refused["session_id"]})
    with pytest.raises(ProtocolError) as refusal:
        await resumer(store, refused.get("key_id", KEY)).take_over(message)
    assert refusal.value.code == code
    await store.renew(SESSION, "old")  # the old connection keeps the session
    assert (await store.get(SESSION)).owner == "old"


def utterance(context_id: str | None, number: int) -> Utterance:
    return Utterance(context_id, number, SentenceSegmenter("sentence"))


async def test_rebuild_owes_the_rest_in_send_order_and_reopens_the_open_utterance():
    store = await written_session()
    message = position()
    rebuilt = rebuild(await resumer(store).take_over(message), message, utterance)
    assert (rebuilt.inputs_received, rebuilt.sentences_released, rebuilt.utterance_count, rebuilt.marker_count) == (3, 2, 2, 1)
    assert not rebuilt.uses_contexts and not rebuilt.closing
    first, second, end = rebuilt.owed
    assert isinstance(first, SentenceJob) and isinstance(second, SentenceJob) and isinstance(end, UtteranceEnd)
    # Sentence 0 was recorded whole: its last 400 bytes are replayed, nothing is made again.
    assert (first.index, first.replay, first.bytes_sent, first.needs_synthesis) == (0, [FIRST[600:]], 600, False)
    # Sentence 1 was cut short: its logged bytes are replayed, then it is made again minus those bytes.
    assert (second.index, second.replay, second.skip_bytes, second.needs_synthesis) == (1, [SECOND], 300, True)
    assert first.utterance is second.utterance is end.utterance and end.utterance.sentences == 2
    assert (end.number, end.after) == (1, 2)
    [(reopened, text)] = rebuilt.reopened
    assert (reopened.number, reopened.context_id, text) == (2, None, "Still being")


async def test_rebuild_after_session_close_owes_its_session_done_and_takes_no_more_text():
    store = await written_session(closed=True)
    message = position(sentence_index=1, bytes_received=300)
    rebuilt = rebuild(await resumer(store).take_over(message), message, utterance)
    assert rebuilt.closing
    assert [type(item) for item in rebuilt.owed] == [SentenceJob, UtteranceEnd, SessionEnd]
    assert rebuilt.owed[0].index == 1 and rebuilt.owed[0].replay == []  # the client has all 300 bytes


async def test_the_client_that_counted_its_ends_is_owed_only_those_it_lacks():
    store = await written_session(closed=True)
    # utterance 1's session.done went out, and the client says it got it
    await store.add_marker(SESSION, MarkerRecord(number=1, after=2, context_id=None, utterance=1, total_sentences=2,
                                                 sent=True), owner="old")
    message = position(sentence_index=2, bytes_received=0, ends_received=1)
    rebuilt = rebuild(await resumer(store).take_over(message), message, utterance)
    assert [type(item) for item in rebuilt.owed] == [SessionEnd]
