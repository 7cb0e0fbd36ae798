"""Timestamps never cost audio (issue 32): a sentence whose word timings are late still gets all its audio and
its `audio.done`, at most `word_timestamps_wait_s` after its audio, with the warning `timestamps_late`
instead of its words; never an error, never a failed request, never a worker set aside.

The slow aligner is the synthetic backend with `words_delay_s`: it sends a sentence's word timings in a
chunk of their own that long after its last audio, as qwen3 with a forced aligner does. Here the delay is
far past the bound (WORDS_LATE_S); before the fix, `audio.done` waited for the words that long.
Against a real gateway on loopback, its backend in-process or a real `voxgate worker` process behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest
import websockets

from tests.gateway_server import running_gateway
from tests.worker_fixtures import synthetic_worker_args, wait_for_async, workers
from tts_backend.base import SynthesisRequest
from tts_backend.remote import RemoteSynthesizer
from tts_backend.synthetic import SyntheticSynthesizer

RATE = 24000
VOICE = "tone-mid"
SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Then everyone went home, tired but happy."]
WORDS_LATE_S = 30.0  # when the slow aligner's words come: far past the bound
WAIT_S = 0.5  # the gateway's bound on the wait for them (word_timestamps_wait_s)
# Each message must come within this (a loaded 2-core machine is slow; the words come 60 times later).
MESSAGE_TIMEOUT_S = WORDS_LATE_S / 2


def audio_bytes(text: str) -> int:
    return 2 * len(SyntheticSynthesizer(sample_rate=RATE).render(SynthesisRequest(text=text, voice=VOICE)))


@contextlib.contextmanager
def gateway_with_a_slow_aligner(where: str, words_delay_s: float = WORDS_LATE_S, wait_s: float = WAIT_S):
    """A real gateway whose backend's word timings come `words_delay_s` after each sentence's audio: the
    synthetic backend in the gateway's process, or in a `voxgate worker` reached through the pool. Yields
    (gateway, pool or None)."""
    settings = {"word_timestamps_wait_s": wait_s}
    if where == "in-process":
        with running_gateway(SyntheticSynthesizer(sample_rate=RATE, speed=8, words_delay_s=words_delay_s),
                             **settings) as gateway:
            yield gateway, None
        return
    with workers(synthetic_worker_args("--option", f"words_delay_s={words_delay_s}", speed=8)) as (worker,):
        # The pool's deadlines shorter than the late words' delay: the worker's keep-alives must carry it.
        pool = RemoteSynthesizer(workers=worker.address, connect_timeout_s=30, info_refresh_s=0.1,
                                 first_audio_timeout_s=5, chunk_timeout_s=2.5)
        with running_gateway(pool, **settings) as gateway:
            yield gateway, pool


async def speak(url: str, timestamps: str, text: str = " ".join(SENTENCES), **config) -> list[dict | int]:
    """A session in `timestamps` mode that says `text`: every text message received, and for the audio the
    byte count of each run of binary frames."""
    received: list[dict | int] = []
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.config", "voice": VOICE, "response_format": "pcm",
                                  "stream_audio": True, "timestamp_type": "word",
                                  "timestamp_transport_strategy": timestamps, **config}))
        await ws.send(json.dumps({"type": "input.text", "text": text}))
        await ws.send(json.dumps({"type": "input.done"}))
        while True:
            frame = await asyncio.wait_for(ws.recv(), MESSAGE_TIMEOUT_S)
            if isinstance(frame, bytes):
                if received and isinstance(received[-1], int):
                    received[-1] += len(frame)
                else:
                    received.append(len(frame))
                continue
            message = json.loads(frame)
            received.append(message)
            if message["type"] in ("session.done", "error"):
                return received


async def late_counted(url: str, transport: str) -> float:
    """The gateway's voxgate_word_timestamps_late_total for `transport`."""
    async with httpx.AsyncClient(timeout=MESSAGE_TIMEOUT_S) as http:
        metrics = (await http.get(url + "/metrics")).text
    prefix = f'voxgate_word_timestamps_late_total{{transport="{transport}"}} '
    return sum(float(line[len(prefix):]) for line in metrics.splitlines() if line.startswith(prefix))


def without_words(received: list[dict | int]) -> None:
    """Every sentence's audio whole and its audio.done warning timestamps_late, with no words; no error."""
    kinds = [m if isinstance(m, int) else m["type"] for m in received]
    assert kinds[0] == "session.started" and kinds[-1] == "session.done", kinds
    assert "error" not in kinds and "audio.words" not in kinds, kinds
    assert [m for m in received[1:-1] if not isinstance(m, int)] == [
        m for m in received if not isinstance(m, int) and m["type"] in ("audio.start", "audio.done")]
    dones = [m for m in received if not isinstance(m, int) and m["type"] == "audio.done"]
    assert [d["sentence_index"] for d in dones] == [0, 1]
    for done, sentence in zip(dones, SENTENCES):
        assert done["error"] is False and done["total_bytes"] == audio_bytes(sentence), done
        assert "timestamp_info" not in done, done
        assert [w["code"] for w in done["warnings"]] == ["timestamps_late"], done
    assert [m for m in received if isinstance(m, int)] == [audio_bytes(s) for s in SENTENCES]


