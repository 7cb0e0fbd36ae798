"""Voxgate client: an asyncio library for the Voxgate streaming TTS WebSocket protocol (version 1)."""

from .audio import MULAW_SILENCE, SoundCardPlayer, alaw_to_pcm16, mulaw_to_pcm16, pcm16_to_mulaw, to_pcm16, write_wav
from .config import SAMPLE_RATES, SessionConfig
from .events import (
    AudioChunk,
    AudioDone,
    AudioStart,
    AudioWords,
    ContextCancelled,
    Disconnected,
    Error,
    Event,
    Pong,
    Reconnected,
    SessionDone,
    SessionStarted,
    UnknownMessage,
    UtteranceDone,
    Word,
    parse_server_message,
)
from .session import DEFAULT_PATH, Context, GatewayUnreachable, Session, VoxgateError, connect
from .voices import add_voice, delete_voice, list_voices

__version__ = "0.1.0"

__all__ = [
    "AudioChunk",
    "AudioDone",
    "AudioStart",
    "AudioWords",
    "Context",
    "ContextCancelled",
    "DEFAULT_PATH",
    "Disconnected",
    "Error",
    "Event",
    "GatewayUnreachable",
    "MULAW_SILENCE",
    "Pong",
    "Reconnected",
    "SAMPLE_RATES",
    "Session",
    "SessionConfig",
    "SessionDone",
    "SessionStarted",
    "SoundCardPlayer",
    "UnknownMessage",
    "UtteranceDone",
    "VoxgateError",
    "Word",
    "add_voice",
    "alaw_to_pcm16",
    "connect",
    "delete_voice",
    "list_voices",
    "mulaw_to_pcm16",
    "parse_server_message",
    "pcm16_to_mulaw",
    "to_pcm16",
    "write_wav",
]
