"""Session state that outlives a connection, for `session.resume` (issue 5) and observability.

A session records its config, every sentence (text, utterance, state, bytes sent), the end-of-utterance
markers still owed to the client, the unreleased text of its open utterances, and a bounded replay log of
its most recent audio, so that (session_id, sentence_index, byte offset) names any byte ever sent and a
client that reconnects - to this process or, with the Redis store, to any replica - can be given exactly
what it missed and the rest of its session.

Ownership: a session belongs to the API key that created it (`key_id`, the key's fingerprint; None when
the gateway has no keys): `claim` by any other key finds nothing, exactly as if the session did not
exist. Within that, one connection owns a live session at a time, named by an opaque `owner` token.
`create` and `claim` (a resume) make the caller the owner, taking the session over from whoever held it;
every write that passes `owner=` is fenced: a connection that lost the session gets `LeaseLost` and must
stop.

Sessions expire `ttl_s` after their last activity while detached (memory) or after their last write or
lease renewal (Redis, where a killed replica cannot detach).

Bounded state: audio is recorded in send order, so the replay log holds the newest bytes of the session
and a position is resumable only while the log still holds every byte after it. A finished sentence older
than the log's oldest entry can never be resumed at again, and a sentence cancelled before any audio was
recorded is never spoken or replayed: both stores drop such sentence records (`prune_sentences`), so a
session that streams or cancels for hours keeps only the sentences its replay log covers. `released`
keeps the count of sentences, `trimmed_through` the newest sentence dropped for having left the log.
Utterance ends go the same way (`prune_markers`): one sent before a sentence now dropped for having left the
log precedes every position that can still be resumed, so no resume can owe it; `ends_pruned` counts those
that went out as a message, so that a resume's `ends_received` still says exactly which ends the client
lacks. Ends without audio between them (empty utterances) never leave the log that way: past
`MAX_ENDS_KEPT` records the oldest sent ones go too, and a resume that would owe one of them (by
`ends_received`, or by a position before it) is out of range. A cancelled end is never sent: its record
goes at once. `last_marker` and `last_utterance` keep the numbering going when every record that carried
the newest numbers is gone.

Codes (issue 33): a sentence being spoken by a backend with codes ("resume_codes", tts_backend/base.py) keeps
the codec codes of its audio delivered so far (`SentenceRecord.codes`, whole frames, uint16 LE) and the byte of
its recorded audio they resume at (`codes_at`, at most `bytes_sent`): a resume elsewhere in the middle of the
sentence continues it from them (the same take) instead of making it again. They are bounded by the
sentence's length (the caller's `limit`, tts_backend/base.py's max_code_bytes of its text) and dropped as soon
as the sentence is done, failed or cancelled; a session keeps codes for its open sentences only.
"""

from __future__ import annotations

import abc
import itertools
from dataclasses import dataclass, field
from typing import Any, Literal

MAX_ENDS_KEPT = 1000  # utterance-end records a session keeps beyond those its replay log covers

SentenceState = Literal["pending", "speaking", "done", "cancelled", "failed"]
FINISHED: tuple[SentenceState, ...] = ("done", "cancelled", "failed")


class ReplayOutOfRange(LookupError):
    """The requested position is no longer (or not yet) in the replay log."""


class LeaseLost(Exception):
    """Another connection (on this or another replica) took the session over, or it expired."""


class AppendMismatch(RuntimeError):
    """An audio append named an offset in its sentence that the recorded bytes neither reach nor pass."""

    def __init__(self, session_id: str, index: int, offset: int) -> None:
        super().__init__(f"session {session_id} sentence {index}: the store did not record the audio before"
                         f" byte {offset}")



@dataclass
class SentenceRecord:
    index: int
    text: str
    context_id: str | None
    state: SentenceState = "pending"
    bytes_sent: int = 0  # audio recorded for this sentence (recorded before it goes on the socket)
    utterance: int = 0  # the session's utterance number (SynthesisRequest.utterance_key)
    codes: bytes = b""  # while it is spoken: the codes of its audio delivered so far (module doc)
    codes_at: int = 0  # the byte of its recorded audio those codes resume at


@dataclass
class MarkerRecord:
    """An utterance end in the send order: `utterance.done` or `session.done` after `after` sentences."""

    number: int  # per session, in send order
    after: int  # sentences released before it
    context_id: str | None
    utterance: int
    total_sentences: int  # the utterance's sentences (utterance.done)
    by_close: bool = False  # ended by session.close
    session_end: bool = False  # session.close's own session.done
    sent: bool = False

    def makes_message(self, uses_contexts: bool) -> bool:
        """Whether this end is (or will be) sent as a message - what a resume's `ends_received` counts: not
        cancelled, and not an input.done ended by session.close in a session without contexts (its
        session.done is session.close's own). As the sender's `_send_utterance_end` decides."""
        return self.after >= 0 and (self.session_end or uses_contexts or self.context_id is not None or not self.by_close)


