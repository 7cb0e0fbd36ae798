"""Twilio Media Streams messages (bidirectional `<Connect><Stream>`), as Twilio documents them.

From Twilio: `connected`, `start`, `media`, `mark`, `dtmf`, `stop` (JSON text frames, a `sequenceNumber`
string on all but `connected`). To Twilio: `media` (base64 `audio/x-mulaw` 8000 Hz in a text frame),
`mark` (echoed back by Twilio once the audio before it has played) and `clear` (drop buffered audio).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from dataclasses import dataclass, field
from typing import Any
from xml.sax.saxutils import quoteattr

TWILIO_ENCODING = "audio/x-mulaw"
TWILIO_SAMPLE_RATE = 8000
FRAME_MS = 20
FRAME_BYTES = TWILIO_SAMPLE_RATE * FRAME_MS // 1000  # 160 bytes of mu-law: 20 ms at 8 kHz


class TwilioProtocolError(ValueError):
    """A message from Twilio that does not follow the Media Streams protocol."""


@dataclass(frozen=True)
class Connected:
    protocol: str
    version: str


@dataclass(frozen=True)
class MediaFormat:
    encoding: str = TWILIO_ENCODING
    sample_rate: int = TWILIO_SAMPLE_RATE
    channels: int = 1


@dataclass(frozen=True)
class Start:
    stream_sid: str
    call_sid: str
    account_sid: str
    tracks: list[str]
    custom_parameters: dict[str, str]
    media_format: MediaFormat
    sequence_number: int | None = None


@dataclass(frozen=True)
class Media:
    stream_sid: str
    track: str
    chunk: int
    timestamp_ms: int
    payload: bytes  # decoded mu-law bytes
    sequence_number: int | None = None


@dataclass(frozen=True)
class Mark:
    stream_sid: str
    name: str
    sequence_number: int | None = None


@dataclass(frozen=True)
class Dtmf:
    stream_sid: str
    digit: str
    track: str = "inbound_track"
    sequence_number: int | None = None


@dataclass(frozen=True)
class Stop:
    stream_sid: str
    call_sid: str | None
    account_sid: str | None
    sequence_number: int | None = None


@dataclass(frozen=True)
class Unknown:
    event: str
    data: dict[str, Any] = field(default_factory=dict)


TwilioEvent = Connected | Start | Media | Mark | Dtmf | Stop | Unknown


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def parse_twilio_message(raw: str | bytes) -> TwilioEvent:
    """Parse one text frame from Twilio. Raises TwilioProtocolError on malformed input."""
    if isinstance(raw, bytes):
        raise TwilioProtocolError("Twilio sends JSON text frames; got a binary frame")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise TwilioProtocolError(f"invalid JSON from Twilio: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("event"), str):
        raise TwilioProtocolError("a Twilio message is a JSON object with a string 'event'")
    event = data["event"]
    sequence = _int(data.get("sequenceNumber"))
    try:
        if event == "connected":
            return Connected(protocol=data.get("protocol", ""), version=data.get("version", ""))
        if event == "start":
            start = data["start"]
            fmt = start.get("mediaFormat") or {}
            return Start(
                stream_sid=data.get("streamSid") or start["streamSid"],
                call_sid=start["callSid"],
                account_sid=start.get("accountSid", ""),
                tracks=list(start.get("tracks", ["inbound"])),
                custom_parameters=dict(start.get("customParameters") or {}),
                media_format=MediaFormat(
                    encoding=fmt.get("encoding", TWILIO_ENCODING),
                    sample_rate=int(fmt.get("sampleRate", TWILIO_SAMPLE_RATE)),
                    channels=int(fmt.get("channels", 1)),
                ),
                sequence_number=sequence,
            )
        if event == "media":
            media = data["media"]
            return Media(
                stream_sid=data.get("streamSid", ""),
                track=media.get("track", "inbound"),
                chunk=_int(media.get("chunk")) or 0,
                timestamp_ms=_int(media.get("timestamp")) or 0,
                payload=base64.b64decode(media["payload"], validate=True),
                sequence_number=sequence,
            )
        if event == "mark":
            return Mark(stream_sid=data.get("streamSid", ""), name=data["mark"]["name"], sequence_number=sequence)
        if event == "dtmf":
            dtmf = data["dtmf"]
            return Dtmf(
                stream_sid=data.get("streamSid", ""),
                digit=str(dtmf["digit"]),
                track=dtmf.get("track", "inbound_track"),
                sequence_number=sequence,
            )
        if event == "stop":
            stop = data.get("stop") or {}
            return Stop(
                stream_sid=data.get("streamSid", ""),
                call_sid=stop.get("callSid"),
                account_sid=stop.get("accountSid"),
                sequence_number=sequence,
            )
    except (KeyError, TypeError, ValueError) as exc:
        raise TwilioProtocolError(f"malformed Twilio {event!r} message: {exc!r}") from None
    return Unknown(event=event, data=data)


def media_message(stream_sid: str, mulaw: bytes) -> str:
    return json.dumps(
        {"event": "media", "streamSid": stream_sid, "media": {"payload": base64.b64encode(mulaw).decode("ascii")}}
    )


def mark_message(stream_sid: str, name: str) -> str:
    return json.dumps({"event": "mark", "streamSid": stream_sid, "mark": {"name": name}})


def clear_message(stream_sid: str) -> str:
    return json.dumps({"event": "clear", "streamSid": stream_sid})


def connect_stream_twiml(stream_url: str, parameters: dict[str, str] | None = None) -> str:
    """TwiML that connects a call to this bridge: `<Connect><Stream url=...>` with custom parameters."""
    params = "".join(
        f"<Parameter name={quoteattr(name)} value={quoteattr(value)}/>" for name, value in (parameters or {}).items()
    )
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        f"<Response><Connect><Stream url={quoteattr(stream_url)}>{params}</Stream></Connect></Response>"
    )


def twilio_signature(auth_token: str, url: str, params: dict[str, str] | None = None) -> str:
    """Twilio's request signature (the `X-Twilio-Signature` header): base64 HMAC-SHA1, keyed with the
    account's auth token, of the full URL followed by the POST parameters sorted by name (none for GET
    requests and WebSocket handshakes)."""
    data = url + "".join(name + value for name, value in sorted((params or {}).items()))
    digest = hmac.new(auth_token.encode(), data.encode(), hashlib.sha1).digest()
    return base64.b64encode(digest).decode("ascii")


def signature_is_valid(auth_token: str, url: str, signature: str | None) -> bool:
    return signature is not None and hmac.compare_digest(twilio_signature(auth_token, url), signature)
