"""split_granularity "token" (issue 21): each sentence's synthesis starts at its first words, the segmenter's
sentence end finishing the running request. A real gateway on loopback, the real `websockets` client, the
synthetic backend (deterministic; its audio of a text pushed in pieces equals the text's audio sent whole, so
every sentence's audio can be checked byte for byte against the backend's rendering of the sentence)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest
import websockets

from bench.first_unit_pause import silent_run
from gateway.session.segmenter import SentenceSegmenter
from tests.gateway_server import RecordingBackend, audio_by_sentence, receive_until, running_gateway
from tests.redis_fixtures import REDIS_URL, redis_prefix  # noqa: F401 (fixture)
from tests.resume_fixtures import PACED, Listener, config_message, gateways, receive_into_sentence, uninterrupted_pcm
from tts_backend.base import SynthesisRequest
from tts_backend.synthetic import SyntheticSynthesizer

VOICE = "tone-mid"
TEXT = "Hello there, friend. Dr. Smith paid $3.50 at 5 p.m. today! Is the weather nice? It is"


class SentencesOnly(SyntheticSynthesizer):
    """A backend that needs a unit's whole text before it speaks (as Piper)."""

    honours = SyntheticSynthesizer.honours - {"text_streaming"}


class WithTextMode(SyntheticSynthesizer):
    """A backend that also takes the model's text mode per request (as the Qwen3 engine)."""

    honours = SyntheticSynthesizer.honours | {"text_mode"}


def send(ws, **message):
    return ws.send(json.dumps(message))


def words_of(text: str) -> list[str]:
    """One word per input.text, each with the space after it, as an LLM streams a reply."""
    words = text.split(" ")
    return [w + " " for w in words[:-1]] + [words[-1]]


def rendered(text: str, voice: str = VOICE) -> bytes:
    return SyntheticSynthesizer().render(SynthesisRequest(text=text, voice=voice)).tobytes()


def of_type(messages: list, kind: str) -> list[dict]:
    return [m for m in messages if isinstance(m, dict) and m["type"] == kind]


async def until_audio(ws) -> list:
    """Messages up to and including the first binary (audio) frame."""
    received = []
    while True:
        frame = await asyncio.wait_for(ws.recv(), 20)
        received.append(frame if isinstance(frame, bytes) else json.loads(frame))
        if isinstance(frame, bytes):
            return received


async def speak(url: str, words: list[str], **config) -> list:
    async with websockets.connect(url, max_size=None) as ws:
        await send(ws, type="session.config", stream_audio=True, voice=VOICE, **config)
        messages = [json.loads(await ws.recv())]
        for word in words:
            await send(ws, type="input.text", text=word)
        await send(ws, type="input.done")
        return messages + await receive_until(ws, "session.done")


async def test_synthesis_starts_at_the_first_words_and_speaks_each_sentence_exactly():
    with running_gateway("synthetic") as server:
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await send(ws, type="session.config", stream_audio=True, voice=VOICE, split_granularity="token")
            started = json.loads(await ws.recv())
            # No sentence end yet, and "dear" may go on ("dearest"): synthesis starts with "Hello there my".
            await send(ws, type="input.text", text="Hello there my dear")
            early = await until_audio(ws)  # audio before the sentence has ended
            session_id = started["session_id"]
            record = await asyncio.wait_for(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                server.gateway.store.get(session_id), server.loop)), 5)
            recorded = (record.sentences[0].text, record.open_utterances[None].open_sentence,
                        record.open_utterances[None].text)  # (the memory store's record is live)
            for word in words_of(" friend. And then some more."):
                await send(ws, type="input.text", text=word)
            await send(ws, type="input.done")
            messages = early + await receive_until(ws, "session.done")
        reference = await speak(server.ws_url, words_of(TEXT), split_granularity="sentence")
        token = await speak(server.ws_url, words_of(TEXT), split_granularity="token")
    assert "warnings" not in started
    assert of_type(early, "audio.start")[0]["sentence_text"] == "Hello there my"
    # The store has the sentence's text so far, and that it is still being written.
    assert recorded == ("Hello there my", 0, "Hello there my dear")
    dones = of_type(messages, "audio.done")
    assert [d["sentence_text"] for d in dones] == ["Hello there my dear friend.", "And then some more."]
    audio = audio_by_sentence(messages)
    assert [audio[i] for i in (0, 1)] == [rendered(d["sentence_text"]) for d in dones]
    # The same sentences as sentence splitting, and the same audio, byte for byte.
    assert [d["sentence_text"] for d in of_type(token, "audio.done")] == [
        s["sentence_text"] for s in of_type(reference, "audio.start")]
    assert audio_by_sentence(token) == audio_by_sentence(reference)
    assert of_type(token, "session.done")[0]["total_sentences"] == 4


