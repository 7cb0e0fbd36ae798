"""Nari Labs' live-text WebSocket, `nari.speech.v1` at `WS /v1/audio/speech/ws`, served by a streaming session.

Nari's server and its benchmark harness (nari-labs/benchmarks, `tts_bench --target nari --transport
websocket`) speak one request per connection:

    client                                   server
                                             session.created {protocol, audio}
    request.start {voice, language, ...}     request.configured
    input_text.append {sequence: 0, text}    input_text.ack {event: "input_text.append", sequence: 0}
    ...                                      response.started {request_id, audio}, binary PCM, ...
    input_text.end {sequence: N}             input_text.ack {event: "input_text.end", sequence: N}
                                             response.done {request_id, stop_reason, audio_chunks}, close 1000

`NariSocket` is the WebSocket as a `StreamingSession` sees it: it reads Nari's events as this gateway's
messages (`request.start` -> `session.config` with `split_granularity: "token"` and 24 kHz PCM,
`input_text.append` -> `input.text`, `input_text.end` -> `input.done` then `session.close`,
`response.cancel` -> `input.cancel`) and writes the session's messages as Nari's events. So admission,
limits, the segmenter, text streaming and the store are the session's own; this module owns only the
translation and the sequence numbers.

An acknowledgement means the session has handled the event (its text is accepted and recorded): after each
event the session is handed a `ping`, and its `pong`, which follows the event's handling, is sent as the
`input_text.ack`. A text it refused is answered by its error first.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.websockets import WebSocket, WebSocketState

from .protocol import CloseCode

NARI_PATH = "/v1/audio/speech/ws"
NARI_PROTOCOL = "nari.speech.v1"
NARI_SAMPLE_RATE = 24000
AUDIO = {"encoding": "pcm_s16le", "sample_rate": NARI_SAMPLE_RATE, "channels": 1}
_ACK_PREFIX = "nari-ack:"  # the id of the pings this module hands the session


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class RequestStart(_Strict):
    """Nari's generation controls. Those this gateway has (voice, language, instructions, seed, ...) become
    the session's config; the sampling ones are accepted and named in request.configured's `warnings`."""

    type: Literal["request.start"]
    model: str | None = None
    voice: str | None = None
    language: str = "auto"
    instruction: str | None = None
    instruct: str | None = None
    instructions: str | None = None
    response_format: Literal["pcm", "pcm16", "pcm_s16le"] = "pcm"
    seed: Annotated[int, Field(ge=0)] | None = None
    max_new_tokens: Annotated[int, Field(ge=1, le=32 * 1024)] | None = None
    stream_chunk_schedule: list[Annotated[int, Field(ge=1, le=128)]] | None = Field(None, min_length=1,
                                                                                    max_length=32)
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    subtalker_dosample: bool | None = None
    subtalker_temperature: float | None = None
    subtalker_top_k: int | None = None
    subtalker_top_p: float | None = None
    skip_fixed_bootstrap_audio: bool | None = None
    stream_chunk_frames: int | None = None
    stream_first_chunk_frames: int | None = None
    stream_steady_chunk_frames: int | None = None

    def session_config(self) -> dict[str, Any]:
        instructions = [v for v in (self.instruction, self.instruct, self.instructions) if v is not None]
        if len(instructions) > 1:
            raise ValueError("set only one of instruction, instruct, or instructions")
        config: dict[str, Any] = {
            "type": "session.config", "model": self.model, "voice": self.voice, "language": self.language,
            "instructions": instructions[0] if instructions else None, "response_format": "pcm",
            "stream_audio": True, "sample_rate": NARI_SAMPLE_RATE, "split_granularity": "token",
            "seed": self.seed, "max_new_tokens": self.max_new_tokens, "chunk_schedule": self.stream_chunk_schedule,
        }
        return {name: value for name, value in config.items() if value is not None}

    def ignored(self) -> list[str]:
        """The controls given that this gateway does not have."""
        used = {"type", "model", "voice", "language", "instruction", "instruct", "instructions", "response_format",
                "seed", "max_new_tokens", "stream_chunk_schedule"}
        return sorted(name for name in self.model_fields_set - used)


class TextAppend(_Strict):
    type: Literal["input_text.append"]
    sequence: Annotated[int, Field(ge=0)]
    text: Annotated[str, Field(min_length=1)]


class TextEnd(_Strict):
    type: Literal["input_text.end"]
    sequence: Annotated[int, Field(ge=0)]


class ResponseCancel(_Strict):
    type: Literal["response.cancel"]


# The close code after a session's error: 1009 for text over a limit (as Nari's input_too_large), 1011 for
# a failure of the server's, 1013 for a refusal that may pass later; 1008 for the rest.
_ERROR_CLOSE = {"text_too_long": CloseCode.too_big, "message_too_large": CloseCode.too_big,
                "internal": CloseCode.internal, "synthesis_failed": CloseCode.internal,
                "overloaded": CloseCode.try_again_later, "rate_limited": CloseCode.try_again_later,
                "too_many_sessions": CloseCode.try_again_later, "slow_consumer": CloseCode.try_again_later}

_EVENTS = {"request.start": RequestStart, "input_text.append": TextAppend, "input_text.end": TextEnd,
           "response.cancel": ResponseCancel}


class NariError(Exception):
    def __init__(self, code: str, message: str, close: int = CloseCode.policy) -> None:
        super().__init__(message)
        self.code = code
        self.close = close


def offers_protocol(websocket: WebSocket) -> bool:
    offered = websocket.headers.get("sec-websocket-protocol", "")
    return NARI_PROTOCOL in (value.strip() for value in offered.split(","))


class NariSocket:
    """The socket a `StreamingSession` reads and writes, speaking `nari.speech.v1` on `websocket`.
    `max_event_bytes` bounds one client event (the session's own limits apply to what it becomes)."""

    def __init__(self, websocket: WebSocket, *, max_event_bytes: int) -> None:
        self.ws = websocket
        self.max_event_bytes = max_event_bytes
        self.request_id: str | None = None
        self._pending: list[dict[str, Any]] = []  # messages for the session, ahead of the next client event
        self._configured = False
        self._input_ended = False
        self._next_sequence = 0
        self._started = False  # response.started sent
        self._done = False  # response.done or a fatal error sent: nothing more goes out
        self._audio_chunks = 0
        self._ignored: list[str] = []

    # ------------------------------------------------------------------ what the session calls

    @property
    def scope(self):
        return self.ws.scope

    @property
    def application_state(self) -> WebSocketState:
        return self.ws.application_state

    async def accept(self) -> None:
        await self.ws.accept(subprotocol=NARI_PROTOCOL)
        await self.ws.send_text(json.dumps({"type": "session.created", "protocol": NARI_PROTOCOL, "audio": AUDIO}))

    async def close(self, code: int = CloseCode.normal, reason: str | None = None) -> None:
        if self.ws.application_state == WebSocketState.CONNECTED:  # an error may have closed it already
            await self.ws.close(code, reason=reason)

    async def receive(self) -> dict[str, Any]:
        """The session's next message: what the last client event still owes it, else the next event's."""
        while not self._pending:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect" or message.get("text") is None:
                return message  # the session ends, or refuses the binary frame
            try:
                self._pending = self._translate(message["text"])
            except NariError as error:
                await self._fail(error)
                return {"type": "websocket.disconnect", "code": error.close}
        return {"type": "websocket.receive", "text": json.dumps(self._pending.pop(0))}

    async def send_text(self, text: str) -> None:
        if self._done:
            return
        message = json.loads(text)
        for event in self._events(message):
            await self.ws.send_text(json.dumps(event))
        if message.get("type") == "error":
            # Every error ends a Nari connection, as Nari's server does: the event it refused (text over a
            # limit, say) is never acknowledged, and nothing the client sends after it is taken.
            self._done = True
            await self.close(_ERROR_CLOSE.get(message.get("code"), CloseCode.policy), reason=message.get("code"))

    async def send_bytes(self, data: bytes) -> None:
        if self._done:
            return
        self._audio_chunks += 1
        await self.ws.send_bytes(data)

    # ------------------------------------------------------------------ client events -> session messages

    def _translate(self, raw: str) -> list[dict[str, Any]]:
        size = len(raw) if raw.isascii() else len(raw.encode("utf-8"))
        if size > self.max_event_bytes:
            raise NariError("input_too_large", f"event of {size} bytes exceeds the {self.max_event_bytes}-byte limit",
                            close=CloseCode.too_big)
        try:
            payload = json.loads(raw)
        except ValueError:
            raise NariError("invalid_json", "the event is not valid JSON") from None
        kind = _EVENTS.get(payload.get("type")) if isinstance(payload, dict) else None
        if kind is None:
            event_type = payload.get("type") if isinstance(payload, dict) else None
            raise NariError("unknown_event", f"unsupported WebSocket event type: {event_type!r}")
        try:
            event = kind.model_validate(payload)
            if isinstance(event, RequestStart):
                config = event.session_config()
        except (ValidationError, ValueError) as exc:
            raise NariError("invalid_request", f"{payload['type']}: {_reason(exc)}") from None
        if isinstance(event, RequestStart):
            if self._configured:
                raise NariError("invalid_request", "the request was already configured")
            self._configured = True
            self._ignored = event.ignored()
            return [config]
        if not self._configured:
            raise NariError("invalid_request", f"send request.start before {event.type}")
        if isinstance(event, ResponseCancel):
            return [{"type": "input.cancel"}, {"type": "session.close"}]
        if self._input_ended:
            raise NariError("invalid_request", f"{event.type} after input_text.end")
        if event.sequence != self._next_sequence:
            raise NariError("invalid_sequence", f"expected sequence {self._next_sequence}, got {event.sequence}")
        self._next_sequence += 1
        ack = {"type": "ping", "id": f"{_ACK_PREFIX}{event.type}:{event.sequence}"}
        if isinstance(event, TextAppend):
            return [{"type": "input.text", "text": event.text}, ack]
        self._input_ended = True
        return [{"type": "input.done"}, ack, {"type": "session.close"}]

    # ------------------------------------------------------------------ session messages -> server events

    def _events(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        kind = message.get("type")
        if kind == "session.started":
            self.request_id = f"ws-{message.get('session_id')}"
            warnings = [*(message.get("warnings") or []),
                        *({"code": "option_ignored", "field": name,
                           "message": f"{name}: this gateway does not use it"} for name in self._ignored)]
            return [{"type": "request.configured", "request_id": self.request_id, "voice": message.get("voice"),
                     **({"warnings": warnings} if warnings else {})}]
        if kind == "pong" and str(message.get("id", "")).startswith(_ACK_PREFIX):
            event, _, sequence = message["id"][len(_ACK_PREFIX):].rpartition(":")
            return [{"type": "input_text.ack", "event": event, "sequence": int(sequence),
                     "request_id": self.request_id}]
        if kind == "audio.start":
            return self._response_started()
        if kind in ("session.done", "context.cancelled"):
            # One response per connection: its end is the first of these; the session's close follows.
            started = self._response_started()
            self._done = True
            return [*started, {"type": "response.done", "request_id": self.request_id,
                               "stop_reason": "cancelled" if kind == "context.cancelled" else "stop",
                               "audio_chunks": self._audio_chunks}]
        if kind == "error":
            retryable = bool(message.get("retryable"))
            return [{"type": "error", "request_id": self.request_id,
                     "error": {"type": "server_error" if retryable else "invalid_request_error",
                               "code": message.get("code"), "message": message.get("message"),
                               "retryable": retryable}}]
        return []  # sentence-level detail (audio.done, utterance ends, words) has no Nari event

    def _response_started(self) -> list[dict[str, Any]]:
        """response.started, before the response's first audio (or its end, when it has none); once."""
        if self._started:
            return []
        self._started = True
        return [{"type": "response.started", "request_id": self.request_id, "audio": AUDIO}]

    async def _fail(self, error: NariError) -> None:
        """A client event this protocol refuses: say why and close, as Nari's server does."""
        if self._done or self.ws.application_state != WebSocketState.CONNECTED:
            return
        self._done = True
        await self.ws.send_text(json.dumps({"type": "error", "request_id": self.request_id, "error": {
            "type": "invalid_request_error", "code": error.code, "message": str(error), "retryable": False}}))
        await self.ws.close(error.close, reason=error.code)


def _reason(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'event'}: {e['msg']}" for e in exc.errors())
    return str(exc)
