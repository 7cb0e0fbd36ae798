"""The Python client library (clients/python, `voxgate_client`) against a real gateway on loopback.

The gateway runs the synthetic backend (deterministic tones, tts_backend/synthetic.py), so the audio a
client receives can be compared byte for byte with the backend's own rendering of each sentence.
"""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
import wave

import pytest

import voxgate_client as vg
from voxgate_client.events import parse_server_message
from tests.gateway_server import running_gateway
from tts_backend.base import SynthesisRequest
from tts_backend.synthetic import SyntheticSynthesizer

VOICE = "tone-mid"
TEXT = "Hello there. How are you today? The weather is lovely."
SENTENCES = ["Hello there.", "How are you today?", "The weather is lovely."]

pytestmark = pytest.mark.timeout(60)


def expected_pcm(sentences: list[str], voice: str = VOICE) -> bytes:
    """What the synthetic backend renders for these sentences, at its native 24 kHz."""
    synth = SyntheticSynthesizer()
    return b"".join(synth.render(SynthesisRequest(text=s, voice=voice)).tobytes() for s in sentences)


@pytest.fixture(scope="module")
def gateway():
    # Strict voices: an unknown name is refused rather than spoken by the default voice.
    with running_gateway(backend="synthetic", voice_fallback=False) as server:
        yield server


@pytest.fixture(scope="module")
def paced_gateway():
    """A backend producing audio at 4x real time after the first chunk, so a test can act mid-sentence."""
    with running_gateway(backend=SyntheticSynthesizer(speed=4.0, chunk_ms=40)) as server:
        yield server


@pytest.fixture(scope="module")
def keyed_gateway():
    with running_gateway(backend="synthetic", api_keys=["sekret-key"]) as server:
        yield server


async def test_full_utterance_events_and_audio(gateway):
    async with vg.connect(gateway.url, vg.SessionConfig(voice=VOICE)) as session:
        assert session.session_id and session.sample_rate == 24000 and session.format == "pcm"
        assert VOICE in session.voices
        await session.send_text(TEXT)
        await session.done()
        events = [event async for event in session]

    kinds = [type(e).__name__ for e in events if not isinstance(e, vg.AudioChunk)]
    assert kinds[0] == "SessionStarted"
    assert kinds[1:] == ["AudioStart", "AudioDone"] * 3 + ["SessionDone"]
    starts = [e for e in events if isinstance(e, vg.AudioStart)]
    assert [s.sentence_text for s in starts] == SENTENCES
    assert [s.sentence_index for s in starts] == [0, 1, 2]
    chunks = [e for e in events if isinstance(e, vg.AudioChunk)]
    for index in range(3):
        mine = [c for c in chunks if c.sentence_index == index]
        # offsets are contiguous within each sentence and match audio.done's total
        assert [c.offset for c in mine] == [sum(len(x.data) for x in mine[:i]) for i in range(len(mine))]
        done = next(e for e in events if isinstance(e, vg.AudioDone) and e.sentence_index == index)
        assert done.total_bytes == sum(len(c.data) for c in mine) and not done.error
    assert b"".join(c.data for c in chunks) == expected_pcm(SENTENCES)
    assert isinstance(events[-1], vg.SessionDone) and events[-1].total_sentences == 3


class SentencesOnly(SyntheticSynthesizer):
    """A backend that cannot take a sentence's text while it speaks (as Piper)."""

    honours = SyntheticSynthesizer.honours - {"text_streaming"}


async def test_token_granularity_is_asked_for_by_default_and_the_session_says_if_it_took_effect():
    assert vg.SessionConfig().to_message()["split_granularity"] == "token"
    with running_gateway(backend=SentencesOnly()) as server:
        async with vg.connect(server.url, vg.SessionConfig(voice=VOICE)) as session:
            assert [w["field"] for w in session.started.warnings] == ["split_granularity"]
            assert session.text_streaming is False
            words = TEXT.split(" ")
            await session.stream_text([w + " " for w in words[:-1]] + [words[-1]])
            events = [event async for event in session]
        async with vg.connect(server.url, vg.SessionConfig(voice=VOICE, split_granularity="sentence")) as session:
            assert session.started.warnings == [] and session.text_streaming is False
    # Split at sentences, as asked for explicitly.
    assert [e.sentence_text for e in events if isinstance(e, vg.AudioStart)] == SENTENCES