async def test_the_next_sentence_is_synthesized_while_the_one_before_is_sent():
    # Paced like a real engine: 150 ms to the first chunk, then 4x faster than real time.
    backend = RecordingBackend(SyntheticSynthesizer(first_chunk_delay_s=0.15, speed=4.0))
    text = "The first sentence is long enough to take a while. Second one. Third one here."
    with running_gateway(backend) as server:
        messages = await speak(server.ws_url, words_of(text), split_granularity="token")
    records = backend.records
    assert [r.text for r in records] == ["The first sentence is long enough to take a while.", "Second one.",
                                         "Third one here."]
    assert records[0].opened_with != records[0].text  # it started before its end came
    audio = audio_by_sentence(messages)
    for previous, following, index in zip(records, records[1:], (0, 1)):
        # Each sentence's first audio exists before the one before, played in real time from its first
        # chunk, runs out: no gap.
        played_until = previous.chunk_times[0] + len(audio[index]) / 2 / 24000
        assert following.chunk_times[0] < played_until
    assert of_type(messages, "session.done")[0]["total_sentences"] == 3


async def test_a_backend_without_text_streaming_warns_and_cuts_the_first_unit_after_a_few_words():
    text = "I think that we should go now. And then we will see what happens next."
    with running_gateway(SentencesOnly()) as server:
        messages = await speak(server.ws_url, words_of(text), split_granularity="token")
    (warning,) = messages[0]["warnings"]
    assert warning["field"] == "split_granularity" and warning["code"] == "option_ignored"
    starts = of_type(messages, "audio.start")
    assert [s["sentence_text"] for s in starts] == ["I think that we", "should go now.",
                                                    "And then we will see what happens next."]
    audio = audio_by_sentence(messages)
    assert [audio[s["sentence_index"]] for s in starts] == [rendered(s["sentence_text"]) for s in starts]
    assert all("sentence_text" not in d for d in of_type(messages, "audio.done"))


async def test_a_resumed_utterance_keeps_whole_sentences_after_its_shortened_first_unit():
    with running_gateway(SentencesOnly()) as server:
        listener = Listener()
        ws = await websockets.connect(server.ws_url, max_size=None)
        await ws.send(config_message(split_granularity="token"))
        await listener.receive(ws, "session.started")
        await ws.send(json.dumps({"type": "input.text", "text": "One two three four five six seven. Eight nine"}))
        await listener.receive(ws, "audio.done")
        await listener.receive(ws, "audio.done")
        await ws.close()  # the network fails: "Eight nine" is open text in the store
        ws = await websockets.connect(server.ws_url, max_size=None)
        await ws.send(listener.resume_message())
        await listener.receive(ws, "session.started")
        await ws.send(json.dumps({"type": "input.text", "text": " ten eleven twelve thirteen fourteen."}))
        await ws.send(json.dumps({"type": "input.done"}))
        await listener.receive(ws, "session.done")
        await ws.close()
    texts = [m["sentence_text"] for m in listener.messages if m["type"] == "audio.start"]
    # Only the utterance's first unit is cut short, also when the utterance goes on after a resume.
    assert texts == ["One two three four", "five six seven.", "Eight nine ten eleven twelve thirteen fourteen."]


async def test_a_growing_sentence_is_cut_at_max_synthesis_chars():
    text = ("this run on reply has no end in sight and it goes on and on for a long while yet with more words"
            " after more words")
    backend = RecordingBackend(SyntheticSynthesizer())
    with running_gateway(backend, max_synthesis_chars=40) as server:
        messages = await speak(server.ws_url, words_of(text), split_granularity="token")
    texts = [d["sentence_text"] for d in of_type(messages, "audio.done")]
    assert len(texts) >= 3 and all(len(t) <= 40 for t in texts) and " ".join(texts) == text
    audio = audio_by_sentence(messages)
    assert [audio[i] for i in range(len(texts))] == [rendered(t) for t in texts]
    # Each unit was one request, fed as its words came, never past the cap.
    assert [r.request.text_stream.text for r in backend.records] == texts


