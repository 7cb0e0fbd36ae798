"""Voice cloning through the gateway (issue 15): the registry, its HTTP and WebSocket APIs, isolation
between API keys, limits, reference audio in any format, and replicas sharing voices through Redis.

Real gateways on loopback (tests/gateway_server.py), real httpx and websockets clients, real Redis. The
backend that clones is tests/cloning_fixtures.py's PitchCloneSynthesizer, a test backend whose voice
prompt is the pitch of the reference clip, so which voice spoke is read from the audio: the reference
clips are tones at distinct pitches (the real Qwen3 Base model behind a gateway is in
tests/test_qwen3_clone_gateway.py). The refusals run on the synthetic
backend, which cannot clone, as Piper cannot.
"""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import pytest
import websockets

from gateway.voices import PromptCache
from tests.cloning_fixtures import PitchCloneSynthesizer, auth, b64, clip, dominant_hz
from tests.gateway_server import audio_by_sentence, open_session, receive_until, running_gateway
from tests.redis_fixtures import REDIS_URL, redis_cluster, redis_prefix, redis_target  # noqa: F401 - fixture

KEY_A, KEY_B = "key-a-" + "a" * 20, "key-b-" + "b" * 20
PRESET_HZ = 150.0  # the test backend's one preset voice


def upload(url: str, key: str, name: str, audio: bytes, **fields: str) -> httpx.Response:
    form = {"name": name, "consent": "recording-42", **fields}
    return httpx.post(url + "/v1/audio/voices", headers=auth(key), data=form,
                      files={"audio_sample": (f"{name}.wav", audio, "audio/wav")}, timeout=30)


def speak(url: str, key: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/audio/speech", headers=auth(key), timeout=30,
                      json={"input": "Hello there, this is a cloned voice.", "response_format": "pcm", **body})


def pitch_of(response: httpx.Response) -> float:
    assert response.status_code == 200, response.text
    return dominant_hz(response.content, 24000)


def error_code(response: httpx.Response) -> str:
    return response.json()["error"]["code"]


@pytest.fixture
def cloning_gateway():
    backend = PitchCloneSynthesizer()
    with running_gateway(backend, api_keys=[KEY_A, KEY_B], max_voices_per_key=3) as server:
        yield server, backend


def test_a_voice_is_cloned_once_and_belongs_to_the_key_that_made_it(cloning_gateway):
    server, backend = cloning_gateway
    url = server.url
    # A stereo 44.1 kHz clip: decoded, mixed down and resampled before the backend sees it.
    made = upload(url, KEY_A, "alice", clip(220.0, rate=44100, channels=2), ref_text="Hello, it is me.")
    assert made.status_code == 200, made.text
    voice = made.json()["voice"]
    assert made.json()["success"] is True
    assert voice["name"] == "alice" and voice["consent"] == "recording-42" and voice["ref_text"] == "Hello, it is me."
    assert voice["size"] > 0 and voice["created_at"] > 0 and abs(voice["duration_s"] - 4.0) < 0.05

    listed = httpx.get(url + "/v1/audio/voices", headers=auth(KEY_A)).json()
    assert listed["voice_cloning"] is True
    assert "alice" in listed["voices"] and [v["name"] for v in listed["uploaded_voices"]] == ["alice"]
    assert httpx.get(url + "/v1/audio/voices/alice", headers=auth(KEY_A)).json()["voice"]["name"] == "alice"

    for _ in range(3):  # spoken with the reference's pitch, from the one prompt computed at upload
        assert abs(pitch_of(speak(url, KEY_A, voice="alice")) - 220.0) < 5
    assert backend.clones == 1

    # Key B: not listed, not found, not deletable, and never spoken with.
    listed_b = httpx.get(url + "/v1/audio/voices", headers=auth(KEY_B)).json()
    assert "alice" not in listed_b["voices"] and listed_b["uploaded_voices"] == []
    assert error_code(httpx.get(url + "/v1/audio/voices/alice", headers=auth(KEY_B))) == "voice_not_found"
    deleted = httpx.delete(url + "/v1/audio/voices/alice", headers=auth(KEY_B))
    assert deleted.status_code == 404 and error_code(deleted) == "voice_not_found"
    refused = speak(url, KEY_B, voice="alice", task_type="Base")
    assert refused.status_code == 404 and error_code(refused) == "voice_not_found"
    fallback = speak(url, KEY_B, voice="alice")  # outside Base: the preset rules, a fallback with a warning
    assert abs(pitch_of(fallback) - PRESET_HZ) < 5
    assert json.loads(fallback.headers["X-Voxgate-Warnings"])[0]["code"] == "voice_fallback"

    # The owner deletes it; then it is gone for the owner too.
    assert httpx.delete(url + "/v1/audio/voices/alice", headers=auth(KEY_A)).json()["success"] is True
    assert error_code(speak(url, KEY_A, voice="alice", task_type="Base")) == "voice_not_found"
    assert httpx.get(url + "/v1/audio/voices", headers=auth(KEY_A)).json()["uploaded_voices"] == []


