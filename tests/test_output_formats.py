"""mp3, opus (Ogg), aac (ADTS), flac, wav and pcm over HTTP (the real `openai` SDK, whole and streamed) and
over the WebSocket (a real `websockets` client, streamed and whole per sentence), against a real gateway
with the synthetic backend. What comes back is decoded with PyAV and compared with the PCM the backend
made: its length (within one codec frame, once the codec's fixed start delay is counted), its alignment,
and its signal-to-noise ratio (exact for the lossless formats)."""

from __future__ import annotations

import asyncio
import io
import json
import wave

import av
import av.logging
import httpx
import numpy as np
import openai
import pytest
import soxr
import websockets

from tests.gateway_server import HeldSynthesizer, audio_by_sentence, receive_until, running_gateway
from tests.resume_fixtures import Listener, config_message
from tts_backend.base import SynthesisRequest
from tts_backend.synthetic import SyntheticSynthesizer

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
TEXT = "The quick brown fox jumps over the lazy dog. It was not amused! Was it?"
SENTENCES = ["The quick brown fox jumps over the lazy dog.", "It was not amused!", "Was it?"]
VOICE = "tone-mid"
RATE = 24000  # the synthetic backend's rate, and what every format here is coded at (opus decodes at 48 kHz)

# Samples of silence a decoder puts before the audio: mp3 (LAME's 576 + the decoder's 529) and aac (one
# frame of priming) are plain frame streams with no header to say how much to skip; Ogg Opus says it.
START_DELAY = {"mp3": 1105, "aac": 1024}
# Samples the end may run past the audio: the last frame is padded to a whole frame.
FRAME = {"mp3": 576, "aac": 1024, "opus": 1}
LOSSY_MIN_SNR_DB = {"mp3": 20.0, "aac": 30.0, "opus": 20.0}  # measured here: 26, 42 and 31 dB


def rendered(texts: list[str]) -> np.ndarray:
    backend = SyntheticSynthesizer()
    return np.concatenate([backend.render(SynthesisRequest(text=t, voice=VOICE)) for t in texts]).astype(np.float64) / 32768


def decode(fmt: str, data: bytes) -> tuple[np.ndarray, int]:
    """Mono float samples and their rate. Raises if the decoder reports any error."""
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.float64) / 32768, RATE
    av.logging.set_level(av.logging.ERROR)
    try:
        with av.logging.Capture() as errors, av.open(io.BytesIO(data)) as container:
            stream = container.streams.audio[0]
            to_float = av.AudioResampler(format="flt", layout="mono")
            pieces = [f.to_ndarray().reshape(-1) for frame in container.decode(stream) for f in to_float.resample(frame)]
            pieces += [f.to_ndarray().reshape(-1) for f in to_float.resample(None)]
            rate = stream.codec_context.sample_rate
    finally:
        av.logging.set_level(None)
    assert not errors, f"{fmt}: the decoder reported {errors}"
    return np.concatenate(pieces).astype(np.float64), rate


def assert_same_audio(fmt: str, data: bytes, reference_24k: np.ndarray) -> None:
    decoded, rate = decode(fmt, data)
    reference = reference_24k if rate == RATE else soxr.resample(reference_24k, RATE, rate)
    delay = START_DELAY.get(fmt, 0)
    extra = len(decoded) - delay - len(reference)
    assert 0 <= extra <= FRAME.get(fmt, 0), f"{fmt}: {len(decoded)} samples decoded for {len(reference)} + {delay}"
    # Aligned where expected: no other shift within two frames matches better.
    window = len(reference) - 2048
    scores = [np.dot(decoded[lag : lag + window], reference[:window]) for lag in range(0, 2048)]
    assert abs(int(np.argmax(scores)) - delay) <= 1
    aligned = decoded[delay : delay + len(reference)]
    if fmt in ("flac", "wav", "pcm"):
        assert np.array_equal(np.round(aligned * 32768), np.round(reference * 32768))
        return
    edge = rate // 50  # the codec's first and last frame
    inner = slice(edge, len(reference) - edge)
    noise = aligned[inner] - reference[inner]
    snr = 10 * np.log10(np.sum(reference[inner] ** 2) / np.sum(noise**2))
    assert snr > LOSSY_MIN_SNR_DB[fmt], f"{fmt}: SNR {snr:.1f} dB"


