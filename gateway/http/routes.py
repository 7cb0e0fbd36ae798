"""HTTP companions of the WebSocket: OpenAI-compatible speech, voices, models, health, readiness, metrics.

`POST /v1/audio/speech` accepts what the OpenAI SDK sends (`client.audio.speech.create`, also through
`with_streaming_response`) plus vLLM-Omni's fields. The body is split into sentences and synthesized
with the same look-ahead as the WebSocket, so the first sentence's audio leaves before the last is made.
The body is one file in `response_format`, sent as it is encoded (gateway/audio/encoders.py):
- `mp3` (the default, as OpenAI's), `opus` (Ogg), `aac` (ADTS), `flac`, `wav`;
- `pcm` (24 kHz unless `sample_rate` says otherwise, as OpenAI documents), `mulaw`, `alaw` (8 kHz): raw;
- `stream_format: "sse"`: Server-Sent Events as OpenAI documents them, `speech.audio.delta` with base64
  pieces of that file (`pcm` by default), then `speech.audio.done`.
`wav` and `flac` state the file's length in their header, which a stream cannot know. Unless the client
asks for a stream (`stream: true`, or a `stream_format`), such a file is held until it is whole (up to
WHOLE_FILE_MAX_BYTES) and sent with its true length, so every reader opens it (libsndfile refuses a FLAC
of unknown length); asked for a stream, it is sent as made, its header saying "length unknown".
`stream: true` without `stream_format` is raw audio, as OpenAI's default `stream_format` and the clients
that send it (vLLM-Omni's demos, `curl | play -t raw`) expect; SSE only when the request's `Accept` names
text/event-stream (see speech_is_sse).
Word timestamps (`timestamp_type: "word"` or `word_timestamps: true`), in seconds of the response's
audio: with SSE a `speech.audio.words` event after the delta that completes the words; otherwise the
header `X-Word-Timestamps`, which a header can only carry once all the audio is made, so such a body is
sent whole, not streamed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Any, Literal, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from tts_backend.base import (
    AudioChunk,
    SynthesisRequest,
    Synthesizer,
    WordTiming,
    split_words,
)

from ..audio import encoders
from ..audio import pcm as audio
from ..auth import PRINCIPAL_SCOPE_KEY, AuthError, Principal, TokenSigner
from ..compat import VoiceChoice, option_warnings, resolve_voice, timestamp_transport
from ..gateway import Gateway
from ..language import voices_for_sentences
from ..limits import AdmissionClaim, LimitExceeded, StreamMeter, SynthesisMonitor
from ..pronunciation.markup import ends_inside_markup
from ..pronunciation.pronouncer import Pronouncer
from ..protocol import (
    ConfigWarning,
    ErrorCode,
    PronunciationEntry,
    Pronunciations,
    ProtocolError,
    backend_error_code,
    loads_client_json,
)
from ..session.segmenter import SLICE_S, SentenceSegmenter, push_in_slices
from ..session.word_times import WordsWait, append_monotonic, count_reached, in_seconds


class _StrictJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads_client_json(await self.body())
        return self._json


class StrictJsonRoute(APIRoute):
    """Request bodies parsed as the WebSocket's messages are (`loads_client_json`): no NaN or Infinity,
    bounded nesting; a refused body is FastAPI's json_invalid validation error."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(_StrictJsonRequest(request.scope, request.receive, request._send))

        return strict


router = APIRouter(route_class=StrictJsonRoute)
T = TypeVar("T")

# Raw formats carry no header, so clients assume a rate: OpenAI documents `pcm` as 24 kHz, telephony
# formats are 8 kHz. `wav` states its rate in its header and stays at the backend's own.
DEFAULT_RATES = {"pcm": 24000, "mulaw": 8000, "alaw": 8000}
WARNINGS_HEADER = "X-Voxgate-Warnings"
WORDS_HEADER = "X-Word-Timestamps"
# Clients bound a response's header block (h11, under httpx and the OpenAI SDK: 16 KiB): a longer input
# asks for its timestamps over SSE instead.
MAX_WORDS_HEADER_BYTES = 12_000
# A non-streamed wav or flac is held until whole so that its header can state its length; past this much
# (about 5.8 minutes of 24 kHz wav) it is sent as a stream instead, its header saying "length unknown".
WHOLE_FILE_MAX_BYTES = 16 * 1024 * 1024
CLIENT_LEFT = 499  # nginx's status for "client closed request": logged, never delivered
BACKEND_METRICS_TIMEOUT_S = 3.0  # a scrape waits this long for the backend's metrics, then goes without