@pytest.mark.parametrize("container,rate,channels", [("wav", 16000, 1), ("flac", 48000, 2), ("mp3", 44100, 2),
                                                      ("ogg", 16000, 2)])
def test_reference_audio_in_any_container_rate_and_layout(cloning_gateway, container, rate, channels):
    server, _ = cloning_gateway
    made = httpx.post(server.url + "/v1/audio/voices", headers=auth(KEY_A), timeout=30, json={
        "name": f"v-{container}", "consent": "c", "x_vector_only_mode": True,
        "audio_sample": b64(clip(180.0, rate=rate, channels=channels, container=container))})
    assert made.status_code == 200, made.text
    assert abs(pitch_of(speak(server.url, KEY_A, voice=f"v-{container}")) - 180.0) < 5


def test_limits_and_bad_reference_audio(cloning_gateway):
    server, backend = cloning_gateway
    url = server.url

    def refused(response: httpx.Response, code: str, status: int = 400) -> str:
        assert response.status_code == status and error_code(response) == code, response.text
        return response.json()["error"]["message"]

    assert "at least 3" in refused(upload(url, KEY_A, "short", clip(200.0, seconds=2.0)), "invalid_reference_audio")
    assert "longer than 30" in refused(upload(url, KEY_A, "long", clip(200.0, seconds=31.0)), "invalid_reference_audio")
    refused(upload(url, KEY_A, "junk", b"RIFF not really audio" * 100), "invalid_reference_audio")
    assert "ref_text" in refused(upload(url, KEY_A, "no-text", clip(200.0)), "invalid_reference_audio")
    refused(upload(url, KEY_A, "bad name!", clip(200.0), ref_text="hi"), "invalid_message")
    refused(speak(url, KEY_A, task_type="Base", ref_audio="https://example.com/a.wav", ref_text="hi"),
            "invalid_reference_audio")  # fetching is off by default
    assert backend.clones == 0

    for i in range(3):
        assert upload(url, KEY_A, f"v{i}", clip(200.0 + i * 20), ref_text="hi").status_code == 200
    refused(upload(url, KEY_A, "v3", clip(300.0), ref_text="hi"), "voice_limit_reached", 403)
    assert backend.clones == 3  # refused before the clone
    replaced = upload(url, KEY_A, "v0", clip(300.0), ref_text="hi")  # the same name replaces
    assert replaced.status_code == 200
    assert abs(pitch_of(speak(url, KEY_A, voice="v0")) - 300.0) < 5
    assert upload(url, KEY_B, "v0", clip(260.0), ref_text="hi").status_code == 200  # B's own allowance
    assert abs(pitch_of(speak(url, KEY_A, voice="v0")) - 300.0) < 5


