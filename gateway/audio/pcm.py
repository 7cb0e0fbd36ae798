"""Audio output formats: streaming resampling (soxr), G.711 mu-law / A-law, and WAV containers.

Backends produce s16le mono PCM at their own rate. A session asks for a format and maybe a rate; a
`StreamEncoder` per sentence stream turns backend chunks into bytes in that format as they arrive, keeping
the resampler's state between chunks so that chunked output equals one-shot output. Every piece it
returns is a whole number of samples.

Resampling uses soxr's streaming resampler at HQ quality. It holds back a little audio while its filter
fills (about 10-40 ms for chunks of 160 ms or more; more when fed tiny chunks), which `flush()` releases at
the end of a sentence. VHQ holds back far more at some rate pairs (all of a first 160 ms chunk at
22.05 -> 8 kHz), which would cost time to first audio, so HQ is the choice here.
"""

from __future__ import annotations

import struct

import numpy as np
import soxr

FORMATS: tuple[str, ...] = ("pcm", "wav", "mulaw", "alaw")
SAMPLE_RATES: tuple[int, ...] = (8000, 16000, 22050, 24000, 44100, 48000)
# Telephony formats are 8 kHz unless the session asks for another rate.
G711_DEFAULT_RATE = 8000
RESAMPLER_QUALITY = "HQ"

_CONTENT_TYPES = {
    "pcm": "audio/pcm",
    "wav": "audio/wav",
    "mulaw": "audio/PCMU",
    "alaw": "audio/PCMA",
}

# WAVE format tags (RFC 2361).
WAVE_FORMAT_PCM = 0x0001
WAVE_FORMAT_ALAW = 0x0006
WAVE_FORMAT_MULAW = 0x0007


