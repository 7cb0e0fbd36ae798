"""Reference audio for voice cloning: what a client sends, read as bytes and decoded to samples.

A client sends a clip as base64 or a data URL (`data:audio/wav;base64,...`), or, only where the operator
allows fetching, an http(s) URL (gateway/audio/fetch.py). Any container and codec FFmpeg reads (wav,
flac, mp3, ogg/vorbis/opus, ...), at any rate, mono or stereo, is decoded with PyAV, mixed down to mono
and resampled with soxr to the rate backends take (24 kHz float32).

`decode_clip` is the untrusted part: FFmpeg parsing a stranger's file. It runs only in a decoder
process (gateway/audio/decoder.py), never in the gateway's own, so that a decoder bug costs one
request, not the replica. Every refusal is `InvalidReferenceAudio`, with a message that says why.

Knows nothing of the rest of the gateway: its callers pass the limits.
"""

from __future__ import annotations

import base64
import binascii
import io
import re

import numpy as np
import soxr

from .pyav import pyav

_DATA_URL = re.compile(r"data:([\w.+/-]*)(;[\w=.+-]+)*;base64,", re.IGNORECASE)
_URL = re.compile(r"[a-z][a-z0-9+.-]*://", re.IGNORECASE)
MAX_CHANNELS = 2  # mono or stereo: PyAV's planar frames of 8+ channels crash in to_ndarray


class InvalidReferenceAudio(ValueError):
    """A clip that cannot be used to clone a voice; the message is safe to show to the client."""


def url_scheme(value: str) -> str | None:
    """The scheme of a `ref_audio` that is a URL (lower case), None for base64 or a data URL."""
    match = _URL.match(value)
    return match.group(0)[:-3].lower() if match else None


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


def decode_clip(data: bytes, min_s: float, max_s: float, output_rate: int) -> np.ndarray:
    """float32 mono samples at `output_rate` of an encoded clip (any container FFmpeg reads)."""
    av = pyav("decoding reference audio")
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
        _check_channels(stream.codec_context.channels)
        # Packed float: one plane whatever the channel count (PyAV's planar frames of 8+ channels have a
        # plane too many, and to_ndarray reads past the frame).
        to_float = av.AudioResampler(format="flt", rate=rate)
        pieces: list[np.ndarray] = []
        samples = 0
        limit = int(max_s * rate)
        try:
            for frame in container.decode(stream):
                # A stream may change its layout or rate mid-way (FLAC frames each state theirs).
                channels = _check_channels(frame.layout.nb_channels)
                if frame.sample_rate != rate:
                    raise InvalidReferenceAudio("the reference audio changes its sample rate mid-stream")
                for converted in to_float.resample(frame):
                    packed = converted.to_ndarray().reshape(-1, channels)
                    mono = packed.mean(axis=1, dtype=np.float32)
                    pieces.append(mono)
                    samples += len(mono)
                if samples > limit:
                    raise InvalidReferenceAudio(f"the reference audio is longer than {max_s:g} s")
        except (av.FFmpegError, ValueError) as exc:
            if isinstance(exc, InvalidReferenceAudio):
                raise
            raise InvalidReferenceAudio(f"the reference audio cannot be decoded: {exc}") from None
    if samples < min_s * rate:
        raise InvalidReferenceAudio(f"the reference audio lasts {samples / rate:.2f} s; at least {min_s:g} s is needed")
    mono = np.concatenate(pieces)
    if rate != output_rate:
        mono = soxr.resample(mono, rate, output_rate, quality="HQ").astype(np.float32)
    if not np.all(np.isfinite(mono)):
        raise InvalidReferenceAudio("the reference audio has samples that are not numbers")
    return np.clip(mono, -1.0, 1.0)


def _check_channels(channels: int) -> int:
    if not 1 <= channels <= MAX_CHANNELS:
        raise InvalidReferenceAudio(f"the reference audio has {channels} channels; send mono or stereo")
    return channels