def test_the_websocket_registers_lists_and_speaks_with_cloned_voices(cloning_gateway):
    server, _ = cloning_gateway
    headers = auth(KEY_A)

    async def scenario() -> None:
        async with websockets.connect(server.ws_url, additional_headers=headers) as ws:
            await ws.send(json.dumps({"type": "voice.add", "name": "bob", "consent": "user_consent",
                                      "audio_data": b64(clip(240.0)), "audio_format": "wav", "ref_text": "Hi."}))
            added = json.loads(await ws.recv())
            assert added["type"] == "voice.add" and added["success"] is True and added["voice"]["name"] == "bob"
            await ws.send(json.dumps({"type": "voice.list"}))
            listed = json.loads(await ws.recv())
            assert "bob" in listed["voices"] and [v["name"] for v in listed["uploaded_voices"]] == ["bob"]
        # A registered voice by name, and a session's own clip (vLLM-Omni's Base fields).
        for config, hz in (({"voice": "bob"}, 240.0),
                           ({"task_type": "Base", "ref_audio": "data:audio/wav;base64," + b64(clip(275.0)),
                             "x_vector_only_mode": True}, 275.0)):
            ws, started, _ = await open_session(server.ws_url, {"type": "session.config", "response_format": "pcm",
                                                                **config}, additional_headers=headers)
            assert not started.get("warnings"), started
            await ws.send(json.dumps({"type": "input.text", "text": "One sentence to speak here."}))
            await ws.send(json.dumps({"type": "input.done"}))
            audio = audio_by_sentence(await receive_until(ws, "session.done"))[0]
            assert abs(dominant_hz(audio, 24000) - hz) < 5
            await ws.close()
        # Key B cannot speak with bob where only a clone can speak.
        ws, error, code = await open_session(server.ws_url, {"type": "session.config", "voice": "bob",
                                                             "task_type": "Base"}, additional_headers=auth(KEY_B))
        assert ws is None and error["code"] == "voice_not_found"

    asyncio.run(scenario())


def test_backends_that_cannot_clone_refuse_and_say_so():
    with running_gateway("synthetic") as server:
        url = server.url
        listed = httpx.get(url + "/v1/audio/voices").json()
        assert listed["voice_cloning"] is False and listed["uploaded_voices"] == []
        made = httpx.post(url + "/v1/audio/voices", data={"name": "x", "consent": "c"},
                          files={"audio_sample": ("x.wav", clip(200.0), "audio/wav")})
        assert made.status_code == 400 and error_code(made) == "voice_cloning_unsupported"

        async def ws_refusal() -> dict:
            async with websockets.connect(server.ws_url) as ws:
                await ws.send(json.dumps({"type": "voice.add", "name": "x", "consent": "c",
                                          "audio_data": b64(clip(200.0)), "audio_format": "wav"}))
                return json.loads(await ws.recv())

        answer = asyncio.run(ws_refusal())
        assert answer["type"] == "error" and answer["code"] == "voice_cloning_unsupported"


def test_replicas_on_redis_share_voices_at_once(redis_target, redis_prefix):  # noqa: F811 - fixture
    options = dict(api_keys=[KEY_A, KEY_B], store="redis", redis_key_prefix=redis_prefix, redis_url=redis_target.url,
                   redis_cluster=redis_target.cluster)
    one, two = PitchCloneSynthesizer(), PitchCloneSynthesizer()
    with running_gateway(one, **options) as first, running_gateway(two, **options) as second:
        assert upload(first.url, KEY_A, "carol", clip(210.0), ref_text="hi").status_code == 200
        # The other replica uses it at once, without cloning again, and keeps it from key B too.
        assert abs(pitch_of(speak(second.url, KEY_A, voice="carol")) - 210.0) < 5
        assert two.clones == 0
        assert [v["name"] for v in httpx.get(second.url + "/v1/audio/voices", headers=auth(KEY_A)).json()[
            "uploaded_voices"]] == ["carol"]
        assert error_code(speak(second.url, KEY_B, voice="carol", task_type="Base")) == "voice_not_found"
        # Replaced on one replica, deleted on the other: each is seen everywhere at once, caches or not.
        assert upload(second.url, KEY_A, "carol", clip(330.0), ref_text="hi").status_code == 200
        assert abs(pitch_of(speak(first.url, KEY_A, voice="carol")) - 330.0) < 5
        assert httpx.delete(second.url + "/v1/audio/voices/carol", headers=auth(KEY_A)).status_code == 200
        assert error_code(speak(first.url, KEY_A, voice="carol", task_type="Base")) == "voice_not_found"


