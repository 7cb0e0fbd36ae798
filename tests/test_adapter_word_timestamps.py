"""Word timestamps through the real voice-agent frameworks (issue 16): voxgate-pipecat reports them with
Pipecat's word-timestamp hooks, voxgate-livekit declares `aligned_transcript` and pushes TimedStrings.

pipecat-ai 1.14.0 and livekit-agents 1.8.9 run in their cached venvs (tests/adapter_env.py) against a real
gateway with the synthetic backend, whose word times are exact by construction. Checked: the words that
reach each framework and their times, and after a barge-in that what the framework records as spoken equals
the words whose audio it had received.
"""

from __future__ import annotations

import pytest

from tests.adapter_fixtures import scenario, scenario_results, synthetic_pcm, ws_base
from tests.gateway_server import running_gateway
from tts_backend.synthetic import SyntheticSynthesizer

pytestmark = pytest.mark.third_party  # a cached venv of third-party packages (tests/conftest.py)


SAMPLE_RATE = 24000
TURN = ["Hello there, how are you?", "The weather is lovely today."]
LONG_TURN = [f"Sentence number {n} of a long reply that the user cuts short." for n in range(1, 7)]
WORDS_BEFORE_CUT = 14  # into the second sentence
# LiveKit's AudioEmitter keeps the last 10 ms of a segment back, to mark the segment's final frame.
EMITTER_TAIL_BYTES = SAMPLE_RATE * 10 // 1000 * 2


def utterance_words(sentences: list[str]) -> list[tuple[str, float, float]]:
    """(word, start, end) of every word in seconds from the start of the utterance's audio: the synthetic
    backend's own timing of each sentence, after the audio of the sentences before it."""
    backend = SyntheticSynthesizer()
    out, offset = [], 0.0
    for sentence in sentences:
        samples = len(synthetic_pcm(sentence)) // 2
        out += [(t.word, offset + t.start / SAMPLE_RATE, offset + t.end / SAMPLE_RATE)
                for t in backend.word_timings(sentence, samples)]
        offset += samples / SAMPLE_RATE
    return out


def heard_words(sentences: list[str], audio_bytes: int) -> list[str]:
    """The words whose audio lies wholly within the first `audio_bytes` of the utterance (24 kHz s16le)."""
    return [w for w, _, end in utterance_words(sentences) if end_byte(end) <= audio_bytes]


def end_byte(seconds: float) -> int:
    """The byte of 24 kHz s16le audio at `seconds` (times on the wire are rounded to the microsecond)."""
    return round(seconds * SAMPLE_RATE) * 2


def assert_timed(actual: list[tuple], expected: list[tuple]) -> None:
    assert [w[0] for w in actual] == [w[0] for w in expected]
    for got, want in zip(actual, expected):
        assert got[1:] == pytest.approx(want[1:], abs=2e-6), got[0]


class UntimedSynthesizer(SyntheticSynthesizer):
    """The synthetic backend without word timings, as a backend that cannot time words (and can do all
    else the synthetic backend does: text streaming too, which the adapters ask for by default)."""

    honours = SyntheticSynthesizer.honours - {"word_timestamps"}


def observe(framework: str, plan: dict) -> dict:
    """What the framework's scenarios observed, by scenario name (each checked for an error)."""
    with scenario_results(framework, lambda forgetful_url: plan) as observed:
        return {name: scenario(observed, name) for name in plan}


@pytest.fixture(scope="module")
def pipecat_runs() -> dict:
    with running_gateway(UntimedSynthesizer(speed=4.0)) as untimed:
        return observe("pipecat", {
            "word_timestamps": {"turn": " ".join(TURN), "long_turn": " ".join(LONG_TURN),
                                "interrupt_after_words": WORDS_BEFORE_CUT},
            "untimed_backend": {"turn": " ".join(TURN), "gateway_url": ws_base(untimed)},
        })