async def test_cancel_of_a_sentence_still_being_written_stops_it_within_one_chunk():
    backend = RecordingBackend(SyntheticSynthesizer(speed=1.0, chunk_ms=80))
    with running_gateway(backend) as server:
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="session.config", stream_audio=True, voice=VOICE, split_granularity="token",
                       timestamp_type="word", timestamp_transport_strategy="async")
            await receive_until(ws, "session.started")
            for word in words_of("This sentence takes a few seconds of audio to speak out loud and it is "):
                await send(ws, type="input.text", context_id="talk", text=word)
            before = await receive_until(ws, "audio.words")
            await send(ws, type="input.cancel", context_id="talk")
            cancelled_sent = time.monotonic()
            messages = await receive_until(ws, "context.cancelled")
            await send(ws, type="input.text", context_id="next", text="Still here.")
            await send(ws, type="input.done", context_id="next")
            later = await receive_until(ws, "utterance.done")
    assert of_type(before, "audio.start")[0]["sentence_index"] == 0
    done = of_type(messages, "audio.done")[0]
    assert done["cancelled"] is True and done["sentence_index"] == 0
    cancelled = messages[-1]
    assert cancelled["type"] == "context.cancelled" and cancelled["sentence_index"] == 0
    # What the listener heard: the words whose audio went out in full, a start of the sentence.
    assert cancelled["spoken_text"]
    assert "This sentence takes a few seconds of audio to speak out loud and it is".startswith(cancelled["spoken_text"])
    cut = backend.records[0]
    assert cut.closed is not None and cut.finished is None
    assert sum(t > cancelled_sent for t in cut.chunk_times) <= 1
    assert of_type(later, "utterance.done")[0] == {"type": "utterance.done", "context_id": "next", "total_sentences": 1}


async def test_word_timestamps_are_those_of_sentence_splitting():
    with running_gateway("synthetic") as server:
        token = await speak(server.ws_url, words_of(TEXT), split_granularity="token", timestamp_type="word")
        sentence = await speak(server.ws_url, words_of(TEXT), split_granularity="sentence", timestamp_type="word")
    assert [d["timestamp_info"] for d in of_type(token, "audio.done")] == [
        d["timestamp_info"] for d in of_type(sentence, "audio.done")]


async def test_limits_count_the_text_once_and_release_it_when_spoken_or_cancelled():
    # 70 characters may wait unspoken. Each utterance below has 61: if a sentence's text were counted both
    # as the utterance's unreleased text and as a released sentence, or never given back, the next would
    # be refused with text_too_long.
    utterance = "The first sentence is here. The second one follows it closely."
    with running_gateway(SyntheticSynthesizer(speed=20.0), max_buffered_chars=70) as server:
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await send(ws, type="session.config", stream_audio=True, voice=VOICE, split_granularity="token")
            await receive_until(ws, "session.started")
            for n in range(3):
                for word in words_of(utterance):
                    await send(ws, type="input.text", context_id=f"u{n}", text=word)
                if n == 1:
                    await until_audio(ws)
                    await send(ws, type="input.cancel", context_id="u1")
                    await receive_until(ws, "context.cancelled")
                else:
                    await send(ws, type="input.done", context_id=f"u{n}")
                    messages = await receive_until(ws, "utterance.done")
                    assert not of_type(messages, "error"), messages
            metrics = httpx.get(server.url + "/metrics").text
    done = [line for line in metrics.splitlines() if line.startswith('voxgate_sentences_total{outcome="done"}')]
    assert done and float(done[0].split()[-1]) == 4.0


async def test_resume_on_another_replica_mid_sentence_continues_the_sentence_byte_for_byte(redis_prefix):  # noqa: F811
    first = "The first sentence is spoken before the network fails. Then the second sentence is"
    rest = " still being written when the client comes back. And the last one ends it."
    with gateways(REDIS_URL, redis_prefix, 2, *PACED) as (a, b):
        reference = await uninterrupted_pcm(b.ws_url, first + rest)
        listener = Listener()
        ws = await websockets.connect(a.ws_url, max_size=None)
        await ws.send(config_message(split_granularity="token"))
        await listener.receive(ws, "session.started")
        for word in words_of(first):
            await ws.send(json.dumps({"type": "input.text", "text": word}))
        await receive_into_sentence(ws, listener, 1, min_bytes=1920)  # into the sentence still being written
        await ws.close()
        ws = await websockets.connect(b.ws_url, max_size=None)
        await ws.send(listener.resume_message())
        started = await listener.receive(ws, ("session.started", "error"))
        assert started["type"] == "session.started", started
        for word in words_of(rest):
            await ws.send(json.dumps({"type": "input.text", "text": word}))
        await ws.send(json.dumps({"type": "input.done"}))
        done = await listener.receive(ws, "session.done")
        await ws.close()
    assert done["total_sentences"] == 3
    texts = [m["sentence_text"] for m in listener.messages if m["type"] == "audio.done" and "sentence_text" in m]
    assert texts[-2:] == ["Then the second sentence is still being written when the client comes back.",
                          "And the last one ends it."]
    assert listener.pcm() == reference


