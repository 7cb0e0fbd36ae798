"""Voxgate telephony bridge: Twilio Media Streams (bidirectional <Connect><Stream>) to a Voxgate gateway."""

from .bargein import EnergyBargeIn, frame_dbfs
from .bridge import Call, Speech, TwilioBridge
from .twilio import (
    FRAME_BYTES,
    FRAME_MS,
    Connected,
    Dtmf,
    Mark,
    Media,
    MediaFormat,
    Start,
    Stop,
    TwilioProtocolError,
    clear_message,
    connect_stream_twiml,
    mark_message,
    media_message,
    parse_twilio_message,
    signature_is_valid,
    twilio_signature,
)

__version__ = "0.1.0"

__all__ = [
    "FRAME_BYTES",
    "FRAME_MS",
    "Call",
    "Connected",
    "Dtmf",
    "EnergyBargeIn",
    "Mark",
    "Media",
    "MediaFormat",
    "Speech",
    "Start",
    "Stop",
    "TwilioBridge",
    "TwilioProtocolError",
    "clear_message",
    "connect_stream_twiml",
    "frame_dbfs",
    "mark_message",
    "media_message",
    "parse_twilio_message",
    "signature_is_valid",
    "twilio_signature",
]
