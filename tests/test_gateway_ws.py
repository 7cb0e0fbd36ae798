"""The WebSocket protocol end to end: a real uvicorn server, the real `websockets` client.

Most tests use the synthetic backend (deterministic tones, named as such) so that they are fast and
exact; tests/test_gateway_piper.py repeats the integrity check with the real Piper voice.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
import wave

import pytest
import websockets

from tests.gateway_server import RecordingBackend, audio_by_sentence, receive_until, running_gateway
from tts_backend.base import SynthesisRequest
from tts_backend.synthetic import SyntheticSynthesizer

TEXT = "Hello there, friend. Dr. Smith paid $3.50 at 5 p.m. today! Is the weather nice? It is"


@pytest.fixture(scope="module")
def server():
    with running_gateway("synthetic") as running:
        yield running


def send(ws, **message):
    return ws.send(json.dumps(message))


def types(messages):
    return [m["type"] if isinstance(m, dict) else "binary" for m in messages]


async def direct_pcm(backend, texts, voice):
    """What the backend produces for each sentence when called directly."""
    out = []
    for text in texts:
        pcm = b"".join([c.pcm async for c in backend.synthesize(SynthesisRequest(text=text, voice=voice))])
        out.append(pcm)
    return out


# ------------------------------------------------------------------------------------------ happy paths


async def test_vllm_omni_client_works_unchanged(server):
    """A client written for vLLM-Omni: config, text word by word, input.done, no context ids, default wav."""
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, type="session.config", model="any", voice="tone-mid", task_type="CustomVoice",
                   language="Auto", response_format="wav", speed=1.0)
        words = TEXT.split(" ")
        for i, word in enumerate(words):
            await send(ws, type="input.text", text=word + (" " if i < len(words) - 1 else ""))
        await send(ws, type="input.done")
        messages = await receive_until(ws, "session.done")
    kinds = [t for t in types(messages) if t != "session.started"]
    starts = [m for m in messages if isinstance(m, dict) and m["type"] == "audio.start"]
    assert [m["sentence_text"] for m in starts] == [
        "Hello there, friend.", "Dr. Smith paid $3.50 at 5 p.m. today!", "Is the weather nice?", "It is",
    ]
    # Non-streaming: exactly one binary frame (a whole WAV file) per sentence, between start and done.
    assert kinds == ["audio.start", "binary", "audio.done"] * 4 + ["session.done"]
    assert messages[-1] == {"type": "session.done", "total_sentences": 4}
    for index, data in audio_by_sentence(messages).items():
        with wave.open(io.BytesIO(data)) as wav:
            assert wav.getframerate() == 24000 and wav.getnchannels() == 1 and wav.getsampwidth() == 2
            assert wav.getnframes() > 0
        done = next(m for m in messages if isinstance(m, dict) and m["type"] == "audio.done" and m["sentence_index"] == index)
        assert done["total_bytes"] == len(data) and done["error"] is False


async def test_streamed_pcm_is_byte_identical_to_the_backend(server):
    """Audio integrity: the streamed PCM of a multi-sentence text equals the backend's own output for the
    same sentences (synthetic backend; the Piper version is in test_gateway_piper.py)."""
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, type="session.config", voice="tone-high", stream_audio=True)
        await send(ws, type="input.text", text=TEXT)
        await send(ws, type="input.done")
        messages = await receive_until(ws, "session.done")
    started = messages[0]
    assert started["type"] == "session.started" and started["format"] == "pcm" and started["sample_rate"] == 24000
    starts = [m for m in messages if isinstance(m, dict) and m["type"] == "audio.start"]
    dones = [m for m in messages if isinstance(m, dict) and m["type"] == "audio.done"]
    audio = audio_by_sentence(messages)
    expected = await direct_pcm(SyntheticSynthesizer(), [m["sentence_text"] for m in starts], "tone-high")
    assert [audio[m["sentence_index"]] for m in starts] == expected
    assert b"".join(audio[i] for i in sorted(audio)) == b"".join(expected)
    for done, pcm in zip(dones, expected):
        assert done["total_bytes"] == len(pcm)
        assert done["duration_ms"] == pytest.approx(len(pcm) / 2 / 24000 * 1000, abs=0.1)
    # Each frame is whole samples and no longer than max_frame_ms (200 ms).
    frames = [m for m in messages if isinstance(m, bytes)]
    assert all(len(f) % 2 == 0 and 0 < len(f) <= 24000 * 2 // 5 for f in frames)


async def test_audio_start_precedes_binary_and_sentences_never_interleave(server):
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, type="session.config", stream_audio=True)
        for context in ("a", "b"):
            await send(ws, type="input.text", context_id=context, text=f"Context {context} one. Context {context} two. ")
        for context in ("a", "b"):
            await send(ws, type="input.done", context_id=context)
        messages = await receive_until(ws, "utterance.done")
        messages += await receive_until(ws, "utterance.done")
    open_sentence = None
    for message in messages:
        if isinstance(message, bytes):
            assert open_sentence is not None
        elif message["type"] == "audio.start":
            assert open_sentence is None, "a sentence started while another was still open"
            open_sentence = message["sentence_index"]
        elif message["type"] == "audio.done":
            assert message["sentence_index"] == open_sentence
            open_sentence = None
    indices = [m["sentence_index"] for m in messages if isinstance(m, dict) and m["type"] == "audio.start"]
    assert indices == [0, 1, 2, 3]


async def test_contexts_each_get_their_own_utterance_done(server):
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, type="session.config", stream_audio=True)
        await send(ws, type="input.text", context_id="turn-1", text="First turn has two sentences. Here is the second.")
        await send(ws, type="input.text", context_id="turn-2", text="Second turn, one sentence.")
        await send(ws, type="input.done", context_id="turn-1")
        await send(ws, type="input.done", context_id="turn-2")
        first = await receive_until(ws, "utterance.done")
        second = await receive_until(ws, "utterance.done")
    assert first[-1] == {"type": "utterance.done", "context_id": "turn-1", "total_sentences": 2}
    assert second[-1] == {"type": "utterance.done", "context_id": "turn-2", "total_sentences": 1}
    starts = [m for m in first + second if isinstance(m, dict) and m["type"] == "audio.start"]
    assert [(m["context_id"], m["sentence_index"]) for m in starts] == [("turn-1", 0), ("turn-1", 1), ("turn-2", 2)]
    assert not any(isinstance(m, dict) and m["type"] == "session.done" for m in first + second)


async def test_flush_speaks_unterminated_text_and_keeps_the_utterance_open(server):
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, type="session.config", stream_audio=True)
        await send(ws, type="input.text", text="No final punctuation here")
        await send(ws, type="input.flush")
        flushed = await receive_until(ws, "audio.done")
        await send(ws, type="input.text", text="More words. ")
        await send(ws, type="input.done")
        rest = await receive_until(ws, "session.done")
    assert [m["sentence_text"] for m in flushed if isinstance(m, dict) and m["type"] == "audio.start"] == [
        "No final punctuation here"
    ]
    assert rest[-1] == {"type": "session.done", "total_sentences": 2}


async def test_session_is_reusable_after_input_done_and_config_can_change_between_utterances(server):
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, type="session.config", stream_audio=True)
        first = await receive_until(ws, "session.started")
        await send(ws, type="input.text", text="One. ")
        await send(ws, type="input.done")
        await receive_until(ws, "session.done")
        await send(ws, type="session.config", stream_audio=True, response_format="mulaw", voice="tone-low")
        second = await receive_until(ws, "session.started")
        await send(ws, type="input.text", text="Two. ")
        await send(ws, type="input.done")
        messages = await receive_until(ws, "session.done")
    assert second[-1]["session_id"] == first[-1]["session_id"]
    assert (second[-1]["format"], second[-1]["sample_rate"]) == ("mulaw", 8000)
    start = next(m for m in messages if isinstance(m, dict) and m["type"] == "audio.start")
    assert (start["format"], start["sample_rate"], start["sentence_index"]) == ("mulaw", 8000, 1)
    assert messages[-1]["total_sentences"] == 2
    mulaw = b"".join(m for m in messages if isinstance(m, bytes))
    # "Two." is 4 characters -> 4/15 s from the synthetic backend: 6400 samples at 24 kHz, 2133 at 8 kHz.
    assert abs(len(mulaw) - 2133) <= 4


async def test_resampled_pcm_reports_its_rate_and_length(server):
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, type="session.config", stream_audio=True, sample_rate=16000)
        await send(ws, type="input.text", text="Resampled to sixteen kilohertz for a phone line.")
        await send(ws, type="input.done")
        messages = await receive_until(ws, "session.done")
    start = next(m for m in messages if isinstance(m, dict) and m["type"] == "audio.start")
    done = next(m for m in messages if isinstance(m, dict) and m["type"] == "audio.done")
    pcm = b"".join(m for m in messages if isinstance(m, bytes))
    assert start["sample_rate"] == 16000
    assert done["total_bytes"] == len(pcm)
    assert len(pcm) / 2 / 16000 * 1000 == pytest.approx(done["duration_ms"], abs=2)


async def test_ping_pong_and_alias_path(server):
    async with websockets.connect(server.url.replace("http", "ws") + "/v1/tts/stream") as ws:
        await send(ws, type="ping", id="before-config")
        assert (await receive_until(ws, "pong"))[-1] == {"type": "pong", "id": "before-config"}
        await send(ws, type="session.config")
        await send(ws, type="ping", id=7)
        messages = await receive_until(ws, "pong")
    assert messages[-1] == {"type": "pong", "id": 7, "inputs_received": 0}  # ext: no input yet


async def test_session_close_finishes_open_text_then_closes_normally(server):
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, type="session.config", stream_audio=True)
        await send(ws, type="input.text", text="Unfinished words that must still be spoken")
        await send(ws, type="session.close")
        messages = await receive_until(ws, "session.done")
        with pytest.raises(websockets.ConnectionClosedOK):
            await ws.recv()
        assert ws.close_code == 1000
    assert [m["sentence_text"] for m in messages if isinstance(m, dict) and m["type"] == "audio.start"] == [
        "Unfinished words that must still be spoken"
    ]
    assert messages[-1] == {"type": "session.done", "total_sentences": 1}


# ------------------------------------------------------------------------------------- pipelining, cancel


async def test_next_sentence_is_synthesized_while_the_current_one_is_sent():
    # Paced like a real engine: 150 ms to the first chunk, then 4x faster than real time.
    backend = RecordingBackend(SyntheticSynthesizer(first_chunk_delay_s=0.15, speed=4.0))
    with running_gateway(backend) as server:
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="session.config", stream_audio=True)
            await send(ws, type="input.text", text="The first sentence is long enough to take a while. Second one. Third one here.")
            await send(ws, type="input.done")
            messages = await receive_until(ws, "session.done")
    records = backend.records
    assert [r.text for r in records] == ["The first sentence is long enough to take a while.", "Second one.", "Third one here."]
    audio = audio_by_sentence(messages)
    for previous, following, index in zip(records, records[1:], (0, 1)):
        # Each sentence starts as soon as the one before is made, one at a time (the head first) ...
        assert 0 <= following.started - previous.finished < 0.05
        # ... and its first audio exists before the previous sentence, played from its first chunk in
        # real time, runs out: no gap.
        played_until = previous.chunk_times[0] + len(audio[index]) / 2 / 24000
        assert following.chunk_times[0] < played_until
    assert messages[-1]["total_sentences"] == 3


async def test_cancel_stops_synthesis_within_one_chunk_and_sends_no_more_audio():
    # Real-time pacing so that the utterance is still being made when the cancel arrives.
    backend = RecordingBackend(SyntheticSynthesizer(speed=1.0, chunk_ms=80))
    with running_gateway(backend, lookahead_sentences=1) as server:
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="session.config", stream_audio=True)
            await send(ws, type="input.text", context_id="talk",
                       text="This sentence takes a few seconds of audio to speak out loud. Then another one follows it. ")
            await receive_until(ws, "audio.start")
            await ws.recv()  # the first binary frame
            await send(ws, type="input.cancel", context_id="talk")
            cancelled_sent = time.monotonic()
            messages = await receive_until(ws, "context.cancelled")
            # Nothing of that context follows: only the pong of a ping sent afterwards.
            await send(ws, type="ping", id="after")
            after = await receive_until(ws, "pong")
            # The session is still usable on another context.
            await send(ws, type="input.text", context_id="next", text="Still here.")
            await send(ws, type="input.done", context_id="next")
            later = await receive_until(ws, "utterance.done")
    done = next(m for m in messages if isinstance(m, dict) and m["type"] == "audio.done")
    assert done["cancelled"] is True and done["context_id"] == "talk" and done["sentence_index"] == 0
    assert messages[-1] == {"type": "context.cancelled", "context_id": "talk", "sentence_index": 0}
    assert types(after) == ["pong"]
    assert later[-1] == {"type": "utterance.done", "context_id": "next", "total_sentences": 1}
    cut = [r for r in backend.records if r.text.startswith("This sentence")][0]
    assert cut.closed is not None and cut.finished is None
    # At most one chunk was produced after the cancel reached the server.
    assert sum(t > cancelled_sent for t in cut.chunk_times) <= 1
    assert all(r.finished is None for r in backend.records if r.text.startswith("Then another"))


async def test_cancel_of_one_context_leaves_the_others_alone():
    backend = RecordingBackend(SyntheticSynthesizer(speed=3.0))
    with running_gateway(backend) as server:
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="session.config", stream_audio=True)
            await send(ws, type="input.text", context_id="a", text="Context a speaks first and for a while. More of a. ")
            await send(ws, type="input.text", context_id="b", text="Context b waits its turn. ")
            await send(ws, type="input.done", context_id="b")
            await receive_until(ws, "audio.start")
            await send(ws, type="input.cancel", context_id="a")
            messages = await receive_until(ws, "utterance.done")
    cancelled = [m for m in messages if isinstance(m, dict) and m["type"] == "context.cancelled"]
    assert cancelled == [{"type": "context.cancelled", "context_id": "a", "sentence_index": 0}]
    after = messages[messages.index(cancelled[0]) + 1 :]
    starts = [m for m in after if isinstance(m, dict) and m["type"] == "audio.start"]
    assert [m["context_id"] for m in starts] == ["b"]
    assert messages[-1] == {"type": "utterance.done", "context_id": "b", "total_sentences": 1}


async def test_cancel_without_contexts_then_a_new_utterance():
    with running_gateway(SyntheticSynthesizer(speed=2.0)) as server:
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="session.config", stream_audio=True)
            await send(ws, type="input.text", text="A long first answer that the user interrupts halfway through. And it goes on.")
            await receive_until(ws, "audio.start")
            await send(ws, type="input.cancel")
            cancelled = await receive_until(ws, "context.cancelled")
            await send(ws, type="input.text", text="A new answer.")
            await send(ws, type="input.done")
            messages = await receive_until(ws, "session.done")
    assert "context_id" not in cancelled[-1]
    assert [m["sentence_text"] for m in messages if isinstance(m, dict) and m["type"] == "audio.start"] == ["A new answer."]


async def test_a_failing_sentence_is_reported_and_the_rest_is_spoken():
    backend = RecordingBackend(SyntheticSynthesizer(), fail_on="BROKEN")
    with running_gateway(backend) as server:
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="session.config", stream_audio=True)
            await send(ws, type="input.text", text="Fine one. This one is BROKEN. Fine again.")
            await send(ws, type="input.done")
            messages = await receive_until(ws, "session.done")
    error = next(m for m in messages if isinstance(m, dict) and m["type"] == "error")
    assert error["code"] == "synthesis_failed" and error["sentence_index"] == 1 and error["retryable"] is True
    dones = [m for m in messages if isinstance(m, dict) and m["type"] == "audio.done"]
    assert [(d["sentence_index"], d["error"]) for d in dones] == [(0, False), (1, True), (2, False)]
    assert dones[1]["total_bytes"] == 0
    assert messages[-1]["total_sentences"] == 3


# ------------------------------------------------------------------------------------- errors and limits


async def expect_error(ws, code):
    messages = await receive_until(ws, "error")
    assert messages[-1]["code"] == code, messages[-1]
    return messages[-1]


async def assert_still_usable(ws):
    await send(ws, type="ping", id="alive")
    assert (await receive_until(ws, "pong"))[-1]["id"] == "alive"


async def test_bad_json_unknown_type_and_invalid_messages_are_not_fatal(server):
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, type="session.config", stream_audio=True)
        await receive_until(ws, "session.started")
        await ws.send("{not json")
        error = await expect_error(ws, "invalid_json")
        assert error["retryable"] is False
        await ws.send(json.dumps({"type": "input.speak", "text": "x"}))
        await expect_error(ws, "unknown_type")
        await ws.send(json.dumps({"type": "input.text"}))
        await expect_error(ws, "invalid_message")
        await ws.send(json.dumps(["a", "list"]))
        await expect_error(ws, "invalid_message")
        await ws.send(json.dumps({"type": "input.text", "text": "x", "contextId": "typo"}))
        await expect_error(ws, "invalid_message")
        await ws.send(b"\x00\x01")
        await expect_error(ws, "invalid_message")
        await assert_still_usable(ws)
        await send(ws, type="input.text", text="Still speaking.")
        await send(ws, type="input.done")
        assert (await receive_until(ws, "session.done"))[-1]["total_sentences"] == 1


async def test_text_before_config_is_refused_then_config_is_accepted(server):
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, type="input.text", text="too early")
        error = await expect_error(ws, "config_required")
        assert "not processed" in error["message"]
        await send(ws, type="session.config")
        assert (await receive_until(ws, "session.started"))[-1]["type"] == "session.started"


async def test_second_config_while_an_utterance_is_open_is_locked(server):
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, type="session.config", stream_audio=True)
        await send(ws, type="input.text", text="An open utterance")
        await send(ws, type="session.config", voice="tone-high")
        await expect_error(ws, "config_locked")
        await send(ws, type="input.done")
        messages = await receive_until(ws, "session.done")
    # The refused config changed nothing: the text was spoken with the first voice.
    assert messages[-1]["total_sentences"] == 1


@pytest.mark.parametrize(
    "config, code",
    [
        ({"response_format": "vorbis"}, "unsupported_format"),
        ({"sample_rate": 11025}, "unsupported_format"),
        ({"split_granularity": "word"}, "invalid_message"),
        ({"speed": 1.5, "stream_audio": True}, "invalid_message"),
        ({"unknown_field": 1}, "invalid_message"),
    ],
)
async def test_bad_configs_are_refused_with_a_code(server, config, code):
    """A first session.config that is refused ends the connection at once (as vLLM-Omni does), with the
    error's code; tests/test_client_compat.py checks that with vLLM-Omni's client loop."""
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, type="session.config", **config)
        await expect_error(ws, code)
        with pytest.raises(websockets.ConnectionClosed):
            await ws.recv()
        assert ws.close_code == 1008


async def test_voice_names_match_case_insensitively_and_speaker_is_an_alias(server):
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, type="session.config", speaker="TONE-HIGH")
        assert (await receive_until(ws, "session.started"))[-1]["voice"] == "tone-high"


async def test_text_over_the_buffer_limit_is_refused_not_dropped():
    with running_gateway("synthetic", max_buffered_chars=60) as server:
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="session.config", stream_audio=True)
            await send(ws, type="input.text", context_id="c", text="Forty characters of text with no stop")
            await send(ws, type="input.text", context_id="c", text=" and thirty more characters here")
            error = await expect_error(ws, "text_too_long")
            assert error["context_id"] == "c" and "not accepted" in error["message"]
            # It fits once the buffered text is spoken: the error says so, and so does `retryable`.
            assert error["retryable"] is True and "send it again" in error["message"]
            await send(ws, type="input.text", context_id="c", text="x" * 61)  # can never fit
            never = await expect_error(ws, "text_too_long")
            assert never["retryable"] is False and "smaller pieces" in never["message"]
            await send(ws, type="input.done", context_id="c")
            messages = await receive_until(ws, "utterance.done")
    # The accepted text is spoken; the refused text was reported.
    assert [m["sentence_text"] for m in messages if isinstance(m, dict) and m["type"] == "audio.start"] == [
        "Forty characters of text with no stop"
    ]


async def test_oversized_messages():
    with running_gateway("synthetic", max_message_bytes=1000, max_config_bytes=4000) as server:
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="session.config")
            await receive_until(ws, "session.started")
            await send(ws, type="input.text", text="x" * 2000)
            error = await expect_error(ws, "message_too_large")
            assert "1000" in error["message"]
            await assert_still_usable(ws)  # non-fatal
            await send(ws, type="session.config", instructions="y" * 5000)
            await expect_error(ws, "message_too_large")  # over the config limit: fatal
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
            assert ws.close_code == 1009


async def test_config_timeout_closes_with_policy_code():
    with running_gateway("synthetic", config_timeout_s=0.3) as server:
        async with websockets.connect(server.ws_url) as ws:
            error = await expect_error(ws, "config_required")
            assert "within" in error["message"]
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
            assert ws.close_code == 1008


async def test_idle_timeout_closes_an_idle_session_but_not_a_busy_one():
    # The utterance (about 2 s of real-time-paced audio) outlasts the 0.5 s idle timeout: busy is not idle.
    with running_gateway(SyntheticSynthesizer(speed=1.0), idle_timeout_s=0.5) as server:
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="session.config", stream_audio=True)
            await send(ws, type="input.text", text="A sentence of about two seconds of audio.")
            await send(ws, type="input.done")
            assert (await receive_until(ws, "session.done"))[-1]["total_sentences"] == 1
            started = time.monotonic()
            await expect_error(ws, "idle_timeout")
            assert 0.3 < time.monotonic() - started < 3
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
            assert ws.close_code == 1000


async def test_resume_is_answered_with_session_not_found(server):
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, type="session.resume", session_id="0123", sentence_index=2, bytes_received=100)
        error = await expect_error(ws, "session_not_found")
        assert error["retryable"] is False
        await send(ws, type="session.config")
        await receive_until(ws, "session.started")


async def test_api_keys_are_checked_at_upgrade():
    with running_gateway("synthetic", api_keys=["secret-key"]) as server:
        async with websockets.connect(server.ws_url) as ws:
            await expect_error(ws, "unauthorized")
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
            assert ws.close_code == 1008
        headers = {"Authorization": "Bearer secret-key"}
        async with websockets.connect(server.ws_url, additional_headers=headers) as ws:
            await send(ws, type="session.config")
            await receive_until(ws, "session.started")
        async with websockets.connect(server.ws_url + "?api_key=secret-key") as ws:
            await send(ws, type="session.config")
            await receive_until(ws, "session.started")


async def test_session_limit_answers_try_again_later():
    with running_gateway("synthetic", max_sessions=1) as server:
        async with websockets.connect(server.ws_url) as first:
            await send(first, type="session.config")
            await receive_until(first, "session.started")
            async with websockets.connect(server.ws_url) as second:
                error = await expect_error(second, "too_many_sessions")
                assert error["retryable"] is True
                with pytest.raises(websockets.ConnectionClosed):
                    await second.recv()
                assert second.close_code == 1013
        # The slot is given back when a session ends.
        for _ in range(50):
            if server.gateway.admission.open_sessions == 0:
                break
            await asyncio.sleep(0.02)
        async with websockets.connect(server.ws_url) as third:
            await send(third, type="session.config")
            await receive_until(third, "session.started")


async def test_store_records_sentences_and_audio(server):
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, type="session.config", stream_audio=True)
        session_id = (await receive_until(ws, "session.started"))[-1]["session_id"]
        await send(ws, type="input.text", text="Recorded one. Recorded two.")
        await send(ws, type="input.done")
        messages = await receive_until(ws, "session.done")
        record = server.call(server.gateway.store.get, session_id)
        assert [s.text for s in record.sentences.values()] == ["Recorded one.", "Recorded two."]
        assert all(s.state == "done" for s in record.sentences.values())
        audio = audio_by_sentence(messages)
        assert [s.bytes_sent for s in record.sentences.values()] == [len(audio[0]), len(audio[1])]
        pieces = server.call(server.gateway.store.replay, session_id, 1, 10)
        assert b"".join(p.data for p in pieces) == audio[1][10:]
    for _ in range(50):  # the connection's end detaches the session (kept for resume until its TTL)
        if not server.call(server.gateway.store.get, session_id).attached:
            break
        await asyncio.sleep(0.02)
    assert server.call(server.gateway.store.get, session_id).attached is False


# ------------------------------------------------------------------------------------- many sessions, disconnects


async def test_concurrent_sessions_each_get_exactly_their_own_audio():
    backend = SyntheticSynthesizer(first_chunk_delay_s=0.02, speed=20.0)
    voices = ["tone-low", "tone-mid", "tone-high"]

    async def one(url, n):
        voice = voices[n % 3]
        text = f"Session {n} says hello. It has a second sentence number {n}. And a third!"
        async with websockets.connect(url) as ws:
            await send(ws, type="session.config", voice=voice, stream_audio=True)
            for word in text.split(" "):
                await send(ws, type="input.text", text=word + " ")
            await send(ws, type="input.done")
            messages = await receive_until(ws, "session.done", timeout=60)
        starts = [m for m in messages if isinstance(m, dict) and m["type"] == "audio.start"]
        audio = audio_by_sentence(messages)
        expected = await direct_pcm(SyntheticSynthesizer(), [m["sentence_text"] for m in starts], voice)
        assert [audio[m["sentence_index"]] for m in starts] == expected
        return len(starts)

    with running_gateway(backend) as server:
        counts = await asyncio.gather(*(one(server.ws_url, n) for n in range(12)))
        assert counts == [3] * 12
        for _ in range(100):
            if not server.gateway.sessions:
                break
            await asyncio.sleep(0.02)
        assert not server.gateway.sessions and server.gateway.admission.open_sessions == 0


async def test_a_client_that_disappears_mid_utterance_stops_its_synthesis():
    backend = RecordingBackend(SyntheticSynthesizer(speed=1.0))
    with running_gateway(backend) as server:
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="session.config", stream_audio=True)
            await send(ws, type="input.text", text="A sentence that takes a couple of seconds to speak. Another one after it.")
            await receive_until(ws, "audio.start")
            await ws.recv()
        # The socket is gone: the session ends, its synthesis stops, nothing is left running.
        for _ in range(100):
            if not server.gateway.sessions and backend.records[0].closed is not None:
                break
            await asyncio.sleep(0.02)
        assert not server.gateway.sessions
        assert backend.records[0].closed is not None and backend.records[0].finished is None
        assert server.gateway.metrics.registry.get_sample_value("voxgate_sessions_active") == 0


async def test_cancel_after_input_done_drops_the_utterance_done_too():
    with running_gateway(SyntheticSynthesizer(speed=2.0)) as server:
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="session.config", stream_audio=True)
            await send(ws, type="input.text", context_id="a", text="A finished turn that is cut off anyway. Its second sentence.")
            await send(ws, type="input.done", context_id="a")
            await receive_until(ws, "audio.start")
            await send(ws, type="input.cancel", context_id="a")
            await receive_until(ws, "context.cancelled")
            await send(ws, type="ping", id=1)
            after = await receive_until(ws, "pong")
    assert types(after) == ["pong"]  # no audio and no utterance.done for the cancelled context


async def test_an_unexpected_server_fault_is_reported_as_internal_and_closes_1011():
    from gateway.store.memory import MemorySessionStore

    class BrokenStore(MemorySessionStore):
        async def apply(self, *args, **kwargs):
            raise RuntimeError("disk on fire")

    with running_gateway("synthetic", store=BrokenStore()) as server:
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="session.config")
            await send(ws, type="input.text", text="This sentence reaches the broken store. Yes.")
            error = await expect_error(ws, "internal")
            assert error["retryable"] is True and "disk on fire" not in error["message"]
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
            assert ws.close_code == 1011


async def test_a_custom_auth_hook_sees_the_connection():
    from gateway.auth import AuthError, Principal

    async def only_team_a(connection):
        if connection.headers.get("x-team") != "a":
            raise AuthError("team a only")
        return Principal(key_id="team-a")

    with running_gateway("synthetic", authenticate=only_team_a) as server:
        async with websockets.connect(server.ws_url) as ws:
            assert (await expect_error(ws, "unauthorized"))["message"] == "team a only"
        async with websockets.connect(server.ws_url, additional_headers={"X-Team": "a"}) as ws:
            await send(ws, type="session.config")
            await receive_until(ws, "session.started")
        import httpx

        assert httpx.get(server.url + "/v1/models").status_code == 401
        assert httpx.get(server.url + "/v1/models", headers={"X-Team": "a"}).status_code == 200


async def test_granularity_none_speaks_each_flush_as_one_unit_and_clause_splits_clauses(server):
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, type="session.config", stream_audio=True, split_granularity="none")
        await send(ws, type="input.text", text="One sentence. Another sentence! ")
        await send(ws, type="input.text", text="And a third, all together.")
        await send(ws, type="input.done")
        whole = await receive_until(ws, "session.done")
        await send(ws, type="session.config", stream_audio=True, split_granularity="clause")
        await send(ws, type="input.text", text="When the clause is long enough to speak alone, it goes first; then the rest follows.")
        await send(ws, type="input.done")
        clauses = await receive_until(ws, "session.done")
    assert [m["sentence_text"] for m in whole if isinstance(m, dict) and m["type"] == "audio.start"] == [
        "One sentence. Another sentence! And a third, all together."
    ]
    assert len([m for m in clauses if isinstance(m, dict) and m["type"] == "audio.start"]) >= 2


async def test_non_streamed_mulaw_is_one_frame_per_sentence(server):
    async with websockets.connect(server.ws_url) as ws:
        await send(ws, type="session.config", response_format="mulaw", voice="tone-low")
        await send(ws, type="input.text", text="First of two. Second of two.")
        await send(ws, type="input.done")
        messages = await receive_until(ws, "session.done")
    assert [t for t in types(messages) if t != "session.started"] == ["audio.start", "binary", "audio.done"] * 2 + ["session.done"]
    expected = await direct_pcm(SyntheticSynthesizer(), ["First of two.", "Second of two."], "tone-low")
    frames = [m for m in messages if isinstance(m, bytes)]
    for frame, pcm in zip(frames, expected):
        assert abs(len(frame) - len(pcm) // 2 / 3) <= 4  # 24 kHz s16le -> 8 kHz, one byte a sample
