"""The web demo in real headless Chromium, loaded from a real gateway.

Debian's Chromium (/usr/bin/chromium) driven by playwright-core from npm (no browser download) opens the
page the gateway serves at `/`, speaks a text, barges in on a second one and speaks a third
(clients/js/test/web_demo_check.mjs). The gateway runs the synthetic backend (deterministic tones, named
as such, 3x faster than real time), so every sentence's expected length is known exactly: the AudioWorklet
must receive exactly those samples, play all of them after resampling to the audio context's rate, and
never underrun; after the interrupt nothing more may play. Screenshots of the last run go to
web_demo/screenshots/latest/.
"""

from __future__ import annotations

import pytest

from tests.gateway_server import running_gateway
from tests.js_fixtures import (
    JS_CLIENT_DIR,
    REPO,
    require_chromium,
    require_node,
    require_npm_packages,
    run_node_json,
)
from tts_backend.base import SynthesisRequest
from tts_backend.synthetic import SyntheticSynthesizer

VOICE = "tone-mid"
TEXT = "Hello from the browser. The worklet plays every sample. Nothing should underrun here!"
LONG_SENTENCE = "This is a longer sentence that keeps the speaker busy for a while."
LONG_TEXT = " ".join([LONG_SENTENCE] * 8)
SCREENSHOTS = REPO / "web_demo" / "screenshots" / "latest"


@pytest.fixture(scope="module")
def backend() -> SyntheticSynthesizer:
    return SyntheticSynthesizer(speed=3.0, chars_per_second=45.0)


@pytest.fixture(scope="module")
def browser_tools() -> None:
    require_node()
    require_npm_packages()
    require_chromium()


@pytest.fixture(scope="module")
def run(backend, browser_tools) -> dict:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with running_gateway(backend=backend) as server:
        return run_node_json(
            JS_CLIENT_DIR / "test" / "web_demo_check.mjs",
            server.url,
            str(SCREENSHOTS),
            VOICE,
            TEXT,
            LONG_TEXT,
            timeout=100,
        )


def samples_of(backend: SyntheticSynthesizer, text: str) -> int:
    # The demo sends no seed, so the gateway asks the backend with seed None.
    return len(backend.render(SynthesisRequest(text=text, voice=VOICE)))


def expected_frames(samples: int, stream_rate: int, context_rate: int) -> float:
    return samples * context_rate / stream_rate


def test_page_loads_from_the_gateway_without_errors(run):
    assert run.get("failure") is None, run.get("failure")
    assert run["pageStatus"] == 200
    assert run["pageErrors"] == [] and run["consoleErrors"] == []
    assert run["voiceOptions"] == ["tone-low", "tone-mid", "tone-high"]


def test_worklet_receives_and_plays_every_sample_without_underrun(backend, run):
    played = run["played"]
    utterance, player = played["utterance"], played["player"]
    assert played["streamRate"] == 24000 and played["format"] == "pcm"
    assert utterance["outcome"] == "played" and utterance["finished"]
    sentences = utterance["sentences"]
    assert " ".join(s["text"].strip() for s in sentences) == TEXT
    assert utterance["serverSentences"] == len(sentences) == 3
    expected_total = 0
    for sentence in sentences:
        expected = samples_of(backend, sentence["text"])
        expected_total += expected
        assert sentence["samples"] == expected
        assert sentence["bytes"] == sentence["totalBytes"] == 2 * expected
    # What the server sent, what the page decoded and what the AudioWorklet received all agree.
    assert utterance["bytes"] == 2 * expected_total
    assert utterance["samples"] == player["samplesReceived"] == expected_total
    # All of it played, resampled to the audio context's rate, with no underrun.
    assert player["underruns"] == 0 and player["underrunFrames"] == 0
    assert player["framesPlayed"] == player["framesQueued"]
    frames = expected_frames(expected_total, played["streamRate"], played["contextRate"])
    assert abs(player["framesPlayed"] - frames) <= 2
    assert player["bufferedFrames"] == 0 and player["state"] == "idle"
    # Timing: every sentence was heard after its first byte arrived, in order.
    assert 0 < player["firstChunkMs"] <= player["ttfaMs"]
    plays = [s["playAt"] for s in sentences]
    assert all(s["firstAudioAt"] is not None and s["playAt"] >= s["firstAudioAt"] for s in sentences)
    assert plays == sorted(plays)