@dataclass
class OpenUtterance:
    """An utterance still taking text: its number and the text the segmenter has not released yet."""

    context_id: str | None
    utterance: int
    text: str
    sentences: int = 0  # sentences it released so far (their records may be pruned before it ends)
    # Text streaming: the sentence still being written (synthesizing from its first words), whose recorded
    # text is the start of `text`; None when there is none.
    open_sentence: int | None = None


@dataclass
class SessionRecord:
    session_id: str
    config: dict[str, Any]
    created_at: float
    last_active: float
    attached: bool = True
    sentences: dict[int, SentenceRecord] = field(default_factory=dict)
    markers: dict[int, MarkerRecord] = field(default_factory=dict)
    open_utterances: dict[str | None, OpenUtterance] = field(default_factory=dict)
    owner: str | None = None
    key_id: str | None = None  # fingerprint of the API key that created the session (None: anonymous)
    inputs_received: int = 0  # client input messages handled (see SessionChanges.inputs_received)
    uses_contexts: bool = False  # some message named a context_id: utterance ends are utterance.done
    released: int = 0  # sentences ever released: the next sentence index
    trimmed_through: int = -1  # the newest sentence pruned after its audio left the replay log
    ends_pruned: int = 0  # pruned utterance ends that went out as a message (MarkerRecord.makes_message)
    ends_pruned_after: int = 0  # the highest `after` of a pruned end: a position before it may lack it
    last_marker: int = 0  # the highest marker number ever recorded, pruned or not
    markers_pruned_through: int = 0  # the highest marker number pruned (they go in number order)
    last_utterance: int = 0  # the highest utterance number an utterance end ever recorded
    # The replay log as positions in the session's recorded audio: it holds bytes [log_start, log_end).
    log_start: int = 0
    log_end: int = 0


@dataclass
class SessionChanges:
    """What handling one client message changed, written in one atomic, fenced store call, so that the
    count of handled inputs (what `session.resume` acknowledges) never disagrees with their effects: after
    a crash either the message and everything it did is recorded, or none of it is and the client sends
    it again."""

    config: dict[str, Any] | None = None
    sentences: list[SentenceRecord] = field(default_factory=list)  # newly released (pending, no audio)
    # Recorded sentences whose text grew (text streaming: a sentence is recorded from its first words on);
    # only their text changes, a sentence no longer recorded stays so.
    sentence_texts: list[SentenceRecord] = field(default_factory=list)
    states: dict[int, SentenceState] = field(default_factory=dict)
    markers: list[MarkerRecord] = field(default_factory=list)
    open_text: dict[str | None, OpenUtterance | None] = field(default_factory=dict)  # None: closed
    inputs_received: int | None = None
    uses_contexts: bool | None = None

    def __bool__(self) -> bool:
        return bool(
            self.config is not None or self.sentences or self.sentence_texts or self.states or self.markers
            or self.open_text
            or self.inputs_received is not None or self.uses_contexts is not None
        )


@dataclass(frozen=True)
class ReplayPiece:
    sentence_index: int
    offset: int  # byte offset of `data` within its sentence's encoded audio
    data: bytes


def replay_owed(record: SessionRecord, sentence_index: int, byte_offset: int) -> int:
    """How many recorded bytes follow (sentence_index, byte_offset): the replay log must hold them all.
    Raises ReplayOutOfRange if the position was never sent or its audio has left the log. Audio is recorded
    in send order, so these are the newest bytes of the log, from position `log_end - owed` on."""
    if sentence_index > record.released or (sentence_index == record.released and byte_offset > 0):
        raise ReplayOutOfRange(f"sentence {sentence_index} was never released")
    if sentence_index <= record.trimmed_through:
        raise ReplayOutOfRange(f"sentence {sentence_index} is older than the replay log")
    sentence = record.sentences.get(sentence_index)  # pruned, below the log: cancelled before any audio
    if byte_offset > (sentence.bytes_sent if sentence is not None else 0):
        raise ReplayOutOfRange(f"sentence {sentence_index} byte {byte_offset} was never sent")
    owed = sum(s.bytes_sent for s in record.sentences.values() if s.index >= sentence_index) - byte_offset
    if owed > record.log_end - record.log_start:
        raise ReplayOutOfRange(f"sentence {sentence_index} byte {byte_offset} is older than the replay log")
    return owed