@pytest.mark.parametrize("where", ["in-process", "worker"])
@pytest.mark.parametrize("timestamps", ["sync", "async"])
async def test_late_word_timings_cost_neither_audio_nor_audio_done(where, timestamps):
    with gateway_with_a_slow_aligner(where) as (gateway, pool):
        started = time.monotonic()
        received = await speak(gateway.ws_url, timestamps)
        took = time.monotonic() - started
        without_words(received)
        assert took < WORDS_LATE_S / 2, took  # bounded: the words would have taken WORDS_LATE_S per sentence
        assert await late_counted(gateway.url, "websocket") == 2
        if pool is not None:  # a late aligner is no fault of the worker's
            (member,) = pool.members.values()
            assert pool.quarantined == 0 and pool.failovers == 0 and member.routable
            # ...and it stopped waiting for the late words (the stream was closed), long before they came.
            await wait_for_async(lambda: member.info["streams"] == 0, MESSAGE_TIMEOUT_S / 2,
                                 "the worker ending its late sentences")
            received = await speak(gateway.ws_url, timestamps)  # and it serves the next session
            without_words(received)


async def test_a_sentence_cut_by_markup_is_bounded_in_each_part():
    """A <break> cuts the sentence into two backend requests, each with its own late words: each part's
    wait is bounded, the second part and the pause are spoken, and the sentence warns once."""
    text = "The quick brown fox <break time='300ms'/> jumps over the lazy dog."
    with gateway_with_a_slow_aligner("in-process", words_delay_s=0.3, wait_s=10.0) as (gateway, _):
        on_time = await speak(gateway.ws_url, "sync", text, text_markup="ssml")
    with gateway_with_a_slow_aligner("in-process") as (gateway, _):
        started = time.monotonic()
        late = await speak(gateway.ws_url, "sync", text, text_markup="ssml")
        took = time.monotonic() - started
    (done_on_time,) = [m for m in on_time if not isinstance(m, int) and m["type"] == "audio.done"]
    (done,) = [m for m in late if not isinstance(m, int) and m["type"] == "audio.done"]
    assert done_on_time["timestamp_info"]["word_alignment"]["words"] == text.replace("<break time='300ms'/> ", "").split()
    assert took < WORDS_LATE_S / 2, took
    assert done["total_bytes"] == done_on_time["total_bytes"] == sum(m for m in late if isinstance(m, int))
    assert "timestamp_info" not in done and [w["code"] for w in done["warnings"]] == ["timestamps_late"], done
    assert "error" not in [m["type"] for m in late if not isinstance(m, int)]


@pytest.mark.parametrize("where", ["in-process", "worker"])
async def test_words_within_the_bound_still_come(where):
    """A slow aligner within the bound: the words come in audio.done as ever, with no warning."""
    with gateway_with_a_slow_aligner(where, words_delay_s=0.3, wait_s=10.0) as (gateway, _):
        received = await speak(gateway.ws_url, "sync")
        assert await late_counted(gateway.url, "websocket") == 0
    dones = [m for m in received if not isinstance(m, int) and m["type"] == "audio.done"]
    assert len(dones) == 2
    for done, sentence in zip(dones, SENTENCES):
        assert "warnings" not in done, done
        assert done["timestamp_info"]["word_alignment"]["words"] == sentence.split()


@pytest.mark.parametrize("where", ["in-process", "worker"])
async def test_http_late_words_leave_the_audio_whole_and_warn(where):
    """The X-Word-Timestamps body (made whole for its header) and SSE: all the audio, status 200, no words
    and the warning (in X-Voxgate-Warnings, or in speech.audio.done with SSE); no speech.audio.error."""
    import base64

    body = {"input": " ".join(SENTENCES), "voice": VOICE, "response_format": "pcm", "timestamp_type": "word"}
    with gateway_with_a_slow_aligner(where) as (gateway, pool):
        async with httpx.AsyncClient(timeout=MESSAGE_TIMEOUT_S) as http:
            response = await http.post(gateway.url + "/v1/audio/speech", json=body)
            events = []
            async with http.stream("POST", gateway.url + "/v1/audio/speech",
                                   json={**body, "stream_format": "sse"}) as sse:
                async for line in sse.aiter_lines():
                    if line.startswith("data: "):
                        events.append(json.loads(line[6:]))
        if pool is not None:
            assert pool.quarantined == 0 and pool.failovers == 0
        assert await late_counted(gateway.url, "http") == 4  # two sentences, two responses
    total = sum(audio_bytes(s) for s in SENTENCES)
    assert response.status_code == 200 and len(response.content) == total
    assert json.loads(response.headers["x-word-timestamps"])["words"] == []
    assert [w["code"] for w in json.loads(response.headers["x-voxgate-warnings"])] == ["timestamps_late"]
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "speech.audio.done" and set(kinds) == {"speech.audio.delta", "speech.audio.done"}, kinds
    assert sum(len(base64.b64decode(e["audio"])) for e in events if e["type"] == "speech.audio.delta") == total
    assert [w["code"] for w in events[-1]["warnings"]] == ["timestamps_late"]