log = logging.getLogger(__name__)

_STATUS = {
    ErrorCode.unauthorized: 401,
    ErrorCode.text_too_long: 413,
    ErrorCode.message_too_large: 413,
    ErrorCode.rate_limited: 429,
    ErrorCode.voice_not_found: 404,
    ErrorCode.voice_limit_reached: 403,
    ErrorCode.pronunciation_not_found: 404,
    ErrorCode.pronunciation_limit_reached: 403,
    ErrorCode.too_many_sessions: 429,
    ErrorCode.overloaded: 503,
    ErrorCode.internal: 500,
    ErrorCode.synthesis_failed: 500,
}


class ApiError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "code", "param"}}."""

    def __init__(self, code: ErrorCode, message: str, status: int | None = None, param: str | None = None,
                 retry_after: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status or _STATUS.get(code, 400)
        self.param = param
        self.retry_after = retry_after  # seconds, for the Retry-After header of 429 and 503

    @classmethod
    def from_limit(cls, exc: LimitExceeded) -> "ApiError":
        return cls(exc.code, exc.message, retry_after=exc.retry_after_header)

    @classmethod
    def from_synthesis_failure(cls, exc: Exception) -> "ApiError":
        code = backend_error_code(exc)
        if code is not None:
            return cls(code, str(exc))
        return cls(ErrorCode.internal, f"synthesis failed: {type(exc).__name__}")

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 401:
            kind = "authentication_error"
        body = {"error": {"message": self.message, "type": kind, "code": self.code.value, "param": self.param}}
        headers = {"Retry-After": self.retry_after} if self.retry_after else None
        return JSONResponse(body, status_code=self.status, headers=headers)


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


async def require_auth(request: Request) -> Principal:
    """The auth hook as a FastAPI dependency: the principal RequestGuard found for an API route, else the
    hook's answer."""
    principal = request.scope.get(PRINCIPAL_SCOPE_KEY)
    if principal is not None:
        return principal
    gateway = gateway_of(request)
    try:
        return await gateway.authenticate(request)
    except AuthError as exc:
        raise ApiError(ErrorCode.unauthorized, str(exc)) from None


# ----------------------------------------------------------------------------------------- speech


class VoiceRef(BaseModel):
    """OpenAI's object form of `voice` (custom voices): `{"id": "..."}`."""

    model_config = ConfigDict(extra="ignore")

    id: str


class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    model: str | None = None
    input: str
    voice: str | VoiceRef | None = Field(None, validation_alias=AliasChoices("voice", "speaker"))
    response_format: str | None = None
    speed: float = Field(1.0, ge=0.25, le=4.0)
    stream: bool | None = None
    stream_format: Literal["audio", "sse"] | None = None
    language: str = "Auto"
    instructions: str | None = None
    sample_rate: int | None = None
    seed: int | None = None
    max_new_tokens: int | None = Field(None, ge=1)
    task_type: str | None = None
    ref_audio: str | None = None
    ref_text: str | None = None
    x_vector_only_mode: bool | None = None
    timestamp_type: str | None = None  # "word" ("char": words, with a warning)
    word_timestamps: bool | None = None  # vLLM-Omni's name for timestamp_type "word"
    # vLLM-Omni's text mode: true puts the whole text in the model's prompt, false feeds it one token per
    # frame; left out, the server's default (-o streaming_text). Honoured by backends with "text_mode".
    non_streaming_mode: bool | None = None
    # Pronunciation (issue 34): dictionary entries and registered dictionaries' names, and the markup subset.
    pronunciations: Pronunciations | None = None
    text_markup: Literal["ssml"] | None = None

    @property
    def voice_id(self) -> str | None:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice

    @property
    def streamed(self) -> bool:
        """Whether the client asked for the audio as it is made: `stream: true`, or a `stream_format` without
        `stream: false`. (Without either the body is still sent as it is made, except a file whose header
        states its length: see the module doc.)"""
        return self.stream if self.stream is not None else self.stream_format is not None


