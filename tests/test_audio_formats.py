"""Output formats, checked by decoding what the encoder produced and comparing it with the source audio."""

from __future__ import annotations

import io
import random
import struct
import warnings
import wave

import numpy as np
import pytest

from gateway.audio.pcm import (
    FORMATS,
    SAMPLE_RATES,
    StreamEncoder,
    UnsupportedFormatError,
    alaw_decode,
    alaw_encode,
    content_type,
    encode_pcm,
    mulaw_decode,
    mulaw_encode,
    wav_bytes,
    wav_header,
)

ALL_INT16 = np.arange(-32768, 32768, dtype=np.int16)
SOURCE_RATES = (24000, 22050)


def tones(rate: int, seconds: float, amplitude: float = 0.5) -> np.ndarray:
    """Two tones well below every Nyquist frequency here, so resampling should reproduce them exactly."""
    t = np.arange(int(rate * seconds)) / rate
    return amplitude * (0.6 * np.sin(2 * np.pi * 440.0 * t) + 0.4 * np.sin(2 * np.pi * 1250.0 * t + 0.3))


def to_pcm(signal: np.ndarray) -> bytes:
    return np.round(signal * 32767).astype("<i2").tobytes()


def decode(fmt: str, data: bytes) -> np.ndarray:
    if fmt == "mulaw":
        return mulaw_decode(data).astype(np.float64) / 32768
    if fmt == "alaw":
        return alaw_decode(data).astype(np.float64) / 32768
    return np.frombuffer(data, dtype="<i2").astype(np.float64) / 32768


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    noise = test - reference
    return 10 * np.log10(np.sum(reference**2) / max(np.sum(noise**2), 1e-20))


def random_chunks(data: bytes, seed: int) -> list[bytes]:
    """Pieces of random size, odd byte counts included (half samples must be carried over)."""
    rng = random.Random(seed)
    chunks, i = [], 0
    while i < len(data):
        n = rng.choice([1, 3, 17, 160, 481, 960, 3841, 7680])
        chunks.append(data[i : i + n])
        i += n
    return chunks


def stream(encoder: StreamEncoder, chunks: list[bytes]) -> list[bytes]:
    return [encoder.encode(c) for c in chunks] + [encoder.flush()]


# -- G.711 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("encode,decode_fn", [(mulaw_encode, mulaw_decode), (alaw_encode, alaw_decode)])
def test_g711_round_trip_error_is_bounded_for_every_sample(encode, decode_fn) -> None:
    encoded = encode(ALL_INT16)
    assert len(encoded) == len(ALL_INT16)
    error = np.abs(decode_fn(encoded).astype(np.int64) - ALL_INT16.astype(np.int64))
    # Logarithmic companding: the error grows with the magnitude, about 3 % at most, plus a small floor.
    assert np.all(error <= np.abs(ALL_INT16.astype(np.int64)) / 32 + 8)
    # Monotone: a larger input never decodes to a smaller value.
    assert np.all(np.diff(decode_fn(encoded).astype(np.int64)) >= 0)


@pytest.mark.parametrize("encode,decode_fn", [(mulaw_encode, mulaw_decode), (alaw_encode, alaw_decode)])
def test_g711_codes_are_a_fixed_point(encode, decode_fn) -> None:
    values = decode_fn(bytes(range(256)))
    assert len(set(values.tolist())) >= 255  # mu-law has two zeros, A-law none
    assert np.array_equal(decode_fn(encode(values)), values)


def test_g711_matches_the_reference_codec_byte_for_byte() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop")
    pcm = ALL_INT16.tobytes()
    assert mulaw_encode(ALL_INT16) == audioop.lin2ulaw(pcm, 2)
    assert alaw_encode(ALL_INT16) == audioop.lin2alaw(pcm, 2)
    codes = bytes(range(256))
    assert mulaw_decode(codes).tobytes() == audioop.ulaw2lin(codes, 2)
    assert alaw_decode(codes).tobytes() == audioop.alaw2lin(codes, 2)


