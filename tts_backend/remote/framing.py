"""The small framed protocol between a gateway and a `voxgate worker`, over a Unix socket or TCP (connection.py).

Each frame: a 4-byte big-endian length of what follows, one type byte, the payload.
  b"J"  a JSON object (control: info, synthesize, words, done, error)
  b"A"  s16le PCM audio of the request in flight
  b"C"  codec codes of the request in flight (base.AudioChunk.codes: uint16 LE, frame-major, whole frames)
One connection carries one request (or one info query). Closing the connection cancels the request: the
worker notices end-of-file and stops its stream within one chunk, which frees the engine slot.

  client -> worker   {"op": "info"}                         -> {"op": "info", ...}
  client -> worker   {"op": "synthesize", "request": {...}} -> A frames..., then {"op": "done"}
                                                               or {"op": "error", "code": ..., "message": ...}
  client -> worker   {"op": "clone", "samples": base64, "ref_text": str|null, "x_vector_only": bool}
                                                            -> {"op": "clone", "prompt": base64}
                                                               or {"op": "error", ...}
Authentication, where the worker has a token (connection.py's Dialer does the client's part): neither side
ever sends the token; each proves that it holds it with an HMAC-SHA256 over both sides' fresh nonces, the
address the gateway's connection reached and the worker's id, the worker first, so that a peer posing as a
worker anywhere but at a worker's own address (an address planted in the registry, a port taken over, even
relaying to a real worker) learns nothing of the token and is sent no text, and a peer posing as a gateway
gets nothing served (what an eavesdropper on the path to a worker's own address sees: connection.py):
  client -> worker   {"op": "hello", "nonce": hex, "to": address}
                                                             16 random bytes; the address the connection reached,
                                                             as the gateway's socket names it (connection.py)
  worker -> client   {"op": "hello", "nonce": hex, "id": str, "proof": hex}
                                                             proof = worker_proof(token, client nonce, worker nonce,
                                                                                  to, id)
  client -> worker   {"op": "auth", "proof": hex}            gateway_proof(token, worker nonce, client nonce, to, id),
                                                             and in the same write the request frame
  A wrong proof, or anything else first: {"op": "error", "code": "unauthorized"}. A worker proves nothing
  for an address it does not answer to (its own, its --advertise, its --reachable-at):
  {"op": "error", "code": "wrong_address"}. So a relay, a listener at another address forwarding the hello
  to a real worker, gets either a refusal or a proof for the worker's address, which the gateway, checking
  it against the address it reached, refuses: it writes nothing more. The gateway checks the worker's
  proof (and, for a worker found in the registry or a static member with an id, its id) before it writes
  its own proof or any request. This costs one round trip per connection. Handshake frames are at most
  MAX_AUTH_FRAME bytes. (A hello without "to" is an older gateway's: the worker answers it with the
  proofs of v1, which bind no address; this version's gateways never accept those, so workers are upgraded
  before gateways.)
On a Unix socket the kernel names the process at the other end (SO_PEERCRED): a gateway that finds the
worker runs as its own user (or root), which a forger of another user cannot, skips the round trip,
  client -> worker   {"op": "hello", "nonce": hex, "proof": local_proof(token, client nonce)}, and the request
and a worker on a Unix socket takes that (a TCP worker never does: a proof without its nonce could be
replayed there). A worker without a token (the default local socket) has no handshake at all.
A worker that is draining answers a synthesize for an utterance it has not served with
{"op": "error", "code": "draining"}: the gateway's pool sends it to another worker. A synthesize with
"place": true (a session's first request, placing the session) is answered {"op": "error", "code": "full"}
by a worker whose capacity is in use, and the pool asks the next best.
("samples": a ReferenceAudio's float32 24 kHz mono samples; "prompt": the backend's voice prompt; a
request's "voice_prompt" travels in base64 too, and is left out when there is none.)
A synthesize with "keepalive": true asks for keep-alives: while its backend is still working (queued for an
engine slot, waiting for the aligner) and has produced nothing for KEEPALIVE_S, the worker sends
{"op": "wait"} on the stream, again every KEEPALIVE_S: proof that it is alive and at work, which the
gateway's pool takes in place of a frame for its inter-frame deadline (pool.py). Without the flag (an older
gateway, which would take the frame for a bad one) none is sent; a worker too old to send them is held to
the deadlines as before.
With "word_timestamps" in the request, {"op": "words", "words": [[word, start, end], ...]} frames (a
chunk's WordTimings, in the backend's samples) come before that chunk's A frame. A synthesize with
"audio_ended": true also gets {"op": "audio_ended"} where its backend says the audio is all out and only words
may follow (base.AudioChunk.audio_ended), so that the gateway can bound its wait for them; an older gateway,
which would take that frame for a bad one, does not ask and gets none.

Codes (issue 33, base.py's "resume_codes"): a synthesize with "codes": true gets each chunk's codes in C
frames after the chunk's A frames (so a chunk is whole once its codes are in: the audio before the last C
frame is what those codes resume after), at most AUDIO_FRAME_BYTES each, cut at whole frames of the
`codebooks` the worker's info names (with its `frame_rate`). A request's "resume_codes" (base64) continues
it after those frames; codes that are not whole frames, or more than the text could make, are answered
{"op": "error", "code": "synthesis_failed"}. A synthesize with
"handover": true as well may be ended, when the worker drains, by
  worker -> client   {"op": "handover"}                     the chunks before it are whole; go on elsewhere
after which the gateway continues the request from the codes it has on another worker (worker.py), and is
answered `draining` to new requests meanwhile.

Text streaming (base.TextStream): a synthesize with "text_stream": true opens a request whose text goes on
after the request's "text"; the client sends the rest on the same connection while the audio comes back:
  client -> worker   {"op": "text", "text": str}            more text (appended as it is)
  client -> worker   {"op": "text_done"}                    the text is complete
Any other frame, or end-of-file, still means "stop". A text frame is a control frame (at most MAX_CONTROL_FRAME bytes), and the
whole text, pushed or not, is bounded as any request's (the worker's --max-text-chars); past either:
{"op": "error", "code": "bad_request"}.
A worker that answers a request it took with an error, or ends a text stream before its text did (an error, a
hand-over), then ends its side and reads on, dropping what comes, until the client closes (worker.py's
CLOSE_LINGER_S at most): a client still writing text gets the answer, not a reset.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import hashlib
import hmac
import json
import secrets
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
CODES = b"C"
# Frame size limits, each checked on the header, before any of the payload is read. Every frame type has
# the smallest limit that what it carries allows, so that a peer cannot make the other side buffer more.
# A handshake frame, from a peer that has proved nothing yet:
# A synthesize stream silent this long while its backend works gets a {"op": "wait"} (see above).
KEEPALIVE_S = 1.0
MAX_AUTH_FRAME = 4096
# A request (the first frame after the handshake): a clone carries its reference clip's samples in base64
# (30 s of float32 at 24 kHz: 3.8 MB), a synthesize may carry a voice prompt.
MAX_REQUEST_FRAME = 8 * 1024 * 1024
# Any later frame a client sends on a request's connection (small control messages).
MAX_CONTROL_FRAME = 64 * 1024
# What a gateway takes from a worker in a stream: audio frames (the worker cuts a chunk's PCM into frames
# of at most AUDIO_FRAME_BYTES) and words frames (at most WORDS_PER_FRAME words each).
MAX_STREAM_FRAME = 256 * 1024
AUDIO_FRAME_BYTES = 64 * 1024
WORDS_PER_FRAME = 256
# A worker's answer to info or metrics; a clone's answer carries a prompt, which must fit a request frame.
MAX_ANSWER_FRAME = 1024 * 1024
READ_LIMIT = 1 << 20  # StreamReader buffer: readexactly reads past it, this only bounds read-ahead
_HEADER = struct.Struct(">IB")


class ProtocolError(RuntimeError):
    pass


def encode(kind: bytes, payload: bytes | memoryview) -> bytes:
    return _HEADER.pack(len(payload) + 1, kind[0]) + payload


def encode_codes(codes: bytes, codebooks: int) -> bytes:
    """A chunk's codes as C frames of at most AUDIO_FRAME_BYTES, each whole frames of `codebooks` codes."""
    step = max(1, AUDIO_FRAME_BYTES // (2 * codebooks)) * 2 * codebooks
    view = memoryview(codes)
    return b"".join(encode(CODES, view[at:at + step]) for at in range(0, len(codes), step))


def encode_json(message: dict) -> bytes:
    return encode(JSON, json.dumps(message, separators=(",", ":")).encode())


async def read_header(reader: asyncio.StreamReader, max_size: int) -> tuple[bytes, int] | None:
    """A frame's (kind, payload length), or None at a clean end of stream; a frame longer than max_size
    is a ProtocolError, before any of its payload is read."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ProtocolError("connection closed inside a frame header") from exc
    length, kind = _HEADER.unpack(header)
    if length < 1 or length > max_size:
        raise ProtocolError(f"bad frame length {length}")
    return bytes([kind]), length - 1


async def read_frame(reader: asyncio.StreamReader, max_size: int) -> tuple[bytes, bytes] | None:
    """(kind, payload), or None at a clean end of stream (see read_header)."""
    head = await read_header(reader, max_size)
    if head is None:
        return None
    kind, size = head
    return kind, await reader.readexactly(size)


def decode_json(payload: bytes) -> dict:
    try:
        message = json.loads(payload)
    except ValueError as exc:
        raise ProtocolError(f"bad JSON frame: {exc}") from exc
    except RecursionError:  # nesting deeper than the interpreter's recursion limit: "[[[[..."
        raise ProtocolError("bad JSON frame: nested too deep") from None
    if not isinstance(message, dict) or "op" not in message:
        raise ProtocolError("JSON frame without an op")
    return message


# ---- the handshake (see the module doc) ----------------------------------------------------------------
NONCE_BYTES = 16
# Each side's proof is labelled with its role, so that one side's proof is never valid as the other's.
_WORKER_LABEL = b"voxgate worker proof v2\0"
_GATEWAY_LABEL = b"voxgate gateway proof v2\0"
_LOCAL_LABEL = b"voxgate local gateway proof v1\0"
# An older gateway's hello (no "to"): proofs that bind no address (module doc).
_V1_WORKER_LABEL = b"voxgate worker proof v1\0"
_V1_GATEWAY_LABEL = b"voxgate gateway proof v1\0"


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def parse_nonce(value: object) -> bytes:
    """A nonce as the peer sent it (hex of NONCE_BYTES bytes); a ProtocolError for anything else."""
    if not isinstance(value, str) or len(value) != 2 * NONCE_BYTES:
        raise ProtocolError("the handshake wants a nonce of 32 hex digits")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ProtocolError("the handshake wants a nonce of 32 hex digits") from None


def _mac(token: str, *parts: bytes) -> str:
    return hmac.new(token.encode(), b"".join(parts), hashlib.sha256).hexdigest()


def _bound(dialled: str, worker_id: str) -> bytes:
    # The nonces have a fixed length and the address its length before it, so no two inputs join into the
    # same bytes.
    address = dialled.encode()
    return len(address).to_bytes(2, "big") + address + worker_id.encode()


def worker_proof(token: str, client_nonce: bytes, worker_nonce: bytes, dialled: str, worker_id: str) -> str:
    return _mac(token, _WORKER_LABEL, client_nonce, worker_nonce, _bound(dialled, worker_id))


def gateway_proof(token: str, worker_nonce: bytes, client_nonce: bytes, dialled: str, worker_id: str) -> str:
    return _mac(token, _GATEWAY_LABEL, worker_nonce, client_nonce, _bound(dialled, worker_id))


def v1_worker_proof(token: str, client_nonce: bytes, worker_nonce: bytes, worker_id: str) -> str:
    return _mac(token, _V1_WORKER_LABEL, client_nonce, worker_nonce, worker_id.encode())


def v1_gateway_proof(token: str, worker_nonce: bytes, client_nonce: bytes) -> str:
    return _mac(token, _V1_GATEWAY_LABEL, worker_nonce, client_nonce)


def local_proof(token: str, client_nonce: bytes) -> str:
    return _mac(token, _LOCAL_LABEL, client_nonce)


def proof_matches(offered: object, expected: str) -> bool:
    """Constant-time comparison of a proof the peer sent with the one it should have sent."""
    return isinstance(offered, str) and hmac.compare_digest(offered.encode(), expected.encode())


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
    if not data["resume_codes"]:  # left out unless resuming, so that a worker older than the field serves
        del data["resume_codes"]
    else:
        data["resume_codes"] = base64.b64encode(data["resume_codes"]).decode()
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
    if data.get("resume_codes") is not None:
        data = {**data, "resume_codes": decode_base64(data["resume_codes"], "resume_codes")}
    return SynthesisRequest(**data)


def decode_base64(value: object, what: str) -> bytes:
    if not isinstance(value, str):
        raise ProtocolError(f"{what} must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolError(f"{what} is not valid base64: {exc}") from exc
