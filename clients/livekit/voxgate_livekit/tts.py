"""Voxgate as a LiveKit Agents TTS (livekit-agents 1.8).

- `TTS.stream()`: one `SynthesizeStream` per agent reply, as the framework drives it. Every stream is a
  Voxgate context on one shared WebSocket session (`voxgate_client`), so many replies, even overlapping
  ones, share a socket. Tokens go out as `input.text` as they arrive (the gateway splits sentences
  itself, releasing each as soon as it is certainly complete); a flush ends the segment with
  `input.done`, and its `utterance.done` ends the emitter segment. `aclose()` (interruption) sends
  `input.cancel`, which stops generation for that context on the gateway at once.
- Word timestamps (`word_timestamps=True`, the default): the TTS declares `aligned_transcript`, asks the
  gateway for words as soon as their audio is sent (`audio.words`), and pushes each as a `TimedString`
  timed from the start of its segment's audio, which the framework's transcript synchronizer follows.
- `TTS.synthesize()`: the chunked path, `POST /v1/audio/speech` with raw PCM streamed back.
- Errors follow the framework's retry rules: connection failures raise `APIConnectionError`
  (`APITimeoutError` for timeouts), gateway refusals raise `APIStatusError` whose `retryable` is the
  protocol's own `retryable` (the framework retries only those, and only before any audio was pushed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from livekit.agents import (
    APIConnectionError,
    APIConnectOptions,
    APIStatusError,
    APITimeoutError,
    tts,
    utils,
)
from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS, TimedString

import voxgate_client
from voxgate_client import events as vg

logger = logging.getLogger("voxgate_livekit")

# protocol.md, "Errors and limits": the codes whose `retryable` is true. HTTP error bodies carry the code
# but not the flag, so it is derived from the code there.
RETRYABLE_CODES = frozenset({"rate_limited", "too_many_sessions", "overloaded", "synthesis_failed", "internal"})

# An HTTP status for each protocol error code, so that LiveKit's status rule (4xx other than 408/429/499
# is never retried) agrees with the protocol's `retryable`; the gateway's HTTP routes use the same ones.
STATUS_FOR_CODE = {
    "invalid_json": 400,
    "invalid_message": 400,
    "unknown_type": 400,
    "config_required": 400,
    "config_locked": 409,
    "unknown_voice": 400,
    "unsupported_format": 400,
    "text_too_long": 413,
    "message_too_large": 413,
    "rate_limited": 429,
    "too_many_sessions": 429,
    "unauthorized": 401,
    "session_not_found": 404,
    "resume_out_of_range": 416,
    "synthesis_failed": 500,
    "overloaded": 503,
    "idle_timeout": 408,
    "internal": 500,
}


def api_error(message: str, code: str | None, retryable: bool, body: object | None = None) -> APIStatusError:
    """The LiveKit error for a Voxgate error code (`http_<status>` for a refused handshake)."""
    status = STATUS_FOR_CODE.get(code or "", 500)
    if code and code.startswith("http_") and code[5:].isdigit():
        status = int(code[5:])
    return APIStatusError(
        f"Voxgate {code}: {message}", status_code=status, body=body if body is not None else {"code": code},
        retryable=retryable,
    )


@dataclass
class _Options:
    voice: str | None
    model: str | None
    language: str | None
    instructions: str | None
    seed: int | None
    sample_rate: int
    split_granularity: str | None
    chunk_schedule: list[int] | None
    word_timestamps: bool
    pronunciations: list[dict[str, Any] | str] | None = None
    text_markup: str | None = None

    def session_config(self) -> voxgate_client.SessionConfig:
        return voxgate_client.SessionConfig(
            voice=self.voice,
            model=self.model,
            language=self.language,
            instructions=self.instructions,
            seed=self.seed,
            response_format="pcm",
            sample_rate=self.sample_rate,
            stream_audio=True,
            split_granularity=self.split_granularity,
            chunk_schedule=self.chunk_schedule,
            timestamp_type="word" if self.word_timestamps else None,
            timestamp_transport_strategy="async" if self.word_timestamps else None,
            pronunciations=self.pronunciations,
            text_markup=self.text_markup,
        )


class _SharedSession:
    """One Voxgate session and the streams using it. A session whose options are outdated is retired:
    it takes no new streams and closes once its last stream ends."""

    def __init__(self, session: voxgate_client.Session) -> None:
        self.session = session
        self.users = 0
        self.retired = False
        # Events no context claims (late audio of forgotten contexts, session-wide errors, reconnects):
        # read so they never pile up, and logged.
        self.drain_task = asyncio.create_task(self._drain(), name="voxgate-session-events")

    async def _drain(self) -> None:
        async for event in self.session.events(until_done=False):
            if isinstance(event, vg.Error):
                logger.warning("voxgate session error %s: %s", event.code, event.message)
            elif isinstance(event, vg.Reconnected):
                logger.info("voxgate session %s resumed after %d attempt(s)", event.session_id, event.attempts)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.session.close(timeout_s=2.0)
        await utils.aio.cancel_and_wait(self.drain_task)


class TTS(tts.TTS):
    """LiveKit Agents TTS for a Voxgate gateway.

    Example::

        from voxgate_livekit import TTS as VoxgateTTS
        session = AgentSession(tts=VoxgateTTS(url="ws://localhost:8000", voice="tone-mid"), ...)

    Args:
        url: Gateway URL (`ws://host:port`; the stream path is added) or a list of replicas to resume on.
        http_url: Base URL for `synthesize()` (default: `url` with an http scheme).
        api_key: Bearer key, when the gateway requires one.
        voice, model, language, instructions, seed: `session.config` fields (see protocol.md).
        sample_rate: Output rate (default 24000, LiveKit's room rate); the gateway resamples.
        split_granularity: `token` (default: each sentence's synthesis starts at its first words where the
            gateway's backend can take text while it speaks; elsewhere the gateway splits at sentences and
            warns in session.started), `sentence`, `clause` or `none`.
        chunk_schedule: Codec frames per audio chunk (Qwen3 backends), e.g. `[2, 4, 8, 12]`.
        word_timestamps: Ask for word timestamps and push them as the aligned transcript (a backend without
            them sends none, and the framework then falls back to the plain text).
        pronunciations: Pronunciation dictionary entries (`{"text": "Voxgate", "say": "vox gate"}`) and names
            of dictionaries registered with the key (docs/pronunciation.md), for streams and `synthesize()`;
            the aligned transcript keeps the words as written.
        text_markup: `"ssml"`: text is read as the gateway's markup subset (`<spell>`, `<sub>`, `<break>`).
            LiveKit's expressive mode writes `<expression value=.../>` tags, which the gateway maps to
            instructions where its backend takes them (docs/protocol.md, "Pronunciation").
        http_session: aiohttp session for `synthesize()`; default the job's, or one this TTS owns.
        session_options: Further `voxgate_client.Session` options.
    """

    def __init__(
        self,
        *,
        url: str | list[str] = "ws://127.0.0.1:8000",
        http_url: str | None = None,
        api_key: str | None = None,
        voice: str | None = None,
        model: str | None = None,
        language: str | None = None,
        instructions: str | None = None,
        seed: int | None = None,
        sample_rate: int = 24000,
        split_granularity: str | None = "token",
        chunk_schedule: list[int] | None = None,
        word_timestamps: bool = True,
        pronunciations: list[dict[str, Any] | str] | None = None,
        text_markup: str | None = None,
        http_session: aiohttp.ClientSession | None = None,
        session_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            capabilities=tts.TTSCapabilities(streaming=True, aligned_transcript=word_timestamps),
            sample_rate=sample_rate,
            num_channels=1,
        )
        self._urls = [url] if isinstance(url, str) else list(url)
        self._http_url = (http_url or _http_base(self._urls[0])).rstrip("/")
        self._api_key = api_key
        self._opts = _Options(
            voice=voice,
            model=model,
            language=language,
            instructions=instructions,
            seed=seed,
            sample_rate=sample_rate,
            split_granularity=split_granularity,
            chunk_schedule=list(chunk_schedule) if chunk_schedule else None,
            word_timestamps=word_timestamps,
            pronunciations=list(pronunciations) if pronunciations else None,
            text_markup=text_markup,
        )
        self._opts.session_config()  # validates sample_rate and chunk_schedule now, not at first use
        self._session_options = dict(session_options or {})
        self._http_session = http_session
        self._owns_http_session = False
        self._shared: _SharedSession | None = None
        self._connect_lock = asyncio.Lock()
        self._streams: set[SynthesizeStream] = set()
        self._background: set[asyncio.Task] = set()  # prewarm, retiring sessions, cancels: kept until done

    @property
    def model(self) -> str:
        return self._opts.model or "voxgate"

    @property
    def provider(self) -> str:
        return "Voxgate"

    def update_options(
        self,
        *,
        voice: str | None = None,
        model: str | None = None,
        language: str | None = None,
        instructions: str | None = None,
        seed: int | None = None,
    ) -> None:
        """New settings apply to the next stream or synthesize() call: the current session is retired
        (it finishes the streams it carries) and the next stream opens one with the new config."""
        changes = {
            k: v for k, v in dict(voice=voice, model=model, language=language, instructions=instructions, seed=seed).items()
            if v is not None
        }
        if not changes:
            return
        self._opts = replace(self._opts, **changes)
        if self._shared is not None:
            self._retire(self._shared)

    def synthesize(
        self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
    ) -> ChunkedStream:
        return ChunkedStream(tts=self, input_text=text, conn_options=conn_options)

    def stream(self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> SynthesizeStream:
        stream = SynthesizeStream(tts=self, conn_options=conn_options)
        self._streams.add(stream)
        return stream

    def prewarm(self) -> None:
        """Open the WebSocket session before the first reply needs it."""

        async def _open() -> None:
            with contextlib.suppress(Exception):
                shared = await self._acquire(DEFAULT_API_CONNECT_OPTIONS.timeout)
                self._release(shared)

        self._spawn(_open(), "voxgate-prewarm")

    async def aclose(self) -> None:
        for stream in list(self._streams):
            await stream.aclose()
        self._streams.clear()
        if self._background:  # cancels in flight reach the gateway before the session closes
            await asyncio.wait(list(self._background), timeout=5.0)
        shared, self._shared = self._shared, None
        if shared is not None:
            await shared.close()
        if self._owns_http_session and self._http_session is not None:
            await self._http_session.close()
            self._http_session = None

    # ------------------------------------------------------------------------------------------- internals

    async def _acquire(self, timeout: float) -> _SharedSession:
        """The shared session, connecting it if needed. Raises LiveKit API errors."""
        async with self._connect_lock:
            shared = self._shared
            if shared is None or shared.session.closed:
                try:
                    session = await asyncio.wait_for(
                        voxgate_client.connect(
                            self._urls, self._opts.session_config(), api_key=self._api_key, **self._session_options
                        ),
                        timeout,
                    )
                except voxgate_client.VoxgateError as e:
                    raise api_error(e.message, e.code, e.retryable) from None
                except asyncio.TimeoutError:
                    raise APITimeoutError(f"no Voxgate session within {timeout} s") from None
                except OSError as e:
                    raise APIConnectionError(f"cannot reach Voxgate at {self._urls[0]}") from e
                shared = self._shared = _SharedSession(session)
            shared.users += 1
            return shared

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _release(self, shared: _SharedSession) -> None:
        shared.users -= 1
        if shared.retired and shared.users == 0:
            self._spawn(shared.close(), "voxgate-retire-session")

    def _retire(self, shared: _SharedSession) -> None:
        shared.retired = True
        if self._shared is shared:
            self._shared = None
        if shared.users == 0:
            self._spawn(shared.close(), "voxgate-retire-session")

    def _ensure_http_session(self) -> aiohttp.ClientSession:
        if self._http_session is None:
            try:
                self._http_session = utils.http_context.http_session()
            except RuntimeError:  # outside a LiveKit job: own one, closed by aclose()
                self._http_session = aiohttp.ClientSession()
                self._owns_http_session = True
        return self._http_session

    def _auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}


class ChunkedStream(tts.ChunkedStream):
    """`synthesize()`: the whole text in one `POST /v1/audio/speech`, raw PCM streamed back as produced."""

    def __init__(self, *, tts: TTS, input_text: str, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, input_text=input_text, conn_options=conn_options)
        self._tts: TTS = tts
        self._opts = tts._opts

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        opts = self._opts
        payload: dict[str, Any] = {
            "input": self.input_text,
            "response_format": "pcm",
            "sample_rate": opts.sample_rate,
            "stream_format": "audio",
        }
        for name in ("voice", "model", "language", "instructions", "seed", "pronunciations", "text_markup"):
            value = getattr(opts, name)
            if value is not None:
                payload[name] = value
        session = self._tts._ensure_http_session()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._conn_options.timeout)
        try:
            async with session.post(
                f"{self._tts._http_url}/v1/audio/speech",
                json=payload,
                headers=self._tts._auth_headers(),
                timeout=timeout,
            ) as response:
                if response.status != 200:
                    raise _http_error(response.status, await response.text())
                output_emitter.initialize(
                    request_id=response.headers.get("x-request-id") or utils.shortuuid(),
                    sample_rate=opts.sample_rate,
                    num_channels=1,
                    mime_type="audio/pcm",
                )
                async for data, _ in response.content.iter_chunks():
                    output_emitter.push(data)
                # No flush(): the framework's end_input() marks the held-back tail as the final frame, where
                # a flush here would make it append a 10 ms silent marker instead.
        except asyncio.TimeoutError:
            raise APITimeoutError() from None
        except aiohttp.ClientError as e:
            raise APIConnectionError(f"Voxgate HTTP request failed: {e}") from e


class SynthesizeStream(tts.SynthesizeStream):
    """One reply: a Voxgate context per segment on the TTS's shared session."""

    def __init__(self, *, tts: TTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._tts: TTS = tts

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        output_emitter.initialize(
            request_id=utils.shortuuid(),
            sample_rate=self._tts.sample_rate,
            num_channels=1,
            mime_type="audio/pcm",
            stream=True,
        )
        shared = await self._tts._acquire(self._conn_options.timeout)
        session = shared.session
        segments: asyncio.Queue[voxgate_client.Context | None] = asyncio.Queue()
        opened: list[voxgate_client.Context] = []

        async def send_input() -> None:
            context: voxgate_client.Context | None = None
            async for item in self._input_ch:
                if isinstance(item, self._FlushSentinel):
                    if context is not None:
                        await context.done()
                        context = None
                    continue
                if context is None:
                    context = session.context(utils.shortuuid("lk-"))
                    opened.append(context)
                    segments.put_nowait(context)
                    self._mark_started()
                await context.send_text(item)
            if context is not None:  # input closed without a flush
                await context.done()
            segments.put_nowait(None)

        async def receive_audio() -> None:
            while (context := await segments.get()) is not None:
                output_emitter.start_segment(segment_id=context.context_id)
                async for event in context.events():
                    if isinstance(event, vg.AudioChunk):
                        output_emitter.push(event.data)
                    elif isinstance(event, vg.AudioWords):
                        output_emitter.push_timed_transcript([
                            # The trailing space keeps words apart when the framework joins the transcript.
                            TimedString(text=f"{w.word} ", start_time=w.utterance_start, end_time=w.utterance_end)
                            for w in event.words
                        ])
                    elif isinstance(event, vg.Error):
                        raise api_error(event.message, event.code, event.retryable)
                    elif isinstance(event, vg.ContextCancelled):
                        raise APIConnectionError(f"Voxgate cancelled context {context.context_id}")
                    elif isinstance(event, vg.Disconnected):
                        raise APIConnectionError(f"Voxgate connection lost: {event.reason}")
                output_emitter.end_segment()
                session.forget_context(context.context_id)

        tasks = [
            asyncio.create_task(send_input(), name="voxgate-send-input"),
            asyncio.create_task(receive_audio(), name="voxgate-receive-audio"),
        ]
        try:
            await _gather_first_error(tasks)
        except voxgate_client.VoxgateError as e:  # a send on a session that ended meanwhile, or a refusal
            if e.code == "closed":
                raise APIConnectionError(str(e)) from None
            raise api_error(e.message, e.code, e.retryable) from None
        finally:
            await utils.aio.gracefully_cancel(*tasks)
            unfinished = [c for c in opened if not c.finished]
            for context in opened:
                if context.finished:
                    session.forget_context(context.context_id)
            if unfinished:
                # Interrupted (aclose) or failed mid-reply: the gateway stops these contexts now.
                self._tts._spawn(_cancel_contexts(session, unfinished), "voxgate-cancel")
            self._tts._release(shared)

    async def aclose(self) -> None:
        await super().aclose()
        self._tts._streams.discard(self)


async def _gather_first_error(tasks: list[asyncio.Task]) -> None:
    """Wait for every task; the first one to fail cancels the others and its error is raised."""
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]


async def _cancel_contexts(session: voxgate_client.Session, contexts: list[voxgate_client.Context]) -> None:
    """input.cancel for each context, then wait (bounded) for its context.cancelled before forgetting it,
    so late events never land in the session queue."""
    for context in contexts:
        with contextlib.suppress(Exception):
            await context.cancel()
    for context in contexts:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(_drain_context(context), 5.0)
        session.forget_context(context.context_id)


async def _drain_context(context: voxgate_client.Context) -> None:
    async for _ in context.events():
        pass


def _http_error(status: int, text: str) -> APIStatusError:
    """APIStatusError for an error response: {"error": {"message", "code", ...}} as the gateway sends."""
    message, code, retryable = text or f"HTTP {status}", None, None
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        body = json.loads(text)
        detail = body.get("error", body) if isinstance(body, dict) else {}
        if isinstance(detail, dict):
            message = detail.get("message", message)
            code = detail.get("code")
            retryable = detail.get("retryable")
    if retryable is None:
        retryable = code in RETRYABLE_CODES if code else (status >= 500 or status in (408, 429))
    return APIStatusError(
        f"Voxgate {code or status}: {message}", status_code=status, body=text, retryable=bool(retryable)
    )


def _http_base(url: str) -> str:
    parts = urlsplit(url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, "", "", ""))
