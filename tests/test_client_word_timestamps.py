"""Word timestamps in the Python and JS clients (issue 16): `AudioWords` events (`words` in JS) with times
within the utterance, sync and async transport, spoken_text / spoken_words on cancel, replayed words given
out once.

A real gateway on loopback runs the synthetic backend, whose word times are exact by construction (its
audio is spread evenly over the text's characters), so every time a client reports can be checked against
the backend's own timing of the same sentence.
"""

from __future__ import annotations

import pytest

import voxgate_client as vg
from tests.gateway_server import running_gateway
from tests.js_fixtures import JS_CLIENT_DIR, require_node, require_npm_packages, run_node_json
from tts_backend.base import SynthesisRequest
from tts_backend.synthetic import SyntheticSynthesizer

pytestmark = pytest.mark.timeout(90)

VOICE = "tone-mid"
SAMPLE_RATE = 24000
SENTENCES = ["Hello there, how are you?", "The weather is lovely today.", "Goodbye."]
TEXT = " ".join(SENTENCES)
LONG_SENTENCES = [f"Sentence number {n} of a long reply that the user cuts short." for n in range(1, 7)]
LONG_TEXT = " ".join(LONG_SENTENCES)
WORDS_BEFORE_CUT = 14  # into the second sentence


@pytest.fixture(scope="module")
def backend() -> SyntheticSynthesizer:
    return SyntheticSynthesizer(speed=4.0)  # 4x real time after the first chunk: a cancel lands mid-reply


@pytest.fixture(scope="module")
def gateway(backend):
    with running_gateway(backend=backend) as server:
        yield server.url


def expected_words(backend: SyntheticSynthesizer, sentences: list[str]) -> list[tuple[str, float, float, float, float]]:
    """(word, start, end, utterance_start, utterance_end) of every word, from the backend's own timing."""
    out, offset = [], 0.0
    for sentence in sentences:
        samples = len(backend.render(SynthesisRequest(text=sentence, voice=VOICE)))
        for timing in backend.word_timings(sentence, samples):
            start, end = timing.start / SAMPLE_RATE, timing.end / SAMPLE_RATE
            out.append((timing.word, start, end, offset + start, offset + end))
        offset += samples / SAMPLE_RATE
    return out


def assert_same_words(actual: list[tuple], expected: list[tuple]) -> None:
    """Same words, and times equal to the microsecond (the wire rounds seconds to 6 decimals)."""
    assert [w[0] for w in actual] == [w[0] for w in expected]
    for got, want in zip(actual, expected):
        assert got[1:] == pytest.approx(want[1:], abs=2e-6), got[0]


ASYNC_WORDS = vg.SessionConfig(voice=VOICE, timestamp_type="word", timestamp_transport_strategy="async")


async def long_reply(session: vg.Session, context_id: str) -> vg.Context:
    """LONG_TEXT sent as one whole utterance of a new context."""
    context = session.context(context_id)
    await context.send_text(LONG_TEXT)
    await context.done()
    return context


def as_tuples(words: list[vg.Word]) -> list[tuple[str, float, float, float, float]]:
    return [(w.word, w.start, w.end, w.utterance_start, w.utterance_end) for w in words]


def heard(words: list[tuple], bytes_of_sentence: dict[int, int], sentence_of_word: list[int]) -> list[tuple]:
    """The words whose audio lies wholly within the bytes received of their sentence."""
    return [w for w, index in zip(words, sentence_of_word) if end_byte(w[2]) <= bytes_of_sentence.get(index, 0)]


def end_byte(seconds: float) -> int:
    """The byte of 24 kHz s16le audio at `seconds` (times on the wire are rounded to the microsecond)."""
    return round(seconds * SAMPLE_RATE) * 2


@pytest.mark.parametrize("strategy", ["async", "sync"])
async def test_words_arrive_as_events_with_utterance_times(backend, gateway, strategy):
    config = vg.SessionConfig(voice=VOICE, timestamp_type="word", timestamp_transport_strategy=strategy)
    assert config.to_message()["timestamp_type"] == "word"
    async with vg.connect(gateway, config) as session:
        context = session.context("reply-1")
        await context.send_text(TEXT)
        await context.done()
        events = [event async for event in context]

    words = [w for e in events if isinstance(e, vg.AudioWords) for w in e.words]
    assert_same_words(as_tuples(words), expected_words(backend, SENTENCES))
    assert [w.word for w in words] == TEXT.split()
    # Each word is given out only once its audio is here: after the chunks that hold its end ("async"), or
    # just before its sentence's AudioDone ("sync").
    received = 0
    for index, event in enumerate(events):
        if isinstance(event, vg.AudioChunk):
            received = event.offset + len(event.data)
        elif isinstance(event, vg.AudioWords):
            assert all(end_byte(w.end) <= received for w in event.words)
            assert event.context_id == "reply-1"
            if strategy == "sync":
                assert isinstance(events[index + 1], vg.AudioDone) and events[index + 1].words is not None
    if strategy == "async":
        assert all(e.words is None for e in events if isinstance(e, vg.AudioDone))


