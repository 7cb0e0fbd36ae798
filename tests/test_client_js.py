"""The JavaScript client (clients/js/voxgate.js) in Node 20 against a real gateway.

A real uvicorn gateway on a loopback port serves the synthetic backend (deterministic tones, named as
such, paced at 5x real time so that a cancel lands mid-sentence). clients/js/test/client_scenarios.mjs
drives the client and reports what it received; every sentence's audio is compared byte for byte
(SHA-256) with what the backend renders for that sentence's text.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from tests.gateway_server import running_gateway
from tests.js_fixtures import JS_CLIENT_DIR, require_node, require_npm_packages, run_node_json
from tts_backend.base import SynthesisRequest
from tts_backend.synthetic import SyntheticSynthesizer

VOICE = "tone-mid"
SEED = 7


@pytest.fixture(scope="module")
def backend() -> SyntheticSynthesizer:
    return SyntheticSynthesizer(speed=5.0)


@pytest.fixture(scope="module")
def observed(backend) -> dict:
    require_node()
    require_npm_packages()
    with running_gateway(backend=backend, voice_fallback=False) as server:  # strict: unknown voices refused
        return run_node_json(JS_CLIENT_DIR / "test" / "client_scenarios.mjs", server.url, VOICE)


def rendered(backend: SyntheticSynthesizer, text: str) -> np.ndarray:
    return backend.render(SynthesisRequest(text=text, voice=VOICE, seed=SEED))


def check_sentences_exact(backend, summary: dict, text: str) -> None:
    """Every sentence arrived whole, in order, byte-identical to the backend's rendering of its text."""
    sentences = summary["sentences"]
    assert " ".join(s["text"].strip() for s in sentences) == text
    for sentence in sentences:
        expected = rendered(backend, sentence["text"]).tobytes()
        assert sentence["error"] is False
        assert sentence["bytes"] == sentence["totalBytes"] == sentence["audioBytes"] == len(expected)
        assert sentence["audioSamples"] == len(expected) // 2
        assert sentence["offsetsContiguous"]
        assert sentence["sha256"] == hashlib.sha256(expected).hexdigest()
    assert summary["bytes"] == sum(s["bytes"] for s in sentences)


def test_runs_in_node_20_through_the_ws_package(observed):
    assert int(observed["node"].lstrip("v").split(".")[0]) >= 20
    assert observed["hasGlobalWebSocket"] is False  # so the client really went through `ws`
    assert observed["voices"]["voices"] == ["tone-low", "tone-mid", "tone-high"]


def test_full_utterance_is_byte_identical_to_the_backend(backend, observed):
    result = observed["fullUtterance"]
    assert result["session"]["sampleRate"] == 24000 and result["session"]["format"] == "pcm"
    assert result["session"]["voice"] == VOICE and len(result["session"]["id"]) >= 16
    assert [s["text"] for s in result["sentences"]] == [
        "Hello from the JavaScript client.",
        "It streams audio sentence by sentence!",
        "Does it work?",
        "Yes.",
    ]
    check_sentences_exact(backend, result, result["text"])
    assert [s["index"] for s in result["sentences"]] == [0, 1, 2, 3]
    # audio.start/audio.done pairs in order, then session.done for input.done and again for session.close.
    assert result["events"] == ["audio.start", "audio.done"] * 4 + ["session.done", "session.done"]
    assert result["totalBytesReceived"] == result["bytes"]
    last = result["sentences"][-1]
    assert result["resumeState"] == {
        "session_id": result["session"]["id"],
        "sentence_index": last["index"],
        "bytes_received": last["bytes"],
    }
    assert result["pingMs"] >= 0
    assert result["closed"] is True


def test_token_granularity_is_asked_for_by_default_and_the_client_says_if_it_took_effect(observed):
    result = observed["granularity"]
    # The synthetic backend takes text while it speaks: token splitting takes effect, with no warning.
    assert result["default"] == result["reconfigured"] == {"textStreaming": True, "warnings": []}
    # Asked for sentences, or for the gateway's default: never text streaming, and nothing to warn of.
    assert result["sentence"] == result["none"] == {"textStreaming": False, "warnings": []}


def test_streamed_tokens_resampled_to_16k(backend, observed):
    result = observed["streamedTokens"]
    assert result["sampleRate"] == 16000
    assert " ".join(s["text"].strip() for s in result["sentences"]) == result["text"]
    assert len(result["sentences"]) == 3
    for sentence in result["sentences"]:
        source_samples = len(rendered(backend, sentence["text"]))
        assert sentence["bytes"] == sentence["totalBytes"] == sentence["audioBytes"]
        assert sentence["audioSamples"] * 2 == sentence["bytes"]
        assert abs(sentence["audioSamples"] - source_samples * 16000 / 24000) <= 2


