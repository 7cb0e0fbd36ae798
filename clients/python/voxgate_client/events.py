"""Typed events a Voxgate session yields, one class per server message (protocol.md, "Server → client").

Binary audio frames become `AudioChunk` events carrying the sentence and context they belong to and their
byte offset within that sentence, so a consumer never has to track which `audio.start` came last.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Event:
    """Base class of everything `Session.events()` yields."""


@dataclass(frozen=True)
class SessionStarted(Event):
    session_id: str
    sample_rate: int
    format: str
    voices: list[str] = field(default_factory=list)
    voice: str | None = None
    inputs_received: int | None = None  # answering session.resume: the client inputs the gateway has
    # What the gateway does differently than configured: {code, message, field} (e.g. timestamps_unsupported)
    warnings: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class AudioStart(Event):
    sentence_index: int
    sentence_text: str
    format: str
    sample_rate: int
    channels: int = 1
    context_id: str | None = None
    voice: str | None = None  # only when another voice than session.started's speaks this sentence
    # What this sentence gets differently than asked: {code, message, field} (e.g. language_unsupported)
    warnings: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class AudioChunk(Event):
    """One binary frame: `data` is raw audio in the session format (s16le mono for pcm)."""

    data: bytes
    sentence_index: int
    offset: int  # byte offset of `data` within its sentence's audio
    context_id: str | None = None

    def __repr__(self) -> str:  # audio bytes make the default repr unreadable
        return (
            f"AudioChunk(sentence_index={self.sentence_index}, offset={self.offset}, "
            f"bytes={len(self.data)}, context_id={self.context_id!r})"
        )


@dataclass(frozen=True)
class Word:
    """One spoken word and where its audio lies.

    `start`/`end` are seconds from the start of its sentence's audio (as on the wire); `utterance_start`/
    `utterance_end` are seconds from the start of its utterance's audio (the context's first sentence),
    which the session adds from the audio of the utterance's earlier sentences."""

    word: str
    start: float
    end: float
    sentence_index: int | None = None
    utterance_start: float | None = None
    utterance_end: float | None = None


@dataclass(frozen=True)
class AudioWords(Event):
    """Words whose audio has been sent (`audio.words`, or a sync session's audio.done word_alignment)."""

    sentence_index: int
    words: list[Word]
    context_id: str | None = None


@dataclass(frozen=True)
class AudioDone(Event):
    sentence_index: int
    total_bytes: int
    error: bool = False
    context_id: str | None = None
    duration_ms: float | None = None
    cancelled: bool | None = None
    words: list[Word] | None = None  # timestamp_info.word_alignment, when the session asked for timestamps
    # The sentence's whole text. With split_granularity "token" its audio.start had only the words known
    # when its synthesis started; the gateway sends the rest here (the client fills in audio.start's
    # otherwise).
    sentence_text: str | None = None
    # What this sentence got differently than asked, known once it is whole: {code, message, field} (e.g.
    # sentence_finished_early: a sentence still being written was ended at the words it had)
    warnings: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class UtteranceDone(Event):
    context_id: str | None
    total_sentences: int


@dataclass(frozen=True)
class ContextCancelled(Event):
    context_id: str | None
    sentence_index: int | None = None
    # What the listener heard: the words whose audio was fully sent before the cut (timestamped sessions).
    spoken_text: str | None = None
    spoken_words: list[Word] | None = None


@dataclass(frozen=True)
class SessionDone(Event):
    total_sentences: int


@dataclass(frozen=True)
class Error(Event):
    message: str
    code: str | None = None
    retryable: bool = False
    context_id: str | None = None
    sentence_index: int | None = None


@dataclass(frozen=True)
class Pong(Event):
    id: Any = None
    inputs_received: int | None = None  # client inputs the gateway handled before the ping


@dataclass(frozen=True)
class Reconnected(Event):
    """The client lost its connection and resumed the session on a new one (client-side event)."""

    session_id: str
    sentence_index: int
    bytes_received: int
    attempts: int
    url: str
    inputs_resent: int = 0  # input messages the gateway never got, sent again on the new connection


@dataclass(frozen=True)
class Disconnected(Event):
    """The connection ended for good (client-side event): no further events follow."""

    code: int | None
    reason: str


@dataclass(frozen=True)
class UnknownMessage(Event):
    """A JSON message of a type this client version does not know; kept, not dropped."""

    type: str
    data: dict[str, Any]


def _pick(data: dict[str, Any], *names: str) -> dict[str, Any]:
    return {name: data[name] for name in names if name in data}


def _words_of_alignment(alignment: Any, sentence_index: int | None) -> list[Word] | None:
    """`timestamp_info.word_alignment` ({words, word_start_times_seconds, word_end_times_seconds})."""
    if not isinstance(alignment, dict):
        return None
    return [
        Word(word=str(word), start=float(start), end=float(end), sentence_index=sentence_index)
        for word, start, end in zip(
            alignment.get("words") or [],
            alignment.get("word_start_times_seconds") or [],
            alignment.get("word_end_times_seconds") or [],
        )
    ]


def _words_of_list(items: Any, sentence_index: int | None) -> list[Word] | None:
    """A list of {word, start, end} (audio.words, context.cancelled's spoken_words)."""
    if not isinstance(items, list):
        return None
    return [
        Word(
            word=str(item.get("word", "")),
            start=float(item.get("start", 0.0)),
            end=float(item.get("end", 0.0)),
            sentence_index=item.get("sentence_index", sentence_index),
        )
        for item in items
        if isinstance(item, dict)
    ]


def parse_server_message(data: dict[str, Any]) -> Event:
    """Turn one decoded JSON server message into its typed event."""
    kind = data.get("type")
    if kind == "session.started":
        return SessionStarted(
            **_pick(data, "session_id", "sample_rate", "format", "voices", "voice", "inputs_received", "warnings")
        )
    if kind == "audio.start":
        return AudioStart(
            **_pick(data, "sentence_index", "format", "sample_rate", "channels", "context_id", "voice", "warnings"),
            sentence_text=data.get("sentence_text", ""),
        )
    if kind == "audio.done":
        timestamp_info = data.get("timestamp_info") or {}
        return AudioDone(
            **_pick(data, "sentence_index", "total_bytes", "error", "context_id", "duration_ms", "cancelled",
                    "sentence_text", "warnings"),
            words=_words_of_alignment(timestamp_info.get("word_alignment"), data.get("sentence_index")),
        )
    if kind == "audio.words":
        return AudioWords(
            sentence_index=data.get("sentence_index", 0),
            words=_words_of_list(data.get("words"), data.get("sentence_index")) or [],
            context_id=data.get("context_id"),
        )
    if kind == "utterance.done":
        return UtteranceDone(context_id=data.get("context_id"), total_sentences=data.get("total_sentences", 0))
    if kind == "context.cancelled":
        return ContextCancelled(
            context_id=data.get("context_id"),
            sentence_index=data.get("sentence_index"),
            spoken_text=data.get("spoken_text"),
            spoken_words=_words_of_list(data.get("spoken_words"), None),
        )
    if kind == "session.done":
        return SessionDone(total_sentences=data.get("total_sentences", 0))
    if kind == "error":
        return Error(
            message=data.get("message", ""),
            **_pick(data, "code", "retryable", "context_id", "sentence_index"),
        )
    if kind == "pong":
        return Pong(id=data.get("id"), inputs_received=data.get("inputs_received"))
    return UnknownMessage(type=str(kind), data=data)
