"""Session state that outlives a connection, for `session.resume` (issue 5) and observability.

A session records its config, every sentence (text, state, bytes sent) and a bounded replay log of its
most recent audio, so that (session_id, sentence_index, byte offset) names any byte ever sent and a
client that reconnects can be given exactly what it missed. The in-memory store lives in one process;
a Redis store (issue 5) implements the same interface so that any replica can resume a session.

Sessions expire `ttl_s` after their connection detaches (or after their last activity while attached but
silent, which the idle timeout bounds anyway).
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

SentenceState = Literal["pending", "speaking", "done", "cancelled", "failed"]


class ReplayOutOfRange(LookupError):
    """The requested position is no longer (or not yet) in the replay log."""


@dataclass
class SentenceRecord:
    index: int
    text: str
    context_id: str | None
    state: SentenceState = "pending"
    bytes_sent: int = 0


@dataclass
class SessionRecord:
    session_id: str
    config: dict[str, Any]
    created_at: float
    last_active: float
    attached: bool = True
    sentences: dict[int, SentenceRecord] = field(default_factory=dict)


@dataclass(frozen=True)
class ReplayPiece:
    sentence_index: int
    offset: int  # byte offset of `data` within its sentence's encoded audio
    data: bytes


class SessionStore(abc.ABC):
    """Where session state lives. All methods are coroutines so that a networked store fits."""

    async def start(self) -> None:
        """Open connections, start expiry."""

    async def stop(self) -> None:
        """Close connections."""

    @abc.abstractmethod
    async def create(self, session_id: str, config: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    async def get(self, session_id: str) -> SessionRecord | None: ...

    @abc.abstractmethod
    async def update_config(self, session_id: str, config: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    async def add_sentence(self, session_id: str, index: int, text: str, context_id: str | None) -> None: ...

    @abc.abstractmethod
    async def set_sentence_state(self, session_id: str, index: int, state: SentenceState) -> None: ...

    @abc.abstractmethod
    async def append_audio(self, session_id: str, index: int, data: bytes) -> None:
        """Record `data` as sent for sentence `index` (adds to bytes_sent and to the replay log)."""

    @abc.abstractmethod
    async def replay(self, session_id: str, sentence_index: int, byte_offset: int) -> list[ReplayPiece]:
        """Audio sent from (sentence_index, byte_offset) on. Raises ReplayOutOfRange if that is not kept."""

    @abc.abstractmethod
    async def detach(self, session_id: str) -> None:
        """The connection ended; the session may be resumed until it expires."""

    @abc.abstractmethod
    async def delete(self, session_id: str) -> None: ...


class MemorySessionStore(SessionStore):
    """Per-process store. Each app instance owns one; nothing is module-global."""

    def __init__(self, ttl_s: float = 120.0, replay_log_bytes: int = 4 * 1024 * 1024, sweep_interval_s: float = 5.0):
        self.ttl_s = ttl_s
        self.replay_log_bytes = replay_log_bytes
        self.sweep_interval_s = sweep_interval_s
        self._sessions: dict[str, SessionRecord] = {}
        self._logs: dict[str, deque[ReplayPiece]] = {}
        self._log_sizes: dict[str, int] = {}
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
        self._log_sizes.pop(session_id, None)

    def _touch(self, session_id: str) -> SessionRecord | None:
        record = self._sessions.get(session_id)
        if record is not None:
            record.last_active = time.monotonic()
        return record

    async def create(self, session_id: str, config: dict[str, Any]) -> None:
        now = time.monotonic()
        self._sessions[session_id] = SessionRecord(session_id, dict(config), created_at=now, last_active=now)
        self._logs[session_id] = deque()
        self._log_sizes[session_id] = 0

    async def get(self, session_id: str) -> SessionRecord | None:
        record = self._sessions.get(session_id)
        if record is not None and not record.attached and time.monotonic() - record.last_active > self.ttl_s:
            self._drop(session_id)
            return None
        return record

    async def update_config(self, session_id: str, config: dict[str, Any]) -> None:
        record = self._touch(session_id)
        if record is not None:
            record.config = dict(config)

    async def add_sentence(self, session_id: str, index: int, text: str, context_id: str | None) -> None:
        record = self._touch(session_id)
        if record is not None:
            record.sentences[index] = SentenceRecord(index, text, context_id)

    async def set_sentence_state(self, session_id: str, index: int, state: SentenceState) -> None:
        record = self._touch(session_id)
        if record is not None and index in record.sentences:
            record.sentences[index].state = state

    async def append_audio(self, session_id: str, index: int, data: bytes) -> None:
        record = self._touch(session_id)
        if record is None or index not in record.sentences:
            return
        sentence = record.sentences[index]
        log = self._logs[session_id]
        log.append(ReplayPiece(index, sentence.bytes_sent, data))
        sentence.bytes_sent += len(data)
        self._log_sizes[session_id] += len(data)
        while self._log_sizes[session_id] > self.replay_log_bytes and len(log) > 1:
            self._log_sizes[session_id] -= len(log.popleft().data)

    async def replay(self, session_id: str, sentence_index: int, byte_offset: int) -> list[ReplayPiece]:
        record = await self.get(session_id)
        if record is None:
            raise KeyError(session_id)
        log = self._logs[session_id]
        sentence = record.sentences.get(sentence_index)
        if sentence is None or byte_offset > sentence.bytes_sent:
            raise ReplayOutOfRange(f"sentence {sentence_index} byte {byte_offset} was never sent")
        if byte_offset == sentence.bytes_sent and all(p.sentence_index <= sentence_index for p in log):
            return []
        oldest = log[0] if log else None
        if oldest is None or (oldest.sentence_index, oldest.offset) > (sentence_index, byte_offset):
            raise ReplayOutOfRange(f"sentence {sentence_index} byte {byte_offset} is older than the replay log")
        pieces: list[ReplayPiece] = []
        for piece in log:
            if piece.sentence_index < sentence_index:
                continue
            if piece.sentence_index == sentence_index:
                end = piece.offset + len(piece.data)
                if end <= byte_offset:
                    continue
                if piece.offset < byte_offset:
                    cut = byte_offset - piece.offset
                    piece = ReplayPiece(piece.sentence_index, byte_offset, piece.data[cut:])
            pieces.append(piece)
        return pieces

    async def detach(self, session_id: str) -> None:
        record = self._touch(session_id)
        if record is not None:
            record.attached = False

    async def delete(self, session_id: str) -> None:
        self._drop(session_id)


def create_store(kind: str, *, ttl_s: float, replay_log_bytes: int, redis_url: str | None = None) -> SessionStore:
    if kind == "memory":
        return MemorySessionStore(ttl_s=ttl_s, replay_log_bytes=replay_log_bytes)
    if kind == "redis":
        try:
            from .redis_store import RedisSessionStore  # issue 5
        except ImportError as exc:
            raise RuntimeError("store=redis is not available in this build (gateway/redis_store.py)") from exc
        return RedisSessionStore(redis_url=redis_url, ttl_s=ttl_s, replay_log_bytes=replay_log_bytes)
    raise ValueError(f"unknown session store {kind!r}; choose memory or redis")
