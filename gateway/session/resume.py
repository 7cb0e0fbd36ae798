"""Resuming a streaming session from the store (`session.resume`, issue 5), for `StreamingSession`
(gateway/session/connection.py).

A connection to any replica takes the session over (the newest connection wins; the old one's next
write fails with LeaseLost) and rebuilds it: it replays the logged bytes the client lacks, queues for
synthesis again what was never fully recorded (dropping bytes already delivered), re-sends the utterance
ends the client has not received (`ends_received`, or by position for clients that do not count), and
reopens utterances that were still taking text. `session.started` carries `inputs_received`: the client
sends again its inputs after that many.

Two steps, neither touching the session: `Resumer.take_over` checks the client's position, takes the
lease and reads what is owed (or refuses, changing nothing); `rebuild` turns that record into what the
session starts from (its counts, the items to queue in send order, the utterances to reopen).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tts_backend.base import TextStream

from ..protocol import ErrorCode, ProtocolError, SessionResume
from ..store.base import FINISHED, MarkerRecord, ReplayOutOfRange, SessionRecord, SessionStore, replay_owed
from .data import ResolvedConfig, SentenceJob, SessionEnd, Utterance, UtteranceEnd


@dataclass
class Resumed:
    """A session taken over: its record, the logged audio owed from the client's position, its config."""

    record: SessionRecord
    pieces: list
    config: ResolvedConfig


@dataclass
class Rebuilt:
    """What a resumed session starts from."""

    inputs_received: int
    sentences_released: int
    utterance_count: int
    marker_count: int
    uses_contexts: bool
    owed: list[SentenceJob | UtteranceEnd | SessionEnd]  # to queue, in send order
    unspoken: list[SentenceJob]  # the owed sentences whose text counts as accepted and not yet spoken
    closing: bool  # session.close was received: no more input is taken
    reopened: list[tuple[Utterance, str]]  # utterances still taking text, with the text not yet released


class Resumer:
    """Takes a session over from the store for one connection (`owner`, the API key `key_id`);
    `resolve` turns the config the store recorded (ResolvedConfig.snapshot) back into the session's config,
    raising KeyError for a record it cannot use."""

    def __init__(self, store: SessionStore, *, owner: str, key_id: str | None,
                 resolve: Callable[[dict], Awaitable[ResolvedConfig]]) -> None:
        self.store = store
        self.owner = owner
        self.key_id = key_id
        self.resolve = resolve

    async def take_over(self, message: SessionResume) -> Resumed:
        """Take the session over (from a dead connection, or a live one elsewhere: the newest connection
        wins) and rebuild it from the store: the client has every byte before (sentence_index,
        bytes_received); everything after it is replayed from the log or re-synthesized.

        Only the key that created the session may resume it; any other key is told the session does not
        exist. The position is checked before the lease is taken, so a refused resume changes nothing
        and the live owner (if any) keeps the session."""
        session_id = message.session_id
        key_id = self.key_id
        record = await self.store.get(session_id)
        if record is None or record.key_id != key_id:
            raise _not_found(session_id)
        # Refused here, nothing has changed. The log is not read yet (it is read once, below, as the owner):
        # the record's counts say whether it holds the position, and the claim checks that again atomically,
        # in case the owner's further audio has pushed the position out of the log meanwhile.
        await self._check_position(record, message, read_log=False)
        log_from = record.log_end - replay_owed(record, message.sentence_index, message.bytes_received)
        try:
            record = await self.store.claim(session_id, self.owner, key_id=key_id, log_from=log_from)
        except ReplayOutOfRange as exc:
            raise _out_of_range(message, exc) from None
        if record is None:
            raise _not_found(session_id)
        try:
            # Read again as the owner: the previous one may have written (and trimmed the log) meanwhile.
            pieces, config = await self._check_position(record, message)
        except ProtocolError:
            await self.store.detach(session_id, owner=self.owner)
            raise
        return Resumed(record, pieces, config)

    async def _check_position(
        self, record: SessionRecord, message: SessionResume, *, read_log: bool = True
    ) -> tuple[list, ResolvedConfig]:
        """The logged audio owed from the client's position (none read unless `read_log`) and the session's
        config, or the ProtocolError that refuses the resume."""
        session_id = message.session_id
        try:
            if read_log:
                pieces = await self.store.replay(
                    session_id, message.sentence_index, message.bytes_received, record=record
                )
            else:
                pieces = []
                replay_owed(record, message.sentence_index, message.bytes_received)
            config = await self.resolve(record.config)
            ends = record.ends_pruned + len(_ends_with_a_message(record))
            if message.ends_received is not None and message.ends_received > ends:
                raise ReplayOutOfRange(f"only {ends} utterance.done/session.done were ever sent")
            # An end the client lacks may be pruned (gateway/store/base.py, prune_markers): by its count, or, without
            # one, by a position before the end.
            if message.ends_received is not None and message.ends_received < record.ends_pruned:
                raise ReplayOutOfRange(f"utterance.done/session.done {message.ends_received + 1} is no longer kept")
            if message.ends_received is None and message.sentence_index < record.ends_pruned_after:
                raise ReplayOutOfRange(f"an utterance.done/session.done after sentence {message.sentence_index} is no longer kept")
        except ReplayOutOfRange as exc:
            raise _out_of_range(message, exc) from None
        except KeyError:  # gone meanwhile (expired or closed), or a record it cannot use
            raise _not_found(session_id) from None
        return pieces, config


