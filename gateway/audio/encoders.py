"""Compressed output formats: mp3, opus (in Ogg), aac (in ADTS) and flac, encoded with PyAV as audio arrives.

One `AudioFileEncoder` makes one file: it is fed s16le mono PCM at the backend's rate in chunks of any
size (resampled by gateway.audio.pcm.StreamEncoder) and returns the file's bytes as the muxer produces them, so
the concatenation of everything `encode` and `finish` return is one valid file that a browser or ffmpeg
plays from its first bytes. It is also how the raw and WAV formats are made, so callers treat all formats
alike: raw formats are the samples themselves, and `wav` is a header of unknown length followed by PCM.

Choices that keep a stream playable while it is being made, and cheap:
- mp3 is plain MPEG frames (no ID3 tag, no Xing header: both need the end of the file or a seek), so the
  files of consecutive sentences concatenate into one valid mp3 stream; aac in ADTS likewise.
- Ogg pages are cut every `OGG_PAGE_MS` of audio instead of the muxer's default second, so opus audio
  leaves within that time of being made. The muxer is bit-exact and the Ogg serial number is the caller's
  `serial` (a sentence's index), so the same audio gives the same bytes: a resumed sentence's re-encoded
  bytes continue the ones logged before.
- flac has no 8 KiB padding block; its header says "length unknown" as a non-seekable output must. A
  caller that holds the whole file before sending it (HTTP without `stream`, a WebSocket sentence sent
  whole) has `with_length` write the true length into it: libsndfile (soundfile) refuses a FLAC file of
  unknown length, and ffprobe gives it no duration. `wav` likewise gets its true RIFF sizes.
- Opus codes at 8, 12, 16, 24 or 48 kHz only: any other rate is resampled to 48 kHz (`coded_rate`).
The codecs cost 0.4-0.7 ms of CPU per 100 ms of audio (bench/encode_cost.py; docs/formats.md):
too much to run on the event loop for every stream, so `encode`/`finish` of the compressed formats run
on a small thread pool (PyAV releases the GIL while a codec runs); raw formats and WAV, microseconds,
run inline.
"""

from __future__ import annotations

import asyncio
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from . import pcm as audio
from .pyav import pyav

OGG_PAGE_MS = 60


@dataclass(frozen=True)
class _Codec:
    muxer: str
    codec: str
    mime: str
    bit_rate: int | None = None  # bits per second; None for lossless
    rates: tuple[int, ...] | None = None  # the only rates the codec takes; None: any
    muxer_options: dict[str, str] = field(default_factory=dict)
    codec_options: dict[str, str] = field(default_factory=dict)
    # The container cannot say how long the encoder's priming is (mp3 without a LAME tag, ADTS), so
    # decoders play it: the decoded audio starts that much late.
    plays_priming: bool = False


CODECS: dict[str, _Codec] = {
    # LAME quality 5: a quarter less CPU than the default, the same SNR on the tests' signals.
    "mp3": _Codec("mp3", "libmp3lame", "audio/mpeg", bit_rate=64000,
                  muxer_options={"id3v2_version": "0", "write_id3v1": "0", "write_xing": "0"},
                  codec_options={"compression_level": "5"}, plays_priming=True),
    "opus": _Codec("ogg", "libopus", "audio/ogg; codecs=opus", bit_rate=32000, rates=(8000, 12000, 16000, 24000, 48000),
                   muxer_options={"page_duration": str(OGG_PAGE_MS * 1000)},
                   codec_options={"application": "audio", "frame_duration": "20"}),
    "aac": _Codec("adts", "aac", "audio/aac", bit_rate=64000, plays_priming=True),
    "flac": _Codec("flac", "flac", "audio/flac", muxer_options={"metadata_header_padding": "0"}),
}
COMPRESSED_FORMATS: tuple[str, ...] = tuple(CODECS)
# The formats whose header states the file's length: made as a stream, they say "unknown" (see with_length).
LENGTH_IN_HEADER: tuple[str, ...] = ("wav", "flac")
FORMATS: tuple[str, ...] = audio.FORMATS + COMPRESSED_FORMATS  # every response_format the gateway makes
OPUS_FALLBACK_RATE = 48000
OPUS_PRE_SKIP = 312  # libopus's priming at 48 kHz (its lookahead), written in every stream's OpusHead
# One stream's calls are awaited in turn, so a stream never has two calls in flight; the pool bounds how
# many codecs run at once (one per core), and a backlog waits here rather than on the event loop.
_POOL = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="voxgate-encode")


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise audio.UnsupportedFormatError(f"response_format {fmt!r} is not supported; choose one of {', '.join(FORMATS)}",
                                           param="response_format")
    return fmt