@pytest.fixture(scope="module")
def backend():
    return HeldSynthesizer()


@pytest.fixture(scope="module")
def server(backend):
    with running_gateway(backend) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


# -------------------------------------------------------------------------------------------- HTTP


@pytest.mark.parametrize("fmt", [None, *FORMATS])
def test_http_whole_body_decodes_to_the_source(client, fmt):
    options = {} if fmt is None else {"response_format": fmt}
    response = client.audio.speech.create(model="tts-1", voice=VOICE, input=TEXT, **options)
    fmt = fmt or "mp3"  # OpenAI's default
    assert response.response.headers["content-type"].startswith(
        {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac", "wav": "audio/wav",
         "pcm": "audio/pcm"}[fmt])
    assert response.response.headers["x-sample-rate"] == str(RATE)
    assert_same_audio(fmt, response.content, rendered(SENTENCES))


@pytest.mark.parametrize("fmt", [None, *FORMATS])
def test_http_streams_the_first_sentence_while_the_next_is_being_made(client, backend, fmt):
    """The OpenAI docs' streaming call: the first bytes arrive while a later sentence cannot have been made
    yet (the backend holds it until they have arrived). wav and flac, whose header states the length,
    stream when asked to (`stream: true`); without it they are sent whole (next tests)."""
    backend.released.clear()
    backend.resumed.clear()
    options = {} if fmt is None else {"response_format": fmt}
    if fmt in ("wav", "flac"):
        options["extra_body"] = {"stream": True}
    text = "The first sentence is spoken at once. Then HOLD this one."
    try:
        with client.audio.speech.with_streaming_response.create(model="tts-1", voice=VOICE, input=text, **options) as response:
            pieces = response.iter_bytes()
            first = next(pieces)
            assert not backend.resumed.is_set(), "no audio came before the whole input was synthesized"
            backend.released.set()
            body = first + b"".join(pieces)
    finally:
        backend.released.set()
    assert_same_audio(fmt or "mp3", body, rendered(["The first sentence is spoken at once.", "Then HOLD this one."]))


# Every format a client can ask for over HTTP, and how libsndfile (soundfile) opens it: the raw formats
# have no header, so their rate and sample type are given; libsndfile has no AAC reader at all (PyAV,
# the other reader tested, decodes it).
ALL_HTTP_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm", "mulaw", "alaw")
SOUNDFILE_RAW = {"pcm": "PCM_16", "mulaw": "ULAW", "alaw": "ALAW"}
HTTP_RATES = {"mulaw": 8000, "alaw": 8000}  # the telephony formats' default rate; every other one 24 kHz


def soundfile_frames(fmt: str, data: bytes) -> tuple[int, int]:
    """(frames, rate) as soundfile reads the file."""
    import soundfile

    if fmt in SOUNDFILE_RAW:
        samples, rate = soundfile.read(io.BytesIO(data), format="RAW", subtype=SOUNDFILE_RAW[fmt], channels=1,
                                       samplerate=HTTP_RATES.get(fmt, RATE), endian="LITTLE")
    else:
        samples, rate = soundfile.read(io.BytesIO(data))
    return len(samples), rate


def pyav_duration(fmt: str, data: bytes) -> float | None:
    """The duration in seconds that FFmpeg's demuxer states for the file (what ffprobe prints), None when
    it states none. Raw formats need their demuxer and rate named, as ffprobe -f s16le -ar N needs."""
    raw = {"pcm": "s16le", "mulaw": "mulaw", "alaw": "alaw"}
    options = {"sample_rate": str(HTTP_RATES.get(fmt, RATE)), "ch_layout": "mono"} if fmt in raw else {}
    with av.open(io.BytesIO(data), format=raw.get(fmt), options=options) as container:
        return None if container.duration is None else container.duration / av.time_base


