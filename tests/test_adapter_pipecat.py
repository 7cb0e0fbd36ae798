"""The Pipecat adapter (clients/pipecat) in real Pipecat pipelines against a real gateway (issue 8).

pipecat-ai 1.14.0 runs in its own cached venv (tests/adapter_env.py); this process serves a gateway on
loopback with the synthetic backend, runs tests/adapter_scripts/pipecat_scenarios.py once with every
scenario (tests/adapter_fixtures.py), and checks the audio that came out of each pipeline against what the
backend makes for the same sentences.
"""

from __future__ import annotations

import hashlib

import pytest

from tests.adapter_fixtures import VOICE, scenario, scenario_results, synthetic_pcm

pytestmark = pytest.mark.third_party  # a cached venv of third-party packages (tests/conftest.py)

CHUNK_BYTES = 24000 * 80 // 1000 * 2  # one synthetic-backend chunk: 80 ms of s16le at 24 kHz

TURN_1 = ["Hello there.", "This is the first turn of the test.", "It has three sentences in all."]
TURN_2 = ["Now the second turn begins on the same socket.", "It ends right here."]
LONG_TURN = [f"This is sentence number {word} of a long answer that the user will interrupt." for word in
             ("one", "two", "three", "four", "five", "six", "seven", "eight")]
AFTER_BARGE_IN = ["After the interruption, speech goes on at once."]
RESUME_TURN = ["The connection drops while this turn plays.", "Resuming brings back every missing byte.",
               "Nothing is lost or repeated."]
AFTER_DROP = ["The next turn speaks on a working session."]
GREETING = ["Hi, I am your assistant.", "How can I help?"]
CANCELLED_TURN = [f"Sentence {word} of a reply that ends when the whole pipeline is cancelled." for word in
                  ("one", "two", "three", "four", "five", "six")]
SENTENCE_MODE = ["Sentence mode works too.", "Each sentence is flushed at once."]
SLOW_CANCEL_TURN = [f"Reply sentence {word}, which a barge-in cuts before the gateway confirms it." for word in
                    ("one", "two", "three", "four", "five", "six")]
NEXT_AFTER_SLOW_CANCEL = ["This turn starts before the gateway has confirmed the barge-in.", "All of it is spoken."]


def pcm_bytes(sentence: str) -> int:
    return len(synthetic_pcm(sentence))


def plan(forgetful_url: str) -> dict:
    return {
        "two_turns": {"turns": [" ".join(TURN_1), " ".join(TURN_2)]},
        "interrupt": {"long_turn": " ".join(LONG_TURN), "next_turn": " ".join(AFTER_BARGE_IN)},
        "resume": {"text": " ".join(RESUME_TURN), "next_turn": " ".join(AFTER_DROP)},
        "fresh_session": {"text": " ".join(RESUME_TURN), "next_turn": " ".join(AFTER_DROP),
                          "gateway_url": forgetful_url},
        "sentence_mode_16k": {"text": " ".join(SENTENCE_MODE)},
        "speak_frame": {"text": " ".join(GREETING)},
        "pipeline_cancel": {"long_turn": " ".join(CANCELLED_TURN)},
        "barge_in_then_next_turn": {"long_turn": " ".join(SLOW_CANCEL_TURN), "next_turn": " ".join(NEXT_AFTER_SLOW_CANCEL)},
        "voice_change": {"turns": [" ".join(TURN_2)] * 2, "voices": ["tone-low", "tone-high"]},
    }


@pytest.fixture(scope="module")
def results():
    with scenario_results("pipecat", plan) as observed:
        yield observed


def assert_whole_turn(audio: dict, sentences: list[str], voice: str = VOICE) -> None:
    """The turn's audio is exactly the backend's audio for its sentences, in order (24 kHz, no resampling)."""
    assert [s.strip() for s in audio["sentences"]] == sentences
    assert audio["odd_frames"] == 0, "every frame must hold whole 16-bit samples"
    assert audio["sample_rates"] == [24000] and audio["channels"] == [1]
    assert audio["bytes"] == sum(pcm_bytes(s) for s in sentences)
    assert audio["sha256"] == hashlib.sha256(b"".join(synthetic_pcm(s, voice) for s in sentences)).hexdigest()


def test_two_llm_turns_on_one_connection(results):
    observed = scenario(results, "two_turns")
    first, second = observed["turns"]
    assert first["context_id"] != second["context_id"], "one Voxgate context per LLM turn"
    assert_whole_turn(first, TURN_1)
    assert_whole_turn(second, TURN_2)
    session_ids = observed["session_ids"]
    assert session_ids[0] and session_ids[0] == session_ids[1] and observed["reconnects"] == 0
    assert observed["errors"] == []
    # Tokens as Pipecat's TOKEN aggregation gives them, and the gateway asked to start each sentence at its
    # first words; the session says whether the backend does (else a warning names split_granularity).
    assert observed["split_granularity"] == "token"
    assert observed["text_streaming"] is True and observed["warnings"] == []


def test_ttfb_metrics_are_reported(results):
    ttfb = scenario(results, "two_turns")["ttfb_s"]
    assert len(ttfb) >= 2, "one TTFB metric per turn"
    assert all(0 < value < 5 for value in ttfb)