async def test_token_granularity_takes_effect_where_the_backend_streams_text(gateway):
    async with vg.connect(gateway.url, vg.SessionConfig(voice=VOICE)) as session:
        assert session.started.warnings == [] and session.text_streaming is True
        words = TEXT.split(" ")
        await session.stream_text([w + " " for w in words[:-1]] + [words[-1]])
        events = [event async for event in session]
    # audio.start names the words known when synthesis began; AudioDone the whole sentence.
    starts = [e.sentence_text for e in events if isinstance(e, vg.AudioStart)]
    assert [e.sentence_text for e in events if isinstance(e, vg.AudioDone)] == SENTENCES
    assert all(whole.startswith(start) for start, whole in zip(starts, SENTENCES))
    assert b"".join(e.data for e in events if isinstance(e, vg.AudioChunk)) == expected_pcm(SENTENCES)


async def test_speak_returns_the_pcm(gateway):
    async with vg.connect(gateway.url, vg.SessionConfig(voice=VOICE)) as session:
        pcm = await session.speak(TEXT)
    assert pcm == expected_pcm(SENTENCES)


async def test_streaming_llm_tokens_sync_and_async(gateway):
    async def llm_tokens():
        for word in TEXT.split(" "):
            for piece in (word[: len(word) // 2], word[len(word) // 2 :], " "):
                yield piece
                await asyncio.sleep(0.001)

    async with vg.connect(gateway.url, vg.SessionConfig(voice=VOICE)) as session:
        sender = asyncio.create_task(session.stream_text(llm_tokens()))
        pcm = b"".join([chunk async for chunk in session.audio()])
        assert await sender == len(TEXT) + 1  # the trailing space token counts
    assert pcm == expected_pcm(SENTENCES)

    # A plain (sync) iterable on a context works the same way.
    async with vg.connect(gateway.url, vg.SessionConfig(voice=VOICE)) as session:
        turn = session.context("turn-1")
        await turn.stream_text([word + " " for word in TEXT.split(" ")])
        assert await turn.collect() == expected_pcm(SENTENCES)
        whole = session.context("turn-2")  # a str is one piece of text, not an iterable of characters
        assert await whole.stream_text(TEXT) == len(TEXT)
        assert await whole.collect() == expected_pcm(SENTENCES)


async def test_flush_releases_an_unterminated_tail(gateway):
    async with vg.connect(gateway.url, vg.SessionConfig(voice=VOICE)) as session:
        turn = session.context()
        await turn.send_text("No final punctuation here")
        await turn.flush()
        events = []
        async for event in turn.events():
            events.append(event)
            if isinstance(event, vg.AudioDone):
                break
        # (AudioStart has the words known when synthesis started: with token splitting, not "here" yet)
        assert [e.sentence_text for e in events if isinstance(e, vg.AudioDone)] == ["No final punctuation here"]
        await turn.send_text("And more.")
        await turn.done()
        rest = [e async for e in turn.events()]
        assert isinstance(rest[-1], vg.UtteranceDone)
        assert [e.sentence_text for e in rest if isinstance(e, vg.AudioDone)] == ["And more."]


async def test_contexts_share_one_socket(gateway):
    config = vg.SessionConfig(voice=VOICE, response_format="mulaw", sample_rate=8000)
    async with vg.connect(gateway.url, config) as session:
        assert session.format == "mulaw" and session.sample_rate == 8000
        first, second = session.context("first"), session.context("second")
        await first.send_text("The first context talks. ")
        await second.send_text("The second one ")
        await second.send_text("talks as well.")
        await first.send_text("It has two sentences.")
        await second.done()
        await first.done()
        events_first, events_second = await asyncio.gather(
            _all(first.events()), _all(second.events())
        )
        ping_rtt = await session.ping()
    assert 0 <= ping_rtt < 1.0
    for events, texts, cid in (
        (events_first, ["The first context talks.", "It has two sentences."], "first"),
        (events_second, ["The second one talks as well."], "second"),
    ):
        assert all(getattr(e, "context_id", cid) == cid for e in events)
        # The client asks for token splitting: audio.start names the words known when synthesis began (the
        # second context's "talks as well." may still be on its way), audio.done the whole sentence.
        starts = [e.sentence_text for e in events if isinstance(e, vg.AudioStart)]
        assert [e.sentence_text for e in events if isinstance(e, vg.AudioDone)] == texts
        assert len(starts) == len(texts) and all(whole.startswith(start) for start, whole in zip(starts, texts))
        assert isinstance(events[-1], vg.UtteranceDone) and events[-1].total_sentences == len(texts)
        mulaw = b"".join(e.data for e in events if isinstance(e, vg.AudioChunk))
        # 8 kHz mu-law: one byte per sample, about as long as the 24 kHz rendering
        assert abs(len(mulaw) - len(expected_pcm(texts)) // 2 // 3) <= 8 * len(texts)
    # the sentence index counts across contexts
    indices = sorted(e.sentence_index for e in events_first + events_second if isinstance(e, vg.AudioStart))
    assert indices == [0, 1, 2]


async def _all(iterator):
    return [item async for item in iterator]


async def test_cancel_stops_a_context_and_the_socket_keeps_working(paced_gateway):
    long_text = "This sentence is long enough to take a while to speak aloud. " * 3
    async with vg.connect(paced_gateway.url, vg.SessionConfig(voice=VOICE)) as session:
        talker = session.context("talker")
        await talker.send_text(long_text)
        await talker.done()
        received = 0
        events = talker.events()
        async for event in events:
            if isinstance(event, vg.AudioChunk):
                received += len(event.data)
                if received >= 3 * 1920:  # a few 40 ms chunks in: the listener barges in
                    break
        await talker.cancel()
        after = [e async for e in talker.events()]
        assert isinstance(after[-1], vg.ContextCancelled) and after[-1].context_id == "talker"
        assert not any(isinstance(e, vg.AudioChunk) for e in after)
        total_expected = len(expected_pcm([s.strip() + "." for s in long_text.split(".") if s.strip()]))
        assert received < total_expected / 2

        # Another utterance on the same socket is unaffected.
        assert await session.context("next").speak("Still here.") == expected_pcm(["Still here."])


async def test_cancel_without_contexts(paced_gateway):
    async with vg.connect(paced_gateway.url, vg.SessionConfig(voice=VOICE)) as session:
        await session.send_text("One long sentence that keeps going for quite a while now. " * 2)
        async for event in session.events():
            if isinstance(event, vg.AudioChunk):
                break
        await session.cancel()
        after = []
        async for event in session.events():
            after.append(event)
            if isinstance(event, vg.ContextCancelled):
                break
        assert not any(isinstance(e, vg.AudioChunk) for e in after)


async def test_handshake_errors_raise_with_codes(gateway, keyed_gateway):
    with pytest.raises(vg.VoxgateError) as refused:
        await vg.connect(gateway.url, vg.SessionConfig(voice="no-such-voice"))
    assert refused.value.code == "unknown_voice" and not refused.value.retryable

    with pytest.raises(vg.VoxgateError) as unauthorized:
        await vg.connect(keyed_gateway.url, vg.SessionConfig(voice=VOICE))
    assert unauthorized.value.code == "unauthorized"
    with pytest.raises(vg.VoxgateError):
        await vg.connect(keyed_gateway.url, vg.SessionConfig(voice=VOICE), api_key="wrong")

    for options in ({}, {"api_key_header": "X-API-Key"}, {"api_key_header": None, "api_key_query": "api_key"}):
        async with vg.connect(keyed_gateway.url, vg.SessionConfig(voice=VOICE), api_key="sekret-key", **options) as s:
            assert await s.speak("Authorized.") == expected_pcm(["Authorized."])


async def test_non_fatal_errors_arrive_as_events(gateway):
    async with vg.connect(gateway.url, vg.SessionConfig(voice=VOICE)) as session:
        await session.send_json({"type": "input.bogus"})
        await session.send_ping("after-the-bogus-one")
        seen = []
        async for event in session.events():
            seen.append(event)
            if isinstance(event, vg.Pong):
                break
        error = next(e for e in seen if isinstance(e, vg.Error))
        assert error.code == "unknown_type" and not error.retryable
        assert seen[-1] == vg.Pong(id="after-the-bogus-one", inputs_received=1)  # a refused input counts too
        assert await session.speak("Still fine.") == expected_pcm(["Still fine."])


def test_cli_writes_a_valid_wav(gateway, tmp_path):
    text_file = tmp_path / "story.txt"
    text_file.write_text(TEXT + "\n", encoding="utf-8")
    out = tmp_path / "story.wav"
    script = [sys.executable, "-c", "import sys; from voxgate_client.cli import main; sys.exit(main())"]
    result = subprocess.run(
        [*script, "--url", gateway.url, "--voice", VOICE, "-o", str(out), str(text_file)],
        capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert "sentence 2: The weather is lovely." in result.stderr
    with wave.open(str(out), "rb") as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24000)
        assert wav.readframes(wav.getnframes()) == expected_pcm(SENTENCES)

    # stdin, mu-law on the wire at 16 kHz: the WAV holds decoded 16-bit PCM at that rate.
    out16 = tmp_path / "stdin.wav"
    result = subprocess.run(
        [*script, "--url", gateway.url, "--voice", VOICE, "--format", "mulaw", "--sample-rate", "16000",
         "-q", "-o", str(out16)],
        input="Read from standard input.", capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 0, result.stderr
    with wave.open(str(out16), "rb") as wav:
        assert wav.getframerate() == 16000
        seconds = wav.getnframes() / 16000
    assert abs(seconds - len("Read from standard input.") / 15.0) < 0.1


def test_cli_prints_the_gateways_warnings(tmp_path):
    """A voice fallback (session.started) and a sentence the voice does not speak (audio.start) are told on
    stderr, even with -q: the user learns why it does not sound as asked."""
    script = [sys.executable, "-c", "import sys; from voxgate_client.cli import main; sys.exit(main())"]
    with running_gateway(backend="synthetic") as lenient:  # the default: an unknown voice falls back
        result = subprocess.run(
            [*script, "--url", lenient.url, "--voice", "nobody-here", "-q", "-o", str(tmp_path / "x.wav")],
            input="Hello there. Bonjour à tous, comment allez-vous aujourd'hui?", capture_output=True, text=True,
            timeout=30,
        )
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert any(line.startswith("voxgate-say: warning: voice_fallback: voice 'nobody-here'") for line in lines), lines
    assert any(line.startswith("voxgate-say: warning: sentence 1: language_unsupported: the text looks French")
               for line in lines), lines


def test_audio_start_keeps_its_voice_and_warnings():
    warning = {"code": "language_unsupported", "message": "the text looks French (fr)", "field": "language"}
    event = parse_server_message({"type": "audio.start", "sentence_index": 3, "sentence_text": "Oui.",
                                     "format": "pcm", "sample_rate": 24000, "voice": "fr_FR-siwis-medium",
                                     "warnings": [warning]})
    assert event.voice == "fr_FR-siwis-medium" and event.warnings == [warning]
    plain = parse_server_message({"type": "audio.start", "sentence_index": 0, "sentence_text": "Hi.",
                                     "format": "pcm", "sample_rate": 24000})
    assert plain.voice is None and plain.warnings == []


def test_cli_reports_an_unreachable_gateway(tmp_path):
    from tests.gateway_server import free_port

    result = subprocess.run(
        [sys.executable, "-m", "voxgate_client.cli", "--url", f"ws://127.0.0.1:{free_port()}", "-o",
         str(tmp_path / "x.wav")],
        input="Hello.", capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 1 and "cannot reach" in result.stderr


def test_g711_codecs_match_the_gateway():
    import numpy as np

    from gateway.audio import pcm as gateway_audio

    samples = (np.sin(np.linspace(0, 60, 4000)) * 30000).astype("<i2")
    pcm = samples.tobytes()
    assert vg.mulaw_to_pcm16(gateway_audio.mulaw_encode(samples)) == gateway_audio.mulaw_decode(
        gateway_audio.mulaw_encode(samples)
    ).astype("<i2").tobytes()
    encoded = vg.pcm16_to_mulaw(pcm)
    assert len(encoded) == 4000
    decoded = np.frombuffer(vg.mulaw_to_pcm16(encoded), "<i2").astype(int)
    assert np.max(np.abs(decoded - samples)) <= 1024  # G.711 quantization step at full scale
    out = io.BytesIO()
    vg.write_wav(out, pcm, 8000)
    out.seek(0)
    with wave.open(out, "rb") as wav:
        assert wav.readframes(4000) == pcm


async def test_whole_file_per_sentence_when_not_streaming(gateway):
    async with vg.connect(gateway.url, vg.SessionConfig(voice=VOICE, stream_audio=False)) as session:
        assert session.format == "wav"
        await session.send_text(TEXT)
        await session.done()
        files: dict[int, bytes] = {}
        async for event in session.events():
            if isinstance(event, vg.AudioChunk):
                files[event.sentence_index] = files.get(event.sentence_index, b"") + event.data
    assert sorted(files) == [0, 1, 2]
    for index, sentence in enumerate(SENTENCES):
        with wave.open(io.BytesIO(files[index]), "rb") as wav:
            assert wav.getframerate() == 24000
            assert wav.readframes(wav.getnframes()) == expected_pcm([sentence])


async def test_keepalive_pings_hold_off_the_idle_timeout():
    with running_gateway(backend="synthetic", idle_timeout_s=0.6) as short_idle:
        listening = await vg.connect(short_idle.url, vg.SessionConfig(voice=VOICE), keepalive_s=0.2)
        silent = await vg.connect(short_idle.url, vg.SessionConfig(voice=VOICE), keepalive_s=None)
        try:
            ended = [e async for e in silent.events()][1:]
            assert [type(e) for e in ended] == [vg.Error, vg.Disconnected]
            assert ended[0].code == "idle_timeout" and silent.closed and silent.reconnects == 0
            await asyncio.sleep(0.6)
            assert not listening.closed
            assert await listening.speak("Still here.") == expected_pcm(["Still here."])
        finally:
            await listening.close()
            await silent.abort()


async def test_reconfigure_between_utterances(gateway):
    async with vg.connect(gateway.url, vg.SessionConfig(voice=VOICE)) as session:
        assert await session.speak("Hello there.") == expected_pcm(["Hello there."])
        await session.reconfigure(vg.SessionConfig(voice="tone-low"))
        assert await session.speak("Hello there.") == expected_pcm(["Hello there."], voice="tone-low")
        assert session.started.voice == "tone-low"


async def test_one_event_stream_with_context_ids_and_cancel(paced_gateway):
    """How a framework adapter uses the client: one reader over all events, routing by context_id."""
    async with vg.connect(paced_gateway.url, vg.SessionConfig(voice=VOICE)) as session:
        await session.send_text("Keep talking for a good while, please. And then some more.", context_id="a")
        await session.done(context_id="a")
        await session.send_text("Short one.", context_id="b")
        await session.done(context_id="b")
        audio: dict[str, bytearray] = {"a": bytearray(), "b": bytearray()}
        cancelled_at = None
        finished = set()
        async for event in session.events(until_done=False):
            if isinstance(event, vg.AudioChunk):
                assert cancelled_at is None or event.context_id != "a", "audio of a cancelled context"
                audio[event.context_id] += event.data
                if event.context_id == "a" and len(audio["a"]) >= 4 * 1920 and cancelled_at is None:
                    cancelled_at = len(audio["a"])
                    await session.cancel(context_id="a")
            elif isinstance(event, (vg.ContextCancelled, vg.UtteranceDone)):
                finished.add((type(event).__name__, event.context_id))
                if len(finished) == 2:
                    break
        assert finished == {("ContextCancelled", "a"), ("UtteranceDone", "b")}
        assert len(audio["a"]) == cancelled_at
        assert bytes(audio["b"]) == expected_pcm(["Short one."])


async def test_connect_falls_over_to_the_next_replica(gateway):
    from tests.gateway_server import free_port

    dead = f"ws://127.0.0.1:{free_port()}"
    with running_gateway(backend="synthetic", max_sessions=1) as full:
        async with vg.connect(full.url, vg.SessionConfig(voice=VOICE)):
            with pytest.raises(vg.VoxgateError) as busy:
                await vg.connect(full.url, vg.SessionConfig(voice=VOICE))
            assert busy.value.retryable
            async with vg.connect([dead, full.url, gateway.url], vg.SessionConfig(voice=VOICE)) as session:
                assert session.url.startswith(gateway.url.replace("http", "ws"))
                assert await session.speak("Over here.") == expected_pcm(["Over here."])


async def test_a_refused_resume_ends_the_session_cleanly(gateway):
    import dataclasses

    session = await vg.connect(gateway.url, vg.SessionConfig(voice=VOICE), backoff_initial_s=0.01)
    try:
        [started] = [e async for e in _take(session.events(), 1)]
        assert isinstance(started, vg.SessionStarted)
        session.started = dataclasses.replace(session.started, session_id="no-such-session")
        await session.drop_connection()
        rest = [event async for event in session.events()]
        # The resume is answered before the session counts as reconnected: no Reconnected event.
        assert [type(e).__name__ for e in rest] == ["Error", "Disconnected"]
        assert rest[0].code == "session_not_found" and not rest[0].retryable
        assert session.closed
        with pytest.raises(vg.VoxgateError):
            await session.send_text("Nobody is listening.")
    finally:
        await session.abort()


async def _take(iterator, count):
    async for item in iterator:
        yield item
        count -= 1
        if count == 0:
            return


async def test_resume_after_the_socket_is_closed_mid_sentence(paced_gateway):
    text = "The first sentence plays completely. The second sentence is cut in the middle of it. Then a third."
    sentences = ["The first sentence plays completely.", "The second sentence is cut in the middle of it.",
                 "Then a third."]
    async with vg.connect(paced_gateway.url, vg.SessionConfig(voice=VOICE), backoff_initial_s=0.01) as session:
        await session.send_text(text)
        await session.done()
        pcm = bytearray()
        dropped_at = None
        reconnected = None
        async for event in session.events():
            if isinstance(event, vg.AudioChunk):
                pcm += event.data
                if dropped_at is None and event.sentence_index == 1 and event.offset > 0:
                    dropped_at = session.resume_position()
                    await session.drop_connection()  # the network fails mid-sentence
            elif isinstance(event, vg.Reconnected):
                reconnected = event
            elif isinstance(event, vg.Error):
                pytest.fail(f"gateway error after resume: {event}")
        assert dropped_at is not None and dropped_at[0] == 1 and dropped_at[1] > 0
        assert reconnected is not None and session.reconnects == 1
        assert (reconnected.sentence_index, reconnected.bytes_received) == dropped_at
    assert bytes(pcm) == expected_pcm(sentences)


def test_cli_play_without_a_sound_card_says_so(gateway):
    if vg.SoundCardPlayer.available():
        pytest.skip("this machine has a sound card: playing would make noise")
    result = subprocess.run(
        [sys.executable, "-m", "voxgate_client.cli", "--url", gateway.url, "--voice", VOICE, "--play"],
        input="Hello.", capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 2 and "no sound card" in result.stderr