def test_g711_known_codes() -> None:
    # Silence is 0xFF in mu-law and 0xD5 in A-law; full scale is 0x80 / 0x7F and 0xAA / 0x2A.
    assert mulaw_encode(np.array([0, 32767, -32768], dtype=np.int16)) == bytes([0xFF, 0x80, 0x00])
    assert alaw_encode(np.array([0, 32767, -32768], dtype=np.int16)) == bytes([0xD5, 0xAA, 0x2A])


# -- streaming encoder ---------------------------------------------------------------------------------


@pytest.mark.parametrize("source_rate", SOURCE_RATES)
@pytest.mark.parametrize("target_rate", SAMPLE_RATES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_encoded_audio_decodes_to_the_source(fmt: str, source_rate: int, target_rate: int) -> None:
    seconds = 0.6
    source = tones(source_rate, seconds)
    encoder = StreamEncoder(fmt, source_rate, target_rate)
    assert encoder.output_rate == target_rate
    assert encoder.bytes_per_sample == (1 if fmt in ("mulaw", "alaw") else 2)
    pieces = stream(encoder, random_chunks(to_pcm(source), seed=target_rate))
    assert all(len(p) % encoder.bytes_per_sample == 0 for p in pieces)
    out = decode(fmt, b"".join(pieces))
    expected_len = len(source) * target_rate / source_rate
    assert abs(len(out) - expected_len) <= 1
    reference = tones(target_rate, len(out) / target_rate)
    # Compare away from the edges, where the resampler's filter sees the signal start and stop.
    edge = target_rate // 50
    inner = slice(edge, len(out) - edge)
    threshold = 30 if fmt in ("mulaw", "alaw") else 50
    assert snr_db(reference[inner], out[inner]) > threshold
    # No time shift: the best alignment is at lag 0.
    lags = range(-5, 6)
    scores = [np.dot(reference[edge + k : len(out) - edge + k], out[inner]) for k in lags]
    assert lags[int(np.argmax(scores))] == 0


@pytest.mark.parametrize("fmt", ["pcm", "mulaw"])
@pytest.mark.parametrize("source_rate,target_rate", [(24000, 8000), (22050, 48000), (24000, 16000), (22050, 24000)])
def test_chunked_stream_equals_one_shot(fmt: str, source_rate: int, target_rate: int) -> None:
    pcm = to_pcm(tones(source_rate, 1.0))
    one_shot = decode(fmt, encode_pcm(pcm, fmt, source_rate, target_rate))
    for seed in (1, 2, 3):
        chunked = decode(fmt, b"".join(stream(StreamEncoder(fmt, source_rate, target_rate), random_chunks(pcm, seed))))
        assert len(chunked) == len(one_shot)
        # soxr's stream is the same filter whatever the chunking; only the last bit of rounding may differ,
        # which for mu-law can move a sample to the neighbouring code (one step: |x|/16 at most).
        difference = np.abs(chunked - one_shot)
        if fmt == "pcm":
            assert np.max(difference) <= 2 / 32768
        else:
            assert np.all(difference <= np.abs(one_shot) / 16 + 16 / 32768)
            assert np.count_nonzero(difference) <= len(one_shot) // 100


def test_flush_readies_the_encoder_for_the_next_sentence() -> None:
    pcm = to_pcm(tones(24000, 0.3))
    encoder = StreamEncoder("pcm", 24000, 16000)
    first = b"".join(stream(encoder, random_chunks(pcm, 5)))
    second = b"".join(stream(encoder, random_chunks(pcm, 6)))
    assert len(first) == len(second) == 2 * 4800
    assert np.max(np.abs(decode("pcm", first) - decode("pcm", second))) <= 2 / 32768


def test_same_rate_pcm_passes_through_unchanged() -> None:
    pcm = to_pcm(tones(24000, 0.2))
    encoder = StreamEncoder("pcm", 24000)
    assert encoder.output_rate == 24000
    assert b"".join(stream(encoder, random_chunks(pcm, 9))) == pcm


def test_default_rates() -> None:
    assert StreamEncoder("mulaw", 24000).output_rate == 8000
    assert StreamEncoder("alaw", 22050).output_rate == 8000
    assert StreamEncoder("wav", 22050).output_rate == 22050
    assert StreamEncoder("mulaw", 24000, 16000).output_rate == 16000


def test_odd_bytes_are_carried_to_the_next_chunk() -> None:
    pcm = to_pcm(tones(8000, 0.05))
    encoder = StreamEncoder("mulaw", 8000)
    out = b"".join(encoder.encode(pcm[i : i + 1]) for i in range(len(pcm))) + encoder.flush()
    assert out == mulaw_encode(np.frombuffer(pcm, dtype="<i2"))


def test_bad_formats_and_rates_are_refused_clearly() -> None:
    with pytest.raises(UnsupportedFormatError, match="response_format"):
        StreamEncoder("mp3", 24000)
    with pytest.raises(UnsupportedFormatError, match="sample_rate"):
        StreamEncoder("pcm", 24000, 11025)
    with pytest.raises(ValueError):
        StreamEncoder("pcm", 0)


# -- WAV -----------------------------------------------------------------------------------------------


def riff_chunks(data: bytes) -> dict[bytes, bytes]:
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    assert struct.unpack("<I", data[4:8])[0] == len(data) - 8
    chunks, i = {}, 12
    while i < len(data):
        name, size = data[i : i + 4], struct.unpack("<I", data[i + 4 : i + 8])[0]
        chunks[name] = data[i + 8 : i + 8 + size]
        i += 8 + size + (size & 1)
    return chunks


@pytest.mark.parametrize("rate", SAMPLE_RATES)
def test_pcm_wav_parses_with_the_wave_module(rate: int) -> None:
    pcm = to_pcm(tones(rate, 0.25))
    with wave.open(io.BytesIO(wav_bytes(pcm, rate))) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, rate)
        assert wav.getnframes() == len(pcm) // 2
        assert wav.readframes(wav.getnframes()) == pcm


