"""Typed messages of the streaming protocol (version 1, docs/protocol.md).

Client messages are parsed through one discriminated union on `type`; server messages are pydantic
models serialized with `encode()`, which leaves out unset optional fields so that clients written for
vLLM-Omni see exactly the fields they know plus our extensions.
"""

from __future__ import annotations

import enum
import json
import math
import re
from typing import Annotated, Any, Literal, Union

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from tts_backend.base import (
    BackendOverloadedError,
    InvalidReferenceAudioError,
    SynthesisError,
    UnknownVoiceError,
    VoiceCloningUnsupportedError,
)

GRANULARITIES = ("sentence", "clause", "none")
# The output rate unless the client asks for `sample_rate`: clients of vLLM-Omni (and OpenAI's `pcm`)
# assume 24 kHz for raw audio, whatever the backend's own rate; telephony formats default to 8 kHz.
DEFAULT_SAMPLE_RATE = 24000
TELEPHONY_SAMPLE_RATE = 8000


class ErrorCode(str, enum.Enum):
    invalid_json = "invalid_json"
    invalid_message = "invalid_message"
    unknown_type = "unknown_type"
    config_required = "config_required"
    config_locked = "config_locked"
    unknown_voice = "unknown_voice"
    unsupported_format = "unsupported_format"
    text_too_long = "text_too_long"
    message_too_large = "message_too_large"
    rate_limited = "rate_limited"
    too_many_sessions = "too_many_sessions"
    unauthorized = "unauthorized"
    session_not_found = "session_not_found"
    resume_out_of_range = "resume_out_of_range"
    synthesis_failed = "synthesis_failed"
    overloaded = "overloaded"
    idle_timeout = "idle_timeout"
    request_timeout = "request_timeout"
    not_found = "not_found"
    method_not_allowed = "method_not_allowed"
    slow_consumer = "slow_consumer"
    voice_cloning_unsupported = "voice_cloning_unsupported"
    invalid_reference_audio = "invalid_reference_audio"
    voice_limit_reached = "voice_limit_reached"
    voice_not_found = "voice_not_found"
    pronunciation_invalid = "pronunciation_invalid"
    pronunciation_limit_reached = "pronunciation_limit_reached"
    pronunciation_not_found = "pronunciation_not_found"
    store_unavailable = "store_unavailable"
    internal = "internal"


# The client's code for a backend's error, wherever it surfaces (WebSocket, HTTP, cloning); first match.
_BACKEND_ERROR_CODES = (
    (UnknownVoiceError, ErrorCode.unknown_voice),
    (BackendOverloadedError, ErrorCode.overloaded),
    (VoiceCloningUnsupportedError, ErrorCode.voice_cloning_unsupported),
    (InvalidReferenceAudioError, ErrorCode.invalid_reference_audio),
    (SynthesisError, ErrorCode.synthesis_failed),
)


def backend_error_code(exc: BaseException) -> ErrorCode | None:
    """The code of a backend's SynthesisError (None for anything else: a bug, not the request's fault)."""
    return next((code for kind, code in _BACKEND_ERROR_CODES if isinstance(exc, kind)), None)


# Whether the same request may succeed later.
RETRYABLE = {
    ErrorCode.rate_limited,
    ErrorCode.too_many_sessions,
    ErrorCode.overloaded,
    ErrorCode.slow_consumer,  # resume the session (session.resume) and read faster
    ErrorCode.synthesis_failed,
    ErrorCode.store_unavailable,
    ErrorCode.internal,
}


class CloseCode(enum.IntEnum):
    normal = 1000
    policy = 1008
    too_big = 1009
    internal = 1011
    service_restart = 1012  # drain: the server is going away; resume the session elsewhere
    try_again_later = 1013


