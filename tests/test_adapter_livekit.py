"""The LiveKit Agents plugin (clients/livekit) driven as the framework drives it, against a real gateway.

livekit-agents 1.8.9 runs in its own cached venv (tests/adapter_env.py); this process serves a gateway on
loopback with the synthetic backend and runs tests/adapter_scripts/livekit_scenarios.py once with every
scenario (tests/adapter_fixtures.py).
"""

from __future__ import annotations

import hashlib

import pytest

from tests.adapter_fixtures import VOICE, scenario, scenario_results, synthetic_pcm
from tests.gateway_server import RecordingBackend, free_port

pytestmark = pytest.mark.third_party  # a cached venv of third-party packages (tests/conftest.py)


REPLY_1 = ["Hello there.", "This is the first reply of the agent.", "It has three sentences in all."]
REPLY_2 = ["A second reply follows on the same socket."]
CHUNKED = ["Chunked synthesis goes over HTTP.", "It streams raw audio back."]
LONG_REPLY = [f"This is sentence number {word} of a long reply that the user will interrupt." for word in
              ("one", "two", "three", "four", "five", "six")]
AFTER_BARGE_IN = ["After the interruption, the agent speaks again."]
NEW_VOICE = ["The same words in another voice."]
DROPPED = ["The network drops while this reply plays.", "Resuming brings back every missing byte.",
           "Nothing is lost or repeated."]


def samples(sentence: str) -> int:
    return len(synthetic_pcm(sentence)) // 2


def plan(forgetful_url: str) -> dict:
    return {
        "stream": {"replies": [" ".join(REPLY_1), " ".join(REPLY_2)]},
        "synthesize": {"text": " ".join(CHUNKED)},
        "cancel": {"long_reply": " ".join(LONG_REPLY), "next_reply": " ".join(AFTER_BARGE_IN)},
        "errors": {"closed_url": f"ws://127.0.0.1:{free_port()}"},
        "voice_change": {"reply": " ".join(NEW_VOICE)},
        "resume": {"reply": " ".join(DROPPED), "next_reply": " ".join(AFTER_BARGE_IN)},
        "fresh_session": {"reply": " ".join(DROPPED), "next_reply": " ".join(AFTER_BARGE_IN),
                          "gateway_url": forgetful_url},
    }


@pytest.fixture(scope="module")
def results():
    with scenario_results("livekit", plan) as observed:
        yield observed


def synthesized(backend: RecordingBackend, sentences: list[str]) -> list[str]:
    """The sentences of `sentences` the gateway asked the backend for, in request order."""
    return [r.text.strip() for r in backend.records if r.text.strip() in sentences]


def assert_whole(audio: dict, sentences: list[str], voice: str = VOICE) -> None:
    """The audio is exactly the backend's audio for the sentences, in order (24 kHz, no resampling)."""
    assert audio["whole_samples"] and audio["sample_rates"] == [24000] and audio["channels"] == [1]
    assert audio["samples"] == sum(samples(s) for s in sentences)
    assert audio["bytes"] == 2 * audio["samples"]
    expected = b"".join(synthetic_pcm(s, voice) for s in sentences)
    assert audio["sha256"] == hashlib.sha256(expected).hexdigest(), "audio differs"


def test_stream_session_fed_tokens(results):
    observed = scenario(results, "stream")
    _, backend = results
    first, second = observed["replies"]
    assert synthesized(backend, REPLY_1) == REPLY_1, "one request per sentence, as the gateway split them"
    assert synthesized(backend, REPLY_2) == REPLY_2
    assert_whole(first, REPLY_1)
    assert_whole(second, REPLY_2)
    for reply in (first, second):
        assert len(reply["segments"]) == 1 and reply["finals"] == 1, "one segment per reply, ended once"
    assert first["segments"] != second["segments"]
    assert observed["session_ids"][0] == observed["session_ids"][1], "replies share one WebSocket session"
    # The gateway is asked to start each sentence at its first words; the session says whether it does.
    assert observed["split_granularity"] == "token"
    assert observed["text_streaming"] is True and observed["warnings"] == []
    assert len(observed["ttfb_s"]) == 2 and all(0 < t < 5 for t in observed["ttfb_s"])


def test_synthesize_over_http(results):
    audio = scenario(results, "synthesize")
    _, backend = results
    assert synthesized(backend, CHUNKED) == CHUNKED
    assert_whole(audio, CHUNKED)
    assert audio["finals"] == 1


def test_cancelled_stream_stops_generation(results):
    observed = scenario(results, "cancel")
    _, backend = results
    interrupted = observed["interrupted"]
    assert interrupted["whole_samples"] and interrupted["samples"] > 0
    assert interrupted["samples"] < sum(samples(s) for s in LONG_REPLY) / 4
    assert observed["contexts_left"] == [], "context.cancelled confirmed, context released"
    # (a sentence cut while its text was still coming has only its start)
    records = [r for r in backend.records if any(s.startswith(r.text.strip()) for s in LONG_REPLY)]
    assert records and len(records) < len(LONG_REPLY), "later sentences must never be synthesized"
    for record in records:
        late = [t for t in record.chunk_times if t > observed["closed_at"]]
        assert len(late) <= 1, f"{record.text!r}: {len(late)} chunks made after the stream was closed"
    assert any(record.closed is not None for record in records), "the sentence being spoken was cut"
    assert observed["same_session"] and observed["reconnects"] == 0
    assert_whole(observed["next"], AFTER_BARGE_IN)


def test_refusals_are_not_retried(results):
    errors = scenario(results, "errors")
    for name in ("stream_unknown_voice", "synthesize_unknown_voice"):
        raised = errors[name]["raised"]
        assert raised is not None, f"{name}: no error raised"
        assert raised["type"] == "APIStatusError" and raised["status"] == 400 and raised["retryable"] is False
        assert "unknown_voice" in raised["message"]
        assert errors[name]["error_events"] == [False], f"{name}: retried a request that cannot succeed"


def test_connection_failures_are_retried(results):
    errors = scenario(results, "errors")
    for name in ("stream_no_gateway", "synthesize_no_gateway"):
        raised = errors[name]["raised"]
        assert raised is not None and raised["type"] == "APIConnectionError" and raised["retryable"] is True
        # max_retry=2: two recoverable failures, then the final one.
        assert errors[name]["error_events"] == [True, True, False]


def test_dropped_connection_resumes_the_reply(results):
    observed = scenario(results, "resume")
    assert observed["raised"] is None and observed["error_events"] == []
    assert observed["reconnects"] == 1
    assert_whole(observed["reply"], DROPPED)
    assert observed["session_ids"][0] == observed["session_ids"][1]
    assert_whole(observed["next"], AFTER_BARGE_IN)


def test_unresumable_session_fails_the_reply_and_the_next_gets_a_fresh_session(results):
    observed = scenario(results, "fresh_session")
    raised = observed["raised"]
    assert raised is not None and raised["type"] == "APIConnectionError" and raised["retryable"] is True
    # Audio was already played, so the framework must not retry (it would repeat speech).
    assert observed["error_events"] == [False]
    assert 0 < observed["reply"]["samples"] < sum(samples(s) for s in DROPPED)
    assert observed["session_ids"][0] != observed["session_ids"][1]
    assert_whole(observed["next"], AFTER_BARGE_IN)


def test_update_options_changes_the_voice_of_the_next_reply(results):
    low, high = scenario(results, "voice_change")["replies"]
    assert_whole(low, NEW_VOICE, voice="tone-low")
    assert_whole(high, NEW_VOICE, voice="tone-high")
