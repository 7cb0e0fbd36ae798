"""The web demo in real headless Chromium, loaded from a real gateway.

Debian's Chromium (/usr/bin/chromium) driven by playwright-core from npm (no browser download) opens the
page the gateway serves at `/`, speaks a text, barges in on a second one and speaks a third
(clients/js/test/web_demo_check.mjs). The gateway runs the synthetic backend (deterministic tones, named
as such, 3x faster than real time), so every sentence's expected length is known exactly: the AudioWorklet
must receive exactly those samples, play all of them after resampling to the audio context's rate, and
never underrun; after the interrupt nothing more may play.

The page is measured and screenshotted at desktop, small-laptop and phone (390 px) widths
(clients/js/test/layout.mjs), and its errors (no gateway, a gateway that wants a key, no text) are driven
at phone width (web_demo_errors.mjs). The screenshots go to pytest's temporary folder (their path is in
each report).

The page on the default gateway (Piper: its long voice name, words espeak runs together, audio sent
faster than real time) runs web_demo_piper.mjs: short replies must finish only once played, every word be highlighted,
a barge-in report the words heard, the clone panel say what cloning needs; it also draws the page as
README's picture shows it, into the temporary folder too. A test run changes nothing in the checkout: the
committed picture, docs/web_demo.png, is refreshed by its own command, `python docs/web_demo_screenshot.py`.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pytest

from tests.gateway_server import free_port, running_gateway
from tests.js_fixtures import (
    JS_CLIENT_DIR,
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
API_KEY = "page-test-key"


@pytest.fixture(scope="module")
def backend() -> SyntheticSynthesizer:
    return SyntheticSynthesizer(speed=3.0, chars_per_second=45.0)


@pytest.fixture(scope="module")
def browser_tools() -> None:
    require_node()
    require_npm_packages()
    require_chromium()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("web-demo-screenshots")


@pytest.fixture(scope="module")
def run(backend, browser_tools, screenshots) -> dict:
    with running_gateway(backend=backend) as server:
        return run_node_json(
            JS_CLIENT_DIR / "test" / "web_demo_check.mjs",
            server.url,
            str(screenshots),
            VOICE,
            TEXT,
            LONG_TEXT,
            timeout=100,
        )


@pytest.fixture(scope="module")
def errors(backend, browser_tools, screenshots) -> dict:
    """The page served by a gateway that wants an API key, and pointed (once) at a port where nothing listens."""
    with running_gateway(backend=backend, api_keys=[API_KEY]) as server:
        result = run_node_json(
            JS_CLIENT_DIR / "test" / "web_demo_errors.mjs",
            server.url,
            f"http://127.0.0.1:{free_port()}",
            str(screenshots),
            API_KEY,
            timeout=100,
        )
    assert result.get("failure") is None, result.get("failure")
    assert result["pageErrors"] == []
    return result


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


def test_the_page_asks_for_synthesis_from_each_sentences_first_words_and_says_what_it_got(run):
    played = run["played"]
    # The synthetic backend takes text while it speaks.
    assert played["warnings"] == [] and played["textStreaming"] is True
    started = [line for line in played["log"] if "session.started" in line]
    assert started and all("synthesis from each sentence's first words" in line for line in started)


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


def test_the_word_being_played_is_highlighted(run):
    """The page asks for word timestamps and highlights each word while the audio clock is inside it: the
    highlight moves forward through the words, never back, and never ahead of the audio."""
    utterance = run["played"]["utterance"]
    words = utterance["words"]
    assert " ".join(w["word"] for w in words) == TEXT
    highlights = utterance["highlights"]
    order = [(h["number"], h["index"]) for h in highlights]
    assert order == sorted(set(order)), "the highlight went back or stayed behind"
    # At 60 frames a second every word of at least one frame is seen; allow a loaded machine to skip some.
    assert len(highlights) >= len(words) * 2 // 3 and highlights[-1]["number"] == 3
    by_number = {s["number"]: s for s in utterance["sentences"]}
    for highlight in highlights:
        word = [w for w in words if w["number"] == highlight["number"]][highlight["index"]]
        assert word["word"] == highlight["word"]
        # Not before the word's audio plays: the sentence's start as the page saw it (a message from the
        # worklet, so a little late) plus the word's start, less that lateness.
        assert highlight["at"] >= by_number[highlight["number"]]["playAt"] + word["start"] * 1000 - 250
    assert utterance["highlighted"] == highlights[-1]["word"]  # the page shows the word it last highlighted


def test_no_word_is_highlighted_after_the_interrupt(run):
    after, later = run["afterInterrupt"]["utterance"], run["later"]["utterance"]
    assert after["highlights"], "words were highlighted while the long text played"
    assert later["highlights"] == after["highlights"]
    spoken = {(w["number"], w["word"]) for w in after["words"]}
    assert all((h["number"], h["word"]) in spoken for h in after["highlights"])


def test_session_keeps_working_after_barge_in(backend, run):
    final = run["afterBargeIn"]
    utterance, player = final["utterance"], final["player"]
    assert utterance["outcome"] == "played" and utterance["contextId"] == "utt-3"
    assert [s["text"] for s in utterance["sentences"]] == ["And we are back."]
    assert utterance["samples"] == samples_of(backend, "And we are back.")
    assert player["underruns"] == 0 and player["bufferedFrames"] == 0


def png_size(path: str | Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk."""
    header = Path(path).read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and header[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", header[16:24])


def assert_layout_sound(report: dict) -> None:
    """What layout.mjs measured where the screenshot was taken: nothing wider than the viewport, no text
    cut, every control whole, tall enough to tap and clear of the others."""
    width = report["viewport"]["width"]
    assert report["scrollWidth"] <= width, f"the page scrolls sideways: {report['scrollWidth']} px in {width}"
    assert report["outside"] == [], "elements stick out of the viewport"
    assert report["clipped"] == [], "text cut off by its box"
    assert report["selectsCut"] == [], "a select's chosen option does not fit"
    assert report["small"] == [], "controls too small to tap"
    assert report["overlapping"] == [], "controls cover each other"
    assert report["controls"] >= 8


@pytest.mark.parametrize("width", [1280, 960, 390])
def test_layout_at_desktop_laptop_and_phone_widths(run, width):
    assert run.get("failure") is None, run.get("failure")
    report = run["layout"][str(width)]
    assert report["viewport"]["width"] == width
    assert_layout_sound(report)
    # The full-page screenshot is as wide as the viewport: nothing made the page wider.
    shot_width, shot_height = png_size(report["screenshot"])
    assert shot_width == width and shot_height >= report["viewport"]["height"]
    assert Path(report["screenshot"]).stat().st_size > 20_000, "blank screenshot"


def test_phone_width_keeps_every_step_usable(run):
    """Barge-in, the next utterance and the mu-law session ran at 390 px: every click found its control
    visible and unobstructed (playwright refuses otherwise), and the run went to the end."""
    assert run.get("failure") is None, run.get("failure")
    assert run["mulaw"]["utterance"]["outcome"] == "played"
    # The page after the barge-in (dropped sentences, the barge-in mark) fits too.
    interrupted = run["layoutInterrupted"]
    assert_layout_sound(interrupted)
    assert png_size(interrupted["screenshot"])[0] == 390


def test_received_and_played_counters_use_one_unit(backend, run):
    """Both counters show seconds of audio at the audio context's rate, so once everything has played
    they read the same (they used to show stream-rate samples against context-rate frames: 2x apart)."""
    played = run["played"]
    counters = played["counters"]
    total = sum(samples_of(backend, s["text"]) for s in played["utterance"]["sentences"])
    assert counters["received"] == counters["played"]
    assert counters["played"].endswith(" s")
    assert abs(float(counters["played"][:-2]) - total / played["streamRate"]) <= 0.01
    # After the barge-in only what played counts as played; what was dropped was still received.
    later = run["later"]["counters"]
    assert float(later["received"][:-2]) > float(later["played"][:-2])
    # The next utterance counts its own audio: the two agree again once it has played (they used to stay
    # apart for the rest of the page's life, by the audio the interrupt dropped).
    back = run["afterBargeIn"]
    counters = back["counters"]
    assert counters["received"] == counters["played"]
    assert abs(float(counters["played"][:-2]) - back["utterance"]["samples"] / back["streamRate"]) <= 0.01


def test_the_interrupt_tells_the_gateway_what_was_heard(run):
    """The synthetic backend sends three times faster than real time, so at the cut the page has received
    far more than it played. The cancel carries the played position (played_ms), and context.cancelled's
    spoken_text is the words whose end that position reached: computed here from the words' times and the
    sentences' lengths, and fewer than the words the gateway had sent."""
    utterance = run["later"]["utterance"]
    played_ms = utterance["playedMs"]
    assert played_ms is not None and played_ms > 0
    rate = run["later"]["streamRate"]
    offsets, offset = {}, 0.0
    for sentence in utterance["sentences"]:
        offsets[sentence["number"]] = offset
        offset += sentence["samples"] / rate
    heard = [w["word"] for w in utterance["words"] if offsets[w["number"]] + w["end"] <= played_ms / 1000 + 0.001]
    assert heard, "nothing had been heard at the cut"
    assert utterance["heardText"] == " ".join(heard)
    assert len(heard) < len(utterance["words"]), "the gateway had sent no more than was heard"
    # What played by the worklet's count, in the interrupted utterance: the same position.
    later, base = run["later"]["player"], utterance["counterBase"]
    assert abs((later["framesPlayed"] - base["played"]) / run["later"]["contextRate"] * 1000 - played_ms) <= 5


def test_sentence_numbers_restart_with_each_utterance(run):
    first = run["played"]
    assert [row[0] for row in first["rows"]] == ["1", "2", "3"]
    assert [s["number"] for s in first["utterance"]["sentences"]] == [1, 2, 3]
    # The barged-in utterance and the one after it count from 1 again (the session's indices go on).
    second = run["beforeInterrupt"]
    assert second["rows"][0][0] == "1" and second["utterance"]["sentences"][0]["index"] >= 3
    third = run["afterBargeIn"]
    assert [row[:2] for row in third["rows"]] == [["1", "And we are back."]]
    assert third["utterance"]["sentences"][0]["index"] > 3


def assert_notice_in_view(step: dict, kind: str) -> None:
    """The error is on show, inside the part of the page the user sees, in the error colours."""
    notice = step["snapshot"]["notice"]
    assert notice is not None and notice["kind"] == kind
    layout = step["layout"]
    assert layout["notice"] is not None and layout["notice"]["inView"], layout["notice"]
    assert layout["notice"]["text"] == notice["text"]
    assert layout["notice"]["color"] == "rgb(254, 242, 242)"
    assert_layout_sound(layout)
    assert png_size(layout["screenshot"]) == (390, 844)


def test_unreachable_gateway_is_shown_where_the_user_looks(errors):
    on_load, on_speak = errors["unreachableOnLoad"], errors["unreachableOnSpeak"]
    assert_notice_in_view(on_load, "unreachable")
    assert "Cannot reach the gateway at http://127.0.0.1:" in on_load["snapshot"]["notice"]["text"]
    assert on_load["snapshot"]["status"] == "error"
    # Speak tries the WebSocket, fails the same way, and the notice is in view beside the Speak button.
    assert_notice_in_view(on_speak, "unreachable")
    assert on_speak["snapshot"]["sessionId"] is None


def test_401_asks_for_the_key_and_retries_with_it(errors):
    on_load = errors["authOnLoad"]
    assert_notice_in_view(on_load, "auth")
    assert "needs an API key" in on_load["snapshot"]["notice"]["text"]
    assert on_load["layout"]["focused"] == "api-key"  # the key field has the cursor
    # Speak without a key: the WebSocket is refused and the page still asks for the key.
    assert_notice_in_view(errors["authOnSpeak"], "auth")
    assert errors["authOnSpeak"]["snapshot"]["sessionId"] is None
    # A wrong key is refused, and said so.
    assert_notice_in_view(errors["wrongKey"], "auth")
    assert "refused this API key" in errors["wrongKey"]["snapshot"]["notice"]["text"]
    # The right key: the notice goes, the voices load, and the Speak that was refused plays.
    right = errors["rightKey"]["snapshot"]
    assert right["notice"] is None and right["status"] == "live"
    assert errors["voiceOptions"] == ["tone-low", "tone-mid", "tone-high"]
    assert right["utterance"]["outcome"] == "played"
    assert [s["text"].strip() for s in right["utterance"]["sentences"]] == ["Spoken once the key is given."]


def test_empty_text_is_refused_visibly(errors):
    empty = errors["empty"]
    assert_notice_in_view(empty, "empty")
    assert empty["textInvalid"] == "true"
    # Nothing was sent: the last utterance is still the one spoken before.
    assert empty["snapshot"]["utterance"]["contextId"] == errors["rightKey"]["snapshot"]["utterance"]["contextId"]
    assert errors["afterTyping"]["notice"] is None


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


def test_a_voice_is_cloned_from_a_clip_and_spoken_on_the_page(browser_tools, tmp_path):
    """On a gateway whose backend clones (tests/cloning_fixtures.py's test backend; the synthetic one cannot,
    and the page then offers no cloning panel), the page registers a chosen clip as a voice and speaks it."""
    from tests.cloning_fixtures import PitchCloneSynthesizer, encode_clip, tone_clip

    clip = tmp_path / "me.wav"
    clip.write_bytes(encode_clip(tone_clip(210.0, 4.0, 44100, 2), 44100, "wav"))
    with running_gateway(backend=PitchCloneSynthesizer()) as server:
        result = run_node_json(JS_CLIENT_DIR / "test" / "web_demo_clone.mjs", server.url, str(clip), "page-voice",
                               timeout=100)
    assert result.get("failure") is None, result.get("failure")
    assert result["pageErrors"] == []
    assert "consent" in result["withoutConsent"]
    assert result["status"] == "voice page-voice added and selected" and result["selected"] == "page-voice"
    assert any("session.started: voice page-voice" in line for line in result["log"]) and result["played"] > 0
    assert result["recordedStatus"] == "voice page-voice-recorded added and selected"
    assert result["recordedSelected"] == "page-voice-recorded"


def test_the_page_offers_no_cloning_where_the_backend_cannot_clone(run):
    assert run["cloneOffered"] is False


# ------------------------------------------------------------------------------------------ Piper

PIPER_SHORT = "Hi."
SHORT_RUNS = 6
# espeak runs "For an" together as one spoken word; Piper once timed "an" with zero length here.
MERGED_WORDS_TEXT = "For an instant he saw Pierre drawn like a silhouette against the sky."
README_SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "web_demo.png"


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def piper_run(browser_tools, screenshots) -> dict:
    """The page on the default gateway (Piper), drawn as README shows it into the temporary folder
    (`readmeView`); `committedPicture` is docs/web_demo.png's digest before and after the run."""
    readme_view = screenshots / "web-demo-readme-view.png"
    before = file_digest(README_SCREENSHOT)
    with running_gateway("piper") as server:
        result = run_node_json(JS_CLIENT_DIR / "test" / "web_demo_piper.mjs", server.url, str(screenshots),
                               str(readme_view), PIPER_SHORT, str(SHORT_RUNS), MERGED_WORDS_TEXT,
                               timeout=150)
    assert result.get("failure") is None, result.get("failure")
    assert result["pageErrors"] == []
    return {**result, "readmeView": readme_view, "committedPicture": (before, file_digest(README_SCREENSHOT))}


def test_a_short_reply_finishes_only_once_it_has_played(piper_run):
    """'playback finished' (and Interrupt disabled) came while a short reply was still playing, in 6 of 8
    runs: the page read a worklet report that predated the reply's audio. Now the worklet itself says when
    everything written has played: at that moment its counters hold every frame of the reply, played."""
    runs = piper_run["short"]
    assert len(runs) == SHORT_RUNS
    for run in runs:
        assert run["outcome"] == "played" and run["interruptDisabled"]
        (sentence,) = run["sentences"]
        assert sentence["playAt"] is not None, f"finished before its audio began to play: {run}"
        end, base = run["endStats"], run["counterBase"]
        frames = sentence["samples"] * end["contextRate"] / 24000
        assert abs(end["framesQueued"] - base["queued"] - frames) <= 2, "finished before the reply reached the player"
        assert end["framesPlayed"] == end["framesQueued"] and end["bufferedFrames"] == 0, "finished while playing"


def test_words_run_together_are_each_timed_and_highlighted(piper_run):
    utterance = piper_run["words"]
    words = utterance["words"]
    assert [w["word"] for w in words] == MERGED_WORDS_TEXT.split()
    assert all(w["start"] < w["end"] for w in words), words  # each has its share of the merged sound
    assert [h["word"] for h in utterance["highlights"]] == [w["word"] for w in words]


def test_the_default_voice_and_whole_sentences_fit_a_phone(piper_run):
    assert piper_run["voice"] == "en_US-joe-medium"
    assert_layout_sound(piper_run["layout"])
    assert_layout_sound(piper_run["desktopLayout"])


def test_a_barge_in_on_piper_reports_the_words_heard_not_the_words_sent(piper_run):
    """Piper sends a sentence faster than real time: cut 1.5 s into the page's second sentence, the
    gateway had sent more words than had played. spoken_text is a prefix of the text, and ends within the
    second sentence."""
    utterance = piper_run["interrupted"]
    heard = utterance["heardText"].split()
    text = " ".join(utterance["sentences"][i]["text"].strip() for i in range(len(utterance["sentences"])))
    assert heard and text.split()[: len(heard)] == heard
    first = utterance["sentences"][0]["text"].split()
    assert len(first) < len(heard) < len(first) + len(utterance["sentences"][1]["text"].split())
    assert len(heard) < len(utterance["words"]), "no more words had been sent than heard"


def test_the_clone_panel_says_what_cloning_needs_where_the_backend_cannot_clone(piper_run):
    clone = piper_run["clone"]
    assert clone["shown"] and not clone["offered"]
    assert "Qwen3-TTS Base checkpoint" in clone["unavailable"]


def test_the_page_draws_at_the_readme_pictures_size_and_the_run_leaves_the_picture_alone(piper_run):
    """README shows docs/web_demo.png, taken by `python docs/web_demo_screenshot.py` on an idle machine; the
    test run draws the same view into its temporary folder and does not touch the committed picture (it
    rewrote it on every run, leaving the checkout modified)."""
    view = piper_run["readmeView"]
    assert png_size(view) == (1280, 900) and 20_000 < view.stat().st_size < 400_000
    before, after = piper_run["committedPicture"]
    assert before == after, "the test run rewrote docs/web_demo.png"
    assert png_size(README_SCREENSHOT) == (1280, 900)
    assert "(docs/web_demo.png)" in (README_SCREENSHOT.parent.parent / "README.md").read_text()