class ProtocolError(Exception):
    """An error to report to the client. `close` set means it is fatal: the socket closes with that code."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        close: CloseCode | None = None,
        context_id: str | None = None,
        sentence_index: int | None = None,
        message_type: str | None = None,
        retryable: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        # Whether the same message may succeed later: the code's (RETRYABLE) unless this instance knows better.
        self.retryable = code in RETRYABLE if retryable is None else retryable
        self.message = message
        self.close = close
        self.context_id = context_id
        self.sentence_index = sentence_index
        self.message_type = message_type  # the `type` of the client message it refuses, when known

    def to_message(self) -> "ErrorMessage":
        return ErrorMessage(
            message=self.message,
            code=self.code.value,
            retryable=self.retryable,
            context_id=self.context_id,
            sentence_index=self.sentence_index,
        )


# ----------------------------------------------------------------------------------------- client messages


class _ClientMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PronunciationEntry(_ClientMessage):
    """One entry of a pronunciation dictionary (gateway/pronunciation/rules.py checks its bounds): the
    written form `text` is said as `say`; in any case and as whole words unless told otherwise."""

    text: str
    say: str
    case_sensitive: bool = False
    whole_word: bool = True


# session.config's and the speech request's `pronunciations`: entries (PronunciationEntry's fields), or the
# names of dictionaries the key registered (POST /v1/audio/pronunciations, pronunciation.add), applied in the
# order given. Taken as plain JSON values here and checked by gateway/pronunciation/registry.py, count first:
# a config of 4 MiB of tiny entries would take a second and more to validate item by item.
Pronunciations = list[Any]


class SessionConfig(_ClientMessage):
    """`session.config`. Unknown fields are rejected. Every field that vLLM-Omni's or Baseten's clients send
    is accepted; those the backend cannot honour (voice cloning, word timestamps, ...) are named in
    session.started's `warnings` (gateway/compat.py) rather than refused."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["session.config"] = "session.config"
    model: str | None = None
    voice: str | None = Field(None, validation_alias=AliasChoices("voice", "speaker"))
    language: str = "Auto"
    instructions: str | None = None
    task_type: str | None = None
    response_format: str | None = None
    stream_audio: bool = False
    speed: float = Field(1.0, ge=0.25, le=4.0)
    max_new_tokens: int | None = Field(None, ge=1)
    initial_codec_chunk_frames: int | None = Field(None, ge=0)
    seed: int | None = None
    # "token" (ext): each sentence's synthesis starts at its first words, where the backend honours
    # "text_streaming"; elsewhere sentences, with a warning (gateway/compat.py).
    split_granularity: Literal["sentence", "clause", "none", "token"] = "sentence"
    sample_rate: int | None = None
    chunk_schedule: list[Annotated[int, Field(ge=1)]] | None = None
    # vLLM-Omni voice cloning inputs, forwarded in SynthesisRequest.extra.
    ref_audio: str | None = None
    ref_text: str | None = None
    x_vector_only_mode: bool | None = None
    # Word timestamps: vLLM-Omni's `word_timestamps`, Baseten's `timestamp_type` ("word", "char") and
    # where they travel (`timestamp_transport_strategy`: "sync" in audio.done, "async" interleaved).
    word_timestamps: bool | None = None
    timestamp_type: str | None = None
    timestamp_transport_strategy: Literal["sync", "async"] | None = None
    # vLLM-Omni's text mode: true puts each sentence's whole text in the model's prompt, false feeds it one
    # token per frame; left out, the server's default (-o streaming_text). Honoured by backends with
    # "text_mode"; true also means a sentence is synthesized only once it has ended (no "token" splitting).
    non_streaming_mode: bool | None = None
    # ext (issue 34): pronunciation dictionaries, and the markup subset ("ssml") read in the text
    pronunciations: Pronunciations | None = None
    text_markup: Literal["ssml"] | None = None

    @model_validator(mode="after")
    def _defaults_and_streaming_rules(self) -> "SessionConfig":
        if self.response_format is None:
            self.response_format = "pcm" if self.stream_audio else "wav"
        self.response_format = self.response_format.lower()
        if self.stream_audio and self.speed != 1.0:
            raise ValueError("speed must be 1.0 when stream_audio is true (speed works for whole files only)")
        return self

    @property
    def effective_chunk_schedule(self) -> tuple[int, ...] | None:
        if self.chunk_schedule:
            return tuple(self.chunk_schedule)
        if self.initial_codec_chunk_frames:
            return (self.initial_codec_chunk_frames,)
        return None

    def backend_extra(self) -> dict[str, Any]:
        """Request options that only some backends understand. Not the reference clip: its voice reaches the
        backend as the prompt computed from it (SynthesisRequest.voice_prompt), not megabytes per sentence."""
        extra: dict[str, Any] = {}
        for name in ("task_type", "ref_text", "x_vector_only_mode"):
            value = getattr(self, name)
            if value is not None:
                extra[name] = value
        if self.speed != 1.0:
            extra["speed"] = self.speed
        return extra


