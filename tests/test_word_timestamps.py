"""Word timestamps (issue 16) end to end: a real gateway on loopback, real `websockets` clients.

The synthetic backend knows its word timings exactly (its audio is spread evenly over the characters),
so every figure the gateway reports is checked against an independent computation: the backend's own
timings, and the bytes this test's client has received at the moment each message arrives.
"""

from __future__ import annotations

import asyncio
import io
import json
import time

import av
import numpy as np
import pytest
import websockets

from tests.gateway_server import running_gateway
from tts_backend.base import SynthesisRequest, split_words
from tts_backend.piper import PiperSynthesizer
from tts_backend.synthetic import SyntheticSynthesizer

VOICE = "tone-mid"
RATE = 24000
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "It costs $3.50 - or so they say, at 10:30 today.",
    "Then everyone went home, tired but happy.",
]
TEXT = " ".join(SENTENCES)


def paced() -> SyntheticSynthesizer:
    # 8x real time in 40 ms chunks: a sentence streams for ~0.4 s, long enough to cut in the middle.
    return SyntheticSynthesizer(sample_rate=RATE, speed=8, chunk_ms=40)


def exact_words(text: str) -> list[tuple[str, float, float]]:
    """The synthetic backend's word timings for `text`, in seconds (computed here, not by the gateway)."""
    text = text.strip()
    n = len(SyntheticSynthesizer(sample_rate=RATE).render(SynthesisRequest(text=text, voice=VOICE)))
    return [(word, (a * n // len(text)) / RATE, (b * n // len(text)) / RATE) for word, a, b in split_words(text)]


@pytest.fixture(scope="module")
def server():
    with running_gateway(paced()) as running:
        yield running


@pytest.fixture(scope="module")
def slow_server():
    """Twice real time: a sentence streams for over a second, so a cancel sent a few hundred ms into one
    lands inside it even on a loaded machine."""
    with running_gateway(SyntheticSynthesizer(sample_rate=RATE, speed=2, chunk_ms=40)) as running:
        yield running


class Client:
    """Everything received, and for each audio.words / context.cancelled the bytes of each sentence the
    client held when it arrived."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.audio: dict[int, bytearray] = {}
        self.open: int | None = None
        self.messages: list[dict] = []
        self.held_at: list[dict[int, int]] = []  # parallel to messages

    async def send(self, **message) -> None:
        await self.ws.send(json.dumps(message))

    def _take(self, frame: str | bytes) -> dict | None:
        if isinstance(frame, bytes):
            self.audio[self.open] += frame
            return None
        message = json.loads(frame)
        self.messages.append(message)
        self.held_at.append({i: len(a) for i, a in self.audio.items()})
        if message["type"] == "audio.start":
            self.open = message["sentence_index"]
            self.audio.setdefault(self.open, bytearray())  # again after a resume: it continues
        return message

    async def until(self, kind: str, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            message = self._take(await asyncio.wait_for(self.ws.recv(), max(0.01, deadline - time.monotonic())))
            if message is not None and message["type"] == kind:
                return message

    async def into_sentence(self, index: int, min_bytes: int) -> None:
        while not (self.open == index and len(self.audio[index]) >= min_bytes):
            self._take(await asyncio.wait_for(self.ws.recv(), 30))

    def of_type(self, kind: str) -> list[tuple[dict, dict[int, int]]]:
        return [(m, h) for m, h in zip(self.messages, self.held_at) if m["type"] == kind]


async def session(url: str, **config) -> Client:
    ws = await websockets.connect(url, max_size=None)
    client = Client(ws)
    await client.send(**{"type": "session.config", "voice": VOICE, "stream_audio": True, "response_format": "pcm",
                         **config})
    started = await client.until("session.started")
    assert "warnings" not in started, started
    return client


def samples_held(held: int, fmt: str) -> int:
    return held // (1 if fmt in ("mulaw", "alaw") else 2)


def assert_close(reported: list[dict], expected: list[tuple[str, float, float]], offset: float = 0.0) -> None:
    assert [w["word"] for w in reported] == [w for w, _, _ in expected]
    for got, (_, start, end) in zip(reported, expected):
        assert got["start"] == pytest.approx(start + offset, abs=2e-6)
        assert got["end"] == pytest.approx(end + offset, abs=2e-6)


def assert_monotonic(words: list[dict]) -> None:
    for before, after in zip(words, words[1:]):
        assert before["start"] <= after["start"] and before["end"] <= after["end"]
    assert all(0 <= w["start"] <= w["end"] for w in words)


# ------------------------------------------------------------------------------------------ sync


async def test_sync_puts_each_sentences_words_in_its_audio_done(server):
    client = await session(server.ws_url, timestamp_type="word", timestamp_transport_strategy="sync")
    await client.send(type="input.text", text=TEXT)
    await client.send(type="input.done")
    await client.until("session.done")
    await client.ws.close()
    dones = [m for m, _ in client.of_type("audio.done")]
    assert len(dones) == 3 and not client.of_type("audio.words")
    for done, sentence in zip(dones, SENTENCES):
        alignment = done["timestamp_info"]["word_alignment"]
        words = [{"word": w, "start": s, "end": e} for w, s, e in zip(
            alignment["words"], alignment["word_start_times_seconds"], alignment["word_end_times_seconds"])]
        assert_close(words, exact_words(sentence))
        assert_monotonic(words)
        assert words[-1]["end"] <= done["duration_ms"] / 1000 + 1e-4  # duration_ms is rounded to 0.1 ms
    # A written word is one word however it is spoken: "$3.50" and "10:30" stay whole; "-" joins "$3.50".
    assert dones[1]["timestamp_info"]["word_alignment"]["words"][:3] == ["It", "costs", "$3.50 -"]


async def test_vllm_word_timestamps_flag_means_sync(server):
    client = await session(server.ws_url, word_timestamps=True)
    await client.send(type="input.text", text=SENTENCES[0])
    await client.send(type="input.done")
    done = await client.until("audio.done")
    await client.ws.close()
    assert done["timestamp_info"]["word_alignment"]["words"] == [w for w, _, _ in exact_words(SENTENCES[0])]


async def test_without_timestamp_type_nothing_changes(server):
    client = await session(server.ws_url)
    await client.send(type="input.text", text=SENTENCES[0], context_id="a")
    await client.send(type="input.flush", context_id="a")
    await client.into_sentence(0, 4000)
    await client.send(type="input.cancel", context_id="a")
    cancelled = await client.until("context.cancelled")
    await client.ws.close()
    assert "spoken_text" not in cancelled and "spoken_words" not in cancelled
    assert all("timestamp_info" not in m for m, _ in client.of_type("audio.done"))


# ------------------------------------------------------------------------------------------ async


@pytest.mark.parametrize("fmt,rate", [("pcm", 24000), ("pcm", 8000), ("pcm", 48000), ("mulaw", 8000), ("wav", 16000)])
async def test_async_words_come_once_their_audio_is_out(server, fmt, rate):
    client = await session(server.ws_url, timestamp_type="word", timestamp_transport_strategy="async",
                           response_format=fmt, sample_rate=rate)
    await client.send(type="input.text", text=TEXT)
    await client.send(type="input.done")
    await client.until("session.done")
    await client.ws.close()
    told: dict[int, list[dict]] = {}
    for message, held in client.of_type("audio.words"):
        index = message["sentence_index"]
        header = 44 if fmt == "wav" else 0
        have = samples_held(max(0, held[index] - header), fmt)
        for word in message["words"]:
            # Never before the client holds the word's whole audio (at the output rate; the resampled
            # sentence may end a fraction of a sample before the backend's last sample maps to).
            assert word["end"] * rate <= have + (1 if word is message["words"][-1] else 1e-6), (word, have)
        told.setdefault(index, []).extend(message["words"])
    assert sorted(told) == [0, 1, 2]
    for index, sentence in enumerate(SENTENCES):
        assert_close(told[index], exact_words(sentence))
        assert_monotonic(told[index])
    # Told as the audio went, not all at the end: the first sentence's words came in several messages.
    assert len([m for m, _ in client.of_type("audio.words") if m["sentence_index"] == 0]) > 1
    # Each sentence's words all came before its audio.done, which carries none in async mode.
    order = [(m["type"], m.get("sentence_index")) for m in client.messages]
    for index in range(3):
        last_words = max(i for i, item in enumerate(order) if item == ("audio.words", index))
        assert last_words < order.index(("audio.done", index))
    assert all("timestamp_info" not in m for m, _ in client.of_type("audio.done"))


@pytest.mark.parametrize("fmt,rate", [("mp3", 24000), ("aac", 8000), ("opus", 48000), ("flac", 24000)])
async def test_compressed_times_match_the_decoded_audio(server, fmt, rate):
    """Times refer to the audio as a decoder plays it: for mp3 and aac, whose streams cannot carry the
    encoder's priming, that is later than the PCM by the priming. Checked by decoding the bytes and
    finding where the synthetic waveform lies in them."""
    client = await session(server.ws_url, timestamp_type="word", response_format=fmt, sample_rate=rate)
    await client.send(type="input.text", text=SENTENCES[0])
    await client.send(type="input.done")
    done = await client.until("audio.done")
    await client.ws.close()
    starts = done["timestamp_info"]["word_alignment"]["word_start_times_seconds"]
    offset = starts[0] - exact_words(SENTENCES[0])[0][1]
    container = av.open(io.BytesIO(bytes(client.audio[0])))
    decoded_rate = container.streams.audio[0].rate
    decoded = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]).astype(float)
    if decoded.dtype.kind != "f" or np.abs(decoded).max() > 2:
        decoded /= 32768.0
    reference = SyntheticSynthesizer(sample_rate=decoded_rate).render(SynthesisRequest(text=SENTENCES[0], voice=VOICE))
    reference = reference.astype(float) / 32768.0
    # The lag at which the reference best matches the decoded audio, searched over 0..200 ms.
    window = reference[: decoded_rate // 2]
    lags = range(0, decoded_rate // 5)
    lag = max(lags, key=lambda k: float(np.dot(decoded[k : k + len(window)], window)))
    assert offset == pytest.approx(lag / decoded_rate, abs=0.002), (fmt, rate, offset, lag / decoded_rate)
    assert_close([{"word": w, "start": s, "end": e} for w, s, e in zip(
        done["timestamp_info"]["word_alignment"]["words"], starts,
        done["timestamp_info"]["word_alignment"]["word_end_times_seconds"])], exact_words(SENTENCES[0]), offset)


# ------------------------------------------------------------------------------------------ cancel


@pytest.mark.parametrize("fmt,rate,strategy", [("pcm", 24000, "async"), ("mulaw", 8000, "sync"), ("pcm", 48000, "sync")])
async def test_cancel_reports_exactly_the_words_the_client_received(slow_server, fmt, rate, strategy):
    client = await session(slow_server.ws_url, timestamp_type="word", timestamp_transport_strategy=strategy,
                           response_format=fmt, sample_rate=rate)
    await client.send(type="input.text", text=TEXT, context_id="turn-1")
    # Into the middle of the second sentence (~0.3 s of its audio), then barge in.
    await client.into_sentence(1, int(0.3 * rate) * (1 if fmt == "mulaw" else 2))
    await client.send(type="input.cancel", context_id="turn-1")
    cancelled = await client.until("context.cancelled")
    await client.ws.close()
    # Independently: every word of sentence 0, and the words of sentence 1 whose end the bytes held reach.
    held = samples_held(len(client.audio[1]), fmt)
    expected = [(0, *w) for w in exact_words(SENTENCES[0])]
    expected += [(1, *w) for w in exact_words(SENTENCES[1]) if w[2] * rate <= held + 1e-6]
    assert 0 < len(expected) - len(exact_words(SENTENCES[0])) < len(exact_words(SENTENCES[1])), "not cut mid-sentence"
    assert cancelled["spoken_text"] == " ".join(w for _, w, _, _ in expected)
    assert [(w["sentence_index"], w["word"]) for w in cancelled["spoken_words"]] == [(i, w) for i, w, _, _ in expected]
    for got, (_, _, start, end) in zip(cancelled["spoken_words"], expected):
        assert (got["start"], got["end"]) == (pytest.approx(start, abs=2e-6), pytest.approx(end, abs=2e-6))
    assert cancelled["spoken_text"] == TEXT[: len(cancelled["spoken_text"])]  # a prefix of what was written
    cut_done = [m for m, _ in client.of_type("audio.done") if m["sentence_index"] == 1][0]
    assert cut_done["cancelled"] is True
    if strategy == "sync":  # the cut sentence's audio.done aligns the words it carried in full
        assert cut_done["timestamp_info"]["word_alignment"]["words"] == [w for i, w, _, _ in expected if i == 1]


@pytest.mark.parametrize("played_into_second_s", [0.3, 0.0, None])
async def test_cancel_with_the_playback_position_reports_what_was_heard(server, played_into_second_s):
    """The 8x backend sends sentences long before they play: at the cut the client holds two whole
    sentences and part of a third, but has played the first and 0.3 s of the second. With `played_ms` the
    words are those whose end the playback reached, not those sent."""
    client = await session(server.ws_url, timestamp_type="word", timestamp_transport_strategy="async")
    await client.send(type="input.text", text=TEXT, context_id="turn-1")
    await client.send(type="input.flush", context_id="turn-1")
    await client.into_sentence(2, 2000)  # sentences 0 and 1 sent whole
    first_s = len(client.audio[0]) / 2 / RATE
    played = None if played_into_second_s is None else (first_s + played_into_second_s) * 1000
    if played_into_second_s == 0.0:
        played = 0.0  # nothing has played yet
    await client.send(type="input.cancel", context_id="turn-1", **({} if played is None else {"played_ms": played}))
    cancelled = await client.until("context.cancelled")
    await client.ws.close()
    if played is None:  # the fallback: what was sent in full
        expected = [(0, w) for w, _, _ in exact_words(SENTENCES[0])] + [(1, w) for w, _, _ in exact_words(SENTENCES[1])]
        cut = [(2, w) for w, _, end in exact_words(SENTENCES[2]) if end * RATE <= len(client.audio[2]) // 2 + 1e-6]
        expected += cut
    elif played == 0.0:
        expected = []
    else:
        expected = [(0, w) for w, _, _ in exact_words(SENTENCES[0])]
        expected += [(1, w) for w, _, end in exact_words(SENTENCES[1]) if end <= played_into_second_s]
        assert 0 < len(expected) - len(exact_words(SENTENCES[0])) < len(exact_words(SENTENCES[1]))
    assert [(w["sentence_index"], w["word"]) for w in cancelled["spoken_words"]] == expected
    assert cancelled["spoken_text"] == " ".join(w for _, w in expected)


async def test_a_playback_position_that_is_not_a_number_is_refused(server):
    client = await session(server.ws_url, timestamp_type="word")
    await client.send(type="input.text", text="Hello there.", context_id="c")
    await client.send(type="input.cancel", context_id="c", played_ms=-5)
    error = await client.until("error")
    await client.ws.close()
    assert error["code"] == "invalid_message" and "played_ms" in error["message"]


async def test_cancel_before_any_audio_of_the_context_speaks_nothing(server):
    client = await session(server.ws_url, timestamp_type="word")
    await client.send(type="input.text", text="Half a sentence without an end", context_id="c")
    await client.send(type="input.cancel", context_id="c")
    cancelled = await client.until("context.cancelled")
    await client.ws.close()
    assert cancelled["spoken_text"] == "" and cancelled["spoken_words"] == []


async def test_an_utterance_keeps_a_bounded_number_of_spoken_words(slow_server, monkeypatch):
    import gateway.session.word_times

    monkeypatch.setattr(gateway.session.word_times, "MAX_SPOKEN_WORDS", 12)
    client = await session(slow_server.ws_url, timestamp_type="word")
    await client.send(type="input.text", text=TEXT, context_id="long")
    await client.send(type="input.flush", context_id="long")
    await client.into_sentence(2, 2000)  # sentences 0 and 1 (9 + 10 words) are sent whole
    await client.send(type="input.cancel", context_id="long")
    cancelled = await client.until("context.cancelled")
    await client.ws.close()
    whole = exact_words(SENTENCES[0]) + exact_words(SENTENCES[1])
    cut = [w for w in exact_words(SENTENCES[2]) if w[2] * RATE <= len(client.audio[2]) // 2 + 1e-6]
    # The last 12 of the words of the sentences sent whole are kept, then those of the cut sentence.
    assert [w["word"] for w in cancelled["spoken_words"]] == [w for w, _, _ in whole[-12:] + cut]


# ------------------------------------------------------------------------------------------ resume


@pytest.mark.parametrize("strategy", ["async", "sync"])
async def test_resume_tells_the_words_of_replayed_audio_again(server, strategy):
    client = await session(server.ws_url, timestamp_type="word", timestamp_transport_strategy=strategy)
    session_id = client.messages[0]["session_id"]
    await client.send(type="input.text", text=TEXT)
    await client.send(type="input.done")
    await client.into_sentence(1, 9600)
    position = len(client.audio[1])
    await client.ws.close()  # the connection drops mid-sentence; the session stays in the store
    resumed = Client(await websockets.connect(server.ws_url, max_size=None))
    resumed.open, resumed.audio = 1, {1: bytearray(client.audio[1][:position])}
    await resumed.send(type="session.resume", session_id=session_id, sentence_index=1, bytes_received=position)
    await resumed.until("session.done")
    await resumed.ws.close()
    assert {i: bytes(a) for i, a in resumed.audio.items() if i > 0} == {
        i: bytes(SyntheticSynthesizer(sample_rate=RATE).render(SynthesisRequest(text=SENTENCES[i], voice=VOICE)))
        for i in (1, 2)}
    for index in (1, 2):
        if strategy == "async":
            words = []
            for message, held in resumed.of_type("audio.words"):
                if message["sentence_index"] == index:
                    assert all(w["end"] * RATE <= held[index] // 2 + 1e-6 for w in message["words"])
                    words.extend(message["words"])
        else:
            done = [m for m, _ in resumed.of_type("audio.done") if m["sentence_index"] == index][0]
            alignment = done["timestamp_info"]["word_alignment"]
            words = [{"word": w, "start": s, "end": e} for w, s, e in zip(
                alignment["words"], alignment["word_start_times_seconds"], alignment["word_end_times_seconds"])]
        assert_close(words, exact_words(SENTENCES[index]))


# ------------------------------------------------------------------------------------------ warnings


async def test_char_timestamps_fall_back_to_words_with_a_warning(server):
    ws = await websockets.connect(server.ws_url, max_size=None)
    client = Client(ws)
    await client.send(type="session.config", voice=VOICE, stream_audio=True, timestamp_type="char")
    started = await client.until("session.started")
    assert [(w["code"], w["field"]) for w in started["warnings"]] == [("timestamps_unsupported", "timestamp_type")]
    await client.send(type="input.text", text=SENTENCES[0])
    await client.send(type="input.done")
    done = await client.until("audio.done")
    await ws.close()
    assert done["timestamp_info"]["word_alignment"]["words"] == [w for w, _, _ in exact_words(SENTENCES[0])]


# ------------------------------------------------------------------------------------------ worker


async def test_a_worker_backend_carries_the_timings(tmp_path):
    """`voxgate worker` in a subprocess, reached through RemoteSynthesizer: the timings cross its socket."""
    from tests.test_engine_worker import start_worker, stop_worker
    from tts_backend.remote import RemoteSynthesizer

    path = str(tmp_path / "w.sock")
    worker = start_worker(path, "--backend", "synthetic", "--option", "speed=2", "--option", "chunk_ms=40")
    try:
        with running_gateway(RemoteSynthesizer(socket=path, connect_timeout_s=60)) as gateway:
            client = await session(gateway.ws_url, timestamp_type="word", timestamp_transport_strategy="async")
            await client.send(type="input.text", text=TEXT, context_id="w")
            await client.into_sentence(1, int(0.3 * RATE) * 2)
            await client.send(type="input.cancel", context_id="w")
            cancelled = await client.until("context.cancelled")
            await client.ws.close()
    finally:
        stop_worker(worker)
    told = [w for m, _ in client.of_type("audio.words") if m["sentence_index"] == 0 for w in m["words"]]
    assert_close(told, exact_words(SENTENCES[0]))
    held = len(client.audio[1]) // 2
    expected = exact_words(SENTENCES[0]) + [w for w in exact_words(SENTENCES[1]) if w[2] * RATE <= held + 1e-6]
    assert cancelled["spoken_text"] == " ".join(w for w, _, _ in expected)


# ------------------------------------------------------------------------------------------ piper


def test_written_words_take_the_spoken_words_espeak_merged_or_expanded():
    from tts_backend.piper_words import assign

    # Counts agree: each written word its own count ("$3.50" -> 5 spoken words).
    assert assign([(1, 2), (5, 20), (1, 2)], [2, 4, 4, 4, 4, 4, 2]) == [1, 5, 1]
    # "in the" spoken as one word "ɪnðə": it goes to one of them and the words after it stay in place.
    assert assign([(1, 2), (1, 2), (3, 20), (1, 3)], [4, 12, 6, 2, 3]) == [1, 0, 3, 1]


async def test_piper_times_every_written_word():
    text = "It costs $3.50 - or so they say, in the 1990s, e.g. at 10:30 today."
    with running_gateway("piper") as piper:
        ws = await websockets.connect(piper.ws_url, max_size=None)
        client = Client(ws)
        await client.send(type="session.config", stream_audio=True, response_format="pcm", sample_rate=22050,
                          timestamp_type="word")
        started = await client.until("session.started")
        assert "warnings" not in started
        await client.send(type="input.text", text=text)
        await client.send(type="input.done")
        done = await client.until("audio.done")
        await ws.close()
    alignment = done["timestamp_info"]["word_alignment"]
    words = [{"word": w, "start": s, "end": e} for w, s, e in zip(
        alignment["words"], alignment["word_start_times_seconds"], alignment["word_end_times_seconds"])]
    assert [w["word"] for w in words] == [w for w, _, _ in split_words(text)]
    assert_monotonic(words)
    assert words[-1]["end"] <= done["duration_ms"] / 1000 + 1e-4
    lengths = {w["word"]: w["end"] - w["start"] for w in words}
    # "$3.50" is spoken as five words, "10:30" as two: far longer than "so" or "it".
    assert lengths["$3.50 -"] > 3 * lengths["so"] and lengths["10:30"] > 2 * lengths["It"]
    # "in the" is one spoken word: each of the two has its share of it, and "1990s," right after keeps its
    # own audio (speech, not a pause: the words after a merge are not shifted).
    pcm = np.frombuffer(bytes(client.audio[0]), dtype="<i2").astype(float)
    nineties = next(w for w in words if w["word"] == "1990s,")
    inside = pcm[int(nineties["start"] * 22050) : int(nineties["end"] * 22050)]
    assert np.sqrt(np.mean(inside**2)) > 1000
    assert lengths["in"] > 0.04 and lengths["the"] > 0.04, lengths


@pytest.mark.parametrize("text, merged", [
    ("For an instant he saw Pierre drawn like a silhouette against the sky.", ("For", "an")),
    ("He sat in the car and looked at the house.", ("in", "the")),
])
async def test_piper_gives_words_run_together_their_share(text, merged):
    """espeak runs some words together ("for an" as one spoken word): before, one of them had it all and the
    other zero length. Each now spans its own sounds: no word has zero length, the two are contiguous
    and each is shorter than the merged word."""
    backend = PiperSynthesizer()
    await backend.start()
    try:
        timings = [w async for chunk in backend.synthesize(SynthesisRequest(text=text, voice=backend.default_voice,
                                                                            word_timestamps=True))
                   for w in chunk.words]
    finally:
        await backend.stop()
    assert [w.word for w in timings] == text.split()
    assert all(w.end > w.start for w in timings), [(w.word, w.start, w.end) for w in timings]
    first, second = (next(w for w in timings if w.word == m) for m in merged)
    assert first.end == second.start
    assert all(w.end - w.start >= 0.03 * backend.sample_rate for w in (first, second))


# ------------------------------------------------------------------------------------------ HTTP


def response_words(sentences: list[str]) -> list[tuple[str, float, float]]:
    """The exact words of several sentences spoken as one file: each sentence's times after the ones before."""
    words, offset = [], 0.0
    for sentence in sentences:
        words += [(w, offset + a, offset + b) for w, a, b in exact_words(sentence)]
        n = len(SyntheticSynthesizer(sample_rate=RATE).render(SynthesisRequest(text=sentence, voice=VOICE)))
        offset += n / RATE
    return words


@pytest.mark.parametrize("fmt,rate", [("pcm", 24000), ("wav", 8000), ("mp3", 24000)])
async def test_http_header_carries_the_words_of_a_whole_body(server, fmt, rate):
    import httpx

    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(server.url + "/v1/audio/speech", json={
            "input": TEXT, "voice": VOICE, "response_format": fmt, "sample_rate": rate, "timestamp_type": "word"})
    assert response.status_code == 200, response.text
    assert "x-voxgate-warnings" not in response.headers
    alignment = json.loads(response.headers["x-word-timestamps"])
    words = [{"word": w, "start": s, "end": e} for w, s, e in zip(
        alignment["words"], alignment["word_start_times_seconds"], alignment["word_end_times_seconds"])]
    offset = 1105 / rate if fmt == "mp3" else 0.0  # mp3's priming, which decoders play
    assert_close(words, response_words(SENTENCES), offset)
    assert_monotonic(words)


async def test_http_sse_sends_words_after_the_audio_that_completes_them(server):
    import base64

    import httpx

    events = []
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", server.url + "/v1/audio/speech", json={
                "input": TEXT, "voice": VOICE, "stream_format": "sse", "response_format": "pcm",
                "timestamp_type": "word"}) as response:
            audio = 0
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    if event["type"] == "speech.audio.delta":
                        audio += len(base64.b64decode(event["audio"]))
                    events.append((event, audio))
    words = []
    for event, held in events:
        if event["type"] == "speech.audio.words":
            assert all(w["end"] * RATE <= held // 2 + 1 for w in event["words"])
            words.extend(event["words"])
    assert_close(words, response_words(SENTENCES))
    assert len([e for e, _ in events if e["type"] == "speech.audio.words"]) > 3  # as the audio went
    assert events[-1][0]["type"] == "speech.audio.done"


async def test_http_refuses_a_header_too_large_and_warns_where_no_timestamps(server):
    import httpx

    async with httpx.AsyncClient(timeout=60) as http:
        refused = await http.post(server.url + "/v1/audio/speech", json={
            "input": "word " * 3000, "voice": VOICE, "timestamp_type": "word"})
        assert refused.status_code == 413 and "sse" in refused.text
    untimed = SyntheticSynthesizer(sample_rate=RATE)
    untimed.honours = frozenset()  # a backend that gives no timestamps
    with running_gateway(untimed) as plain:
        async with httpx.AsyncClient(timeout=60) as http:
            response = await http.post(plain.url + "/v1/audio/speech", json={
                "input": SENTENCES[0], "voice": VOICE, "response_format": "pcm", "word_timestamps": True})
    assert "x-word-timestamps" not in response.headers
    assert [w["code"] for w in json.loads(response.headers["x-voxgate-warnings"])] == ["timestamps_unsupported"]


async def test_a_barge_in_after_the_whole_utterance_went_out_reports_what_was_heard(server):
    """A voice faster than real time sends a whole reply before the listener has heard half of it: the
    utterance is done on the gateway (utterance.done sent) while it still plays. A cancel with the playback
    position must still say what was heard, from that finished utterance; without the position nothing was
    left to cut and nothing is reported, as before."""
    client = await session(server.ws_url, timestamp_type="word", timestamp_transport_strategy="async")
    await client.send(type="input.text", text=TEXT, context_id="turn-1")
    await client.send(type="input.done", context_id="turn-1")
    await client.until("utterance.done")
    first_s = len(client.audio[0]) / 2 / RATE
    await client.send(type="input.cancel", context_id="turn-1", played_ms=(first_s + 0.3) * 1000)
    heard = await client.until("context.cancelled")
    await client.send(type="input.cancel", context_id="turn-1")
    unsaid = await client.until("context.cancelled")
    await client.ws.close()
    expected = [(0, w) for w, _, _ in exact_words(SENTENCES[0])]
    expected += [(1, w) for w, _, end in exact_words(SENTENCES[1]) if end <= 0.3]
    assert 0 < len(expected) - len(exact_words(SENTENCES[0])) < len(exact_words(SENTENCES[1]))
    assert [(w["sentence_index"], w["word"]) for w in heard["spoken_words"]] == expected
    assert heard["spoken_text"] == " ".join(w for _, w in expected)
    assert not unsaid.get("spoken_words") and not unsaid.get("spoken_text")
