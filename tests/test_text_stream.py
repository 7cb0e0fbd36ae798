"""Text pushed while the backend speaks (issue 21): the TextStream interface and the synthetic backend.

The synthetic backend is what the gateway's CPU tests run on, so it must keep the contract exactly: the
audio (and word timings) of a text pushed in pieces, whatever the pieces and their timing, equal those of
the same text sent whole, and the audio starts before the text is finished.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from tts_backend.base import SynthesisError, SynthesisRequest, TextStream
from tts_backend.remote import framing
from tts_backend.synthetic import SyntheticSynthesizer

SENTENCE = "Well, it's $3.50 - or so they said... Then   the rain came down, hard and cold."


async def test_text_stream_collects_pushes_and_wakes_waiters():
    stream = TextStream("Hello")
    assert stream.text == "Hello" and not stream.finished
    seen = []
    unsubscribe = stream.subscribe(lambda: seen.append(stream.text))
    waiter = asyncio.ensure_future(stream.wait_beyond(5))
    await asyncio.sleep(0)
    assert not waiter.done()
    stream.push(" world")
    assert await waiter is True
    stream.push("")  # nothing: no wake-up
    unsubscribe()
    stream.push(".")
    assert seen == ["Hello world"]
    pieces = []

    async def read():
        async for piece in stream.pieces(len("Hello")):
            pieces.append(piece)

    reader = asyncio.ensure_future(read())
    await asyncio.sleep(0)
    stream.push(" Bye")
    await asyncio.sleep(0)
    stream.finish()
    await reader
    assert "".join(pieces) == " world. Bye" and len(pieces) == 2
    assert await stream.wait_beyond(len(stream.text)) is False
    with pytest.raises(RuntimeError):
        stream.push("more")
    stream.finish()  # idempotent


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


async def collect(backend, request):
    pcm, words = b"", []
    async for chunk in backend.synthesize(request):
        pcm += chunk.pcm
        words.extend(chunk.words)
    return pcm, words


@pytest.mark.parametrize("case", range(6))
async def test_synthetic_pieces_give_the_bytes_and_words_of_the_whole(case):
    rng = random.Random(case)
    backend = SyntheticSynthesizer(chunk_ms=40, speed=0 if case % 2 else 50.0)
    whole = SynthesisRequest(text=SENTENCE, voice="tone-mid", seed=5, word_timestamps=True)
    want_pcm, want_words = await collect(backend, whole)
    assert len(want_pcm) > 0 and len(want_words) > 5

    pieces = random_pieces(SENTENCE, rng)  # cut anywhere, even inside words: the backend holds them back
    stream = TextStream(pieces[0])
    request = SynthesisRequest(text=pieces[0], voice="tone-mid", seed=5, word_timestamps=True, text_stream=stream)
    audio_before_finish = []

    async def write():
        for piece in pieces[1:]:
            await asyncio.sleep(rng.choice([0, 0, 0.001, 0.01]))
            stream.push(piece)
        await asyncio.sleep(0.02)
        audio_before_finish.append(got_pcm[0])
        stream.finish()

    got_pcm = [b""]
    got_words = []

    async def read():
        async for chunk in backend.synthesize(request):
            got_pcm[0] += chunk.pcm
            got_words.extend(chunk.words)

    await asyncio.gather(write(), read())
    assert got_pcm[0] == want_pcm
    assert got_words == want_words
    assert len(audio_before_finish[0]) > 0  # it spoke before the text was finished


async def test_synthetic_stream_waits_for_text_and_never_speaks_a_word_twice():
    backend = SyntheticSynthesizer(chunk_ms=40)
    stream = TextStream("One two")
    request = SynthesisRequest(text="One two", voice="tone-low", text_stream=stream, word_timestamps=True)
    chunks = backend.synthesize(request)
    first = await chunks.__anext__()
    assert len(first.pcm) > 0
    assert [w.word for w in first.words] == ["One"]  # "two" may still grow ("two-thirds")
    audio = first.pcm
    pending = asyncio.ensure_future(_drain(chunks))
    await asyncio.sleep(0.05)
    assert not pending.done()  # all it had is spoken: it waits for text, it does not end
    stream.push(" three.")
    stream.finish()
    rest, words = await pending
    audio += rest
    assert [w.word for w in words] == ["two", "three."]
    whole = backend.render(SynthesisRequest(text="One two three.", voice="tone-low")).tobytes()
    assert audio == whole


async def _drain(chunks):
    pcm, words = b"", []
    async for chunk in chunks:
        pcm += chunk.pcm
        words.extend(chunk.words)
    return pcm, words


async def test_a_cancelled_text_stream_stops_at_once():
    backend = SyntheticSynthesizer(capacity=1)
    stream = TextStream("Waiting for an LLM")
    chunks = backend.synthesize(SynthesisRequest(text=stream.text, voice="tone-mid", text_stream=stream))
    await chunks.__anext__()
    assert backend.load() == 1.0
    await chunks.aclose()
    assert backend.load() == 0.0  # the slot is given back though the text never finished


def test_the_synthetic_audio_of_a_prefix_is_a_prefix_of_the_audio():
    backend = SyntheticSynthesizer()
    whole = backend.render(SynthesisRequest(text=SENTENCE, voice="tone-high", seed=1))
    for cut in (1, 7, 30, len(SENTENCE) - 1):
        prefix = SENTENCE[:cut].rstrip()
        part = backend.render(SynthesisRequest(text=prefix, voice="tone-high", seed=1))
        assert np.array_equal(part, whole[: len(part)])
        assert len(part) == len(prefix) * backend.samples_per_char
    other = backend.render(SynthesisRequest(text=SENTENCE, voice="tone-high", seed=2))
    assert not np.array_equal(other, whole)


async def test_backends_without_the_ability_refuse_a_text_stream_rather_than_drop_text():
    class Whole(SyntheticSynthesizer):
        honours = frozenset({"seed"})

    request = SynthesisRequest(text="Hello", voice="tone-mid", text_stream=TextStream("Hello"))
    with pytest.raises(SynthesisError, match="cannot take text while it speaks"):
        Whole().refuse_text_stream(request)


def test_a_text_stream_never_travels_in_the_request_frame():
    request = SynthesisRequest(text="Hi", voice="v", text_stream=TextStream("Hi"), streaming_text=True)
    data = framing.request_to_json(request)
    assert "text_stream" not in data and data["streaming_text"] is True
    assert framing.request_from_json(dict(data)).streaming_text is True
    assert "streaming_text" not in framing.request_to_json(SynthesisRequest(text="Hi", voice="v"))
    with pytest.raises(SynthesisError, match="unknown request fields"):
        framing.request_from_json({**data, "text_stream": "Hi"})