def check_output(fmt: str, rate: int, source_rate: int) -> int:
    """The rate a stream asked for as `fmt` at `rate`, from a backend at `source_rate`, is coded at (see
    coded_rate). The rate must be one the resampler makes, or the backend's own (no resampling). Raises
    audio.UnsupportedFormatError; the WebSocket and HTTP answer it each in their own error shape."""
    check_format(fmt)
    if rate not in audio.SAMPLE_RATES and rate != source_rate:
        raise audio.UnsupportedFormatError(
            f"sample_rate {rate} is not supported; choose one of {', '.join(map(str, audio.SAMPLE_RATES))}",
            param="sample_rate",
        )
    return coded_rate(fmt, rate)


def coded_rate(fmt: str, rate: int) -> int:
    """The rate a stream of `fmt` asked to be at `rate` is coded at: `rate`, unless the codec cannot take it
    (opus: 22050 and 44100 become 48000, the rate opus decoders play at anyway)."""
    codec = CODECS.get(fmt)
    if codec is None or codec.rates is None or rate in codec.rates:
        return rate
    return OPUS_FALLBACK_RATE


def content_type(fmt: str, sample_rate: int | None = None) -> str:
    codec = CODECS.get(fmt)
    return codec.mime if codec is not None else audio.content_type(fmt, sample_rate)


