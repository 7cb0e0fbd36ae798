"""The memory store: sessions kept in this process (gateway/store/base.py says what a store keeps and why).

Each app instance owns one; nothing is module-global. A resume works only on the replica that served the
session, and a session lives no longer than its process.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

from .base import (
    FINISHED,
    AppendMismatch,
    LeaseLost,
    OpenUtterance,
    ReplayOutOfRange,
    ReplayPiece,
    SentenceRecord,
    SessionChanges,
    SessionRecord,
    SessionStore,
    prune_sentences,
    record_marker,
    select_replay,
)


class MemorySessionStore(SessionStore):
    """Per-process store. Each app instance owns one; nothing is module-global. Resume works only on the
    replica that served the session."""

    def __init__(
        self,
        ttl_s: float = 120.0,
        replay_log_bytes: int = 4 * 1024 * 1024,
        sweep_interval_s: float = 5.0,
        replay_log_s: float = 300.0,
    ):
        self.ttl_s = ttl_s
        self.replay_log_bytes = replay_log_bytes
        self.replay_log_s = replay_log_s
        self.sweep_interval_s = sweep_interval_s
        self._sessions: dict[str, SessionRecord] = {}
        self._voices: dict[str, dict[str, tuple[dict[str, Any], bytes]]] = {}  # owner -> name -> (meta, prompt)
        self._logs: dict[str, deque[tuple[float, ReplayPiece]]] = {}
        self._dictionaries: dict[str, dict[str, tuple[dict[str, Any], str]]] = {}  # owner -> name -> (meta, entries)
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="session-store-sweeper")

    async def stop(self) -> None:
        if self._sweeper:
            self._sweeper.cancel()
            try:
                await self._sweeper
            except asyncio.CancelledError:
                pass
            self._sweeper = None

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            self.expire()

    def expire(self, now: float | None = None) -> list[str]:
        """Drop detached sessions idle longer than ttl_s; returns their ids."""
        now = time.monotonic() if now is None else now
        gone = [s.session_id for s in self._sessions.values() if not s.attached and now - s.last_active > self.ttl_s]
        for session_id in gone:
            self._drop(session_id)
        return gone

    def __len__(self) -> int:
        return len(self._sessions)

    def _drop(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        self._logs.pop(session_id, None)

    def _owned(self, session_id: str, owner: str | None) -> SessionRecord | None:
        """The record for a write, touched; LeaseLost if `owner` is given and does not hold it."""
        record = self._sessions.get(session_id)
        if owner is not None and (record is None or record.owner != owner):
            raise LeaseLost(session_id)
        if record is not None:
            record.last_active = time.monotonic()
        return record

    async def create(
        self, session_id: str, config: dict[str, Any], *, owner: str | None = None, key_id: str | None = None
    ) -> None:
        now = time.monotonic()
        self._sessions[session_id] = SessionRecord(
            session_id, dict(config), created_at=now, last_active=now, owner=owner, key_id=key_id
        )
        self._logs[session_id] = deque()

    async def get(self, session_id: str) -> SessionRecord | None:
        record = self._sessions.get(session_id)
        if record is not None and not record.attached and time.monotonic() - record.last_active > self.ttl_s:
            self._drop(session_id)
            return None
        return record

    async def claim(
        self, session_id: str, owner: str, *, key_id: str | None = None, log_from: int | None = None
    ) -> SessionRecord | None:
        record = await self.get(session_id)
        if record is not None and record.key_id != key_id:
            return None
        if record is not None and log_from is not None and record.log_start > log_from:
            raise ReplayOutOfRange(f"the replay log no longer holds position {log_from}")
        if record is not None:
            record.owner = owner
            record.attached = True
            record.last_active = time.monotonic()
        return record

    async def renew(self, session_id: str, owner: str) -> None:
        self._owned(session_id, owner)

    async def append_audio(
        self, session_id: str, index: int, data: bytes, *, offset: int, owner: str | None = None
    ) -> None:
        record = self._owned(session_id, owner)
        if record is None or index not in record.sentences:
            return
        sentence = record.sentences[index]
        if sentence.bytes_sent >= offset + len(data):
            return  # delivered twice: recorded already
        if sentence.bytes_sent != offset:
            raise AppendMismatch(session_id, index, offset)
        now = time.monotonic()
        log = self._logs[session_id]
        log.append((now, ReplayPiece(index, sentence.bytes_sent, data)))
        sentence.bytes_sent += len(data)
        record.log_end += len(data)
        trimmed = False
        while len(log) > 1 and (
            record.log_end - record.log_start > self.replay_log_bytes or now - log[0][0] > self.replay_log_s
        ):
            record.log_start += len(log.popleft()[1].data)
            trimmed = True
        if trimmed:
            prune_sentences(record, log[0][1].sentence_index)

    async def append_codes(
        self, session_id: str, index: int, codes: bytes, *, offset: int, at: int, limit: int,
        owner: str | None = None,
    ) -> None:
        record = self._owned(session_id, owner)
        sentence = record.sentences.get(index) if record is not None else None
        if sentence is None or sentence.state in FINISHED or len(sentence.codes) >= offset + len(codes):
            return
        if len(sentence.codes) != offset or offset + len(codes) > limit or at > sentence.bytes_sent:
            raise AppendMismatch(session_id, index, offset)
        sentence.codes += codes
        sentence.codes_at = at

    async def apply(self, session_id: str, changes: SessionChanges, *, owner: str | None = None) -> None:
        record = self._owned(session_id, owner)
        if record is None:
            return
        if changes.config is not None:
            record.config = dict(changes.config)
        for sentence in changes.sentences:
            record.sentences[sentence.index] = SentenceRecord(**vars(sentence))
            record.released = max(record.released, sentence.index + 1)
        for sentence in changes.sentence_texts:
            if sentence.index in record.sentences:
                record.sentences[sentence.index].text = sentence.text
        for index, state in changes.states.items():
            sentence = record.sentences.get(index)
            if sentence is not None and state == "cancelled" and sentence.bytes_sent == 0:
                del record.sentences[index]  # never spoken, never replayed: nothing to keep
            elif sentence is not None:
                sentence.state = state
                if state in FINISHED:  # its codes resume nothing any more
                    sentence.codes, sentence.codes_at = b"", 0
        for marker in changes.markers:
            record_marker(record, marker)
        for context_id, opened in changes.open_text.items():
            if opened is None:
                record.open_utterances.pop(context_id, None)
            else:
                record.open_utterances[context_id] = OpenUtterance(**vars(opened))
        if changes.inputs_received is not None:
            record.inputs_received = changes.inputs_received
        if changes.uses_contexts is not None:
            record.uses_contexts = changes.uses_contexts

    async def replay(
        self, session_id: str, sentence_index: int, byte_offset: int, *, record: SessionRecord | None = None
    ) -> list[ReplayPiece]:
        record = record or await self.get(session_id)
        if record is None or session_id not in self._logs:
            raise KeyError(session_id)
        return select_replay(record, [piece for _, piece in self._logs[session_id]], sentence_index, byte_offset)

    async def detach(self, session_id: str, *, owner: str | None = None) -> None:
        record = self._sessions.get(session_id)
        if record is not None and (owner is None or record.owner in (None, owner)):
            record.attached = False
            record.owner = None
            record.last_active = time.monotonic()

    async def delete(self, session_id: str, *, owner: str | None = None) -> None:
        record = self._sessions.get(session_id)
        if record is not None and (owner is None or record.owner in (None, owner)):
            self._drop(session_id)

    async def put_voice(self, owner: str, name: str, meta: dict[str, Any], prompt: bytes, max_voices: int) -> bool:
        voices = self._voices.setdefault(owner, {})
        if name not in voices and len(voices) >= max_voices:
            return False
        voices[name] = (dict(meta), prompt)
        return True

    async def voice_meta(self, owner: str, name: str) -> dict[str, Any] | None:
        entry = self._voices.get(owner, {}).get(name)
        return dict(entry[0]) if entry else None

    async def voice_metas(self, owner: str) -> list[dict[str, Any]]:
        return [dict(meta) for meta, _ in self._voices.get(owner, {}).values()]

    async def voice_prompt(self, owner: str, name: str) -> bytes | None:
        entry = self._voices.get(owner, {}).get(name)
        return entry[1] if entry else None

    async def delete_voice(self, owner: str, name: str) -> bool:
        return self._voices.get(owner, {}).pop(name, None) is not None

    async def put_dictionary(self, owner: str, name: str, meta: dict[str, Any], entries: str, max_count: int,
                             max_bytes: int) -> int:
        kept = self._dictionaries.setdefault(owner, {})
        if name not in kept and len(kept) >= max_count:
            return 0
        total = sum(m["bytes"] for n, (m, _) in kept.items() if n != name) + meta["bytes"]
        if total > max_bytes:
            return -1
        kept[name] = (dict(meta), entries)
        return 1

    async def dictionary(self, owner: str, name: str) -> tuple[dict[str, Any], str] | None:
        found = self._dictionaries.get(owner, {}).get(name)
        return (dict(found[0]), found[1]) if found is not None else None

    async def dictionary_metas(self, owner: str) -> list[dict[str, Any]]:
        return [dict(meta) for meta, _ in self._dictionaries.get(owner, {}).values()]

    async def delete_dictionary(self, owner: str, name: str) -> bool:
        return self._dictionaries.get(owner, {}).pop(name, None) is not None