# A context id is echoed in every message about its context and stored with each of its sentences.
MAX_CONTEXT_ID_CHARS = 128
ContextId = Annotated[str, Field(max_length=MAX_CONTEXT_ID_CHARS)]


class InputText(_ClientMessage):
    type: Literal["input.text"]
    text: str
    context_id: ContextId | None = None


class InputFlush(_ClientMessage):
    type: Literal["input.flush"]
    context_id: ContextId | None = None


class InputDone(_ClientMessage):
    type: Literal["input.done"]
    context_id: ContextId | None = None


class InputCancel(_ClientMessage):
    type: Literal["input.cancel"]
    context_id: ContextId | None = None
    # ext: how much of this context's audio the client has played, in ms from the start of its cut
    # utterance's audio: context.cancelled's spoken_text is then what was heard, not what was sent.
    played_ms: float | None = Field(None, ge=0)


class SessionResume(_ClientMessage):
    type: Literal["session.resume"]
    session_id: str
    sentence_index: int = Field(0, ge=0)
    bytes_received: int = Field(0, ge=0)
    # ext: utterance.done + session.done messages received in this session, over all its connections;
    # with it the server re-sends exactly the ends the client lacks (without it: decided by position).
    ends_received: int | None = Field(None, ge=0)


class SessionClose(_ClientMessage):
    type: Literal["session.close"]


class Ping(_ClientMessage):
    type: Literal["ping"]
    id: Any = None


class VoiceList(_ClientMessage):
    """Before session.config (Baseten's Qwen3-TTS servers): answered with the voices."""

    type: Literal["voice.list"]


class VoiceAdd(_ClientMessage):
    """Register a cloned voice from reference audio (before or after session.config), as LiveKit's Baseten
    client sends it. Other fields servers take (speaker_description, ...) are accepted and unused; it is as
    large as a session.config may be. `audio_format` is a hint only: the clip's own container says what
    it is (gateway/audio/reference.py)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["voice.add"]
    name: Any = None  # checked by the registry, which names what a voice name may be
    audio_data: str | None = None  # base64 (or a data URL)
    audio_format: str | None = None
    ref_text: str | None = None
    consent: Any = None
    x_vector_only_mode: bool | None = None


class PronunciationAdd(_ClientMessage):
    """ext: register (or replace) a pronunciation dictionary of this key by name, as
    POST /v1/audio/pronunciations does."""

    type: Literal["pronunciation.add"]
    name: str
    entries: list[PronunciationEntry]


class PronunciationList(_ClientMessage):
    type: Literal["pronunciation.list"]


class PronunciationDelete(_ClientMessage):
    type: Literal["pronunciation.delete"]
    name: str


PRONUNCIATION_MESSAGES = (PronunciationAdd, PronunciationList, PronunciationDelete)
# Messages answered before session.config, and as large as it may be.
HANDSHAKE_MESSAGES = (SessionConfig, VoiceAdd, PronunciationAdd)

ClientMessage = Annotated[
    Union[SessionConfig, InputText, InputFlush, InputDone, InputCancel, SessionResume, SessionClose, Ping,
          VoiceList, VoiceAdd, PronunciationAdd, PronunciationList, PronunciationDelete],
    Field(discriminator="type"),
]
CLIENT_TYPES = (
    "session.config",
    "input.text",
    "input.flush",
    "input.done",
    "input.cancel",
    "session.resume",
    "session.close",
    "ping",
    "voice.list",
    "voice.add",
    "pronunciation.add",
    "pronunciation.list",
    "pronunciation.delete",
)
_client_adapter: TypeAdapter[Any] = TypeAdapter(ClientMessage)


def _describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        location = ".".join(str(p) for p in item["loc"] if p not in CLIENT_TYPES)
        parts.append(f"{location}: {item['msg']}" if location else item["msg"])
    return "; ".join(parts)


def _has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False


_SURROGATE = re.compile("[\ud800-\udfff]")

MAX_JSON_DEPTH = 64  # no client message nests deeper; pydantic and json.dumps recurse per level


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # e.g. 1e400: parsed as inf, which no JSON reply could carry back
        raise ValueError(f"number {text[:32]} is out of range")
    return value


def _nesting_depth(value: Any) -> int:
    """Deepest nesting of lists and objects, found without recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > deepest:
            deepest = depth
            if deepest > MAX_JSON_DEPTH:
                break
        pending.extend((child, depth + 1) for child in children)
    return deepest


