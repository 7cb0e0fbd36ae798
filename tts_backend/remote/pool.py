"""A backend that is a `voxgate worker` on the same host, reached over its Unix socket (framing.py)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from . import framing
from ..base import (
    AudioChunk,
    BackendMetric,
    ReferenceAudio,
    SynthesisError,
    SynthesisRequest,
    Synthesizer,
    UnknownVoiceError,
    Voice,
    WordTiming,
)

_ERRORS = {code: kind for kind, code in framing.ERROR_CODES.items()}

log = logging.getLogger(__name__)


class RemoteSynthesizer(Synthesizer):
    """socket: the worker's socket path. start() waits up to `connect_timeout_s` for the worker to answer
    (it may still be loading its model and capturing graphs). `info_refresh_s`: how often load and
    readiness are re-read from the worker."""

    name = "remote"

    def __init__(self, socket: str = "/tmp/voxgate-worker.sock", connect_timeout_s: float = 600.0,
                 info_refresh_s: float = 1.0) -> None:
        self.socket_path = socket
        self.connect_timeout_s = connect_timeout_s
        self.info_refresh_s = info_refresh_s
        self._info: dict | None = None
        self._voices: list[Voice] = []
        self._refresh_task: asyncio.Task | None = None

    async def _query_info(self) -> dict:
        return await self._query("info")

    async def _query(self, op: str, **fields) -> dict:
        reader, writer = await asyncio.open_unix_connection(self.socket_path)
        try:
            writer.write(framing.encode_json({"op": op, **fields}))
            await writer.drain()
            frame = await framing.read_frame(reader)
            if frame is None or frame[0] != framing.JSON:
                raise SynthesisError("worker closed the connection without answering")
            return framing.decode_json(frame[1])
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _apply_info(self, info: dict) -> None:
        self._info = info
        self.name = f"remote:{info.get('name', '?')}"
        self.sample_rate = int(info["sample_rate"])
        self._voices = [Voice(**v) for v in info.get("voices", [])]
        self.honours = frozenset(info.get("honours", ()))  # a worker too old to say honours nothing
        self.speaks_only_clones = bool(info.get("speaks_only_clones", False))

    async def start(self) -> None:
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                info = await self._query_info()
                if info.get("ready"):
                    break
            except (OSError, SynthesisError, framing.ProtocolError):
                pass
            if time.monotonic() > deadline:
                raise SynthesisError(f"no ready worker at {self.socket_path} after {self.connect_timeout_s:.0f} s")
            await asyncio.sleep(0.1)
        self._apply_info(info)
        self._refresh_task = asyncio.create_task(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.info_refresh_s)
            try:
                self._apply_info(await self._query_info())
            except (OSError, SynthesisError, framing.ProtocolError, KeyError):
                if self._info is not None:
                    self._info = {**self._info, "ready": False}

    async def stop(self) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresh_task
            self._refresh_task = None

    @property
    def ready(self) -> bool:
        return bool(self._info and self._info.get("ready"))

    def voices(self) -> list[Voice]:
        return list(self._voices)

    @property
    def default_voice(self) -> str:
        if self._info and self._info.get("default_voice"):
            return self._info["default_voice"]
        return super().default_voice

    def load(self) -> float:
        return float(self._info.get("load", 0.0)) if self._info else 1.0

    async def clone_voice(self, reference: ReferenceAudio, x_vector_only: bool = False) -> bytes:
        if not self.can_clone:  # as the worker said in its info
            return await super().clone_voice(reference, x_vector_only)
        try:
            answer = await self._query("clone", samples=base64.b64encode(reference.samples).decode(),
                                       ref_text=reference.ref_text, x_vector_only=x_vector_only)
        except OSError as exc:
            raise SynthesisError(f"worker unreachable at {self.socket_path}: {exc}") from exc
        if answer.get("op") == "error":
            raise _ERRORS.get(answer.get("code"), SynthesisError)(answer.get("message", "worker error"))
        if answer.get("op") != "clone":
            raise framing.ProtocolError(f"unexpected op {answer.get('op')!r}")
        return framing.decode_base64(answer.get("prompt"), "prompt")

    async def metrics(self) -> list[BackendMetric]:
        """The worker's metrics (its backend's and its own), read at each call (the gateway's scrape bounds
        how long it waits). An unreachable worker, or one too old to know the op, reports none."""
        try:
            answer = await self._query("metrics")
            if answer.get("op") != "metrics":
                return []
            return [BackendMetric.from_json(m) for m in answer.get("metrics", [])]
        except (OSError, SynthesisError, framing.ProtocolError, KeyError, TypeError, ValueError):
            log.debug("no metrics from the worker at %s", self.socket_path, exc_info=True)
            return []

    async def synthesize(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        if request.voice_prompt is None and self._voices and not self.has_voice(request.voice):
            raise UnknownVoiceError(f"unknown voice {request.voice!r}")
        try:
            reader, writer = await asyncio.open_unix_connection(self.socket_path)
        except OSError as exc:
            raise SynthesisError(f"worker unreachable at {self.socket_path}: {exc}") from exc
        try:
            writer.write(framing.encode_json({"op": "synthesize", "request": framing.request_to_json(request)}))
            await writer.drain()
            while True:
                frame = await framing.read_frame(reader)
                if frame is None:
                    raise SynthesisError("worker closed the stream before it was done")
                kind, payload = frame
                if kind == framing.AUDIO:
                    yield AudioChunk(payload)
                    continue
                message = framing.decode_json(payload)
                if message["op"] == "words":
                    try:
                        words = tuple(WordTiming.from_json(w) for w in message["words"])
                    except (KeyError, TypeError, ValueError) as exc:
                        raise framing.ProtocolError(f"bad words frame: {exc}") from exc
                    yield AudioChunk(b"", words)
                    continue
                if message["op"] == "done":
                    return
                if message["op"] == "error":
                    raise _ERRORS.get(message.get("code"), SynthesisError)(message.get("message", "worker error"))
                raise framing.ProtocolError(f"unexpected op {message['op']!r}")
        finally:
            # Closing the connection is the cancel signal when we stop early; harmless after "done".
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
