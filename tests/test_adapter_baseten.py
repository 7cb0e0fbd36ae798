"""LiveKit Agents' Baseten Qwen3-TTS client (livekit-plugins-baseten 1.8.9, `baseten.TTS(model="qwen3-tts")`), a
real client of the vLLM-Omni protocol, used unchanged against the default gateway (Piper).

The plugin runs in the livekit venv (tests/adapter_env.py) as tests/adapter_scripts/baseten_scenarios.py;
this process serves the gateways. What the plugin needs of a server (read from its source): `Authorization:
Api-Key <key>`; 24 kHz PCM (it warns "audio will be mistimed" at any other audio.start rate); its
session.config (task_type "Base", language "Auto", ...) accepted; an empty input.done answered by
session.done (its keep-alive); voice.list / voice.add answered in Baseten's shape; and a refusal it must
not retry given as a 4xx answer to the upgrade, the only failure it treats as permanent.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.adapter_env import adapter_python, run_in_adapter_env
from tests.adapter_fixtures import SCRIPTS, ws_base
from tests.gateway_server import RecordingBackend, running_gateway
from tts_backend.base import SynthesisRequest
from tts_backend.piper import PiperSynthesizer
from tts_backend.synthetic import SyntheticSynthesizer

pytestmark = pytest.mark.third_party  # a cached venv of third-party packages (tests/conftest.py)


KEY = "k-baseten-test"  # as in the script
REPLIES = ["Hello there. This is the first reply.", "A second reply on the same socket."]
LONG_REPLY = " ".join(f"This is sentence number {n} of a long reply that the user will interrupt."
                      for n in ("one", "two", "three", "four", "five", "six"))
AFTER = "After the interruption, the agent speaks again."
CHUNKED = "Synthesize makes one whole utterance."
TIMED_SENTENCES = ["Word timestamps, as Baseten sends them.", "The plugin reads them unchanged."]
TIMED_REPLY = " ".join(TIMED_SENTENCES)
PIPER_RATE, OUTPUT_RATE = 22050, 24000


def metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def run():
    adapter_python("livekit")
    backend = RecordingBackend(PiperSynthesizer())
    with running_gateway(backend) as server, running_gateway("synthetic", api_keys=[KEY]) as keyed, \
            running_gateway("synthetic", api_keys=[KEY]) as catalogue:
        plan = {
            "conversation": {"replies": REPLIES, "long_reply": LONG_REPLY, "after_interrupt": AFTER,
                             "chunked": CHUNKED},
            "refusals": {"keyed_url": ws_base(keyed) + "/v1/audio/speech/stream",
                         "gateway_url": ws_base(catalogue) + "/v1/audio/speech/stream"},
            # Synthetic audio, whose word times are exact by construction.
            "word_timestamps": {"reply": TIMED_REPLY, "gateway_url": ws_base(catalogue) + "/v1/audio/speech/stream"},
        }
        result = run_in_adapter_env("livekit", SCRIPTS / "baseten_scenarios.py",
                                    ws_base(server) + "/v1/audio/speech/stream", json.dumps(plan), timeout=240)
        line = next(line for line in result.stdout.splitlines() if line.startswith("RESULTS "))
        observed = json.loads(line[len("RESULTS "):])
        yield observed, backend, server, keyed


def scenario(run, name: str) -> dict:
    observed = run[0][name]
    assert "error" not in observed, observed["error"]
    return observed


@pytest.fixture(scope="module")
def piper_samples():
    """Samples Piper makes for a sentence at its own 22.05 kHz."""
    piper = PiperSynthesizer()
    asyncio.run(piper.start())

    async def count(sentence: str) -> int:
        request = SynthesisRequest(text=sentence, voice=piper.default_voice)
        return sum([len(chunk.pcm) async for chunk in piper.synthesize(request)]) // 2

    return lambda sentences: sum(asyncio.run(count(s)) for s in sentences)


def assert_24khz_speech(audio: dict, native_samples: int, sentences: int) -> None:
    """Whole 24 kHz mono audio, as long as Piper's audio resampled from 22.05 kHz (not mistimed). livekit's
    AudioEmitter may end a segment with a 10 ms silent marker frame of its own (when no audio frame is left
    to mark final), hence the one-sided allowance."""
    assert audio["sample_rates"] == [OUTPUT_RATE] and audio["channels"] == [1]
    assert audio["bytes"] == 2 * audio["samples"]
    expected = native_samples * OUTPUT_RATE / PIPER_RATE
    marker = OUTPUT_RATE // 100
    assert -40 * sentences <= audio["samples"] - expected <= 40 * sentences + marker, (audio["samples"], expected)


def test_replies_stream_at_24_khz_on_one_reused_socket(run, piper_samples):
    observed = scenario(run, "conversation")
    first, second = observed["replies"]
    assert_24khz_speech(first, piper_samples(["Hello there.", "This is the first reply."]), 2)
    assert_24khz_speech(second, piper_samples([REPLIES[1]]), 1)
    assert not [m for m in observed["plugin_warnings"] if "sample_rate" in m], observed["plugin_warnings"]


def test_keepalive_is_answered_and_the_socket_stays_in_use(run, piper_samples):
    observed = scenario(run, "conversation")
    assert observed["keepalives"] == [True], "an empty input.done must get session.done"
    assert observed["parked_after_keepalive"], "the plugin drops a socket whose keep-alive went unanswered"
    assert observed["reply_after_keepalive"]["sha256"] == observed["replies"][0]["sha256"]
    # Replies, keep-alive and the interrupted reply: one session; the interrupted socket is discarded by the
    # plugin, so the reply after it and synthesize() share a second one. Exactly 2 because the scenario runs
    # one keep-alive, between replies: a turn starting while a keep-alive has the socket out dials its own.
    _, _, server, _ = run
    assert metric(server, "voxgate_sessions_total") == 2


def test_interrupt_stops_synthesis_and_the_next_reply_is_whole(run, piper_samples):
    observed = scenario(run, "conversation")
    _, backend, _, _ = run
    assert 0 < observed["interrupted"]["samples"]
    long_sentences = [r for r in backend.records if "long reply" in r.text]
    assert long_sentences and len(long_sentences) < 6, "sentences after the interruption must not be made"
    assert_24khz_speech(observed["after_interrupt"], piper_samples([AFTER]), 1)


def test_synthesize_works(run, piper_samples):
    assert_24khz_speech(scenario(run, "conversation")["synthesize"], piper_samples([CHUNKED]), 1)


def test_a_wrong_key_is_refused_once_not_retried(run):
    refused = scenario(run, "refusals")["wrong_key"]
    assert refused["raised"] == "APIStatusError" and refused["status"] == 401 and refused["retryable"] is False
    assert refused["error_events"] == [False], "the plugin retried a refusal that cannot succeed"
    _, _, _, keyed = run
    assert metric(keyed, "voxgate_sessions_total") == 0, "refused at the upgrade: no session was opened"


def test_voice_list_and_voice_add_answer_in_the_plugins_shape(run):
    observed = scenario(run, "refusals")
    assert observed["voices"] == {"type": "voice.list", "voices": ["tone-low", "tone-mid", "tone-high"],
                                  "uploaded_voices": []}
    assert observed["voice_add"].startswith("voice.add failed: voice.add: the synthetic backend cannot clone")


def test_word_timestamps_give_the_plugin_a_working_aligned_transcript(run):
    """`baseten.TTS(word_timestamps=True)` asks for `timestamp_type: "word"` with the "sync" strategy and
    reads audio.done's `timestamp_info.word_alignment`: its timed transcript is every word, at the time the
    synthetic backend put it, from the start of the reply's audio."""
    observed = scenario(run, "word_timestamps")
    assert observed["aligned_transcript"] is True
    synth = SyntheticSynthesizer()
    expected, offset = [], 0.0
    for sentence in TIMED_SENTENCES:
        samples = len(synth.render(SynthesisRequest(text=sentence, voice=synth.default_voice)))
        expected += [(f"{t.word} ", offset + t.start / OUTPUT_RATE, offset + t.end / OUTPUT_RATE)
                     for t in synth.word_timings(sentence, samples)]
        offset += samples / OUTPUT_RATE
    words = observed["words"]
    assert [w["text"] for w in words] == [text for text, _, _ in expected]
    for word, (_, start, end) in zip(words, expected):
        assert (word["start"], word["end"]) == pytest.approx((start, end), abs=2e-6), word["text"]
    assert observed["samples"] == round(offset * OUTPUT_RATE)