def loads_client_json(raw: str | bytes) -> Any:
    """Client JSON, strictly: RFC 8259 numbers only (no NaN, Infinity or overflowing floats, which
    Python would accept and echo back as invalid JSON) and at most MAX_JSON_DEPTH levels of nesting.
    Raises json.JSONDecodeError for all of it, so both transports answer invalid_json."""
    try:
        text = raw.decode("utf-8", "surrogatepass") if isinstance(raw, (bytes, bytearray)) else raw
    except UnicodeDecodeError as exc:
        raise json.JSONDecodeError(f"not UTF-8 ({exc.reason})", "", exc.start) from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise json.JSONDecodeError(f"nested deeper than {MAX_JSON_DEPTH} levels", text, 0) from None
    except ValueError as exc:
        raise json.JSONDecodeError(str(exc), text, 0) from None
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _nesting_depth(data) > MAX_JSON_DEPTH:
        raise json.JSONDecodeError(f"nested deeper than {MAX_JSON_DEPTH} levels", text, 0)
    return data


def parse_client_message(raw: str) -> Any:
    """Parse one text frame. Raises ProtocolError (invalid_json, invalid_message, unknown_type)."""
    try:
        data = loads_client_json(raw)
    except ValueError as exc:
        raise ProtocolError(ErrorCode.invalid_json, f"message is not valid JSON: {exc}") from None
    # JSON escapes can smuggle unpaired UTF-16 surrogates into strings: not text, and unencodable in any
    # reply that would echo them (sentence_text, context_id), so refused here.
    if "\\u" in raw and _has_lone_surrogate(data):
        raise ProtocolError(ErrorCode.invalid_message, "message contains an unpaired surrogate escape (\\ud800-\\udfff)")
    if not isinstance(data, dict):
        raise ProtocolError(ErrorCode.invalid_message, "message must be a JSON object")
    kind = data.get("type")
    if not isinstance(kind, str):
        raise ProtocolError(ErrorCode.invalid_message, "message needs a string field 'type'")
    if kind not in CLIENT_TYPES:
        raise ProtocolError(
            ErrorCode.unknown_type, f"unknown message type {kind!r}; expected one of {', '.join(CLIENT_TYPES)}"
        )
    try:
        return _client_adapter.validate_python(data)
    except ValidationError as exc:
        raise ProtocolError(ErrorCode.invalid_message, f"invalid {kind}: {_describe(exc)}", message_type=kind) from None


# ----------------------------------------------------------------------------------------- server messages


class _ServerMessage(BaseModel):
    def encode(self) -> str:
        return self.model_dump_json(exclude_none=True)


class ConfigWarning(BaseModel):
    """Something of a request the gateway does differently than asked (an unknown voice spoken by the
    default one, an option this backend cannot honour); the request goes ahead."""

    code: str  # stable: voice_fallback, voice_cloning_unsupported, timestamps_unsupported, option_ignored,
    # language_unsupported, markup_ignored, expression_ignored, sentence_finished_early, timestamps_late
    message: str
    field: str | None = None  # the request field it concerns


class SessionStarted(_ServerMessage):
    type: Literal["session.started"] = "session.started"
    session_id: str
    sample_rate: int
    format: str
    voices: list[str]
    voice: str
    warnings: list[ConfigWarning] | None = None  # ext: left out when there are none
    inputs_received: int | None = None  # ext, answering session.resume: client inputs handled


