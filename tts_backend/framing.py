"""The small framed protocol between a gateway and a `voxgate worker` over a local (Unix) socket.

Each frame: a 4-byte big-endian length of what follows, one type byte, the payload.
  b"J"  a JSON object (control: info, synthesize, done, error)
  b"A"  s16le PCM audio of the request in flight
One connection carries one request (or one info query). Closing the connection cancels the request: the
worker notices end-of-file and stops its stream within one chunk, which frees the engine slot.

  client -> worker   {"op": "info"}                         -> {"op": "info", ...}
  client -> worker   {"op": "synthesize", "request": {...}} -> A frames..., then {"op": "done"}
                                                               or {"op": "error", "code": ..., "message": ...}
"""

from __future__ import annotations

import asyncio
import json
import struct

JSON = b"J"
AUDIO = b"A"
MAX_FRAME = 16 * 1024 * 1024
_HEADER = struct.Struct(">IB")


class ProtocolError(RuntimeError):
    pass


def encode(kind: bytes, payload: bytes) -> bytes:
    return _HEADER.pack(len(payload) + 1, kind[0]) + payload


def encode_json(message: dict) -> bytes:
    return encode(JSON, json.dumps(message, separators=(",", ":")).encode())


async def read_frame(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """(kind, payload), or None at a clean end of stream."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ProtocolError("connection closed inside a frame header") from exc
    length, kind = _HEADER.unpack(header)
    if length < 1 or length > MAX_FRAME:
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
