"""What the session's parts are driven with in their own tests, without a server or a socket: a WebSocket
stand-in that keeps every frame written to it (and can stop taking them, as a client that reads nothing),
a session config, and the items of a send queue."""

from __future__ import annotations

import asyncio
import json

from starlette.websockets import WebSocketState

from gateway.protocol import SessionConfig
from gateway.session.data import ResolvedConfig, SentenceJob, Utterance
from gateway.session.segmenter import SentenceSegmenter

RATE = 24000
VOICE = "tone-mid"  # one of the synthetic backend's voices


class RecordingSocket:
    """The part of a starlette WebSocket a `SocketWriter` uses. Frames are kept in order as ("text", dict)
    or ("bytes", bytes). While `reading` is clear, a write waits, as one to a client that reads nothing;
    while `reading_audio` is clear, only binary frames wait."""

    def __init__(self) -> None:
        self.application_state = WebSocketState.CONNECTED
        self.scope: dict = {}
        self.frames: list[tuple[str, object]] = []
        self.closed_with: int | None = None
        self.reading = asyncio.Event()
        self.reading.set()
        self.reading_audio = asyncio.Event()
        self.reading_audio.set()
        self.frame_written = asyncio.Event()

    async def _written(self, frame) -> None:
        await self.reading.wait()
        await asyncio.sleep(0)  # a socket write lets other tasks run, as a real one does
        self.frames.append(frame)
        self.frame_written.set()

    async def send_text(self, text: str) -> None:
        await self._written(("text", json.loads(text)))

    async def send_bytes(self, data: bytes) -> None:
        await self.reading_audio.wait()
        await self._written(("bytes", data))

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.closed_with = code
        self.application_state = WebSocketState.DISCONNECTED

    def messages(self, kind: str | None = None) -> list[dict]:
        return [m for t, m in self.frames if t == "text" and (kind is None or m["type"] == kind)]

    def audio(self) -> bytes:
        return b"".join(data for t, data in self.frames if t == "bytes")


def resolved_config(**fields) -> ResolvedConfig:
    message = SessionConfig(type="session.config", **fields)
    return ResolvedConfig(message=message, voice=VOICE, response_format="pcm", stream_audio=True,
                          source_rate=RATE, output_rate=RATE)


def utterance(number: int = 1, context_id: str | None = None) -> Utterance:
    return Utterance(context_id, number, SentenceSegmenter("sentence"))


def sentence(index: int, text: str, of: Utterance, config: ResolvedConfig) -> SentenceJob:
    return SentenceJob(index=index, text=text, utterance=of, config=config, released_at=0.0,
                       first_of_utterance=index == 0)