class VoiceListed(_ServerMessage):
    """Answer to voice.list, in the shape Baseten's servers give: the names usable as `voice` (presets,
    then cloned ones), and the cloned voices this key may use with their metadata (gateway/voices.py)."""

    type: Literal["voice.list"] = "voice.list"
    voices: list[str]
    uploaded_voices: list[dict[str, Any]] = Field(default_factory=list)


class VoiceAdded(_ServerMessage):
    """Answer to voice.add: the registered voice's metadata (an error message instead when refused)."""

    type: Literal["voice.add"] = "voice.add"
    success: bool = True
    voice: dict[str, Any]


class PronunciationAnswer(_ServerMessage):
    """Answer to pronunciation.add (the dictionary's metadata), .list (every dictionary of the key) and
    .delete (the name deleted)."""

    type: Literal["pronunciation.add", "pronunciation.list", "pronunciation.delete"]
    dictionary: dict[str, Any] | None = None
    dictionaries: list[dict[str, Any]] | None = None
    deleted: str | None = None


class AudioStart(_ServerMessage):
    type: Literal["audio.start"] = "audio.start"
    sentence_index: int
    sentence_text: str
    format: str
    sample_rate: int
    channels: int = 1
    context_id: str | None = None
    # ext: the voice speaking this sentence, when it is not session.started's (picked for the text's
    # language: gateway/language.py), and what the sentence gets differently than asked (language_unsupported)
    voice: str | None = None
    warnings: list[ConfigWarning] | None = None


TIMESTAMP_TYPES = ("word", "char")


class SpokenWord(BaseModel):
    """A word and where it is spoken, in seconds from the start of its sentence's audio as shipped."""

    word: str
    start: float
    end: float
    sentence_index: int | None = None  # only in context.cancelled's spoken_words, which span sentences


class WordAlignment(BaseModel):
    """The shape Baseten's servers give (and LiveKit's Baseten client reads): three parallel lists."""

    words: list[str]
    word_start_times_seconds: list[float]
    word_end_times_seconds: list[float]


class TimestampInfo(BaseModel):
    word_alignment: WordAlignment


class AudioDone(_ServerMessage):
    type: Literal["audio.done"] = "audio.done"
    sentence_index: int
    total_bytes: int
    error: bool = False
    context_id: str | None = None
    duration_ms: float | None = None  # None (left out): unknown, for compressed audio replayed after a resume
    cancelled: bool | None = None
    timestamp_info: TimestampInfo | None = None  # timestamp_transport_strategy "sync": the sentence's words
    # ext, split_granularity "token": the sentence's whole text (its audio.start had the words known then)
    sentence_text: str | None = None
    # ext: left out when empty. split_granularity "token": what of its markup was not honoured (its audio.start
    # had not its whole text), and sentence_finished_early (a sentence still being written ended at its words)
    warnings: list[ConfigWarning] | None = None


class AudioWords(_ServerMessage):
    """ext (timestamp_transport_strategy "async"): words whose audio has just gone out in full."""

    type: Literal["audio.words"] = "audio.words"
    sentence_index: int
    context_id: str | None = None
    words: list[SpokenWord]


class UtteranceDone(_ServerMessage):
    type: Literal["utterance.done"] = "utterance.done"
    context_id: str | None = None
    total_sentences: int


class ContextCancelled(_ServerMessage):
    type: Literal["context.cancelled"] = "context.cancelled"
    context_id: str | None = None
    sentence_index: int | None = None
    # ext, with timestamps on: the words of the cut utterance whose audio went out in full, in order
    spoken_text: str | None = None
    spoken_words: list[SpokenWord] | None = None


class SessionDone(_ServerMessage):
    type: Literal["session.done"] = "session.done"
    total_sentences: int


class ErrorMessage(_ServerMessage):
    type: Literal["error"] = "error"
    message: str
    code: str
    retryable: bool = False
    context_id: str | None = None
    sentence_index: int | None = None


class Pong(_ServerMessage):
    type: Literal["pong"] = "pong"
    id: Any = None
    inputs_received: int | None = None  # ext: client inputs handled before this ping

    def encode(self) -> str:  # `id` is echoed even when null
        message = {"type": self.type, "id": self.id}
        if self.inputs_received is not None:
            message["inputs_received"] = self.inputs_received
        return json.dumps(message)
