"""Clients written for other servers, unchanged: what they send and how they read, against a real gateway.

- vLLM-Omni's example client (examples/online_serving/qwen3_tts/streaming_speech_client.py): its messages
  and reading loop are reproduced here (CI cannot fetch it), with its defaults (voice "Vivian", task
  CustomVoice, wav per sentence) against the default Piper gateway, and after a refused config;
- the OpenAI SDK with OpenAI's voice names;
- what LiveKit's Baseten plugin sends (Api-Key auth, its session.config fields, voice.list / voice.add) at
  the protocol level; the plugin itself runs in tests/test_adapter_baseten.py;
- voice names of other servers: built-in aliases, --voice-alias, the fallback and its warnings, strict mode;
- the default output rate: 24 kHz for the WebSocket and HTTP pcm whatever the backend's own rate.
"""

from __future__ import annotations

import asyncio
import io
import json
import wave

import httpx
import openai
import pytest
import websockets

from gateway.cli import build_parser, settings_from_args
from tests.gateway_server import receive_until, running_gateway
from tts_backend.base import SynthesisRequest
from tts_backend.synthetic import SyntheticSynthesizer

KEY = "k-compat-0123"
# The voices OpenAI's speech API documents.
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse",
                 "marin", "cedar")
# What livekit-plugins-baseten 1.8.9 sends as session.config with word_timestamps=True and its defaults.
BASETEN_CONFIG = {
    "type": "session.config", "task_type": "Base", "response_format": "pcm", "stream_audio": True, "speed": 1.0,
    "voice": "my-cloned-voice", "language": "Auto", "max_new_tokens": 2048, "initial_codec_chunk_frames": 4,
    "x_vector_only_mode": True, "timestamp_type": "word", "timestamp_transport_strategy": "sync",
}


class RequestLog(SyntheticSynthesizer):
    """The synthetic backend at a rate of its own, keeping every request it was given."""

    def __init__(self, sample_rate: int = 16000, honours: frozenset[str] = frozenset()) -> None:
        super().__init__(sample_rate=sample_rate)
        self.honours = honours
        self.requests: list[SynthesisRequest] = []

    async def synthesize(self, request: SynthesisRequest):
        self.requests.append(request)
        async for chunk in super().synthesize(request):
            yield chunk


@pytest.fixture(scope="module")
def server():
    with running_gateway(RequestLog()) as running:
        yield running


@pytest.fixture(scope="module")
def keyed():
    with running_gateway("synthetic", api_keys=[KEY]) as running:
        yield running


def send(ws, **message):
    return ws.send(json.dumps({"type": message.pop("type"), **message}))


async def started(url: str, config: dict, **connect) -> dict:
    async with websockets.connect(url, **connect) as ws:
        await ws.send(json.dumps({"type": "session.config", **config}))
        return (await receive_until(ws, "session.started", "error"))[-1]


async def speak(url: str, config: dict, text: str) -> tuple[dict, list]:
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "session.config", **config}))
        await send(ws, type="input.text", text=text)
        await send(ws, type="input.done")
        messages = await receive_until(ws, "session.done")
    return messages[0], messages


def codes(message: dict) -> list[str]:
    return [w["code"] for w in message.get("warnings", [])]


# ------------------------------------------------------------------------------------------ auth


async def test_api_key_scheme_is_accepted_and_a_wrong_one_refused_at_the_upgrade(keyed):
    first = await started(keyed.ws_url, {"voice": "tone-mid"}, additional_headers={"Authorization": f"Api-Key {KEY}"})
    assert first["type"] == "session.started"
    speech = httpx.post(keyed.url + "/v1/audio/speech", json={"input": "Hi.", "response_format": "pcm"},
                        headers={"Authorization": f"Api-Key {KEY}"})
    assert speech.status_code == 200 and speech.content
    # A refused Api-Key client gets a 4xx to its upgrade (what the Baseten plugin treats as permanent), with the
    # protocol's error as the body; no session is opened.
    with pytest.raises(websockets.InvalidStatus) as refused:
        await websockets.connect(keyed.ws_url, additional_headers={"Authorization": "Api-Key wrong"})
    assert refused.value.response.status_code == 401
    body = json.loads(refused.value.response.body)
    assert (body["type"], body["code"], body["retryable"]) == ("error", "unauthorized", False)
    # Browsers cannot read an upgrade's status: the other ways keep the error message and close 1008.
    async with websockets.connect(keyed.ws_url + "?api_key=wrong") as ws:
        assert json.loads(await ws.recv())["code"] == "unauthorized"
        with pytest.raises(websockets.ConnectionClosed):
            await ws.recv()
        assert ws.close_code == 1008


# ------------------------------------------------------------------------------------------ rates