def rebuild(resumed: Resumed, position: SessionResume,
            new_utterance: Callable[[str | None, int], Utterance]) -> Rebuilt:
    """What the client is owed, in the original send order, and the utterances to reopen (each made by
    `new_utterance(context_id, number)`)."""
    record, config = resumed.record, resumed.config
    sentence_index, byte_offset = position.sentence_index, position.bytes_received
    sentences = sorted(record.sentences.values(), key=lambda s: s.index)
    numbers = [s.utterance for s in sentences] + [m.utterance for m in record.markers.values()]
    numbers += [u.utterance for u in record.open_utterances.values()]
    uses_contexts = record.uses_contexts or any(
        c is not None
        for c in [*(s.context_id for s in sentences), *(m.context_id for m in record.markers.values()),
                  *record.open_utterances]
    )
    utterances: dict[int, Utterance] = {}

    def utterance(number: int, context_id: str | None) -> Utterance:
        if number not in utterances:
            utterances[number] = new_utterance(context_id, number)
        return utterances[number]

    for sentence in sentences:
        utterance(sentence.utterance, sentence.context_id).sentences += 1
    # Sentence records older than the replay log are pruned: the counts recorded with the utterance's
    # end, or with its open text, cover them.
    for marker in record.markers.values():
        if not marker.session_end:
            counted = utterance(marker.utterance, marker.context_id)
            counted.sentences = max(counted.sentences, marker.total_sentences)
    for open_utterance in record.open_utterances.values():
        counted = utterance(open_utterance.utterance, open_utterance.context_id)
        counted.sentences = max(counted.sentences, open_utterance.sentences)
        if counted.sentences:  # its first unit went before: the rest is split as ever
            counted.segmenter.continue_utterance()
    # Text streaming: sentences still being written when the session was recorded. Each continues where it
    # was (its text so far given to synthesis again, the rest as the client sends it); its utterance's open
    # text begins with it.
    still_open = {u.open_sentence: u for u in record.open_utterances.values() if u.open_sentence is not None}
    replay: dict[int, list[bytes]] = {}
    for piece in resumed.pieces:
        replay.setdefault(piece.sentence_index, []).append(piece.data)
    # Send order: a marker recorded after N sentences goes before sentence N.
    owed: list[tuple[tuple[int, int], SentenceJob | UtteranceEnd | SessionEnd]] = []
    unspoken: list[SentenceJob] = []
    now = time.monotonic()
    for sentence in sentences:
        if sentence.index < sentence_index or sentence.state == "cancelled":
            continue
        delivered = byte_offset if sentence.index == sentence_index else 0
        logged = replay.get(sentence.index, [])
        job = SentenceJob(
            index=sentence.index,
            text=sentence.text,
            utterance=utterance(sentence.utterance, sentence.context_id),
            config=config,
            released_at=now,
            first_of_utterance=False,
            replay=logged,
            skip_bytes=delivered + sum(map(len, logged)),
            # With timestamps a sentence logged whole is made again too, for its word timings; its bytes are
            # all dropped (skip_bytes), as the backend is deterministic, which resume relies on anyway.
            needs_synthesis=sentence.state != "done" or config.timestamps is not None,
        )
        job.bytes_sent = delivered
        if sentence.codes and sentence.state not in FINISHED:  # it goes on from them where the backend can
            job.resume_codes, job.resume_at, job.codes_recorded = sentence.codes, sentence.codes_at, len(sentence.codes)
        if sentence.index in still_open and config.text_streaming:
            job.text_stream = TextStream(job.text)
            job.utterance.open_job = job
        else:  # (an open sentence's text is counted in its utterance's unreleased text)
            unspoken.append(job)
        owed.append(((sentence.index, 1), job))
    if position.ends_received is not None:
        # The client counted the utterance ends it got; they go out in marker order, so it has the
        # first `ends_received` of those that make a message (the pruned ones among them), and is owed
        # the rest.
        with_message = _ends_with_a_message(record, uses_contexts)
        owed_markers = with_message[position.ends_received - record.ends_pruned :]
    else:
        # Without the count (older clients), by position: markers go out after sentence `after - 1`, so
        # one the client's position lies before is owed even if it was sent; at the position itself,
        # only if unsent.
        owed_markers = [
            m for m in record.markers.values()
            if m.after > sentence_index or (m.after == sentence_index and byte_offset == 0 and not m.sent)
        ]
    for marker in owed_markers:
        item = (
            SessionEnd(number=marker.number, after=marker.after)
            if marker.session_end
            else UtteranceEnd(
                utterance(marker.utterance, marker.context_id), by_close=marker.by_close, number=marker.number,
                after=marker.after,
            )
        )
        owed.append(((marker.after, 0), item))
    return Rebuilt(
        inputs_received=record.inputs_received,
        sentences_released=record.released,
        utterance_count=max([*numbers, record.last_utterance]),
        marker_count=max([*record.markers, record.last_marker]),
        uses_contexts=uses_contexts,
        owed=[item for _, item in sorted(owed, key=lambda pair: (pair[0], getattr(pair[1], "number", 0)))],
        unspoken=unspoken,
        closing=any(isinstance(item, SessionEnd) for _, item in owed),
        reopened=[(utterance(u.utterance, u.context_id), u.text) for u in record.open_utterances.values()],
    )


def _out_of_range(message: SessionResume, reason: ReplayOutOfRange) -> ProtocolError:
    return ProtocolError(
        ErrorCode.resume_out_of_range,
        f"cannot resume session {message.session_id} at sentence {message.sentence_index} byte"
        f" {message.bytes_received}: {reason}",
    )


def _not_found(session_id: str) -> ProtocolError:
    """The same answer whether the session never existed, has ended, or belongs to another key."""
    return ProtocolError(
        ErrorCode.session_not_found,
        f"session {session_id!r} is unknown, finished or expired; send session.config to start a new session",
    )


def _ends_with_a_message(record: SessionRecord, uses_contexts: bool | None = None) -> list[MarkerRecord]:
    """The session's recorded (not pruned) utterance ends that are or will be sent as a message, in send
    order (MarkerRecord.makes_message)."""
    if uses_contexts is None:
        uses_contexts = record.uses_contexts or any(
            c is not None
            for c in [*(s.context_id for s in record.sentences.values()),
                      *(m.context_id for m in record.markers.values()), *record.open_utterances]
        )
    return [m for m in sorted(record.markers.values(), key=lambda m: m.number) if m.makes_message(uses_contexts)]
