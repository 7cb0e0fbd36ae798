"""The small framed protocol between a gateway and a `voxgate worker`, over a Unix socket or TCP (connection.py).

Each frame: a 4-byte big-endian length of what follows, one type byte, the payload.
  b"J"  a JSON object (control: info, synthesize, words, done, error)
  b"A"  s16le PCM audio of the request in flight
One connection carries one request (or one info query). Closing the connection cancels the request: the
worker notices end-of-file and stops its stream within one chunk, which frees the engine slot.

  client -> worker   {"op": "info"}                         -> {"op": "info", ...}
  client -> worker   {"op": "synthesize", "request": {...}} -> A frames..., then {"op": "done"}
                                                               or {"op": "error", "code": ..., "message": ...}
  client -> worker   {"op": "clone", "samples": base64, "ref_text": str|null, "x_vector_only": bool}
                                                            -> {"op": "clone", "prompt": base64}
                                                               or {"op": "error", ...}
  client -> worker   {"op": "auth", "token": str}           first, where the worker has a token; no answer,
                                                               the request frame follows at once. A wrong or
                                                               missing token: {"op": "error", "code": "unauthorized"}
A worker that is draining answers a synthesize for an utterance it has not served with
{"op": "error", "code": "draining"}: the gateway's pool sends it to another worker. A synthesize with
"place": true (a session's first request, placing the session) is answered {"op": "error", "code": "full"}
by a worker whose capacity is in use, and the pool asks the next best.
("samples": a ReferenceAudio's float32 24 kHz mono samples; "prompt": the backend's voice prompt; a
request's "voice_prompt" travels in base64 too, and is left out when there is none.)
With "word_timestamps" in the request, {"op": "words", "words": [[word, start, end], ...]} frames (a
chunk's WordTimings, in the backend's samples) come before that chunk's A frame.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import json
import struct

from ..base import (
    BackendOverloadedError,
    InvalidReferenceAudioError,
    InvalidVoicePromptError,
    SynthesisError,
    SynthesisRequest,
    UnknownVoiceError,
    VoiceCloningUnsupportedError,
)

JSON = b"J"
AUDIO = b"A"
MAX_FRAME = 16 * 1024 * 1024
# Where the worker has a token, a peer's first frame must be the (small) auth frame: a longer one is
# refused before its payload is read, so an unauthenticated peer cannot make the worker buffer megabytes.
MAX_AUTH_FRAME = 4096
READ_LIMIT = 1 << 20  # StreamReader buffer: readexactly reads past it, this only bounds read-ahead
_HEADER = struct.Struct(">IB")


class ProtocolError(RuntimeError):
    pass


def encode(kind: bytes, payload: bytes) -> bytes:
    return _HEADER.pack(len(payload) + 1, kind[0]) + payload


def encode_json(message: dict) -> bytes:
    return encode(JSON, json.dumps(message, separators=(",", ":")).encode())


async def read_frame(reader: asyncio.StreamReader, max_size: int = MAX_FRAME) -> tuple[bytes, bytes] | None:
    """(kind, payload), or None at a clean end of stream; a frame longer than max_size is a ProtocolError
    before any of its payload is read."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ProtocolError("connection closed inside a frame header") from exc
    length, kind = _HEADER.unpack(header)
    if length < 1 or length > max_size:
        raise ProtocolError(f"bad frame length {length}")
    payload = await reader.readexactly(length - 1)
    return bytes([kind]), payload


def decode_json(payload: bytes) -> dict:
    try:
        message = json.loads(payload)
    except ValueError as exc:
        raise ProtocolError(f"bad JSON frame: {exc}") from exc
    if not isinstance(message, dict) or "op" not in message:
        raise ProtocolError("JSON frame without an op")
    return message


# The errors a gateway tells apart, by their code on the socket (the worker sends them, pool.py raises them again).
ERROR_CODES: dict[type[SynthesisError], str] = {
    UnknownVoiceError: "unknown_voice",
    BackendOverloadedError: "overloaded",
    VoiceCloningUnsupportedError: "voice_cloning_unsupported",
    InvalidReferenceAudioError: "invalid_reference_audio",
    InvalidVoicePromptError: "invalid_voice_prompt",
}


# The request travels as its dataclass's fields; this module is the one both sides of the socket import
# (a gateway's remote backend and the worker, which imports the backend registry that names the remote).


def request_to_json(request: SynthesisRequest) -> dict:
    # A text stream is a live object, not data (asdict would deep-copy it): it never travels in the request.
    data = dataclasses.asdict(dataclasses.replace(request, text_stream=None))
    del data["text_stream"]
    if data["streaming_text"] is None:  # left out unless chosen, so that a worker older than the field serves
        del data["streaming_text"]
    if not data["word_timestamps"]:  # left out unless asked, so that a worker older than the field still serves
        del data["word_timestamps"]
    if data["session_key"] is None:  # likewise
        del data["session_key"]
    if data["voice_prompt"] is None:  # likewise
        del data["voice_prompt"]
    else:
        data["voice_prompt"] = base64.b64encode(data["voice_prompt"]).decode()
    if data["chunk_schedule"] is not None:
        data["chunk_schedule"] = list(data["chunk_schedule"])
    return data


def request_from_json(data: dict) -> SynthesisRequest:
    fields = {f.name for f in dataclasses.fields(SynthesisRequest)} - {"text_stream"}  # never from a peer
    unknown = set(data) - fields
    if unknown:
        raise SynthesisError(f"unknown request fields: {sorted(unknown)}")
    if data.get("chunk_schedule") is not None:
        data = {**data, "chunk_schedule": tuple(data["chunk_schedule"])}
    if data.get("voice_prompt") is not None:
        data = {**data, "voice_prompt": decode_base64(data["voice_prompt"], "voice_prompt")}
    return SynthesisRequest(**data)


def decode_base64(value: object, what: str) -> bytes:
    if not isinstance(value, str):
        raise ProtocolError(f"{what} must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolError(f"{what} is not valid base64: {exc}") from exc