async def test_default_output_rate_is_24_khz_whatever_the_backend(server):
    """A 16 kHz backend: streamed pcm, wav per sentence and HTTP pcm default to 24 kHz (resampled);
    `sample_rate` still chooses; telephony formats stay 8 kHz."""
    text = "One sentence of speech."
    native = len(SyntheticSynthesizer(sample_rate=16000).render(SynthesisRequest(text=text, voice="tone-low")))
    first, messages = await speak(server.ws_url, {"stream_audio": True}, text)
    assert first["sample_rate"] == 24000
    start = next(m for m in messages if isinstance(m, dict) and m["type"] == "audio.start")
    assert start["sample_rate"] == 24000
    pcm = b"".join(m for m in messages if isinstance(m, bytes))
    assert abs(len(pcm) // 2 - native * 24000 / 16000) <= 40
    first, messages = await speak(server.ws_url, {}, text)  # vLLM-Omni's default: one wav per sentence
    with wave.open(io.BytesIO(next(m for m in messages if isinstance(m, bytes)))) as wav:
        assert first["sample_rate"] == wav.getframerate() == 24000
    assert (await started(server.ws_url, {"stream_audio": True, "sample_rate": 16000}))["sample_rate"] == 16000
    assert (await started(server.ws_url, {"stream_audio": True, "response_format": "mulaw"}))["sample_rate"] == 8000
    http = httpx.post(server.url + "/v1/audio/speech", json={"input": text, "response_format": "pcm"})
    assert http.headers["x-sample-rate"] == "24000"


# ------------------------------------------------------------------------------------------ Baseten's config


async def test_baseten_config_is_accepted_with_warnings_for_what_the_backend_cannot_do(server):
    first = await started(server.ws_url, {k: v for k, v in BASETEN_CONFIG.items() if k != "type"})
    assert first["type"] == "session.started" and first["voice"] == "tone-low" and first["sample_rate"] == 24000
    warnings = {w["field"]: w["code"] for w in first["warnings"]}
    assert warnings == {
        "voice": "voice_fallback",
        "task_type, x_vector_only_mode": "voice_cloning_unsupported",
        "max_new_tokens": "option_ignored",
        "initial_codec_chunk_frames": "option_ignored",
        "timestamp_type": "timestamps_unsupported",
    }
    assert all(w["message"] for w in first["warnings"])


async def test_options_the_backend_honours_reach_it_without_warnings():
    backend = RequestLog(honours=frozenset({"language", "instructions", "max_new_tokens", "chunk_schedule"}))
    with running_gateway(backend) as running:
        config = {"stream_audio": True, "voice": "tone-mid", "task_type": "CustomVoice", "language": "English",
                  "instructions": "Calm.", "max_new_tokens": 300, "initial_codec_chunk_frames": 4}
        first, _ = await speak(running.ws_url, config, "Hello there.")
    assert "warnings" not in first
    request = backend.requests[-1]
    assert (request.language, request.instructions, request.max_new_tokens, request.chunk_schedule) == (
        "English", "Calm.", 300, (4,))


async def test_voice_list_and_voice_add_before_the_config(server):
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, type="voice.list")
        assert json.loads(await ws.recv()) == {"type": "voice.list", "voices": ["tone-low", "tone-mid", "tone-high"],
                                               "uploaded_voices": []}
        # As large as a session.config may be (reference audio), and refused for what it asks, not its size.
        await send(ws, type="voice.add", name="mine", consent="yes", audio_data="A" * 300_000, audio_format="wav")
        refused = json.loads(await ws.recv())
        assert (refused["type"], refused["code"], refused["retryable"]) == ("error", "voice_cloning_unsupported", False)
        await send(ws, type="session.config", stream_audio=True)  # the socket goes on to a session
        assert (await receive_until(ws, "session.started"))[-1]["type"] == "session.started"
        await send(ws, type="voice.list")
        assert json.loads(await ws.recv())["type"] == "voice.list"


# ------------------------------------------------------------------------------------------ voice names


async def test_voice_names_of_other_servers_resolve():
    with running_gateway("synthetic", voice="tone-mid", voice_aliases={"alloy": "tone-high", "Mine": "TONE-LOW"}) as gw:
        assert (await started(gw.ws_url, {"voice": "Vivian"}))["voice"] == "tone-mid"  # built-in, no warning
        assert "warnings" not in await started(gw.ws_url, {"voice": "vivian"})
        assert (await started(gw.ws_url, {"voice": "ALLOY"}))["voice"] == "tone-high"  # --voice-alias wins
        assert (await started(gw.ws_url, {"voice": "mine"}))["voice"] == "tone-low"
        fallback = await started(gw.ws_url, {"voice": "Ethan"})
        assert fallback["voice"] == "tone-mid" and codes(fallback) == ["voice_fallback"]
        assert "'Ethan'" in fallback["warnings"][0]["message"]
    with running_gateway("synthetic", voice_aliases={"alloy": "nobody"}) as gw:
        refused = await started(gw.ws_url, {"voice": "alloy"})
        assert refused["code"] == "unknown_voice" and "alias" in refused["message"]