def test_shared_voices_from_files_serve_every_key(tmp_path):
    (tmp_path / "narrator.flac").write_bytes(clip(190.0, container="flac"))
    (tmp_path / "narrator.txt").write_text("This is the narrator.")
    (tmp_path / "notes.md").write_text("not a voice")
    with running_gateway(PitchCloneSynthesizer(), api_keys=[KEY_A, KEY_B], shared_voices_dir=str(tmp_path)) as server:
        for key in (KEY_A, KEY_B):
            listed = httpx.get(server.url + "/v1/audio/voices", headers=auth(key)).json()["uploaded_voices"]
            assert listed == [{"name": "narrator", "consent": "operator", "created_at": listed[0]["created_at"],
                               "size": listed[0]["size"], "file_size": listed[0]["file_size"], "duration_s": 4.0,
                               "ref_text": "This is the narrator.", "x_vector_only": False, "shared": True}]
            assert abs(pitch_of(speak(server.url, key, voice="narrator")) - 190.0) < 5
        assert error_code(httpx.delete(server.url + "/v1/audio/voices/narrator", headers=auth(KEY_A))) == \
            "voice_not_found"


def test_the_prompt_cache_is_bounded_in_bytes_and_keeps_the_recently_used():
    cache = PromptCache(max_bytes=100)
    cache.put("a", b"x" * 40)
    cache.put("b", b"x" * 40)
    assert cache.get("a") is not None  # a is now the most recently used
    cache.put("c", b"x" * 40)
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.bytes == 80
    cache.put("huge", b"x" * 101)  # larger than the whole cache: not kept, nothing evicted for it
    assert cache.get("huge") is None and len(cache) == 2
    assert np.isclose(cache.bytes, 80)


def test_the_python_client_adds_lists_and_deletes_voices(cloning_gateway, tmp_path):
    from voxgate_client import SessionConfig, VoxgateError, add_voice, connect, delete_voice, list_voices

    server, _ = cloning_gateway
    ws_url = server.url.replace("http://", "ws://")
    path = tmp_path / "ref.flac"
    path.write_bytes(clip(205.0, rate=48000, channels=2, container="flac"))

    async def scenario() -> None:
        voice = await add_voice(ws_url, "py-voice", path, consent="rec-1", ref_text="Hello.", api_key=KEY_A)
        assert voice["name"] == "py-voice" and voice["consent"] == "rec-1"
        listed = await list_voices(server.url, api_key=KEY_A)
        assert listed["voice_cloning"] is True and "py-voice" in listed["voices"]
        assert (await list_voices(server.url, api_key=KEY_B))["uploaded_voices"] == []
        async with connect(ws_url, SessionConfig(voice="py-voice", response_format="pcm"), api_key=KEY_A) as session:
            assert abs(dominant_hz(await session.speak("Spoken with the clone."), 24000) - 205.0) < 5
        with pytest.raises(VoxgateError) as refused:
            await delete_voice(server.url, "py-voice", api_key=KEY_B)
        assert refused.value.code == "voice_not_found"
        with pytest.raises(VoxgateError) as refused:
            await add_voice(server.url, "short", clip(200.0, seconds=1.0), consent="c", ref_text="x", api_key=KEY_A)
        assert refused.value.code == "invalid_reference_audio"
        await delete_voice(server.url, "py-voice", api_key=KEY_A)
        assert (await list_voices(server.url, api_key=KEY_A))["uploaded_voices"] == []

    asyncio.run(scenario())