class _Sink:
    """The muxer's output: a write-only, non-seekable file object whose bytes are taken as they come."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data = b"".join(self._parts)
        self._parts.clear()
        return data


class _Muxed:
    """One PyAV output container with one mono audio stream, fed s16 samples at `rate`."""

    def __init__(self, codec: _Codec, rate: int, serial: int) -> None:
        self._sink = _Sink()
        options = {"fflags": "+bitexact", "flush_packets": "1", **codec.muxer_options}
        if codec.muxer == "ogg":
            options["serial_offset"] = str(serial)
        av = pyav("compressed output (mp3, opus, aac, flac)")
        self._container = av.open(self._sink, mode="w", format=codec.muxer, container_options=options)
        self._stream = self._container.add_stream(codec.codec, rate=rate, options=dict(codec.codec_options))
        context = self._stream.codec_context
        context.layout = "mono"
        if codec.bit_rate is not None:
            context.bit_rate = codec.bit_rate
        self._av = av
        self._rate = rate
        self._samples = 0
        self._ogg = codec.muxer == "ogg"
        self._plays_priming = codec.plays_priming
        self.decoded_samples = 0  # how much audio the bytes returned so far decode to (see AudioFileEncoder)
        self.priming = 0  # samples of priming a decoder plays before the audio (see AudioFileEncoder)

    def _mux(self, packets) -> None:
        if not self._ogg:  # these muxers write each packet at once (flush_packets)
            for packet in packets:
                if packet.pts is not None and packet.pts < 0 and self._plays_priming:
                    self.priming = max(self.priming, -packet.pts)
                if packet.pts is not None and packet.duration:
                    # Packet times count from the first input sample: the encoder's priming has negative ones.
                    end = packet.pts + packet.duration
                    self.decoded_samples = min(self._samples, max(self.decoded_samples, end))
        self._container.mux(packets)

    def _take(self) -> bytes:
        data = self._sink.take()
        if self._ogg:  # Ogg holds packets until a page is full: read the written pages' granule positions
            self.decoded_samples = min(self._samples, max(self.decoded_samples, _ogg_opus_samples(data, self._rate)))
        return data

    def encode(self, samples: np.ndarray) -> bytes:
        if len(samples):
            frame = self._av.AudioFrame.from_ndarray(np.ascontiguousarray(samples, dtype=np.int16).reshape(1, -1),
                                               format="s16", layout="mono")
            frame.sample_rate = self._rate
            frame.pts = self._samples
            self._samples += len(samples)
            self._mux(self._stream.encode(frame))
        return self._take()

    def finish(self) -> bytes:
        """The codec's held-back audio and the container's trailer; the container is closed."""
        self._mux(self._stream.encode(None))
        self._container.close()
        data = self._take()
        self.decoded_samples = self._samples
        return data


_OGG_PAGE = struct.Struct("<4sBBqIII")  # capture pattern, version, header type, granule position, ...


def _ogg_opus_samples(data: bytes, rate: int) -> int:
    """The audio (samples at `rate`) that the last Ogg Opus page in `data` completes, or -1 if none does.
    An Opus granule position counts 48 kHz samples including the pre-skip (RFC 7845), which is the
    encoder's priming and which decoders drop."""
    end = -1
    at = data.find(b"OggS")
    while at >= 0 and at + _OGG_PAGE.size <= len(data):
        _, version, _, granule, _, _, _ = _OGG_PAGE.unpack_from(data, at)
        if version == 0 and granule > 0:
            end = max(end, (granule - OPUS_PRE_SKIP) * rate // 48000)
        at = data.find(b"OggS", at + 4)
    return end


_FLAC_STREAMINFO = 8  # "fLaC", then the first metadata block's 4-byte header; STREAMINFO is always first
_FLAC_SAMPLES_AT = _FLAC_STREAMINFO + 10  # after the block and frame sizes: rate, channels, bits, samples
_FLAC_SAMPLES_MASK = (1 << 36) - 1  # total samples: the low 36 bits of that 64-bit field


def _flac_with_total_samples(data: bytes, samples: int) -> bytes:
    """A FLAC file whose STREAMINFO says `samples` in all (0 means unknown: how a stream is written). The
    MD5 stays zero, which the format defines as "not computed"; decoders then skip the check."""
    if data[:4] != b"fLaC" or data[4] & 0x7F != 0 or len(data) < _FLAC_SAMPLES_AT + 8:
        raise ValueError("not a FLAC file that starts with its STREAMINFO block")
    (field,) = struct.unpack_from(">Q", data, _FLAC_SAMPLES_AT)
    field = (field & ~_FLAC_SAMPLES_MASK) | (samples & _FLAC_SAMPLES_MASK)
    return data[:_FLAC_SAMPLES_AT] + struct.pack(">Q", field) + data[_FLAC_SAMPLES_AT + 8 :]


class AudioFileEncoder:
    """One file (or raw stream) of `response_format` at `target_rate`, from s16le mono PCM at `source_rate`.

    `encode` returns the bytes made so far (maybe none: codecs and resampler hold a little back), `finish`
    the rest; the encoder is then spent. Await one call before making the next. An encoder abandoned before
    `finish` is released with its last reference (a call still running on the pool holds one).
    `serial` tells consecutive Ogg files apart (see the module doc). `output_rate` is the rate the audio is
    coded at (see `coded_rate`).
    """

    def __init__(self, response_format: str, source_rate: int, target_rate: int | None = None, *, serial: int = 0) -> None:
        self.response_format = check_format(response_format)
        codec = CODECS.get(response_format)
        if codec is None:
            raw = "pcm" if response_format == "wav" else response_format
            self._samples = audio.StreamEncoder(raw, source_rate, target_rate)
            self._muxed = None
            self._header = audio.wav_header(self._samples.output_rate) if response_format == "wav" else b""
            self.bytes_per_sample: int | None = self._samples.bytes_per_sample
        else:
            rate = coded_rate(response_format, target_rate or source_rate)
            self._samples = audio.StreamEncoder("pcm", source_rate, rate)
            self._muxed = _Muxed(codec, rate, serial)
            self._header = b""
            self.bytes_per_sample = None  # compressed: no fixed size per sample
        self.output_rate = self._samples.output_rate
        self._raw_samples = 0

    @property
    def decoded_samples(self) -> int:
        """How many samples (at `output_rate`) of audio the bytes returned so far decode to, counted from
        the first sample fed in: a codec's priming (encoder delay) is not counted, as decoders that honour
        it drop it (opus pre-skip); see `priming` for the codecs whose decoders play it. Audio a codec still holds back, and
        for Ogg the packets of an unfinished page, are not counted either."""
        return self._muxed.decoded_samples if self._muxed is not None else self._raw_samples

    @property
    def priming(self) -> int:
        """Samples (at `output_rate`) that a decoder plays before the first sample fed in: the encoder's
        priming where the container cannot tell the decoder to drop it (mp3 without a LAME tag: 1104 at
        24 kHz; aac in ADTS: 1024). Known once the first packet is out; 0 for every other format."""
        return self._muxed.priming if self._muxed is not None else 0

    async def encode(self, pcm_s16le: bytes) -> bytes:
        return await self._run(self.encode_now, pcm_s16le)

    async def finish(self) -> bytes:
        return await self._run(self.finish_now)

    def encode_now(self, pcm_s16le: bytes) -> bytes:
        """`encode` on the caller's thread."""
        return self._emit(self._samples.encode(pcm_s16le))

    def finish_now(self) -> bytes:
        """`finish` on the caller's thread."""
        data = self._emit(self._samples.flush())
        if self._muxed is not None:
            data += self._muxed.finish()
        return data

    def with_length(self, data: bytes) -> bytes:
        """The whole file `data` (everything `encode` and `finish` returned, the encoder finished) with the
        true length in its header where the format has one (LENGTH_IN_HEADER): a wav's RIFF and data
        sizes, a FLAC STREAMINFO's total samples. Other formats are returned as they are."""
        if self.response_format == "wav":
            data_bytes = len(data) - len(audio.wav_header(self.output_rate))
            return audio.wav_header(self.output_rate, data_bytes=data_bytes) + data[len(data) - data_bytes:]
        if self.response_format == "flac":
            return _flac_with_total_samples(data, self.decoded_samples)
        return data

    async def _run(self, method, *args) -> bytes:
        if self._muxed is None:
            return method(*args)
        return await asyncio.get_running_loop().run_in_executor(_POOL, method, *args)

    def _emit(self, data: bytes) -> bytes:
        self._raw_samples += len(data) // 2
        if self._muxed is not None:
            data = self._muxed.encode(np.frombuffer(data, dtype="<i2"))
        if self._header:
            data, self._header = self._header + data, b""
        return data