def test_interruption_stops_audio_within_one_chunk(results):
    observed = scenario(results, "interrupt")
    _, backend = results
    interrupted = observed["interrupted"]
    full = sum(pcm_bytes(s) for s in LONG_TURN)
    assert 0 < interrupted["bytes"] < full / 4, "the interrupted turn must have been cut short"
    assert interrupted["odd_frames"] == 0
    # Pipecat side: at most one audio frame reaches the end of the pipeline after the interruption.
    assert observed["frames_after_interrupt"] <= 1
    # Gateway side: input.cancel was sent and confirmed, with at most one chunk in flight meanwhile...
    cancelled = observed["cancelled"]
    assert [c["context_id"] for c in cancelled] == [interrupted["context_id"]]
    assert cancelled[0]["late_bytes"] <= CHUNK_BYTES
    # ...and generation stopped: no sentence of the long turn produced more than one chunk after it.
    cancel_at = observed["cancel_sent_at"]
    # (a sentence cut while its text was still coming has only its start)
    records = [r for r in backend.records if any(s.startswith(r.text.strip()) for s in LONG_TURN)]
    assert records and len(records) < len(LONG_TURN), "later sentences must never be synthesized"
    for record in records:
        late = [t for t in record.chunk_times if t > cancel_at]
        assert len(late) <= 1, f"{record.text!r}: {len(late)} chunks made after input.cancel"
    assert any(record.closed is not None for record in records), "the sentence being spoken was cut"


def test_next_turn_after_barge_in_uses_the_same_socket(results):
    observed = scenario(results, "interrupt")
    assert_whole_turn(observed["next"], AFTER_BARGE_IN)
    assert observed["reconnects"] == 0
    assert observed["errors"] == []


def test_dropped_connection_resumes_without_losing_audio(results):
    observed = scenario(results, "resume")
    assert observed["reconnected"], "the client must have resumed the session"
    assert observed["session_ids"][0] == observed["session_ids"][1]
    assert observed["turn_stopped"]
    assert_whole_turn(observed["turn"], RESUME_TURN)
    assert_whole_turn(observed["next"], AFTER_DROP)
    assert observed["errors"] == []


def test_unresumable_session_is_replaced_by_a_fresh_one(results):
    """The gateway has forgotten the session (restart, expiry): the adapter drops it, Pipecat reconnects
    with a new session, and the agent keeps speaking."""
    observed = scenario(results, "fresh_session")
    assert any("session_not_found" in e for e in observed["errors"])
    assert observed["session_ids"][0] != observed["session_ids"][1]
    assert observed["turn"]["bytes"] > 0 and observed["turn"]["odd_frames"] == 0
    assert_whole_turn(observed["next"], AFTER_DROP)


def test_speak_frame_is_an_utterance_of_its_own(results):
    observed = scenario(results, "speak_frame")
    assert_whole_turn(observed["utterance"], GREETING)
    assert observed["errors"] == []


def test_voice_setting_changes_between_turns(results):
    observed = scenario(results, "voice_change")
    low, high = observed["turns"]
    assert_whole_turn(low, TURN_2, voice="tone-low")
    assert_whole_turn(high, TURN_2, voice="tone-high")
    assert observed["errors"] == []


def test_next_turn_during_an_unconfirmed_barge_in_is_spoken_whole(results):
    """Frames that reach the service between input.cancel and context.cancelled are taken: Pipecat's
    queue_frame drops everything while `self._cancelling` is truthy, which the service's dict of pending
    cancels was."""
    observed = scenario(results, "barge_in_then_next_turn")
    assert observed["cancel_sent"]
    assert observed["text_taken_while_cancelling"], "the next turn's text was dropped"
    assert_whole_turn(observed["next"], NEXT_AFTER_SLOW_CANCEL)
    assert observed["errors"] == []


def test_sentence_aggregation_and_16k_output(results):
    turn = scenario(results, "sentence_mode_16k")["turn"]
    assert [s.strip() for s in turn["sentences"]] == SENTENCE_MODE
    assert turn["odd_frames"] == 0 and turn["sample_rates"] == [16000]
    expected = sum(pcm_bytes(s) for s in SENTENCE_MODE) * 16000 // 24000
    # The gateway resamples each sentence; its length may differ by a few samples at the edges.
    assert abs(turn["bytes"] - expected) <= 2 * 64 * len(SENTENCE_MODE)


def test_cancelled_pipeline_stops_the_gateway(results):
    """A CancelFrame cancels the open contexts and closes the session. Pipecat's FrameProcessor flags a
    cancel in `self._cancelling`, which the service also used for its own dict: the flag replaced the
    dict, the receive task then failed on the next audio chunk and dropped the session before the service's
    cancel ran (under load: no input.cancel, the gateway synthesized on), and closing the session always
    failed (the socket was left open)."""
    observed = scenario(results, "pipeline_cancel")
    _, backend = results
    assert observed["logged_errors"] == []
    assert observed["session_closed"], "session.close must end the session on the gateway"
    assert observed["finished_after_s"] < 3
    # (a sentence cut while its text was still coming has only its start)
    records = [r for r in backend.records if any(s.startswith(r.text.strip()) for s in CANCELLED_TURN)]
    assert records and len(records) < len(CANCELLED_TURN)
    for record in records:
        late = [t for t in record.chunk_times if t > observed["cancelled_at"] + 0.5]
        assert not late, f"{record.text!r}: synthesis went on after the pipeline was cancelled"