def test_the_js_client_adds_lists_and_deletes_voices(cloning_gateway, tmp_path):
    from tests.js_fixtures import JS_CLIENT_DIR, require_npm_packages, run_node_json

    require_npm_packages()
    server, _ = cloning_gateway
    path = tmp_path / "ref.mp3"
    path.write_bytes(clip(230.0, rate=44100, channels=2, container="mp3"))
    result = run_node_json(JS_CLIENT_DIR / "test" / "voice_scenarios.mjs", server.url, KEY_A, KEY_B, str(path))
    assert result["added"]["name"] == "js-voice" and result["added"]["consent"] == "rec-7"
    assert result["listedA"] == ["js-voice"] and result["listedB"] == []
    assert result["badClip"]["code"] == "invalid_reference_audio"
    assert result["spokenBytes"] > 0
    assert result["deleteByB"]["code"] == "voice_not_found"
    assert result["afterDelete"] == 0


@pytest.mark.third_party
def test_livekits_baseten_client_registers_lists_and_streams_a_clone(tmp_path):
    """The plugin's register_voice() and list_voices(), then a stream with the clone, all unchanged."""
    from tests.adapter_env import adapter_python, run_in_adapter_env
    from tests.adapter_fixtures import ws_base

    adapter_python("livekit")
    path = tmp_path / "reference.wav"
    path.write_bytes(clip(245.0, rate=16000))
    with running_gateway(PitchCloneSynthesizer(), api_keys=[KEY_A]) as server:
        result = run_in_adapter_env("livekit", "tests/adapter_scripts/baseten_voices.py",
                                    ws_base(server) + "/v1/audio/speech/stream", KEY_A, str(path), "Hello there.")
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULTS "))
    observed = json.loads(line[len("RESULTS "):])
    assert observed["registered"]["name"] == "livekit-clone" and observed["registered"]["consent"] == "user_consent"
    assert "livekit-clone" in observed["listed"]["voices"]
    assert [v["name"] for v in observed["listed"]["uploaded_voices"]] == ["livekit-clone"]
    assert observed["sample_rates"] == [24000]
    assert abs(dominant_hz(base64.b64decode(observed["audio"]), 24000) - 245.0) < 5


def test_reference_urls_are_fetched_only_where_allowed_and_within_limits(tmp_path):
    import functools
    import http.server
    import threading

    (tmp_path / "ref.wav").write_bytes(clip(225.0))
    (tmp_path / "big.wav").write_bytes(clip(225.0, seconds=29.0, rate=48000, channels=2))  # 5.6 MB
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=files.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{files.server_address[1]}"
    try:
        with running_gateway(PitchCloneSynthesizer(), api_keys=[KEY_A], reference_audio_fetch=True,
                             reference_fetch_allowed_networks=["127.0.0.1/32"]) as server:
            spoken = speak(server.url, KEY_A, task_type="Base", ref_audio=base + "/ref.wav", x_vector_only_mode=True)
            assert abs(pitch_of(spoken) - 225.0) < 5
            too_big = speak(server.url, KEY_A, task_type="Base", ref_audio=base + "/big.wav", x_vector_only_mode=True)
            assert too_big.status_code == 400 and error_code(too_big) == "invalid_reference_audio"
            assert too_big.json()["error"]["message"] == "the reference audio could not be fetched from its URL"
            missing = speak(server.url, KEY_A, task_type="Base", ref_audio=base + "/none.wav", x_vector_only_mode=True)
            assert error_code(missing) == "invalid_reference_audio"
    finally:
        files.shutdown()
        files.server_close()