def speech_is_sse(body: SpeechRequest, accept: str) -> bool:
    """SSE for `stream_format: "sse"`; for `stream: true` without a `stream_format` only when the request
    accepts text/event-stream. Raw audio otherwise: OpenAI's default `stream_format` is "audio", and the
    clients that send `stream: true` alone and read the body as audio (vLLM-Omni's Gradio demos, its
    README's `curl ... | play -t raw`) would play SSE text as noise, while an SSE client handed audio sees
    no `data:` line and fails loudly. SSE clients that send only `stream: true` (current vLLM-Omni made it
    SSE) get SSE by saying so, as EventSource and httpx-sse do with `Accept: text/event-stream`."""
    if body.stream_format is not None:
        return body.stream_format == "sse"
    return body.stream is True and "text/event-stream" in accept.lower()


async def pipelined_synthesis(
    backend: Synthesizer, requests: list[SynthesisRequest], lookahead: int,
    monitor: SynthesisMonitor | None = None, claim: AdmissionClaim | None = None,
    pronouncer: Pronouncer | None = None,
    words_wait_s: float = 1.0, late: list[ConfigWarning] | None = None,
) -> AsyncIterator[AudioChunk]:
    """The chunks of each request in order, their word timings moved onto the timeline of all the requests'
    audio (a request's sample 0 follows the previous requests' last). One producer synthesizes the requests
    one after another, running up to `lookahead` requests ahead of the one being read, so the next sentence is made while this one
    is sent and the head sentence never competes with its successors for the backend. While it runs it
    is one stream of `monitor` (with each pull's audio and time), replacing the request's admission
    `claim`. With a `pronouncer`, each request's text is the client's and the backend is given its rewrite.
    A request's word timings that come after its audio are waited for at most `words_wait_s`
    (session/word_times.WordsWait): past it the request goes on with all its audio and without those words,
    and its warning goes into `late`."""
    queues: list[asyncio.Queue] = [asyncio.Queue() for _ in requests]
    end = object()
    reading = 0
    advanced = asyncio.Event()
    bytes_per_second = 2 * backend.sample_rate

    async def produce(meter: StreamMeter | None) -> None:
        made = 0  # samples of audio made so far
        for j, request in enumerate(requests):
            offset = made  # this request's sample 0 on the response's timeline
            while j > reading + lookahead:
                advanced.clear()
                await advanced.wait()
            try:
                words_wait = WordsWait(words_wait_s)
                chunks = (words_wait.bound(backend.synthesize(request)) if pronouncer is None
                          else pronouncer.synthesize(backend, request, words_wait))
                async with contextlib.aclosing(chunks) as stream:
                    while True:
                        pulled_at = time.monotonic()
                        try:
                            chunk = await anext(stream)
                        except StopAsyncIteration:
                            break
                        if chunk.pcm and meter is not None:
                            meter.produced(len(chunk.pcm) / bytes_per_second, time.monotonic() - pulled_at)
                        if chunk.words:
                            words = tuple(WordTiming(w.word, w.start + offset, w.end + offset) for w in chunk.words)
                            chunk = AudioChunk(chunk.pcm, words)
                        if chunk.pcm or chunk.words:
                            made += len(chunk.pcm) // 2
                            queues[j].put_nowait(chunk)
                if words_wait.late and late is not None:
                    late.append(words_wait.late_warning("timestamp_type"))
            except Exception as exc:
                queues[j].put_nowait(exc)
                return
            queues[j].put_nowait(end)

    async def produce_as_a_stream() -> None:
        if claim is not None:
            claim.release()
        with monitor.stream() if monitor is not None else contextlib.nullcontext() as meter:
            await produce(meter)

    producer = asyncio.create_task(produce_as_a_stream(), name="http-synthesis")
    try:
        for i in range(len(requests)):
            reading = i
            advanced.set()
            while True:
                item = await queues[i].get()
                if item is end:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        producer.cancel()
        with contextlib.suppress(BaseException):
            await producer


async def _sentences(text: str, language: str, max_chars: int, markup_on: bool = False) -> list[str]:
    segmenter = SentenceSegmenter("sentence", language=language, max_unit_chars=max_chars,
                                  keeps_together=ends_inside_markup if markup_on else None)
    units = await push_in_slices(segmenter, text) + segmenter.flush()
    return [u for u in units if u.strip()]


async def _in_slices(work: Iterable[T]) -> list[T]:
    """The items of `work` (a generator doing a sentence's work per item), taken in slices of about SLICE_S
    with the event loop let run between them: telling a sentence's language looks at every character
    (100,000 of them in one block stalled the loop 190-319 ms)."""
    done = []
    deadline = time.perf_counter() + SLICE_S
    for item in work:
        done.append(item)
        if time.perf_counter() > deadline:
            await asyncio.sleep(0)
            deadline = time.perf_counter() + SLICE_S
    return done