async def test_strict_voices_refuse_unknown_names_and_close_at_once():
    with running_gateway("synthetic", voice_fallback=False, config_timeout_s=600) as gw:
        assert (await started(gw.ws_url, {"voice": "nova"}))["voice"] == "tone-low"  # known names still resolve
        async with websockets.connect(gw.ws_url) as ws:
            await send(ws, type="session.config", voice="Ethan")
            await send(ws, type="input.text", text="Hello.")
            error = json.loads(await ws.recv())
            assert error["code"] == "unknown_voice" and error["retryable"] is False
            # Closed now, not after the config timeout (600 s here): the test's own timeout would catch a hang.
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 60)
            assert ws.close_code == 1008
        unknown = httpx.post(gw.url + "/v1/audio/speech", json={"input": "Hi.", "voice": "Ethan"})
        assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "unknown_voice"


def test_voice_alias_flags():
    args = build_parser().parse_args(["serve", "--voice-alias", "alloy=joe", "--voice-alias", "Vivian = joe",
                                      "--no-voice-fallback"])
    settings = settings_from_args(args)
    assert settings.voice_aliases == {"alloy": "joe", "Vivian": "joe"} and settings.voice_fallback is False
    assert settings_from_args(build_parser().parse_args(["serve"])).voice_fallback is True
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--voice-alias", "alloy"])


# ------------------------------------------------------------------------------------------ OpenAI SDK


def test_openai_sdk_with_every_openai_voice_name(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    expected = None
    for voice in OPENAI_VOICES:
        with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice=voice, input="Hello from the SDK.", response_format="pcm",
        ) as response:
            assert response.headers.get("x-voxgate-warnings") is None, voice
            audio = response.read()
        expected = expected or audio
        assert audio == expected and len(audio) > 1000, voice  # all speak with the default voice
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="someone-else", input="Hello.", response_format="pcm",
    ) as response:
        warnings = json.loads(response.headers["x-voxgate-warnings"])
        assert [w["code"] for w in warnings] == ["voice_fallback"] and response.read()


# ------------------------------------------------------------------------------------------ vLLM-Omni's client


async def vllm_omni_client(url: str, text: str, config: dict, printed: list[str]) -> None:
    """streaming_speech_client.py's stream_tts(): the config, the text and input.done sent by a task of their
    own, and its reading loop (binary frames kept per sentence, until session.done). What it prints goes to
    `printed` (a file it saves as "saved <index> <first 4 bytes> <total_bytes>")."""
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "session.config", **config}))

        async def send_text() -> None:
            await ws.send(json.dumps({"type": "input.text", "text": text}))
            await ws.send(json.dumps({"type": "input.done"}))

        sender = asyncio.create_task(send_text())
        chunks: list[bytes] = []
        try:
            while True:
                message = await ws.recv()
                if isinstance(message, bytes):
                    chunks.append(message)
                    continue
                msg = json.loads(message)
                if msg["type"] == "audio.start":
                    chunks = []
                elif msg["type"] == "audio.done":
                    printed.append(f"saved {msg['sentence_index']} {b''.join(chunks)[:4]!r} {msg['total_bytes']}")
                    chunks = []
                elif msg["type"] == "session.done":
                    printed.append(f"complete {msg['total_sentences']}")
                    break
                elif msg["type"] == "error":
                    printed.append(f"ERROR: {msg['message']}")
        finally:
            sender.cancel()
            try:
                await sender
            except asyncio.CancelledError:
                pass


# Its argparse defaults: --voice Vivian --task-type CustomVoice --language Auto --response-format wav --speed 1.0
VLLM_OMNI_DEFAULTS = {"voice": "Vivian", "task_type": "CustomVoice", "language": "Auto", "response_format": "wav",
                      "speed": 1.0}


async def test_vllm_omni_client_defaults_get_audio_from_piper():
    with running_gateway("piper") as gw:
        printed: list[str] = []
        await vllm_omni_client(gw.ws_url, "Hello world. How are you? I am fine.", VLLM_OMNI_DEFAULTS, printed)
    assert printed[-1] == "complete 3"
    assert len(printed) == 4 and all(line.startswith("saved ") and "b'RIFF'" in line for line in printed[:3])
    assert all(int(line.split()[-1]) > 24000 for line in printed[:3])  # each a wav file of real speech


async def test_vllm_omni_client_after_a_refused_config_gets_the_error_and_the_close():
    """--speed 9 is refused: the client prints the error and its reading loop ends as the socket closes (as
    against vLLM-Omni), instead of waiting out a config timeout while its text is refused."""
    printed: list[str] = []
    with running_gateway("synthetic", config_timeout_s=600) as gw:
        with pytest.raises(websockets.ConnectionClosed):  # its recv() raises this once the socket is closed
            await asyncio.wait_for(vllm_omni_client(gw.ws_url, "Hello world.",
                                                    {**VLLM_OMNI_DEFAULTS, "speed": 9.0}, printed), 60)
    assert len(printed) == 1 and printed[0].startswith("ERROR: invalid session.config: speed:"), printed