async def test_cancel_reports_what_the_listener_heard(backend, gateway):
    async with vg.connect(gateway, ASYNC_WORDS) as session:
        context = await long_reply(session, "barge-in")
        given: list[vg.Word] = []
        cancelled = None
        async for event in context:
            if isinstance(event, vg.AudioWords):
                given += event.words
                if len(given) >= WORDS_BEFORE_CUT and not context.cancelling:
                    await context.cancel()
            elif isinstance(event, vg.ContextCancelled):
                cancelled = event
        received = dict(session.bytes_received)  # also the audio dropped here after the cancel

    assert cancelled is not None and cancelled.spoken_words is not None
    spoken = [w.word for w in cancelled.spoken_words]
    assert cancelled.spoken_text == " ".join(spoken)
    # Exactly the words whose audio reached this client, timed within the utterance ...
    everything = expected_words(backend, LONG_SENTENCES)
    sentence_of_word = [i for i, s in enumerate(LONG_SENTENCES) for _ in s.split()]
    assert_same_words(as_tuples(cancelled.spoken_words), heard(everything, received, sentence_of_word))
    # ... and the words it gave out before the cut are the first of them.
    assert len(given) >= WORDS_BEFORE_CUT and [w.word for w in given] == spoken[: len(given)]


async def test_a_resumed_session_gives_each_word_once(backend, gateway):
    """The connection drops mid-reply; the resumed session replays the missing audio with its words: the
    application sees every word once, with the same times as without the drop."""
    async with vg.connect(gateway, ASYNC_WORDS) as session:
        context = await long_reply(session, "resumed")
        given: list[vg.Word] = []
        async for event in context:
            if isinstance(event, vg.AudioWords):
                given += event.words
                if len(given) >= WORDS_BEFORE_CUT and session.reconnects == 0 and session._ws is not None:
                    await session.drop_connection()
        assert session.reconnects == 1
    assert_same_words(as_tuples(given), expected_words(backend, LONG_SENTENCES))


def test_config_checks_the_timestamp_fields():
    with pytest.raises(ValueError, match="timestamp_type"):
        vg.SessionConfig(timestamp_type="phoneme")
    with pytest.raises(ValueError, match="timestamp_transport_strategy"):
        vg.SessionConfig(timestamp_type="word", timestamp_transport_strategy="later")


@pytest.fixture(scope="module")
def js_observed(gateway) -> dict:
    require_node()
    require_npm_packages()
    return run_node_json(JS_CLIENT_DIR / "test" / "word_scenarios.mjs", gateway, VOICE, TEXT, LONG_TEXT,
                         str(WORDS_BEFORE_CUT))


def js_tuples(words: list[dict]) -> list[tuple]:
    return [(w["word"], w["start"], w["end"], w["utteranceStart"], w["utteranceEnd"]) for w in words]


@pytest.mark.parametrize("strategy", ["async", "sync"])
def test_js_client_emits_words_with_utterance_times(backend, js_observed, strategy):
    observed = js_observed[strategy]
    words = [w for event in observed["events"] for w in event["words"]]
    assert_same_words(js_tuples(words), expected_words(backend, SENTENCES))
    assert [w["word"] for w in observed["resultWords"]] == TEXT.split()
    for event in observed["events"]:
        assert event["contextId"] == "reply-1"
        # given out once the word's audio is here (the bytes of its sentence received so far)
        assert all(end_byte(w["end"]) <= event["receivedBefore"] for w in event["words"])


def test_js_client_cancel_carries_what_the_listener_heard(backend, js_observed):
    observed = js_observed["bargeIn"]
    spoken = [w["word"] for w in observed["spokenWords"]]
    assert observed["spokenText"] == " ".join(spoken)
    received = {int(index): count for index, count in observed["received"].items()}
    first = min(received)  # the session's index of the reply's first sentence
    sentence_of_word = [first + i for i, s in enumerate(LONG_SENTENCES) for _ in s.split()]
    everything = expected_words(backend, LONG_SENTENCES)
    assert_same_words(js_tuples(observed["spokenWords"]), heard(everything, received, sentence_of_word))
    given = [w["word"] for w in observed["given"]]
    assert len(given) >= WORDS_BEFORE_CUT and given == spoken[: len(given)]


def test_js_client_gives_each_word_once_across_a_resume(backend, js_observed):
    observed = js_observed["resumed"]
    assert observed["resumes"] == 1
    assert_same_words(js_tuples(observed["given"]), expected_words(backend, LONG_SENTENCES))