class _ClientLeft(Exception):
    """The HTTP client disconnected before its response started."""


async def _until_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelled at once if the client disconnects meanwhile (then raises _ClientLeft): the
    work done before a response starts (its first audio, or a whole file) stops with the client."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    listener = asyncio.create_task(disconnected())
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, listener):
            if not pending.done():
                pending.cancel()
        await asyncio.gather(task, listener, return_exceptions=True)
    if task.cancelled():
        raise _ClientLeft()
    return task.result()


@router.post("/v1/audio/speech")
async def create_speech(body: SpeechRequest, request: Request, principal: Principal = Depends(require_auth)) -> Response:
    arrived = time.monotonic()
    gateway = gateway_of(request)
    settings, backend = gateway.settings, gateway.backend
    sse = speech_is_sse(body, request.headers.get("accept", ""))
    gateway.metrics.http_requests_total.labels("sse" if sse else "audio").inc()
    if not gateway.ready:
        reason = gateway.failure or "the speech backend is not ready"
        raise ApiError(ErrorCode.overloaded, f"{reason}; retry shortly", retry_after="5")
    if not body.input.strip():
        raise ApiError(ErrorCode.invalid_message, "input must contain text", param="input")
    if len(body.input) > settings.max_http_input_chars:
        raise ApiError(
            ErrorCode.text_too_long,
            f"input has {len(body.input)} characters; the limit is {settings.max_http_input_chars}",
            param="input",
        )
    async def cloned_voice(ref_audio: str | None):
        try:
            return await gateway.voices.voice_for(
                principal, voice=body.voice_id, ref_audio=ref_audio, ref_text=body.ref_text,
                x_vector_only=body.x_vector_only_mode, task_type=body.task_type,
                admitted=True)  # the request's own admission (below, before its clip is cloned) counts it
        except LimitExceeded as exc:  # the key's clones in progress, or every decoder busy
            raise ApiError.from_limit(exc) from None
        except ProtocolError as exc:
            raise ApiError(exc.code, exc.message, param="ref_audio" if ref_audio is not None else "voice") from None

    # The request's own clip is cloned once it is admitted (below): decoding and cloning cost more than any
    # other refusal, so they are done only for a request its key's allowance and the load let through.
    inline_clone = body.ref_audio is not None and backend.can_clone
    cloned = None if inline_clone else await cloned_voice(None)
    try:
        choice = (VoiceChoice(body.voice_id or "ref_audio") if inline_clone
                  else VoiceChoice(cloned.name) if cloned else resolve_voice(backend, settings, body.voice_id))
    except ProtocolError as exc:
        raise ApiError(exc.code, exc.message, param="voice") from None
    voice = choice.voice
    # What the request gets differently than asked (a fallback voice, options the backend ignores), for
    # clients that look: a JSON list of {code, message, field}, ASCII-escaped to be a valid header value.
    options = body.model_dump()
    warnings = [w.model_dump(exclude_none=True) for w in (*choice.warnings, *option_warnings(backend, options))]
    timestamps = timestamp_transport(backend, options) is not None
    try:
        pronouncer = await gateway.pronunciations.pronouncer(principal, body.pronunciations, body.text_markup)
    except ProtocolError as exc:
        raise ApiError(exc.code, exc.message, param="pronunciations") from None
    fmt = (body.response_format or ("pcm" if sse else "mp3")).lower()
    try:
        rate = encoders.check_output(fmt, body.sample_rate or DEFAULT_RATES.get(fmt, backend.sample_rate),
                                     backend.sample_rate)
    except audio.UnsupportedFormatError as unsupported:
        raise ApiError(ErrorCode.unsupported_format, str(unsupported), param=unsupported.param) from None
    # Admitted before any splitting or language detection (as the WebSocket charges text before it splits
    # it): a key over its allowance, or a loaded gateway, costs only the checks above (100,000 characters
    # of "Dr. " took 12-22 CPU-s of splitting before their 429). A request those checks refuse uses none of
    # the key's allowance; one the words header refuses (below) does.
    try:
        claim = await gateway.admission.admit_request(principal, len(body.input))
    except LimitExceeded as exc:
        raise ApiError.from_limit(exc) from None
    try:
        if timestamps and not sse:
            words = split_words(body.input)
            if len(json.dumps([w for w, _, _ in words])) + 24 * len(words) > MAX_WORDS_HEADER_BYTES:
                raise ApiError(
                    ErrorCode.text_too_long,
                    f"word timestamps of {len(words)} words do not fit in the {WORDS_HEADER} header; ask with"
                    ' stream_format "sse" to get them as speech.audio.words events',
                    param="timestamp_type",
                )
        # Each sentence's voice: one of its language where the client left that to the server
        # (gateway/language.py), and a warning per language the voice cannot read.
        sentences = await _sentences(body.input, body.language, settings.max_synthesis_chars, body.text_markup is not None)
        auto_voice = (body.voice_id is None and body.ref_audio is None and cloned is None
                      and body.language.lower() == "auto")
        spoken_by = await _in_slices(voices_for_sentences(backend, voice, sentences, auto=auto_voice))
        told = [choice_of_sentence.warning for choice_of_sentence in spoken_by]
        if pronouncer is not None:
            found = await _in_slices(pronouncer.warnings(text, backend) for text in sentences)
            told += [warning for warnings_of_sentence in found for warning in warnings_of_sentence]
        if inline_clone:
            cloned = await cloned_voice(body.ref_audio)
    except BaseException:
        claim.release()
        raise
    for warning in told:
        if warning is not None and warning.model_dump(exclude_none=True) not in warnings:
            warnings.append(warning.model_dump(exclude_none=True))
    warning_headers = {WARNINGS_HEADER: json.dumps(warnings)} if warnings else {}

    extra: dict[str, Any] = {
        k: v for k, v in (("task_type", body.task_type), ("ref_text", body.ref_text),
                          ("x_vector_only_mode", body.x_vector_only_mode)) if v is not None
    }
    if body.speed != 1.0:
        extra["speed"] = body.speed
    request_id = f"http-{id(request):x}-{int(arrived * 1000)}"
    streaming_text = (None if body.non_streaming_mode is None or "text_mode" not in backend.honours
                      else not body.non_streaming_mode)
    requests = [
        SynthesisRequest(
            text=text,
            voice=sentence_voice.voice,
            language=body.language,
            instructions=body.instructions,
            seed=body.seed,
            max_new_tokens=body.max_new_tokens,
            utterance_key=request_id,
            session_key=request_id,
            request_id=f"{request_id}/{i}",
            extra=extra,
            word_timestamps=timestamps,
            voice_prompt=cloned.prompt if cloned else None,
            streaming_text=streaming_text,
        )
        for i, (text, sentence_voice) in enumerate(zip(sentences, spoken_by))
    ]
    metrics = gateway.metrics
    encoder = encoders.AudioFileEncoder(fmt, backend.sample_rate, rate)
    late: list[ConfigWarning] = []  # timestamps_late, once per sentence whose words came too late
    synthesis = pipelined_synthesis(backend, requests, settings.lookahead_sentences, gateway.admission.monitor, claim,
                                    pronouncer, settings.word_timestamps_wait_s, late)

    def with_late(told: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`told` and, once, the warning of late word timings."""
        warning = [late[0].model_dump(exclude_none=True)] if late else []
        return told + [w for w in warning if w not in told]

    async def encoded() -> AsyncIterator[tuple[bytes, list[dict[str, Any]]]]:
        """The response's audio file, piece by piece as it is made, recording time to first audio; with
        each piece the words whose audio it completes (`start`/`end` in seconds of the decoded file)."""
        clock = _WordClock(encoder, backend.sample_rate)
        first = True
        async with contextlib.aclosing(synthesis) as chunks:
            async for chunk in chunks:
                clock.add(chunk.words)
                data = await encoder.encode(chunk.pcm) if chunk.pcm else b""
                words = clock.complete()
                if data:
                    if first:
                        metrics.ttfa_seconds.labels("http").observe(time.monotonic() - arrived)
                        first = False
                    metrics.audio_bytes_total.labels("http").inc(len(data))
                if data or words:
                    yield data, words
        tail = await encoder.finish()
        if tail:
            metrics.audio_bytes_total.labels("http").inc(len(tail))
        if late:
            metrics.word_timestamps_late_total.labels("http").inc(len(late))
        words = clock.complete(everything=True)
        if tail or words:
            yield tail, words

    if sse:
        async def events() -> AsyncIterator[bytes]:
            try:
                async for data, words in encoded():
                    if data:
                        event = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")}
                        yield f"data: {json.dumps(event)}\n\n".encode()
                    if words:  # after the audio that completes them
                        yield f"data: {json.dumps({'type': 'speech.audio.words', 'words': words})}\n\n".encode()
            except Exception as exc:
                error = ApiError.from_synthesis_failure(exc)
                metrics.errors_total.labels(error.code.value).inc()
                event = {"type": "speech.audio.error", "error": {"message": error.message, "code": error.code.value}}
                yield f"data: {json.dumps(event)}\n\n".encode()
                return
            tokens = len(body.input.split())
            usage = {"input_tokens": tokens, "output_tokens": 0, "total_tokens": tokens}
            done: dict[str, Any] = {"type": "speech.audio.done", "usage": usage}
            if late:  # the headers went long before: the warning comes with the end
                done["warnings"] = with_late([])
            yield f"data: {json.dumps(done)}\n\n".encode()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **warning_headers})

    if timestamps:  # the header needs every word's time: the whole file is made first
        async def whole() -> tuple[bytes, list[dict[str, Any]]]:
            parts, words = [], []
            async for data, told in encoded():
                parts.append(data)
                words.extend(told)
            return b"".join(parts), words

        try:
            data, words = await _until_client_leaves(request, whole())
        except _ClientLeft:
            return Response(status_code=CLIENT_LEFT)
        except Exception as exc:
            raise ApiError.from_synthesis_failure(exc) from None
        data = encoder.with_length(data)
        alignment = {"words": [w["word"] for w in words], "word_start_times_seconds": [w["start"] for w in words],
                     "word_end_times_seconds": [w["end"] for w in words]}
        told = with_late(warnings)
        return Response(data, media_type=encoders.content_type(fmt, rate),
                        headers={"X-Sample-Rate": str(rate), WORDS_HEADER: json.dumps(alignment),
                                 **({WARNINGS_HEADER: json.dumps(told)} if told else {})})

    # Fail before the status line if the first sentence cannot be made (e.g. the backend refuses it); a
    # file whose header states its length is held until it is whole (or too large to hold: then streamed).
    stream = (data async for data, _ in encoded())
    held_whole = fmt in encoders.LENGTH_IN_HEADER and not body.streamed
    try:
        if held_whole:
            first, complete = await _until_client_leaves(request, _hold(stream, WHOLE_FILE_MAX_BYTES))
        else:
            first, complete = await _until_client_leaves(request, anext(stream, b"")), False
    except _ClientLeft:
        await stream.aclose()
        return Response(status_code=CLIENT_LEFT)
    except Exception as exc:
        await stream.aclose()
        raise ApiError.from_synthesis_failure(exc) from None
    if complete:
        return Response(encoder.with_length(first), media_type=encoders.content_type(fmt, rate),
                        headers={"X-Sample-Rate": str(rate), **warning_headers})
    if held_whole:
        log.info("a %s response outgrew %d bytes before it was whole: sent as a stream of unknown length",
                 fmt, WHOLE_FILE_MAX_BYTES)

    async def rest() -> AsyncIterator[bytes]:
        async with contextlib.aclosing(stream):
            if first:
                yield first
            async for data in stream:
                yield data

    return StreamingResponse(rest(), media_type=encoders.content_type(fmt, rate),
                             headers={"X-Sample-Rate": str(rate), **warning_headers})


async def _hold(stream: AsyncIterator[bytes], limit: int) -> tuple[bytes, bool]:
    """The bytes of `stream` joined, and True, once it ends; or, as soon as they exceed `limit`, those so
    far and False (the rest stays in the stream)."""
    parts: list[bytes] = []
    size = 0
    async for data in stream:
        parts.append(data)
        size += len(data)
        if size > limit:
            return b"".join(parts), False
    return b"".join(parts), True


class _WordClock:
    """Which word timings (backend samples on the response's timeline) the encoded bytes so far complete."""

    def __init__(self, encoder: encoders.AudioFileEncoder, source_rate: int) -> None:
        self.encoder = encoder
        self.source_rate = source_rate
        self._words: list[WordTiming] = []
        self._told = 0

    def add(self, words) -> None:
        append_monotonic(self._words, words)

    def complete(self, *, everything: bool = False) -> list[dict[str, Any]]:
        encoder = self.encoder
        reached = len(self._words) if everything else count_reached(
            self._words, encoder.decoded_samples, self.source_rate, encoder.output_rate)
        done = self._words[self._told : reached]
        self._told = max(self._told, reached)
        return [w.model_dump(exclude_none=True)
                for w in in_seconds(done, self.source_rate, encoder.priming / encoder.output_rate)]


# ----------------------------------------------------------------------------------------- tokens


class TokenRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ttl_s: float = Field(300.0, gt=0, description="lifetime in seconds, capped at the gateway's max_token_ttl_s")


@router.post("/v1/tokens")
async def mint_token(request: Request, body: TokenRequest | None = None,
                     principal: Principal = Depends(require_auth)) -> dict[str, Any]:
    """A short-lived token for a browser: it authenticates like the API key that minted it (and counts
    against that key's limits) until it expires. Only an API key may mint one, not another token."""
    gateway = gateway_of(request)
    if not gateway.settings.api_keys:
        raise ApiError(ErrorCode.invalid_message, "this gateway has no API keys configured, so it needs no tokens",
                       status=404)
    if principal.key_id is None or principal.via_token:
        raise ApiError(ErrorCode.unauthorized, "tokens are minted with an API key, not with another token")
    body = body or TokenRequest()
    token, expires_at = TokenSigner.from_settings(gateway.settings).mint(principal.key_id, body.ttl_s)
    return {"token": token, "expires_at": expires_at, "expires_in": max(0, expires_at - int(time.time())),
            "token_type": "Bearer"}


# ----------------------------------------------------------------------------------------- catalogue


@router.get("/v1/audio/voices")
async def list_voices(request: Request, principal: Principal = Depends(require_auth)) -> dict[str, Any]:
    """The backend's voices and the cloned voices this key may use (vLLM-Omni's `voices` and
    `uploaded_voices`), and whether the backend can clone at all (`voice_cloning`)."""
    gateway = gateway_of(request)
    try:  # a backend still loading (or failed) may not know its voices yet: an empty list, not a 500
        voices = gateway.backend.voices()
        default = gateway.default_voice if voices else None
    except Exception:  # noqa: BLE001 - the catalogue must answer whatever state the backend is in
        log.warning("the %s backend cannot list its voices", gateway.backend.name, exc_info=True)
        voices, default = [], None
    uploaded = await _voice_call(gateway.voices.list_voices(principal))
    return {
        "object": "list",
        "voices": [v.id for v in voices] + [v["name"] for v in uploaded],
        "default": default,
        "voice_cloning": gateway.backend.can_clone,
        "data": [
            {"id": v.id, "object": "voice", "name": v.name, "language": v.language, "description": v.description}
            for v in voices
        ] + [{"id": v["name"], "object": "voice", "name": v["name"], "cloned": True} for v in uploaded],
        "uploaded_voices": uploaded,
    }


async def _voice_call(work: Awaitable[T]) -> T:
    try:
        return await work
    except LimitExceeded as exc:
        raise ApiError.from_limit(exc) from None
    except ProtocolError as exc:
        raise ApiError(exc.code, exc.message) from None


def _form_text(form: Any, name: str) -> str | None:
    value = form.get(name)
    return value if isinstance(value, str) else None


@router.post("/v1/audio/voices")
async def add_voice(request: Request, principal: Principal = Depends(require_auth)) -> dict[str, Any]:
    """Clone and register a voice, as vLLM-Omni's upload: multipart/form-data with `audio_sample` (the
    clip), `name`, `consent`, optional `ref_text` (and our `x_vector_only_mode`); or the same fields as
    JSON with the clip in base64 as `audio_sample` (or `audio_data`, as voice.add)."""
    gateway = gateway_of(request)
    # The key's allowance, its clones in progress and the load are checked before a byte of the
    # body is parsed: a refused upload costs no parsing and holds no clip.
    async with contextlib.AsyncExitStack() as stack:
        registration = await _voice_call(stack.enter_async_context(gateway.voices.registering(principal)))
        content_type = request.headers.get("content-type", "")
        if content_type.startswith("multipart/form-data"):
            async with request.form(max_files=1, max_fields=16) as form:
                upload = form.get("audio_sample")
                if upload is None or isinstance(upload, str):
                    raise ApiError(ErrorCode.invalid_reference_audio, "audio_sample (a file) is required",
                                   param="audio_sample")
                audio_data: str | bytes = await upload.read()
                fields = {name: _form_text(form, name) for name in ("name", "consent", "ref_text", "x_vector_only_mode")}
            x_vector_only = (fields["x_vector_only_mode"] or "").lower() in ("1", "true", "yes")
        else:
            try:
                fields = loads_client_json(await request.body())
            except ValueError as exc:
                raise ApiError(ErrorCode.invalid_json, f"the body is not valid JSON: {exc}") from None
            if not isinstance(fields, dict):
                raise ApiError(ErrorCode.invalid_message, "the body must be a JSON object or multipart/form-data")
            audio_data = fields.get("audio_sample") or fields.get("audio_data")
            if not isinstance(audio_data, str):
                raise ApiError(ErrorCode.invalid_reference_audio, "audio_sample (base64 audio) is required",
                               param="audio_sample")
            x_vector_only = fields.get("x_vector_only_mode") is True
            if fields.get("ref_text") is not None and not isinstance(fields["ref_text"], str):
                raise ApiError(ErrorCode.invalid_message, "ref_text must be a string", param="ref_text")
        voice = await _voice_call(registration.add(fields.get("name"), audio_data, consent=fields.get("consent"),
                                                   ref_text=fields.get("ref_text"), x_vector_only=x_vector_only))
    return {"success": True, "voice": voice}


@router.get("/v1/audio/voices/{name}")
async def get_voice(name: str, request: Request, principal: Principal = Depends(require_auth)) -> dict[str, Any]:
    return {"success": True, "voice": await _voice_call(gateway_of(request).voices.get(principal, name))}


@router.delete("/v1/audio/voices/{name}")
async def delete_voice(name: str, request: Request, principal: Principal = Depends(require_auth)) -> dict[str, Any]:
    await _voice_call(gateway_of(request).voices.delete(principal, name))
    return {"success": True, "message": f"voice {name!r} deleted"}


class PronunciationDictionary(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    entries: list[PronunciationEntry]


@router.post("/v1/audio/pronunciations")
async def add_pronunciations(body: PronunciationDictionary, request: Request,
                             principal: Principal = Depends(require_auth)) -> dict[str, Any]:
    """Register (or replace) a pronunciation dictionary of this key (gateway/pronunciation/registry.py)."""
    registry = gateway_of(request).pronunciations
    return {"success": True, "dictionary": await _voice_call(registry.add(principal, body.name, body.entries))}


@router.get("/v1/audio/pronunciations")
async def list_pronunciations(request: Request, principal: Principal = Depends(require_auth)) -> dict[str, Any]:
    return {"object": "list", "data": await _voice_call(gateway_of(request).pronunciations.list(principal))}


@router.get("/v1/audio/pronunciations/{name}")
async def get_pronunciations(name: str, request: Request, principal: Principal = Depends(require_auth)) -> dict[str, Any]:
    return {"success": True, "dictionary": await _voice_call(gateway_of(request).pronunciations.get(principal, name))}


@router.delete("/v1/audio/pronunciations/{name}")
async def delete_pronunciations(name: str, request: Request,
                                principal: Principal = Depends(require_auth)) -> dict[str, Any]:
    await _voice_call(gateway_of(request).pronunciations.delete(principal, name))
    return {"success": True, "message": f"pronunciation dictionary {name!r} deleted"}


@router.get("/v1/models")
async def list_models(request: Request, principal: Principal = Depends(require_auth)) -> dict[str, Any]:
    gateway = gateway_of(request)
    return {
        "object": "list",
        "data": [
            {
                "id": gateway.settings.served_model_name,
                "object": "model",
                "created": int(gateway.started_at),
                "owned_by": "voxgate",
                "backend": gateway.backend.name,
            }
        ],
    }


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """Liveness: 200 unless the store or the backend failed to start (`voxgate serve` then exits; an app
    embedding the gateway may not)."""
    failure = gateway_of(request).failure
    if failure is not None:
        return JSONResponse({"status": "failed", "error": failure}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    gateway = gateway_of(request)
    store_problem = await gateway.store.unavailable()
    is_ready = gateway.ready and store_problem is None
    body: dict[str, Any] = {"status": "ready" if is_ready else "not_ready", "backend": gateway.backend.name,
                            "draining": gateway.draining}
    if store_problem is not None:
        body["store"] = store_problem
    if gateway.failure is not None:
        body.update(status="failed", error=gateway.failure)
    return JSONResponse(body, status_code=200 if is_ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    gateway = gateway_of(request)
    try:
        backend_metrics = await asyncio.wait_for(gateway.backend.metrics(), timeout=BACKEND_METRICS_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - a scrape must answer with the gateway's metrics whatever the backend does
        log.warning("the %s backend's metrics are unavailable", gateway.backend.name, exc_info=True)
        backend_metrics = []
    return Response(gateway.metrics.render(backend_metrics), media_type=gateway.metrics.content_type)
