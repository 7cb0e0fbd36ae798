"""Pronunciation in the Python and JS clients (issue 34): `pronunciations` and `text_markup` pass through
`session.config`, the backend is given the rewrite (recorded per request), and the client's words and
sentence texts are the ones written. A real gateway on loopback with the synthetic backend."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
import voxgate_client as vg

from tests.gateway_server import RecordingBackend, running_gateway
from tests.js_fixtures import JS_CLIENT_DIR, require_node, require_npm_packages, run_node_json
from tts_backend.synthetic import SyntheticSynthesizer

pytestmark = pytest.mark.timeout(90)

VOICE = "tone-mid"
PRONUNCIATIONS = [{"text": "Voxgate", "say": "vox gate"}]
TEXT = "Voxgate reads <spell>AB-12</spell> <break time='200ms'/> aloud. Then Voxgate stops."
SAID = ["vox gate reads A B, 1 2", "aloud.", "Then vox gate stops."]
WRITTEN = ["Voxgate", "reads", "AB-12", "aloud.", "Then", "Voxgate", "stops."]
SENTENCES = ["Voxgate reads AB-12  aloud.", "Then Voxgate stops."]


@pytest.fixture
def gateway():
    backend = RecordingBackend(SyntheticSynthesizer())
    with running_gateway(backend) as server:
        yield server.url, backend


def heard(backend: RecordingBackend) -> list[str]:
    return [r.text.strip() for r in backend.records]


async def test_python_client_passes_pronunciations(gateway):
    url, backend = gateway
    config = vg.SessionConfig(voice=VOICE, timestamp_type="word", pronunciations=PRONUNCIATIONS, text_markup="ssml")
    assert config.to_message()["pronunciations"] == PRONUNCIATIONS
    async with vg.connect(url, config) as session:
        context = session.context("reply")
        await context.send_text(TEXT)
        await context.done()
        events = [event async for event in context]
    assert heard(backend) == SAID
    assert [w.word for e in events if isinstance(e, vg.AudioWords) for w in e.words] == WRITTEN
    assert [e.sentence_text for e in events if isinstance(e, vg.AudioStart)] == SENTENCES
    with pytest.raises(ValueError):
        vg.SessionConfig(text_markup="html")


def test_js_client_passes_pronunciations(gateway):
    url, backend = gateway
    require_node()
    require_npm_packages()
    observed = run_node_json(JS_CLIENT_DIR / "test" / "pronunciation_scenarios.mjs", url, VOICE, TEXT,
                             json.dumps(PRONUNCIATIONS))
    assert heard(backend) == SAID
    assert observed["words"] == WRITTEN
    assert observed["sentenceTexts"] == SENTENCES


def test_voxgate_say_passes_entries_dictionaries_and_markup(gateway, tmp_path):
    url, backend = gateway
    assert httpx.post(url + "/v1/audio/pronunciations",
                      json={"name": "units", "entries": [{"text": "km", "say": "kilometres"}]}).is_success
    script = [sys.executable, "-c", "import sys; from voxgate_client.cli import main; sys.exit(main())"]
    result = subprocess.run(
        [*script, "--url", url, "--voice", VOICE, "-o", str(tmp_path / "out.wav"), "--say", "Voxgate=vox gate",
         "--dictionary", "units", "--ssml"],
        input="Voxgate drove 5 km with <spell>AB</spell>.", capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert heard(backend) == ["vox gate drove 5 kilometres with A B."]
    # Its progress line names the written words (token splitting: those known when synthesis began).
    assert "sentence 0: Voxgate drove 5 km with" in result.stderr
