"""Reference audio for voice cloning: from what a client sends to the backend's `ReferenceAudio`.

A client sends a clip as base64, a data URL (`data:audio/wav;base64,...`), or, only where the operator
allows fetching (`reference_audio_fetch`), an http(s) URL. Any container and codec FFmpeg reads (wav,
flac, mp3, ogg/vorbis/opus, ...), at any rate, mono or multichannel, is decoded with PyAV, mixed down to
mono and resampled with soxr to the one rate backends take (24 kHz float32).

Bounded: the encoded clip is at most `max_reference_audio_bytes`; decoding stops as soon as the audio
passes `max_reference_audio_s` and a clip shorter than `min_reference_audio_s` is refused; a fetch has a
time limit and the same byte limit. Decoding runs on worker threads, as many at once as the caller's
semaphore lets (the voice registry's), never on the event loop. Every refusal is `InvalidReferenceAudio`, with a message that says why.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import re
import time
import urllib.error
import urllib.request

import av
import numpy as np
import soxr

from tts_backend.base import REFERENCE_SAMPLE_RATE, ReferenceAudio

from ..settings import GatewaySettings

_DATA_URL = re.compile(r"^data:([\w.+/-]*)(;[\w=.+-]+)*;base64,", re.IGNORECASE)
_FETCH_CHUNK = 64 * 1024


class InvalidReferenceAudio(ValueError):
    """A clip that cannot be used to clone a voice; the message is safe to show to the client."""


def decode_base64_audio(value: str, max_bytes: int) -> bytes:
    """The bytes of a base64 string or a base64 data URL, refused before decoding when too large."""
    match = _DATA_URL.match(value)
    payload = value[match.end():] if match else value
    if len(payload) * 3 // 4 > max_bytes + 2:
        raise InvalidReferenceAudio(f"the reference audio is larger than {max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidReferenceAudio("the reference audio is neither base64 nor a base64 data URL") from None
    if not data:
        raise InvalidReferenceAudio("the reference audio is empty")
    return data


def _fetch(url: str, max_bytes: int, timeout_s: float) -> bytes:
    deadline = time.monotonic() + timeout_s
    chunks: list[bytes] = []
    size = 0
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - http(s) only, checked
            while chunk := response.read(_FETCH_CHUNK):
                size += len(chunk)
                if size > max_bytes:
                    raise InvalidReferenceAudio(f"the reference audio at the URL is larger than {max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise InvalidReferenceAudio(f"fetching the reference audio took longer than {timeout_s:g} s")
                chunks.append(chunk)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise InvalidReferenceAudio(f"the reference audio could not be fetched: {exc}") from None
    return b"".join(chunks)


async def reference_bytes(value: str, settings: GatewaySettings) -> bytes:
    """The encoded clip a client's `ref_audio` / `audio_data` names: base64, a data URL, or a URL."""
    if re.match(r"^https?://", value, re.IGNORECASE):
        if not settings.reference_audio_fetch:
            raise InvalidReferenceAudio("this server does not fetch reference audio from URLs; send it as base64"
                                        " or a data URL")
        return await asyncio.to_thread(_fetch, value, settings.max_reference_audio_bytes,
                                       settings.reference_fetch_timeout_s)
    if re.match(r"^[a-z][a-z0-9+.-]*://", value, re.IGNORECASE):
        raise InvalidReferenceAudio("ref_audio must be base64, a base64 data URL or an http(s) URL")
    return decode_base64_audio(value, settings.max_reference_audio_bytes)


def decode_clip(data: bytes, min_s: float, max_s: float) -> np.ndarray:
    """float32 mono samples at REFERENCE_SAMPLE_RATE of an encoded clip (any container FFmpeg reads)."""
    try:
        container = av.open(io.BytesIO(data), "r")
    except (av.FFmpegError, ValueError) as exc:
        raise InvalidReferenceAudio(f"the reference audio cannot be decoded: {exc}") from None
    with container:
        if not container.streams.audio:
            raise InvalidReferenceAudio("the reference file has no audio stream")
        stream = container.streams.audio[0]
        rate = stream.codec_context.sample_rate or stream.rate
        if not rate:
            raise InvalidReferenceAudio("the reference audio does not state its sample rate")
        # Planar float keeps the channels apart whatever the codec's own sample format; mixed down below.
        to_float = av.AudioResampler(format="fltp", rate=rate)
        pieces: list[np.ndarray] = []
        samples = 0
        limit = int(max_s * rate)
        try:
            for frame in container.decode(stream):
                for converted in to_float.resample(frame):
                    mono = converted.to_ndarray().mean(axis=0, dtype=np.float32)
                    pieces.append(mono)
                    samples += len(mono)
                if samples > limit:
                    raise InvalidReferenceAudio(f"the reference audio is longer than {max_s:g} s")
        except av.FFmpegError as exc:
            raise InvalidReferenceAudio(f"the reference audio cannot be decoded: {exc}") from None
    if samples < min_s * rate:
        raise InvalidReferenceAudio(f"the reference audio lasts {samples / rate:.2f} s; at least {min_s:g} s is needed")
    mono = np.concatenate(pieces)
    if rate != REFERENCE_SAMPLE_RATE:
        mono = soxr.resample(mono, rate, REFERENCE_SAMPLE_RATE, quality="HQ").astype(np.float32)
    if not np.all(np.isfinite(mono)):
        raise InvalidReferenceAudio("the reference audio has samples that are not numbers")
    return np.clip(mono, -1.0, 1.0)


async def load_reference(value: str | bytes, ref_text: str | None, settings: GatewaySettings,
                         slots: asyncio.Semaphore) -> ReferenceAudio:
    """A client's clip (a ref_audio string, or the bytes of an uploaded file) as the backend takes it;
    decoded once one of `slots` is free."""
    data = value if isinstance(value, bytes) else await reference_bytes(value, settings)
    if len(data) > settings.max_reference_audio_bytes:
        raise InvalidReferenceAudio(f"the reference audio is larger than {settings.max_reference_audio_bytes} bytes")
    async with slots:
        samples = await asyncio.to_thread(decode_clip, data, settings.min_reference_audio_s,
                                          settings.max_reference_audio_s)
    text = ref_text.strip() if ref_text else None
    return ReferenceAudio(samples.astype("<f4").tobytes(), text or None)