@pytest.mark.parametrize("fmt,tag,codec", [("mulaw", 7, mulaw_decode), ("alaw", 6, alaw_decode)])
def test_g711_wav_has_its_format_tag_and_decodes_to_the_source(fmt: str, tag: int, codec) -> None:
    source = tones(8000, 0.3)
    pcm = to_pcm(source)
    chunks = riff_chunks(wav_bytes(pcm, 8000, fmt))
    format_tag, channels, rate, byte_rate, block_align, bits, extra = struct.unpack("<HHIIHHH", chunks[b"fmt "])
    assert (format_tag, channels, rate, byte_rate, block_align, bits, extra) == (tag, 1, 8000, 8000, 1, 8, 0)
    assert struct.unpack("<I", chunks[b"fact"])[0] == len(source)
    decoded = codec(chunks[b"data"]).astype(np.float64) / 32768
    assert snr_db(source, decoded) > 30


def test_odd_length_wav_data_is_padded() -> None:
    chunks = riff_chunks(wav_bytes(to_pcm(tones(8000, 0.001875)), 8000, "alaw"))  # 15 samples
    assert len(chunks[b"data"]) == 15


def test_streaming_wav_header_has_unknown_sizes() -> None:
    header = wav_header(24000)
    assert len(header) == 44
    assert struct.unpack("<I", header[4:8])[0] == 0xFFFFFFFF
    assert header[36:40] == b"data" and struct.unpack("<I", header[40:44])[0] == 0xFFFFFFFF
    assert wav_header(24000, "pcm", 480) == wav_bytes(b"\0" * 480, 24000)[:44]


def test_content_types() -> None:
    assert content_type("wav") == "audio/wav"
    assert content_type("pcm") == "audio/pcm"
    assert content_type("pcm", 24000) == "audio/pcm;rate=24000"
    assert content_type("mulaw", 8000) == "audio/PCMU;rate=8000"
    assert content_type("alaw") == "audio/PCMA"
    with pytest.raises(UnsupportedFormatError):
        content_type("ogg")