def test_a_session_resumed_on_another_replica_keeps_its_cloned_voice(redis_prefix):  # noqa: F811 - fixture
    options = dict(api_keys=[KEY_A], store="redis", redis_url=REDIS_URL, redis_key_prefix=redis_prefix)
    with running_gateway(PitchCloneSynthesizer(), **options) as first, \
            running_gateway(second_backend := PitchCloneSynthesizer(), **options) as second:
        assert upload(first.url, KEY_A, "dave", clip(265.0), ref_text="hi").status_code == 200

        async def scenario() -> bytes:
            ws, started, _ = await open_session(first.ws_url, {"type": "session.config", "voice": "dave",
                                                               "response_format": "pcm"}, additional_headers=auth(KEY_A))
            await ws.send(json.dumps({"type": "input.text", "text": "The first sentence is here."}))
            await ws.send(json.dumps({"type": "input.flush"}))
            await receive_until(ws, "audio.done")
            await ws.close()  # the client goes away mid-utterance; the session waits in Redis
            async with websockets.connect(second.ws_url, additional_headers=auth(KEY_A)) as again:
                await again.send(json.dumps({"type": "session.resume", "session_id": started["session_id"],
                                             "sentence_index": 1, "bytes_received": 0}))
                resumed = (await receive_until(again, "session.started", "error"))[-1]
                assert resumed["type"] == "session.started" and resumed["voice"] == "dave", resumed
                await again.send(json.dumps({"type": "input.text", "text": "Then one made on the other replica."}))
                await again.send(json.dumps({"type": "input.done"}))
                return audio_by_sentence(await receive_until(again, "session.done"))[1]

        assert abs(dominant_hz(asyncio.run(scenario()), 24000) - 265.0) < 5
        assert second_backend.clones == 0


def test_a_first_session_config_with_unusable_reference_audio_is_refused(cloning_gateway):
    server, backend = cloning_gateway

    async def refusal(config: dict) -> tuple[dict, int | None]:
        ws, error, code = await open_session(server.ws_url, {"type": "session.config", "task_type": "Base", **config},
                                             additional_headers=auth(KEY_A))
        assert ws is None
        return error, code

    for config in ({"ref_audio": "not base64 at all!", "ref_text": "hi"},
                   {"ref_audio": b64(clip(200.0, seconds=1.0)), "ref_text": "hi"},
                   {"ref_audio": b64(clip(200.0))},  # in-context cloning needs ref_text
                   {"ref_audio": "file:///etc/passwd", "ref_text": "hi"}):
        error, code = asyncio.run(refusal(config))
        assert error["code"] == "invalid_reference_audio" and code == 1008, error
    error, code = asyncio.run(refusal({}))  # Base without a voice or a clip
    assert error["code"] == "voice_not_found" and code == 1008
    assert backend.clones == 0


def test_registrations_and_inline_clones_count_against_the_keys_request_rate():
    backend = PitchCloneSynthesizer()
    with running_gateway(backend, api_keys=[KEY_A, KEY_B], sessions_per_minute=1) as server:
        assert upload(server.url, KEY_A, "first", clip(200.0), ref_text="hi").status_code == 200
        again = upload(server.url, KEY_A, "second", clip(200.0), ref_text="hi")
        assert again.status_code == 429 and error_code(again) == "rate_limited" and "Retry-After" in again.headers
        inline = speak(server.url, KEY_A, task_type="Base", ref_audio=b64(clip(220.0)), x_vector_only_mode=True)
        assert inline.status_code == 429 and error_code(inline) == "rate_limited"
        assert backend.clones == 1  # neither refused request decoded nor cloned anything
        inline_b = speak(server.url, KEY_B, task_type="Base", ref_audio=b64(clip(220.0)), x_vector_only_mode=True)
        assert abs(pitch_of(inline_b) - 220.0) < 5 and backend.clones == 2