@pytest.mark.parametrize("fmt", ALL_HTTP_FORMATS)
def test_a_non_streamed_http_file_opens_in_soundfile_and_pyav_with_its_length(server, fmt):
    """A response the client did not ask to stream is a file every reader opens, and knows the length of:
    soundfile (libsndfile: it refuses a FLAC whose header says "length unknown"), FFmpeg's demuxers as
    ffprobe uses them (a duration), Python's wave module (a wav's frame count). wav and flac are held
    until whole and sent with their length in the header and a Content-Length."""
    response = httpx.post(server.url + "/v1/audio/speech", timeout=30,
                          json={"input": TEXT, "voice": VOICE, "response_format": fmt})
    assert response.status_code == 200, response.text
    data = response.content
    rate = HTTP_RATES.get(fmt, RATE)
    reference = rendered(SENTENCES)
    seconds = len(reference) / RATE
    if fmt in ("wav", "flac"):
        assert response.headers["content-length"] == str(len(data))
    if fmt != "aac":
        frames, read_rate = soundfile_frames(fmt, data)
        expected = len(reference) * rate // RATE
        assert read_rate == rate
        if fmt in ("flac", "wav", "pcm", "mulaw", "alaw"):
            assert abs(frames - expected) <= 1, f"{fmt}: soundfile read {frames} frames of {expected}"
        else:  # lossy: the codec's start delay and last frame's padding
            assert expected <= frames <= expected + START_DELAY.get(fmt, 0) + 1152, (fmt, frames, expected)
    duration = pyav_duration(fmt, data)
    assert duration is not None and duration == pytest.approx(seconds, abs=0.12), f"{fmt}: duration {duration}"
    if fmt == "wav":
        with wave.open(io.BytesIO(data)) as wav:
            assert wav.getnframes() == len(reference)
    if fmt not in ("mulaw", "alaw"):
        assert_same_audio(fmt, data, reference)


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_a_streamed_wav_or_flac_says_length_unknown(server, fmt):
    """Asked for as a stream, the header is written before the length is known: the conventions for "unknown"
    (RIFF sizes 0xFFFFFFFF; STREAMINFO total samples 0), and no Content-Length."""
    with httpx.stream("POST", server.url + "/v1/audio/speech", timeout=30,
                      json={"input": TEXT, "voice": VOICE, "response_format": fmt, "stream": True}) as response:
        assert "content-length" not in response.headers
        data = response.read()
    if fmt == "wav":
        assert data[4:8] == b"\xff\xff\xff\xff" and data[40:44] == b"\xff\xff\xff\xff"
    else:
        assert data[:4] == b"fLaC" and int.from_bytes(data[18:26], "big") & ((1 << 36) - 1) == 0
    assert_same_audio(fmt, data, rendered(SENTENCES))


def test_a_non_streamed_file_too_large_to_hold_is_streamed(server, monkeypatch):
    """Holding a file until it is whole is bounded: past WHOLE_FILE_MAX_BYTES it goes out as a stream, its
    header saying "length unknown", and still decodes to all of its audio."""
    from gateway.http import routes

    monkeypatch.setattr(routes, "WHOLE_FILE_MAX_BYTES", 20_000)
    response = httpx.post(server.url + "/v1/audio/speech", timeout=30,
                          json={"input": TEXT, "voice": VOICE, "response_format": "wav"})
    assert "content-length" not in response.headers and response.content[4:8] == b"\xff\xff\xff\xff"
    assert_same_audio("wav", response.content, rendered(SENTENCES))


def test_stream_true_alone_is_raw_audio_as_it_is_made(server, backend):
    """vLLM-Omni's Gradio demos and `curl ... | play -t raw` send {"stream": true, "response_format": "pcm"}
    and play the body as raw PCM: it is raw PCM (not SSE), and its first bytes leave before a later
    sentence is made."""
    backend.released.clear()
    backend.resumed.clear()
    text = "The first sentence is spoken at once. Then HOLD this one."
    try:
        with httpx.stream("POST", server.url + "/v1/audio/speech", timeout=30,
                          json={"input": text, "voice": VOICE, "stream": True, "response_format": "pcm"}) as response:
            assert response.headers["content-type"].startswith("audio/pcm")
            pieces = response.iter_bytes()
            first = next(pieces)
            assert not backend.resumed.is_set(), "no audio came before the whole input was synthesized"
            backend.released.set()
            body = first + b"".join(pieces)
    finally:
        backend.released.set()
    assert_same_audio("pcm", body, rendered(["The first sentence is spoken at once.", "Then HOLD this one."]))