@pytest.fixture(scope="module")
def pipecat(pipecat_runs) -> dict:
    """A whole turn, then one cut after WORDS_BEFORE_CUT words."""
    return pipecat_runs["word_timestamps"]


@pytest.fixture(scope="module")
def livekit() -> dict:
    """A whole reply, then one cut after WORDS_BEFORE_CUT words."""
    return observe("livekit", {"word_timestamps": {"reply": " ".join(TURN), "long_reply": " ".join(LONG_TURN),
                                                   "interrupt_after_words": WORDS_BEFORE_CUT}})["word_timestamps"]


def test_pipecat_words_reach_the_transcript_in_step_with_the_audio(pipecat):
    whole = pipecat["whole"]
    assert [w["word"] for w in whole["words"]] == " ".join(TURN).split()
    assert_timed([(w["word"], w["start"], w["end"]) for w in whole["received"]], utterance_words(TURN))
    # Pipecat times each word frame from the context's first audio: presentation times are spaced exactly as
    # the words' start times (in nanoseconds).
    pts = [w["pts"] for w in whole["words"]]
    starts = [start for _, start, _ in utterance_words(TURN)]
    assert [(p - pts[0]) / 1e9 for p in pts] == pytest.approx([s - starts[0] for s in starts], abs=1e-6)
    assert pipecat["assistant_messages"][0] == " ".join(TURN)
    assert pipecat["errors"] == []


def test_pipecat_records_exactly_the_words_heard_before_a_barge_in(pipecat):
    interrupted = pipecat["interrupted"]
    spoken = [w["word"] for w in interrupted["words"]]
    assert len(spoken) >= WORDS_BEFORE_CUT and spoken == " ".join(LONG_TURN).split()[: len(spoken)]
    # What the assistant's context holds for the interrupted turn: the words whose audio reached Pipecat.
    assert spoken == heard_words(LONG_TURN, interrupted["bytes"])
    assert pipecat["assistant_messages"][1] == " ".join(spoken)


def test_pipecat_pushes_sentences_when_the_backend_gives_no_timestamps(pipecat_runs):
    """Word timestamps are the default; a backend without them still gives Pipecat the turn's text, per
    sentence, rather than leaving the transcript and the context empty until the turn ends."""
    untimed = pipecat_runs["untimed_backend"]
    assert untimed["warnings"] == ["timestamps_unsupported"]
    assert [text.strip() for text in untimed["text_frames"]] == TURN
    # (Pipecat joins per-sentence frames that keep their leading space with one more: spaces normalized.)
    assert [" ".join(message.split()) for message in untimed["assistant_messages"]] == [" ".join(TURN)]
    assert untimed["errors"] == []


def test_livekit_declares_and_pushes_the_aligned_transcript(livekit):
    assert livekit["aligned_transcript"] is True
    words = livekit["whole"]["words"]
    assert_timed([(w["text"], w["start"], w["end"]) for w in words],
                 [(f"{w} ", start, end) for w, start, end in utterance_words(TURN)])
    # A word reaches the framework on a frame after its own audio, never ahead of it (but for the 10 ms the
    # emitter holds back to mark a segment's final frame).
    assert all(end_byte(w["end"]) <= w["audio_bytes"] + EMITTER_TAIL_BYTES for w in words)


def test_livekit_interrupted_transcript_is_the_words_heard(livekit):
    interrupted = livekit["interrupted"]
    spoken = [w["text"].strip() for w in interrupted["words"]]
    assert len(spoken) >= WORDS_BEFORE_CUT and spoken == " ".join(LONG_TURN).split()[: len(spoken)]
    # Every word the framework got had its audio there; of the words whose audio it got, only those whose
    # TimedString waits for the next frame (the emitter hands them over with audio) can be missing.
    assert all(end_byte(w["end"]) <= w["audio_bytes"] + EMITTER_TAIL_BYTES for w in interrupted["words"])
    heard = heard_words(LONG_TURN, interrupted["bytes"])
    assert heard[: len(spoken)] == spoken and len(heard) - len(spoken) <= 1