def test_contexts_each_end_with_their_own_utterance_done(backend, observed):
    result = observed["contexts"]
    done = {m["context_id"]: m["total_sentences"] for m in result["utteranceDone"]}
    assert done == {"first": 2, "second": 3}
    first, second = result["results"]
    assert first["contextId"] == "first" and second["contextId"] == "second"
    check_sentences_exact(backend, first, result["texts"]["first"])
    check_sentences_exact(backend, second, result["texts"]["second"])
    indices = sorted(s["index"] for s in first["sentences"] + second["sentences"])
    assert indices == list(range(5))  # one sentence counter across contexts


def test_cancel_stops_the_context_and_the_session_goes_on(backend, observed):
    result = observed["cancel"]
    assert result["cancelled"] is True
    assert result["cancelledMessage"]["context_id"] == "talker"
    full_sentence_bytes = len(rendered(backend, result["sentence"])) * 2
    # The first sentence was cut short: the server stopped the context almost at once.
    assert 0 < result["wireBytes"] < full_sentence_bytes
    # Nothing of the cancelled context reached the application after cancel() returned.
    assert result["audioEventsAfterCancel"] == 0
    assert 0 < result["emittedBytes"] <= result["wireBytes"]
    check_sentences_exact(backend, result["after"], "Still here after the barge-in.")
    assert result["after"]["contextId"] == "after"


def test_resume_position_names_the_next_byte(observed):
    result = observed["resumePosition"]
    assert result["frames"] == 3
    assert result["state"]["sentence_index"] == 0
    assert result["state"]["bytes_received"] == result["receivedForSentence"] > 0
    assert result["state"]["bytes_received"] % 2 == 0


def test_unknown_voice_is_refused_with_its_code(observed):
    refused = observed["errors"]["unknownVoice"]
    assert refused is not None, "connect() accepted an unknown voice"
    assert refused["code"] == "unknown_voice" and refused["retryable"] is False
    assert "tone-mid" in refused["message"]


def test_auto_resume_after_a_dropped_connection_is_byte_exact(backend, observed):
    result = observed["autoResume"]
    assert result["resumes"] == 1
    reconnecting, resumed = result["events"]
    assert reconnecting["type"] == "reconnecting" and reconnecting["code"] == 1006
    assert resumed["type"] == "resumed" and resumed["sentence_index"] == result["droppedAt"]["sentence_index"]
    # Cut in the middle of the first sentence ...
    assert result["droppedAt"]["sentence_index"] == 0
    assert 0 < result["droppedAt"]["bytes_received"] < len(rendered(backend, result["sentences"][0]["text"])) * 2
    # ... and still every sentence arrived exactly once, whole and byte-identical to the backend's audio.
    assert [s["index"] for s in result["sentences"]] == [0, 1, 2]
    check_sentences_exact(backend, result, result["text"])


def test_auto_resume_sends_again_the_input_a_dying_socket_lost(backend, observed):
    result = observed["autoResumeLostInput"]
    assert result["resumes"] == 1
    [resumed] = result["events"]
    assert resumed["inputsResent"] == 3  # two input.text and the input.done; the first text had arrived
    assert result["endsReceived"] == 1
    assert [s["index"] for s in result["sentences"]] == [0, 1, 2]
    check_sentences_exact(backend, result, result["text"])


def test_api_key_as_query_parameter_with_the_platform_websocket(backend):
    """A browser cannot set WebSocket headers: the key goes in ?api_key=. Node's own (experimental)
    WebSocket stands in for the browser's, so the client takes its browser code path."""
    require_node()
    require_npm_packages()
    key = "demo-key-123"
    with running_gateway(backend=backend, api_keys=[key]) as server:
        result = run_node_json(
            JS_CLIENT_DIR / "test" / "auth_scenarios.mjs", server.url, key, node_options=["--experimental-websocket"]
        )
    assert result["platformWebSocket"] and result["usedPlatformWebSocket"]
    assert result["url"].endswith("/v1/audio/speech/stream?api_key=<key>")
    assert result["withoutKey"]["code"] == "unauthorized"
    assert result["wrongKey"]["code"] == "unauthorized"
    assert result["voicesWithoutKey"]["code"] == "unauthorized" and "401" in result["voicesWithoutKey"]["message"]
    assert result["voices"] == ["tone-low", "tone-mid", "tone-high"]
    assert result["spoken"] == {"sentences": 1, "bytes": 2 * len(rendered(backend, "Authorized speech."))}