def test_stream_true_is_sse_for_a_client_that_accepts_event_streams(server):
    """An SSE client that sends only `stream: true` (current vLLM-Omni answers it with SSE) says what it
    reads in its Accept header, and gets SSE."""
    response = httpx.post(server.url + "/v1/audio/speech", timeout=30, headers={"Accept": "text/event-stream"},
                          json={"input": "Was it?", "voice": VOICE, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    import base64

    pcm = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert_same_audio("pcm", pcm, rendered(["Was it?"]))


# -------------------------------------------------------------------------------------------- WebSocket


async def ws_session(server, config: dict) -> list:
    async with websockets.connect(server.ws_url) as ws:
        await ws.send(json.dumps({"type": "session.config", "voice": VOICE, **config}))
        started = (await receive_until(ws, "session.started"))[-1]
        assert started["format"] == config.get("response_format", "wav")
        await ws.send(json.dumps({"type": "input.text", "text": TEXT}))
        await ws.send(json.dumps({"type": "input.done"}))
        return await receive_until(ws, "session.done")


@pytest.mark.parametrize("stream_audio", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_websocket_sentences_are_playable_files(server, fmt, stream_audio):
    """Each sentence's binary frames (between audio.start and audio.done) concatenate to one file of its
    audio: streamed piece by piece with stream_audio, one frame otherwise (vLLM-Omni's client saves each
    sentence so, for every --response-format it offers)."""
    messages = await ws_session(server, {"response_format": fmt, "stream_audio": stream_audio})
    starts = [m for m in messages if isinstance(m, dict) and m["type"] == "audio.start"]
    assert [(m["format"], m["sample_rate"]) for m in starts] == [(fmt, RATE)] * len(SENTENCES)
    frames: dict[int, int] = {}
    current = None
    for message in messages:
        if isinstance(message, dict) and message["type"] == "audio.start":
            current = message["sentence_index"]
        elif isinstance(message, bytes):
            frames[current] = frames.get(current, 0) + 1
    if stream_audio:
        assert frames[0] > 3  # the 3 s first sentence arrives in pieces as it is encoded
    else:
        assert set(frames.values()) == {1}
    dones = {m["sentence_index"]: m for m in messages if isinstance(m, dict) and m["type"] == "audio.done"}
    for index, data in audio_by_sentence(messages).items():
        assert dones[index]["total_bytes"] == len(data) and not dones[index]["error"]
        assert dones[index]["duration_ms"] == pytest.approx(len(rendered([SENTENCES[index]])) / RATE * 1000, abs=0.1)
        assert_same_audio(fmt, data, rendered([SENTENCES[index]]))
        if not stream_audio and fmt in ("flac", "wav"):  # whole: its header states its length
            assert soundfile_frames(fmt, data)[0] == len(rendered([SENTENCES[index]]))


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac"])
async def test_a_whole_sessions_streamed_frames_play_as_one_stream(server, fmt):
    """Every binary frame of a session, concatenated, decodes without an error to all of its audio
    (mp3 and ADTS are frame streams, Ogg files chain). Not so flac and wav: a file per sentence."""
    messages = await ws_session(server, {"response_format": fmt, "stream_audio": True})
    decoded, rate = decode(fmt, b"".join(m for m in messages if isinstance(m, bytes)))
    per_sentence = [len(decode(fmt, data)[0]) for data in audio_by_sentence(messages).values()]
    assert len(decoded) == sum(per_sentence)


async def test_opus_at_a_rate_opus_cannot_code_is_coded_at_48k(server):
    async with websockets.connect(server.ws_url) as ws:
        await ws.send(json.dumps({"type": "session.config", "voice": VOICE, "response_format": "opus",
                                  "stream_audio": True, "sample_rate": 44100}))
        assert (await receive_until(ws, "session.started"))[-1]["sample_rate"] == 48000
        await ws.send(json.dumps({"type": "input.text", "text": "Was it?"}))
        await ws.send(json.dumps({"type": "input.done"}))
        messages = await receive_until(ws, "session.done")
    assert [m["sample_rate"] for m in messages if isinstance(m, dict) and m["type"] == "audio.start"] == [48000]
    decoded, rate = decode("opus", b"".join(m for m in messages if isinstance(m, bytes)))
    assert rate == 48000 and abs(len(decoded) - len(rendered(["Was it?"])) * 2) <= 2


@pytest.mark.parametrize("fmt", ["opus", "mp3"])
async def test_a_compressed_sentence_resumed_mid_way_continues_byte_for_byte(fmt):
    """The drop lands inside sentence 1 (paced backend); the resumed connection replays the logged bytes
    and re-encodes the rest, and every sentence's file equals an uninterrupted run's."""
    text = " ".join(SENTENCES)
    with running_gateway(SyntheticSynthesizer(speed=8.0, chunk_ms=40)) as server:
        reference = Listener()
        async with websockets.connect(server.ws_url) as ws:
            await ws.send(config_message(response_format=fmt))
            await reference.receive(ws, "session.started")
            await ws.send(json.dumps({"type": "input.text", "text": text}))
            await ws.send(json.dumps({"type": "input.done"}))
            await reference.receive(ws, "session.done")
        listener = Listener()
        ws = await websockets.connect(server.ws_url)
        await ws.send(config_message(response_format=fmt))
        await listener.receive(ws, "session.started")
        await ws.send(json.dumps({"type": "input.text", "text": text}))
        await ws.send(json.dumps({"type": "input.done"}))
        while not (listener.open_sentence == 1 and len(listener.audio[1]) >= 500):
            listener.feed(await asyncio.wait_for(ws.recv(), 30))
        await ws.close()
        assert listener.position()[1] > 0  # inside a sentence
        async with websockets.connect(server.ws_url) as ws:
            await ws.send(listener.resume_message())
            await listener.receive(ws, "session.done")
    assert {i: bytes(a) for i, a in listener.audio.items()} == {i: bytes(a) for i, a in reference.audio.items()}
    for index, data in listener.audio.items():
        decode(fmt, bytes(data))


# -------------------------------------------------------------------------------------------- encoder


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac"])
def test_the_encoder_is_incremental_and_reproducible(fmt):
    """Bytes leave as the audio arrives, not at the end; the same audio gives the same bytes (a resumed
    sentence's re-encoded audio continues what was logged); consecutive Ogg files differ in serial."""
    from gateway.audio.encoders import AudioFileEncoder  # here: the tests above also run where it does not exist

    pcm = np.round(rendered(SENTENCES[:1]) * 32767).astype("<i2").tobytes()
    chunk = RATE // 10 * 2

    def encode(serial: int) -> list[bytes]:
        encoder = AudioFileEncoder(fmt, RATE, RATE, serial=serial)
        return [encoder.encode_now(pcm[i : i + chunk]) for i in range(0, len(pcm), chunk)] + [encoder.finish_now()]

    pieces = encode(0)
    produced = sum(len(p) for p in pieces[:-1])
    assert produced > 0.8 * sum(len(p) for p in pieces)
    assert pieces == encode(0)
    assert (b"".join(encode(1)) != b"".join(pieces)) == (fmt == "opus")


def test_coded_rates():
    from gateway.audio.encoders import coded_rate

    assert [coded_rate("opus", r) for r in (8000, 16000, 22050, 24000, 44100, 48000)] == [8000, 16000, 48000, 24000, 48000, 48000]
    assert [coded_rate(f, 22050) for f in ("mp3", "aac", "flac", "wav", "pcm")] == [22050] * 5
