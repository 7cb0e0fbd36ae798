"""The HTTP companions, through the real `openai` SDK where OpenAI defines the endpoint (synthetic backend)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
import wave

import httpx
import openai
import pytest
import websockets

from tests.gateway_server import receive_until, running_gateway
from tts_backend.base import SynthesisRequest
from tts_backend.synthetic import SyntheticSynthesizer

TEXT = "The quick brown fox jumps over the lazy dog. It was not amused! Was it?"
SENTENCES = ["The quick brown fox jumps over the lazy dog.", "It was not amused!", "Was it?"]


@pytest.fixture(scope="module")
def server():
    with running_gateway("synthetic") as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def expected_pcm(voice="tone-mid", texts=SENTENCES) -> bytes:
    backend = SyntheticSynthesizer()

    async def run():
        out = b""
        for text in texts:
            out += b"".join([c.pcm async for c in backend.synthesize(SynthesisRequest(text=text, voice=voice))])
        return out

    return asyncio.run(run())


def test_speech_create_returns_a_wav_file(client):
    response = client.audio.speech.create(model="voxgate", voice="tone-mid", input=TEXT, response_format="wav")
    with wave.open(io.BytesIO(response.content)) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (24000, 1, 2)
        frames = wav.readframes(wav.getnframes())
    assert frames == expected_pcm()


def test_speech_create_without_a_format_defaults_to_mp3_as_openai(client):
    response = client.audio.speech.create(model="tts-1", voice="tone-mid", input="Just this.")
    assert response.content[:2] == b"\xff\xf3"  # an MPEG-2 layer III frame (24 kHz), no ID3 tag
    assert response.response.headers["content-type"] == "audio/mpeg"


def test_streaming_pcm_with_streaming_response_is_byte_identical(client):
    chunks = []
    with client.audio.speech.with_streaming_response.create(
        model="voxgate", voice="tone-mid", input=TEXT, response_format="pcm"
    ) as response:
        assert response.headers["content-type"].startswith("audio/pcm")
        assert response.headers["x-sample-rate"] == "24000"
        for chunk in response.iter_bytes():
            chunks.append(chunk)
    assert b"".join(chunks) == expected_pcm()


def test_streamed_wav_has_an_open_ended_header(client):
    with client.audio.speech.with_streaming_response.create(
        model="voxgate", voice="tone-mid", input=TEXT, response_format="wav", stream_format="audio"
    ) as response:
        body = response.read()
    assert body[:4] == b"RIFF" and body[4:8] == b"\xff\xff\xff\xff"
    assert body[44:] == expected_pcm()


def test_sse_stream_as_openai_documents_it(client):
    with client.audio.speech.with_streaming_response.create(
        model="voxgate", voice="tone-mid", input=TEXT, response_format="pcm", stream_format="sse"
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 3 and events[-1]["type"] == "speech.audio.done"
    assert set(events[-1]["usage"]) >= {"input_tokens", "output_tokens", "total_tokens"}
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == expected_pcm()


def test_vllm_style_stream_true_gives_raw_audio(server):
    """`stream: true` alone is the audio itself (see tests/test_output_formats.py for SSE by Accept)."""
    response = httpx.post(server.url + "/v1/audio/speech", json={"input": "Was it?", "voice": "tone-mid", "stream": True,
                                                                  "response_format": "pcm"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("audio/pcm")
    assert response.content == expected_pcm(texts=["Was it?"])


def test_mulaw_at_8k_and_resampled_pcm(server):
    mulaw = httpx.post(server.url + "/v1/audio/speech", json={"input": "Hello phone.", "voice": "tone-low", "response_format": "mulaw"})
    assert mulaw.status_code == 200 and mulaw.headers["content-type"] == "audio/PCMU;rate=8000"
    samples_24k = len(expected_pcm("tone-low", ["Hello phone."])) // 2
    assert abs(len(mulaw.content) - samples_24k / 3) <= 4
    pcm16 = httpx.post(server.url + "/v1/audio/speech",
                       json={"input": "Hello phone.", "voice": "tone-low", "response_format": "pcm", "sample_rate": 16000})
    assert abs(len(pcm16.content) // 2 - samples_24k * 2 / 3) <= 4


def test_voice_object_form_is_accepted(server):
    response = httpx.post(server.url + "/v1/audio/speech", json={"input": "Hi.", "voice": {"id": "tone-high"}, "response_format": "pcm"})
    assert response.status_code == 200
    assert response.content == expected_pcm("tone-high", ["Hi."])


@pytest.mark.parametrize(
    "params, code, status",
    [
        ({"voice": "tone-mid", "response_format": "m4a"}, "unsupported_format", 400),
        ({"voice": "tone-mid", "extra_body": {"sample_rate": 11025}}, "unsupported_format", 400),
        ({"voice": "tone-mid", "input": "   "}, "invalid_message", 400),
        ({"voice": "tone-mid", "speed": 9.0}, "invalid_message", 400),
    ],
)
def test_errors_come_back_as_openai_errors(client, params, code, status):
    params = {"model": "voxgate", "input": "Hello.", **params}
    with pytest.raises(openai.APIStatusError) as info:
        client.audio.speech.create(**params)
    assert info.value.status_code == status
    assert info.value.body["code"] == code and info.value.body["message"]


def test_input_over_the_limit_is_413():
    with running_gateway("synthetic", max_http_input_chars=20) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            client.audio.speech.create(model="voxgate", voice="tone-mid", input="x" * 21)
        assert info.value.status_code == 413 and info.value.body["code"] == "text_too_long"


def test_api_keys_protect_http_routes_but_not_probes():
    with running_gateway("synthetic", api_keys=["k-123"]) as server:
        denied = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            denied.audio.speech.create(model="voxgate", voice="tone-mid", input="Hi.")
        allowed = openai.OpenAI(base_url=server.url + "/v1", api_key="k-123", max_retries=0)
        assert allowed.audio.speech.create(model="voxgate", voice="tone-mid", input="Hi.", response_format="wav").content[:4] == b"RIFF"
        assert [m.id for m in allowed.models.list()] == ["voxgate"]
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/ready").status_code == 200


def test_voices_models_health_ready(server, client):
    voices = httpx.get(server.url + "/v1/audio/voices").json()
    assert voices["voices"] == ["tone-low", "tone-mid", "tone-high"] and voices["default"] == "tone-low"
    assert [m.id for m in client.models.list()] == ["voxgate"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").json()["status"] == "ready"


class SlowStart(SyntheticSynthesizer):
    """Takes a while to load, like a real model: loading ends when the test says so, not after a fixed delay a
    slow machine could outrun."""

    def __init__(self):
        super().__init__()
        self.loaded = False
        self.finish_loading = threading.Event()

    async def start(self):
        while not self.finish_loading.is_set():
            await asyncio.sleep(0.01)
        self.loaded = True

    @property
    def ready(self):
        return self.loaded


def test_the_catalogue_names_the_default_voice_as_it_lists_it():
    """A --voice in another case is the backend's voice all the same; the catalogue's default must be an
    entry of its own list, as a client picks from it."""
    with running_gateway("synthetic", voice="TONE-MID") as server:
        voices = httpx.get(server.url + "/v1/audio/voices").json()
    assert voices["default"] == "tone-mid" and voices["default"] in voices["voices"]


def test_ready_waits_for_the_backend_while_health_answers_at_once():
    import time

    backend = SlowStart()
    with running_gateway(backend, ready_path="/health", ready_timeout_s=5.0) as server:
        assert httpx.get(server.url + "/ready").status_code == 503

        async def early_session():
            async with websockets.connect(server.ws_url) as ws:
                error = (await receive_until(ws, "error"))[-1]
                with pytest.raises(websockets.ConnectionClosed):
                    await ws.recv()
                return error, ws.close_code

        error, close_code = asyncio.run(early_session())
        assert (error["code"], error["retryable"], close_code) == ("overloaded", True, 1013)
        assert httpx.get(server.url + "/ready").status_code == 503
        backend.finish_loading.set()
        deadline = time.monotonic() + 5.0
        while httpx.get(server.url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "/ready never turned 200 after the backend loaded"
            time.sleep(0.05)


async def test_metrics_count_sessions_sentences_bytes_ttfa_and_errors():
    with running_gateway("synthetic") as server:
        async with websockets.connect(server.ws_url) as ws:
            await ws.send(json.dumps({"type": "session.config", "stream_audio": True}))
            await ws.send("not json")
            await ws.send(json.dumps({"type": "input.text", "text": "One sentence. Two sentences."}))
            await ws.send(json.dumps({"type": "input.done"}))
            messages = await receive_until(ws, "session.done")
        sent = sum(len(m) for m in messages if isinstance(m, bytes))
        async with httpx.AsyncClient() as http:
            await http.post(server.url + "/v1/audio/speech", json={"input": "Hi.", "voice": "tone-low", "response_format": "pcm"})
            unknown = await http.post(server.url + "/v1/audio/speech", json={"input": "Hi.", "response_format": "vorbis"})
            assert unknown.status_code == 400
            text = (await http.get(server.url + "/metrics")).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    assert values["voxgate_sessions_total"] == 1
    assert values['voxgate_sentences_total{outcome="done"}'] == 2
    assert values['voxgate_audio_bytes_total{transport="websocket"}'] == sent
    assert values['voxgate_ttfa_seconds_count{transport="websocket"}'] == 1  # one utterance
    assert values['voxgate_ttfa_seconds_count{transport="http"}'] == 1
    assert values['voxgate_errors_total{code="invalid_json"}'] == 1
    assert values['voxgate_errors_total{code="unsupported_format"}'] == 1  # HTTP errors count too


def test_a_backend_failure_is_an_error_response_or_an_sse_error_event():
    from tests.gateway_server import RecordingBackend

    with running_gateway(RecordingBackend(SyntheticSynthesizer(), fail_on="BROKEN")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            client.audio.speech.create(model="voxgate", voice="tone-mid", input="BROKEN text.", response_format="pcm")
        assert info.value.body["code"] == "synthesis_failed"
        # Audio streams as it is made: a later sentence's failure cuts the body short, which the client sees
        # as an incomplete read, never as a shorter file that looks complete.
        with pytest.raises(openai.APIConnectionError):
            client.audio.speech.create(model="voxgate", voice="tone-mid", input="Fine. BROKEN later.", response_format="pcm")
        # A wav not asked for as a stream is held until whole (its header states its length), so a later
        # sentence's failure is still an error response.
        with pytest.raises(openai.InternalServerError) as info:
            client.audio.speech.create(model="voxgate", voice="tone-mid", input="Fine. BROKEN later.", response_format="wav")
        assert info.value.body["code"] == "synthesis_failed"
        response = httpx.post(server.url + "/v1/audio/speech",
                              json={"input": "Fine first. BROKEN second.", "voice": "tone-mid", "stream_format": "sse"})
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[0]["type"] == "speech.audio.delta"
        assert events[-1]["type"] == "speech.audio.error" and events[-1]["error"]["code"] == "synthesis_failed"


class BrokenStart(SyntheticSynthesizer):
    async def start(self):
        raise RuntimeError("model file is corrupt")


def test_ready_reports_a_backend_that_failed_to_start():
    with pytest.raises(RuntimeError, match="model file is corrupt"):
        with running_gateway(BrokenStart()):
            pass
    from fastapi.testclient import TestClient

    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    with TestClient(create_app(GatewaySettings(backend="synthetic"), backend=BrokenStart())) as client:
        for _ in range(100):
            response = client.get("/ready")
            if response.json()["status"] == "failed":
                break
        assert response.status_code == 503 and "model file is corrupt" in response.json()["error"]


def test_a_server_process_freezes_its_start_up_objects_once_the_backend_is_up():
    """`voxgate serve` builds its app with freeze_gc_when_ready: the objects alive once the backend is up
    (model, torch, tokenizer) leave the cyclic collector, whose full passes would otherwise pause the event
    loop for hundreds of ms under load. An embedded app (the default) leaves the collector alone."""
    import gc
    import time

    from fastapi.testclient import TestClient

    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    gc.unfreeze()
    try:
        with TestClient(create_app(GatewaySettings(backend="synthetic"))) as client:
            assert client.get("/health").status_code == 200
        assert gc.get_freeze_count() == 0
        with TestClient(create_app(GatewaySettings(backend="synthetic"), freeze_gc_when_ready=True)) as client:
            deadline = time.monotonic() + 10
            while client.get("/ready").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()