class UnsupportedFormatError(ValueError):
    """An output format or sample rate this module cannot produce; the message is safe to show, `param` names
    the request field to change."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise UnsupportedFormatError(f"unsupported response_format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return fmt


def check_sample_rate(rate: int) -> int:
    if rate not in SAMPLE_RATES:
        raise UnsupportedFormatError(
            f"unsupported sample_rate {rate!r}; choose one of {', '.join(str(r) for r in SAMPLE_RATES)}"
        )
    return rate


def content_type(fmt: str, sample_rate: int | None = None) -> str:
    """The MIME type for a response format; raw formats carry their rate when it is given."""
    mime = _CONTENT_TYPES[check_format(fmt)]
    if sample_rate and fmt != "wav":
        mime += f";rate={sample_rate}"
    return mime


# -- G.711 ---------------------------------------------------------------------------------------------

# Encoding works on 14-bit magnitudes (bias 0x21), decoding yields 16-bit values (bias 0x84).
_MULAW_ENCODE_BIAS = 0x21
_MULAW_CLIP = 8159
_MULAW_BIAS = 0x84
_MULAW_SEGMENT_ENDS = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF], dtype=np.int32)
# A-law segment ends for 13-bit magnitudes.
_ALAW_SEGMENT_ENDS = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF], dtype=np.int32)


def mulaw_encode(samples: np.ndarray) -> bytes:
    """G.711 mu-law: int16 samples -> one byte each (the 14-bit reference algorithm, as in SoX and
    Python's audioop, so the bytes match those tools exactly)."""
    x = np.asarray(samples, dtype=np.int32) >> 2  # 14-bit
    negative = x < 0
    mask = np.where(negative, 0x7F, 0xFF)
    magnitude = np.minimum(np.where(negative, -x, x), _MULAW_CLIP) + _MULAW_ENCODE_BIAS
    segment = np.searchsorted(_MULAW_SEGMENT_ENDS, magnitude)
    code = (np.minimum(segment, 7) << 4) | ((magnitude >> (segment + 1)) & 0x0F)
    code = np.where(segment >= 8, 0x7F, code)
    return ((code ^ mask) & 0xFF).astype(np.uint8).tobytes()


def mulaw_decode(data: bytes) -> np.ndarray:
    """G.711 mu-law bytes -> int16 samples."""
    u = ~np.frombuffer(data, dtype=np.uint8).astype(np.int32) & 0xFF
    exponent = (u >> 4) & 0x07
    magnitude = ((((u & 0x0F) << 3) + _MULAW_BIAS) << exponent) - _MULAW_BIAS
    return np.where(u & 0x80, -magnitude, magnitude).astype(np.int16)


def alaw_encode(samples: np.ndarray) -> bytes:
    """G.711 A-law: int16 samples -> one byte each."""
    x = np.asarray(samples, dtype=np.int32) >> 3  # 13-bit
    positive = x >= 0
    mask = np.where(positive, 0xD5, 0x55)
    magnitude = np.where(positive, x, -x - 1)
    segment = np.searchsorted(_ALAW_SEGMENT_ENDS, magnitude)  # first end >= magnitude; 8 when beyond
    shift = np.where(segment < 2, 1, segment)
    code = (np.minimum(segment, 7) << 4) | ((magnitude >> shift) & 0x0F)
    code = np.where(segment >= 8, 0x7F, code)
    return ((code ^ mask) & 0xFF).astype(np.uint8).tobytes()


def alaw_decode(data: bytes) -> np.ndarray:
    """G.711 A-law bytes -> int16 samples."""
    a = np.frombuffer(data, dtype=np.uint8).astype(np.int32) ^ 0x55
    segment = (a & 0x70) >> 4
    t = (a & 0x0F) << 4
    t = np.where(segment == 0, t + 8, t + 0x108)
    t = np.where(segment > 1, t << np.maximum(segment - 1, 0), t)
    return np.where(a & 0x80, t, -t).astype(np.int16)


# -- streaming encoder ---------------------------------------------------------------------------------


class StreamEncoder:
    """s16le mono PCM at `source_rate` in, bytes of `response_format` at `output_rate` out.

    `encode` may hold back a few milliseconds inside the resampler; `flush` releases them and readies the
    encoder for the next stream (sentence). For `wav`, the bytes are PCM: build the container with
    `wav_bytes` (whole sentences) or `wav_header` (a stream of unknown length).
    """

    def __init__(self, response_format: str, source_rate: int, target_rate: int | None = None) -> None:
        self.response_format = check_format(response_format)
        if source_rate <= 0:
            raise ValueError(f"source_rate must be positive, not {source_rate}")
        if target_rate is None:
            target_rate = G711_DEFAULT_RATE if response_format in ("mulaw", "alaw") else source_rate
        else:
            check_sample_rate(target_rate)
        self.source_rate = source_rate
        self.output_rate = target_rate
        self.bytes_per_sample = 1 if response_format in ("mulaw", "alaw") else 2
        self._resampler = (
            soxr.ResampleStream(source_rate, target_rate, 1, dtype="int16", quality=RESAMPLER_QUALITY)
            if source_rate != target_rate
            else None
        )
        self._odd_byte = b""  # half a sample left over from a chunk with an odd length

    def encode(self, pcm_s16le: bytes) -> bytes:
        data = self._odd_byte + pcm_s16le if self._odd_byte else pcm_s16le
        whole = len(data) & ~1
        self._odd_byte = data[whole:]
        samples = np.frombuffer(data, dtype="<i2", count=whole // 2)
        if self._resampler is not None:
            samples = self._resampler.resample_chunk(samples)
        return self._pack(samples)

    def flush(self) -> bytes:
        """Everything still held; the encoder then starts afresh (a half sample left over is dropped)."""
        self._odd_byte = b""
        if self._resampler is None:
            return b""
        tail = self._resampler.resample_chunk(np.zeros(0, dtype=np.int16), last=True)
        self._resampler.clear()
        return self._pack(tail)

    def _pack(self, samples: np.ndarray) -> bytes:
        if self.response_format == "mulaw":
            return mulaw_encode(samples)
        if self.response_format == "alaw":
            return alaw_encode(samples)
        return np.asarray(samples, dtype="<i2").tobytes()


def encode_pcm(pcm_s16le: bytes, response_format: str, source_rate: int, target_rate: int | None = None) -> bytes:
    """One-shot form of StreamEncoder: a whole piece of PCM in, the whole encoded piece out."""
    encoder = StreamEncoder(response_format, source_rate, target_rate)
    return encoder.encode(pcm_s16le) + encoder.flush()


# -- WAV -----------------------------------------------------------------------------------------------

_STREAMING_SIZE = 0xFFFFFFFF  # the RIFF and data sizes of a stream whose length is not known


def wav_header(sample_rate: int, fmt: str = "pcm", data_bytes: int | None = None) -> bytes:
    """A RIFF/WAVE header for `data_bytes` of audio in `fmt` (pcm s16le, mulaw or alaw bytes).

    With data_bytes None the sizes are 0xFFFFFFFF, the common convention for a stream of unknown length.
    Non-PCM formats get the 18-byte fmt chunk and the fact chunk that the WAVE spec asks of them.
    """
    if fmt == "pcm":
        tag, bits, fmt_chunk_extra, fact = WAVE_FORMAT_PCM, 16, b"", b""
    elif fmt in ("mulaw", "alaw"):
        tag = WAVE_FORMAT_MULAW if fmt == "mulaw" else WAVE_FORMAT_ALAW
        bits, fmt_chunk_extra = 8, struct.pack("<H", 0)
        frames = 0 if data_bytes is None else data_bytes
        fact = b"fact" + struct.pack("<II", 4, frames)
    else:
        raise UnsupportedFormatError(f"a WAV file holds pcm, mulaw or alaw audio, not {fmt!r}")
    block_align = bits // 8
    fmt_body = struct.pack("<HHIIHH", tag, 1, sample_rate, sample_rate * block_align, block_align, bits)
    fmt_body += fmt_chunk_extra
    fmt_chunk = b"fmt " + struct.pack("<I", len(fmt_body)) + fmt_body
    if data_bytes is None:
        riff_size = data_size = _STREAMING_SIZE
    else:
        data_size = data_bytes
        riff_size = 4 + len(fmt_chunk) + len(fact) + 8 + data_bytes + (data_bytes & 1)
    return b"RIFF" + struct.pack("<I", riff_size) + b"WAVE" + fmt_chunk + fact + b"data" + struct.pack("<I", data_size)


def wav_bytes(pcm_s16le: bytes, sample_rate: int, fmt: str = "pcm") -> bytes:
    """A complete WAV file of s16le PCM (already at `sample_rate`), stored as PCM, mu-law or A-law."""
    samples = np.frombuffer(pcm_s16le, dtype="<i2", count=len(pcm_s16le) // 2)
    if fmt == "pcm":
        data = samples.tobytes()
    elif fmt == "mulaw":
        data = mulaw_encode(samples)
    elif fmt == "alaw":
        data = alaw_encode(samples)
    else:
        raise UnsupportedFormatError(f"a WAV file holds pcm, mulaw or alaw audio, not {fmt!r}")
    pad = b"\0" if len(data) & 1 else b""
    return wav_header(sample_rate, fmt, len(data)) + data + pad