async def test_non_streaming_mode_is_honoured_per_request_or_named_in_the_warnings():
    backend = RecordingBackend(WithTextMode())
    with running_gateway(backend) as server:
        for flag in (True, False):
            await speak(server.ws_url, ["One sentence here."], non_streaming_mode=flag)
        plain = await speak(server.ws_url, ["One sentence here."])
        token = await speak(server.ws_url, words_of("Whole words only. Then more."), split_granularity="token",
                            non_streaming_mode=True)
        response = httpx.post(server.url + "/v1/audio/speech", json={"input": "Over HTTP.", "voice": VOICE,
                                                                     "non_streaming_mode": True})
    modes = [r.request.streaming_text for r in backend.records]
    assert modes[:3] == [False, True, None]  # not non_streaming_mode; left out: the server's default
    assert "warnings" not in plain[0]
    # non_streaming_mode true puts a sentence's whole text in the prompt: no synthesis before its end.
    assert [w["field"] for w in token[0]["warnings"]] == ["split_granularity"]
    assert all(r.request.text_stream is None for r in backend.records[3:5])
    assert response.status_code == 200 and backend.records[-1].request.streaming_text is False
    with running_gateway("synthetic") as server:  # no per-request text mode here
        ignored = await speak(server.ws_url, ["One sentence here."], non_streaming_mode=True)
        streamed = await speak(server.ws_url, ["One sentence here."], split_granularity="token",
                               non_streaming_mode=False)
        response = httpx.post(server.url + "/v1/audio/speech", json={"input": "Over HTTP.", "voice": VOICE,
                                                                     "non_streaming_mode": False})
    assert [w["field"] for w in ignored[0]["warnings"]] == ["non_streaming_mode"]
    assert "warnings" not in streamed[0]  # a text stream is in streaming-text mode: what was asked for
    assert response.status_code == 200 and "non_streaming_mode" in response.headers.get("x-voxgate-warnings", "")


def test_token_segmenter_cuts_an_overlong_unit_at_its_last_whitespace_not_an_earlier_clause_mark():
    # What the session has pushed of an open unit (its whole words) must stay the unit's start: a unit cut
    # back at the clause mark would leave pushed words out of it.
    text = "one two, three four five six seven eight nine ten"
    sentence = SentenceSegmenter("sentence", max_unit_chars=30).push(text)
    token = SentenceSegmenter("token", max_unit_chars=30)
    units = token.push(text)
    assert sentence[0] == "one two,"
    assert units == ["one two, three four five six"]
    assert token.buffered_text == "seven eight nine ten"
    with pytest.raises(ValueError):
        SentenceSegmenter("word")


@pytest.mark.parametrize("seed", range(20))
def test_the_stable_prefix_always_starts_the_unit_it_belongs_to(seed: int):
    """Whatever the pieces, text up to `stable_chars` is the start of the next unit released."""
    import random

    rng = random.Random(seed)
    text = ("Dr. Smith paid $3.50 at 5 p.m. today! Steps: 1. mix, 2. bake. Is it nice?\nYes, it is; "
            "a long run on clause without any end that keeps going past the cap for a while ") * 2
    segmenter = SentenceSegmenter("token", max_unit_chars=60)
    promised = ""
    i = 0
    while i < len(text):
        n = rng.randint(1, 9)
        for unit in segmenter.push(text[i:i + n]):
            assert unit.startswith(promised), (unit, promised)
            promised = ""
        stable = segmenter.buffered_text[: segmenter.stable_chars]
        assert stable.startswith(promised) and not stable[-1:].isspace()
        promised = stable
        i += n
    for unit in segmenter.flush():
        assert unit.startswith(promised)
        promised = ""


async def test_on_piper_the_first_units_cut_is_not_heard_as_a_break():
    """Token mode on Piper (the clients' default) cuts the first sentence after a few words to speak sooner;
    the unit's sentence-end silence made a pause of about 200 ms inside the sentence there (spoken whole:
    none; bench/first_unit_pause.py). A cut inside the sentence now drops that silence; a cut at a comma
    keeps the pause a speaker makes there."""
    cases = {"Gregson shoved back his chair and rose to his feet.": "Gregson shoved back his",
             "He turned sharply, and faced Gregson across the table.": "He turned sharply,"}
    pauses = {}
    with running_gateway("piper") as server:
        for text, first in cases.items():
            messages = await speak(server.ws_url, words_of(text), split_granularity="token")
            starts = of_type(messages, "audio.start")
            assert [s["sentence_text"] for s in starts][0] == first
            audio = audio_by_sentence(messages)
            joined = np.frombuffer(audio[0] + audio[1], dtype="<i2")
            pauses[first] = silent_run(joined, 24000, len(audio[0]) // 2)  # as the bench measures it
    assert pauses["Gregson shoved back his"] <= 0.100, pauses
    assert pauses["He turned sharply,"] >= 0.150, pauses