def select_replay(
    record: SessionRecord, log: list[ReplayPiece], sentence_index: int, byte_offset: int
) -> list[ReplayPiece]:
    """The logged audio from (sentence_index, byte_offset) on, or ReplayOutOfRange unless `log` (the
    replay log, or its newest part) holds every recorded byte from there (shared by the stores so that
    they agree on what is in range)."""
    owed = replay_owed(record, sentence_index, byte_offset)
    pieces: list[ReplayPiece] = []
    for piece in log:
        if (piece.sentence_index, piece.offset + len(piece.data)) <= (sentence_index, byte_offset):
            continue
        if piece.sentence_index == sentence_index and piece.offset < byte_offset:
            piece = ReplayPiece(piece.sentence_index, byte_offset, piece.data[byte_offset - piece.offset :])
        pieces.append(piece)
    if sum(len(p.data) for p in pieces) != owed:
        raise ReplayOutOfRange(f"sentence {sentence_index} byte {byte_offset} is older than the replay log")
    return pieces


def prune_sentences(record: SessionRecord, oldest_logged: int) -> None:
    """Drop the finished sentences older than sentence `oldest_logged`, the one of the replay log's oldest
    entry, once the log has lost bytes: no position at or before them can be resumed (the memory store's
    twin of the Redis store's `prune` script function)."""
    if record.log_start == 0:
        return
    for index in [i for i in itertools.takewhile(lambda i: i < oldest_logged, record.sentences)]:
        if record.sentences[index].state in FINISHED:
            del record.sentences[index]
            record.trimmed_through = max(record.trimmed_through, index)
    prune_markers(record)


def prune_markers(record: SessionRecord) -> None:
    """Drop the utterance ends sent before sentence `trimmed_through` (a resumable position lies after
    that sentence, and a client there has every end sent before it), and the oldest sent ones past
    MAX_ENDS_KEPT (the memory store's twin of the Redis store's `prune_markers`). Markers are numbered in send
    order, so this stops at the first one still needed."""
    while record.markers:
        marker = next(iter(record.markers.values()))
        if marker.after > record.trimmed_through and not (len(record.markers) > MAX_ENDS_KEPT and marker.sent):
            break
        del record.markers[marker.number]
        record.markers_pruned_through = marker.number
        record.ends_pruned += marker.makes_message(record.uses_contexts)
        record.ends_pruned_after = max(record.ends_pruned_after, marker.after)


def record_marker(record: SessionRecord, marker: MarkerRecord) -> None:
    """Record an utterance end, or its update (sent, or cancelled: never sent, so dropped)."""
    record.last_marker = max(record.last_marker, marker.number)
    record.last_utterance = max(record.last_utterance, marker.utterance)
    if marker.after < 0:
        record.markers.pop(marker.number, None)
    elif marker.after > record.trimmed_through and marker.number > record.markers_pruned_through:
        # (else pruned already, and counted: a late "sent" update, or a resume's re-send, is not kept)
        record.markers[marker.number] = MarkerRecord(**vars(marker))
        prune_markers(record)