def test_interrupt_stops_audio_at_once(backend, run):
    before, after, later = run["beforeInterrupt"], run["afterInterrupt"], run["later"]
    assert before["utterance"]["contextId"] == "utt-2"
    assert before["player"]["state"] == "playing" and before["player"]["bufferedFrames"] > 0
    # The queue is gone the moment the interrupt lands ...
    assert after["utterance"]["outcome"] == "interrupted"
    assert after["player"]["interrupts"] == 1 and after["player"]["droppedFrames"] > 0
    assert after["player"]["bufferedFrames"] == 0 and after["player"]["state"] == "idle"
    # ... and 700 ms later not one more frame has played or been received for the cancelled context.
    assert later["utterance"]["cancelAcknowledged"] is True
    assert later["player"]["framesPlayed"] == after["player"]["framesPlayed"]
    assert later["player"]["samplesReceived"] == after["player"]["samplesReceived"]
    assert later["player"]["state"] == "idle" and later["player"]["underruns"] == 0
    # The server stopped too: the utterance never completed and less than its full audio arrived.
    assert later["utterance"]["finished"] is False
    assert later["utterance"]["samples"] < 8 * samples_of(backend, LONG_SENTENCE)


def test_session_keeps_working_after_barge_in(backend, run):
    final = run["afterBargeIn"]
    utterance, player = final["utterance"], final["player"]
    assert utterance["outcome"] == "played" and utterance["contextId"] == "utt-3"
    assert [s["text"] for s in utterance["sentences"]] == ["And we are back."]
    assert utterance["samples"] == samples_of(backend, "And we are back.")
    assert player["underruns"] == 0 and player["bufferedFrames"] == 0


def test_screenshots_saved(run):
    for name in ("web-demo-played.png", "web-demo-interrupted.png"):
        path = SCREENSHOTS / name
        assert path.stat().st_size > 20_000, f"{path} is missing or blank"


def test_mulaw_8k_is_decoded_and_resampled_in_the_browser(backend, run):
    final = run["mulaw"]
    utterance, player = final["utterance"], final["player"]
    assert final["format"] == "mulaw" and final["streamRate"] == 8000 and final["bytesPerSample"] == 1
    assert final["sessionId"] != run["afterBargeIn"]["sessionId"]  # new settings, new session
    assert utterance["outcome"] == "played"
    (sentence,) = utterance["sentences"]
    # One byte per sample on the wire; the gateway resampled 24 kHz to 8 kHz (soxr, so +-1 sample).
    assert sentence["bytes"] == sentence["totalBytes"] == sentence["samples"] == utterance["samples"]
    assert abs(sentence["samples"] - samples_of(backend, sentence["text"]) / 3) <= 2
    # The worklet counts across the page's life: this utterance added exactly its samples.
    previous = run["afterBargeIn"]["player"]
    assert player["samplesReceived"] - previous["samplesReceived"] == sentence["samples"]
    added_frames = player["framesPlayed"] - previous["framesPlayed"]
    assert abs(added_frames - sentence["samples"] * final["contextRate"] / 8000) <= 2
    assert player["underruns"] == 0 and player["bufferedFrames"] == 0


def test_underruns_are_counted_when_audio_arrives_slower_than_real_time(browser_tools):
    """The counter behind 'no underrun' can count: a synthetic backend at half real time starves the
    worklet inside the sentence, and every sample still plays once it arrives."""
    slow = SyntheticSynthesizer(speed=0.5, chars_per_second=30.0)
    text = "This sentence arrives at half speed."
    with running_gateway(backend=slow) as server:
        result = run_node_json(JS_CLIENT_DIR / "test" / "underrun_check.mjs", server.url, VOICE, text, timeout=60)
    final = result["snapshot"]
    player = final["player"]
    assert player["underruns"] >= 1 and player["underrunFrames"] > 0
    expected = len(slow.render(SynthesisRequest(text=text, voice=VOICE)))
    assert player["samplesReceived"] == final["utterance"]["samples"] == expected
    assert player["framesPlayed"] == player["framesQueued"]
    assert abs(player["framesPlayed"] - expected * final["contextRate"] / 24000) <= 2
