"""What the web demo tells its user, in real headless Chromium against a real gateway
(clients/js/test/web_demo_feedback.mjs): the status pill follows /ready, the gateway's warnings are shown,
the Underruns tile counts the silences a listener hears between sentences, and the page keeps animating
whatever one of its draws throws."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gateway_server import running_gateway
from tests.js_fixtures import JS_CLIENT_DIR, require_chromium, require_node, require_npm_packages, run_node_json
from tests.test_web_demo import png_size
from tts_backend.synthetic import SyntheticSynthesizer

REPO = Path(__file__).resolve().parent.parent
SCRIPT = JS_CLIENT_DIR / "test" / "web_demo_feedback.mjs"
TEXT = "Hello from the browser. The worklet plays every sample. Nothing should underrun here!"


@pytest.fixture(scope="module", autouse=True)
def browser_tools() -> None:
    require_node()
    require_npm_packages()
    require_chromium()


def checked(result: dict) -> dict:
    assert result.get("failure") is None, result.get("failure")
    return result


class LoadsWhenTold(SyntheticSynthesizer):
    """A backend that loads like a real model: /ready answers 503 until the page has been seen saying so
    (the browser script then creates `loaded`), not after a delay a slow machine could outrun."""

    def __init__(self, loaded: Path):
        super().__init__()
        self.loaded_file = loaded
        self.loaded = False

    async def start(self):
        while not self.loaded_file.exists():
            await asyncio.sleep(0.02)
        self.loaded = True

    @property
    def ready(self):
        return self.loaded


def test_the_pill_says_ready_only_once_the_gateway_is(tmp_path):
    """It said "ready" as soon as the voice list answered, which a loading gateway does, and never looked
    again. Now it says "starting…" while /ready answers 503 and turns "ready" once /ready does."""
    loaded = tmp_path / "loaded"
    with running_gateway(LoadsWhenTold(loaded), ready_path="/health") as server:
        result = checked(run_node_json(SCRIPT, "readiness", server.url, str(loaded), timeout=90))
    loading = result["whileLoading"]
    assert loading["readiness"] == "starting" and loading["pill"] == "starting…" and loading["status"] == "busy"
    assert any("gateway starting" in line for line in loading["log"])
    ready = result["afterLoading"]
    assert ready["readiness"] == "ready" and ready["pill"] == "ready"
    assert result["pageErrors"] == []


def test_the_gateway_warnings_are_shown(browser_tools):
    """Chinese text to the English default voice (language_unsupported, per sentence, in audio.start) and
    a voice the gateway does not have (voice_fallback, in session.started) are shown beside the controls;
    the page's own best-effort request for token splitting, which Piper cannot do, is only logged."""
    with running_gateway("piper") as server:
        result = checked(run_node_json(SCRIPT, "warnings", server.url, timeout=120))
    chinese = result["chinese"]
    assert chinese["utterance"]["outcome"] == "played"
    (shown,) = chinese["shownWarnings"]
    assert shown.startswith("Sentences 1, 2: the text looks Chinese") and shown.endswith("(language_unsupported)")
    assert any("warning option_ignored: split_granularity" in line for line in chinese["log"])
    fallback = result["fallback"]
    assert fallback["utterance"]["outcome"] == "played"
    assert fallback["shownWarnings"] == [
        "voice 'gone-voice' is not available here; speaking with the default voice 'en_US-joe-medium'"
        " (see voices for the ones there are) (voice_fallback)"]
    assert not result["warningsBox"]["hidden"] and "voice_fallback" in result["warningsBox"]["text"]
    assert result["pageErrors"] == []


def test_the_underruns_tile_counts_a_late_sentence_s_silence():
    """Each sentence's audio comes 1.5 s after its synthesis starts, one sentence at a time: the second
    sentence starts a second or more after the short first one ended. The listener hears that silence; the
    tile counted 0 (the worklet counts only running dry inside a sentence as an underrun)."""
    backend = SyntheticSynthesizer(speed=3.0, chars_per_second=45.0, first_chunk_delay_s=1.5)
    with running_gateway(backend=backend) as server:
        result = checked(run_node_json(SCRIPT, "gap", server.url, "Hi. This second sentence comes late.", timeout=90))
    played = result["played"]
    player, sentences = played["player"], played["utterance"]["sentences"]
    assert played["utterance"]["outcome"] == "played" and len(sentences) == 2
    assert player["underruns"] == 0 and player["gaps"] == 1
    assert played["underrunsTile"] == "1"
    assert sentences[0]["gapBeforeMs"] is None and 700 <= sentences[1]["gapBeforeMs"] <= 5000
    assert any("ms of silence before sentence 2" in line for line in played["log"])
    assert result["pageErrors"] == []


def test_no_gap_is_counted_where_the_audio_keeps_up():
    """The same text from a backend without the delay: the sentences follow each other, nothing to count."""
    backend = SyntheticSynthesizer(speed=3.0, chars_per_second=45.0)
    with running_gateway(backend=backend) as server:
        result = checked(run_node_json(SCRIPT, "gap", server.url, "Hi. This second sentence comes late.", timeout=90))
    played = result["played"]
    assert played["player"]["gaps"] == 0 and played["underrunsTile"] == "0"


def test_the_animation_goes_on_whatever_a_draw_throws():
    """One roundRect exception (a negative radius, from a timeline canvas laid out without width) stopped
    the animation loop for good: no more word highlighting, timeline or buffer chart. Now that canvas draws
    nothing, and any draw that throws is reported once while the rest of the frame and the next frames go
    on."""
    backend = SyntheticSynthesizer(speed=3.0, chars_per_second=45.0)
    with running_gateway(backend=backend) as server:
        result = checked(run_node_json(SCRIPT, "draw", server.url, TEXT, timeout=120))
    zero = result["zeroWidth"]["utterance"]
    assert result["zeroWidthErrors"] == {"pageErrors": [], "consoleErrors": []}
    assert [h["word"] for h in zero["highlights"]][-1] == TEXT.split()[-1]
    throwing = result["throwing"]["utterance"]
    assert result["pageErrors"] == []
    assert len(result["consoleErrors"]) == 1 and "the timeline failed to draw" in result["consoleErrors"][0]
    assert any("the timeline failed to draw: roundRect refused" in line for line in result["throwing"]["log"])
    assert throwing["highlights"][-1]["word"] == TEXT.split()[-1]
    assert result["sparklineMoved"], "the jitter-buffer chart stopped"


def test_the_readme_picture_has_a_command_of_its_own(tmp_path):
    """README's picture is taken on purpose (docs/web_demo_screenshot.py), not as a side effect of a test
    run: the command starts the default gateway, speaks the page's own text and writes a 1280 x 900 PNG
    where it is told, saying what the listener heard. (On a busy machine it refuses, without
    --accept-busy, a picture with silences in it: that is for a person to run when the machine is idle.)"""
    picture = tmp_path / "page.png"
    completed = subprocess.run([sys.executable, str(REPO / "docs" / "web_demo_screenshot.py"), "--output", str(picture),
                                "--attempts", "1", "--accept-busy"], capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert re.search(r"attempt 1: S1 plays at \d+ ms, S2 plays at \d+ ms", completed.stdout), completed.stdout
    assert png_size(picture) == (1280, 900) and picture.stat().st_size > 20_000