class SessionStore(abc.ABC):
    """Where session state lives. All methods are coroutines so that a networked store fits.
    Writes take `owner=`: when given, a caller that no longer owns the session gets LeaseLost."""

    async def start(self) -> None:
        """Open connections, start expiry."""

    async def stop(self) -> None:
        """Close connections."""

    async def unavailable(self) -> str | None:
        """Why the store cannot serve sessions right now (for /ready); None when it can."""
        return None

    @abc.abstractmethod
    async def create(
        self, session_id: str, config: dict[str, Any], *, owner: str | None = None, key_id: str | None = None
    ) -> None: ...

    @abc.abstractmethod
    async def get(self, session_id: str) -> SessionRecord | None: ...

    @abc.abstractmethod
    async def claim(
        self, session_id: str, owner: str, *, key_id: str | None = None, log_from: int | None = None
    ) -> SessionRecord | None:
        """Take the session over for `owner` (a resume) and return it attached; None, and nothing changed,
        if it is gone or another key created it; ReplayOutOfRange, and nothing changed, if the replay log
        no longer holds position `log_from` (the resume position, checked before the claim)."""

    @abc.abstractmethod
    async def renew(self, session_id: str, owner: str) -> None:
        """Keep the lease and the session alive while its connection is open; LeaseLost if taken over."""

    @abc.abstractmethod
    async def apply(self, session_id: str, changes: SessionChanges, *, owner: str | None = None) -> None:
        """Write all of `changes` at once (LeaseLost, and nothing written, if `owner` lost the session)."""

    @abc.abstractmethod
    async def append_audio(
        self, session_id: str, index: int, data: bytes, *, offset: int, owner: str | None = None
    ) -> None:
        """Record `data`, the sentence's audio from byte `offset`, as sent for sentence `index` (adds to
        bytes_sent and to the replay log). Idempotent: an append whose bytes are recorded already (a
        write delivered twice) changes nothing; AppendMismatch if `offset` is past the recorded bytes."""

    @abc.abstractmethod
    async def append_codes(
        self, session_id: str, index: int, codes: bytes, *, offset: int, at: int, limit: int,
        owner: str | None = None,
    ) -> None:
        """Add `codes` (whole frames) to sentence `index`'s from byte `offset` of them: with them, the sentence
        resumes at byte `at` of its recorded audio (module doc). Idempotent as append_audio; AppendMismatch
        if `offset` is not the end of the recorded codes, if they would pass `limit` bytes, or if `at` is
        past the recorded audio. A sentence not recorded, or finished, keeps none: nothing changes."""

    # One change at a time, for the sender and for tests:

    async def update_config(self, session_id: str, config: dict[str, Any], *, owner: str | None = None) -> None:
        await self.apply(session_id, SessionChanges(config=config), owner=owner)

    async def add_sentence(
        self, session_id: str, index: int, text: str, context_id: str | None, *, utterance: int = 0,
        owner: str | None = None,
    ) -> None:
        sentence = SentenceRecord(index, text, context_id, utterance=utterance)
        await self.apply(session_id, SessionChanges(sentences=[sentence]), owner=owner)

    async def set_sentence_state(
        self, session_id: str, index: int, state: SentenceState, *, owner: str | None = None
    ) -> None:
        await self.apply(session_id, SessionChanges(states={index: state}), owner=owner)

    async def add_marker(self, session_id: str, marker: MarkerRecord, *, owner: str | None = None) -> None:
        """Record an utterance end in the send order (or, with marker.sent, that it went out)."""
        await self.apply(session_id, SessionChanges(markers=[marker]), owner=owner)

    async def set_open_text(
        self, session_id: str, context_id: str | None, utterance: int, text: str | None, *, sentences: int = 0,
        owner: str | None = None,
    ) -> None:
        """The unreleased text of an open utterance; None when the utterance no longer takes text."""
        opened = None if text is None else OpenUtterance(context_id, utterance, text, sentences)
        await self.apply(session_id, SessionChanges(open_text={context_id: opened}), owner=owner)

    @abc.abstractmethod
    async def replay(
        self, session_id: str, sentence_index: int, byte_offset: int, *, record: SessionRecord | None = None
    ) -> list[ReplayPiece]:
        """Audio sent from (sentence_index, byte_offset) on. Raises ReplayOutOfRange if that is not kept,
        KeyError if the session is gone. `record`: the session as the caller just read it (else read)."""

    @abc.abstractmethod
    async def detach(self, session_id: str, *, owner: str | None = None) -> None:
        """The connection ended; the session may be resumed until it expires (a no-op for a non-owner)."""

    @abc.abstractmethod
    async def delete(self, session_id: str, *, owner: str | None = None) -> None: ...

    # Cloned voices (issue 15, gateway/voices.py): per owner (an API key's fingerprint, '' without keys) and
    # name, a metadata dict and the backend's prompt, kept until deleted (no expiry).

    @abc.abstractmethod
    async def put_voice(self, owner: str, name: str, meta: dict[str, Any], prompt: bytes, max_voices: int) -> bool:
        """Store a voice, replacing the owner's voice of that name. False (nothing stored) when it is a new
        name and the owner has `max_voices` already; the check and the write are one atomic step."""

    @abc.abstractmethod
    async def voice_meta(self, owner: str, name: str) -> dict[str, Any] | None: ...

    @abc.abstractmethod
    async def voice_metas(self, owner: str) -> list[dict[str, Any]]: ...

    @abc.abstractmethod
    async def voice_prompt(self, owner: str, name: str) -> bytes | None: ...

    @abc.abstractmethod
    async def delete_voice(self, owner: str, name: str) -> bool:
        """True if the owner had a voice of that name."""

    # Pronunciation dictionaries (issue 34, gateway/pronunciation/registry.py): per owner and name, a metadata
    # dict (its "bytes" counted against the owner's total) and the entries as JSON, kept until deleted.

    @abc.abstractmethod
    async def put_dictionary(self, owner: str, name: str, meta: dict[str, Any], entries: str, max_count: int,
                             max_bytes: int) -> int:
        """Store a dictionary, replacing the owner's dictionary of that name: 1 stored; 0 (nothing stored) when
        it is a new name and the owner has `max_count` already; -1 when the owner's dictionaries would take
        more than `max_bytes` (their metas' "bytes" added up). The checks and the write are one atomic step."""

    @abc.abstractmethod
    async def dictionary(self, owner: str, name: str) -> tuple[dict[str, Any], str] | None:
        """(meta, entries JSON), or None."""

    @abc.abstractmethod
    async def dictionary_metas(self, owner: str) -> list[dict[str, Any]]: ...

    @abc.abstractmethod
    async def delete_dictionary(self, owner: str, name: str) -> bool:
        """True if the owner had a dictionary of that name."""
