"""Pronunciation through a real gateway (issue 34): dictionaries inline and registered (HTTP and WebSocket,
per API key, shared by replicas through Redis), the markup subset, text streaming with random piece
boundaries, resume on another replica, on the synthetic backend and on Piper.

Each feature is checked by what reaches the backend (tests/gateway_server.py's RecordingBackend records every
request the gateway makes) and by the word timestamps that come back, which name the client's written words.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import pytest
import websockets

from tests.cloning_fixtures import auth
from tests.gateway_server import RecordingBackend, audio_by_sentence, open_session, receive_until, running_gateway
from tests.redis_fixtures import REDIS_URL, redis_prefix  # noqa: F401 - fixture
from tts_backend.synthetic import SyntheticSynthesizer

KEY_A, KEY_B = "key-a-" + "a" * 20, "key-b-" + "b" * 20
VOICE = "tone-mid"
BRANDS = [{"text": "Voxgate", "say": "vox gate"}, {"text": "SQL", "say": "sequel", "case_sensitive": True}]


def send(ws, **message):
    return ws.send(json.dumps(message))


def of_type(messages: list, kind: str) -> list[dict]:
    return [m for m in messages if isinstance(m, dict) and m["type"] == kind]


def said(backend: RecordingBackend) -> list[str]:
    return [record.text for record in backend.records]


def words_of(done: dict) -> list[str]:
    return done["timestamp_info"]["word_alignment"]["words"]


async def session(url: str, texts: list[str], key: str | None = None, **config) -> list:
    headers = auth(key) if key else {}
    async with websockets.connect(url, max_size=None, additional_headers=headers) as ws:
        await send(ws, type="session.config", voice=VOICE, response_format="pcm", timestamp_type="word", **config)
        messages = [json.loads(await ws.recv())]
        assert messages[0]["type"] == "session.started", messages
        for text in texts:
            await send(ws, type="input.text", text=text)
        await send(ws, type="input.done")
        return messages + await receive_until(ws, "session.done")


@pytest.fixture
def synthetic():
    backend = RecordingBackend(SyntheticSynthesizer())
    with running_gateway(backend, api_keys=[KEY_A, KEY_B]) as server:
        yield server, backend


async def test_an_inline_dictionary_rewrites_what_the_backend_hears_and_timestamps_name_the_written_words(synthetic):
    server, backend = synthetic
    messages = await session(server.ws_url, ["Voxgate speaks SQL and sql. ", "Voxgate's fine."], KEY_A,
                             pronunciations=BRANDS)
    assert said(backend) == ["vox gate speaks sequel and sql.", "vox gate's fine."]
    starts, dones = of_type(messages, "audio.start"), of_type(messages, "audio.done")
    assert [s["sentence_text"] for s in starts] == ["Voxgate speaks SQL and sql.", "Voxgate's fine."]
    assert [words_of(d) for d in dones] == [["Voxgate", "speaks", "SQL", "and", "sql."], ["Voxgate's", "fine."]]
    # "vox gate" is two words for the backend, one for the client: timed from "vox" to "gate".
    times = dones[0]["timestamp_info"]["word_alignment"]
    assert times["word_start_times_seconds"][0] == 0 and times["word_end_times_seconds"][0] > 0
    # Without pronunciations the text goes as written.
    backend.records.clear()
    await session(server.ws_url, ["Voxgate speaks SQL."], KEY_A)
    assert said(backend) == ["Voxgate speaks SQL."]


async def test_markup_spells_substitutes_and_pauses_with_real_silence(synthetic):
    server, backend = synthetic
    text = ('Your code is <spell>AB-12</spell>. Call <say-as interpret-as="telephone">555-0100</say-as> '
            '<break time="700ms"/> for <sub alias="doctor">Doc</sub> Who. Then a < b and <spell>oops.')
    messages = await session(server.ws_url, [text], KEY_A, text_markup="ssml")
    assert said(backend) == ["Your code is A B, 1 2.", "Call 5 5 5, 0 1 0 0 ", " for doctor Who.",
                             "Then a < b and <spell>oops."]
    starts, dones = of_type(messages, "audio.start"), of_type(messages, "audio.done")
    assert [s["sentence_text"] for s in starts] == ["Your code is AB-12.", "Call 555-0100  for Doc Who.",
                                                    "Then a < b and <spell>oops."]
    assert words_of(dones[0]) == ["Your", "code", "is", "AB-12."]
    assert words_of(dones[1]) == ["Call", "555-0100", "for", "Doc", "Who."]
    # Malformed markup is read as text, with a warning; the sentence is spoken all the same.
    assert [w["code"] for w in starts[2]["warnings"]] == ["markup_ignored", "markup_ignored"]
    assert "warnings" not in starts[0] and "warnings" not in starts[1]
    # The pause is 700 ms of silence between "0100" and "for", in the audio and in the timestamps.
    alignment = dones[1]["timestamp_info"]["word_alignment"]
    gap = alignment["word_start_times_seconds"][2] - alignment["word_end_times_seconds"][1]
    assert 0.7 <= gap < 0.8
    pcm = audio_by_sentence(messages)[1]
    silence_at = int(alignment["word_end_times_seconds"][1] * 24000) + 1200  # past the word's own fade
    assert pcm[2 * silence_at: 2 * (silence_at + 24000 * 500 // 1000)] == bytes(24000)
    # Without text_markup "<" is text.
    backend.records.clear()
    await session(server.ws_url, ["Code <spell>AB</spell>."], KEY_A)
    assert said(backend) == ["Code <spell>AB</spell>."]


def test_http_speech_rewrites_and_its_timestamps_name_the_written_words(synthetic):
    server, backend = synthetic
    response = httpx.post(server.url + "/v1/audio/speech", headers=auth(KEY_A), timeout=30, json={
        "input": "Voxgate runs SQL. Code <spell>X1</spell> <break time='300ms'/> done.", "voice": VOICE,
        "response_format": "pcm", "timestamp_type": "word", "pronunciations": BRANDS, "text_markup": "ssml"})
    assert response.status_code == 200, response.text
    assert said(backend) == ["vox gate runs sequel.", "Code X 1 ", " done."]
    alignment = json.loads(response.headers["X-Word-Timestamps"])
    assert alignment["words"] == ["Voxgate", "runs", "SQL.", "Code", "X1", "done."]
    # The 300 ms pause lies between "X1" and "done.".
    assert alignment["word_start_times_seconds"][5] - alignment["word_end_times_seconds"][4] >= 0.3


def test_registered_dictionaries_belong_to_their_key_over_http(synthetic):
    server, backend = synthetic
    url = server.url + "/v1/audio/pronunciations"
    made = httpx.post(url, headers=auth(KEY_A), json={"name": "brands", "entries": BRANDS})
    assert made.status_code == 200, made.text
    assert made.json()["dictionary"]["name"] == "brands" and made.json()["dictionary"]["entries"] == 2
    assert [d["name"] for d in httpx.get(url, headers=auth(KEY_A)).json()["data"]] == ["brands"]
    got = httpx.get(url + "/brands", headers=auth(KEY_A)).json()["dictionary"]
    assert [e["text"] for e in got["entries"]] == ["Voxgate", "SQL"]
    # Key B sees nothing of it, cannot use it and cannot delete it.
    assert httpx.get(url, headers=auth(KEY_B)).json()["data"] == []
    assert httpx.get(url + "/brands", headers=auth(KEY_B)).json()["error"]["code"] == "pronunciation_not_found"
    assert httpx.delete(url + "/brands", headers=auth(KEY_B)).status_code == 404
    speech = {"input": "Voxgate.", "voice": VOICE, "response_format": "pcm", "pronunciations": ["brands"]}
    refused = httpx.post(server.url + "/v1/audio/speech", headers=auth(KEY_B), json=speech)
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "pronunciation_not_found"
    assert httpx.post(server.url + "/v1/audio/speech", headers=auth(KEY_A), json=speech).status_code == 200
    assert said(backend) == ["vox gate."]
    # Bounds, each with its code.
    bad = httpx.post(url, headers=auth(KEY_A), json={"name": "x", "entries": [{"text": " ", "say": "y"}]})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "pronunciation_invalid"
    big = [{"text": f"word{i}", "say": "y"} for i in range(1001)]
    over = httpx.post(url, headers=auth(KEY_A), json={"name": "big", "entries": big})
    assert over.status_code == 403 and over.json()["error"]["code"] == "pronunciation_limit_reached"
    for n in range(31):
        assert httpx.post(url, headers=auth(KEY_A), json={"name": f"d{n}", "entries": BRANDS}).status_code == 200
    full = httpx.post(url, headers=auth(KEY_A), json={"name": "one-more", "entries": BRANDS})
    assert full.json()["error"]["code"] == "pronunciation_limit_reached"
    assert httpx.post(url, headers=auth(KEY_A), json={"name": "brands", "entries": BRANDS[:1]}).status_code == 200
    assert httpx.delete(url + "/brands", headers=auth(KEY_A)).status_code == 200
    assert httpx.get(url + "/brands", headers=auth(KEY_A)).status_code == 404


async def test_dictionaries_on_the_websocket_and_a_name_in_session_config(synthetic):
    server, backend = synthetic
    async with websockets.connect(server.ws_url, additional_headers=auth(KEY_A)) as ws:
        await send(ws, type="pronunciation.add", name="brands", entries=BRANDS)
        added = json.loads(await ws.recv())
        assert added["type"] == "pronunciation.add" and added["dictionary"]["entries"] == 2
        await send(ws, type="pronunciation.list")
        assert [d["name"] for d in json.loads(await ws.recv())["dictionaries"]] == ["brands"]
        await send(ws, type="session.config", voice=VOICE, response_format="pcm",
                   pronunciations=["brands", {"text": "Vox", "say": "fox"}])
        assert json.loads(await ws.recv())["type"] == "session.started"
        await send(ws, type="input.text", text="Voxgate and Vox.")
        await send(ws, type="input.done")
        await receive_until(ws, "session.done")
        await send(ws, type="pronunciation.delete", name="brands")
        assert json.loads(await ws.recv())["deleted"] == "brands"
    assert said(backend) == ["vox gate and fox."]
    # A name the key has not registered refuses the session.
    ws, error, close = await open_session(server.ws_url, {"type": "session.config", "pronunciations": ["brands"]},
                                          additional_headers=auth(KEY_A))
    assert ws is None and error["code"] == "pronunciation_not_found" and close == 1008
    # Bounds on what a config carries, each with its code, checked before any entry is looked at.
    for pronunciations, code in (([{"text": "a", "say": "b"}] * 1001, "pronunciation_limit_reached"),
                                 ([{"text": "a"}], "pronunciation_invalid"),
                                 ([{"text": "a", "say": "b", "regex": ".*"}], "pronunciation_invalid"),
                                 (["x"] * 33, "pronunciation_limit_reached"),
                                 ([{"text": "a", "say": "b"}] * 100_000, "pronunciation_limit_reached")):
        ws, error, close = await open_session(server.ws_url, {"type": "session.config", "pronunciations": pronunciations},
                                              additional_headers=auth(KEY_A), max_size=None)
        assert ws is None and error["code"] == code and close == 1008, error


async def test_token_streaming_says_the_same_whatever_the_piece_boundaries():
    """split_granularity "token": rules and tags that span input.text pieces are applied once whole. Random
    piece boundaries (seeded) give the backend the same text and the client the same audio and words."""
    text = ("Voxgate's code is <spell>AB-12</spell>, and SQL runs in New York <break time='200ms'/> today. "
            "Call <sub alias='doctor'>Doc</sub> Who about Voxgate now.")
    config = dict(split_granularity="token", stream_audio=True, text_markup="ssml",
                  pronunciations=[*BRANDS, {"text": "New York", "say": "new york city"}])
    backend = RecordingBackend(SyntheticSynthesizer())
    with running_gateway(backend) as server:
        whole = await session(server.ws_url, [text], **config)
        heard = said(backend)
        assert heard == ["vox gate's code is A B, 1 2, and sequel runs in new york city ", " today.",
                         "Call doctor Who about vox gate now."]
        for seed in range(4):
            cuts = sorted(random.Random(seed).sample(range(1, len(text)), 25))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            backend.records.clear()
            messages = await session(server.ws_url, pieces, **config)
            assert said(backend) == heard, pieces
            assert audio_by_sentence(messages) == audio_by_sentence(whole)
            assert [words_of(d) for d in of_type(messages, "audio.done")] == \
                [words_of(d) for d in of_type(whole, "audio.done")]
    assert [words_of(d) for d in of_type(whole, "audio.done")] == [
        ["Voxgate's", "code", "is", "AB-12,", "and", "SQL", "runs", "in", "New York", "today."],
        ["Call", "Doc", "Who", "about", "Voxgate", "now."]]
    assert [d["sentence_text"] for d in of_type(whole, "audio.done")] == [
        "Voxgate's code is AB-12, and SQL runs in New York  today.", "Call Doc Who about Voxgate now."]


async def test_a_barge_in_reports_the_written_words_heard(synthetic):
    server, _ = synthetic
    async with websockets.connect(server.ws_url, additional_headers=auth(KEY_A)) as ws:
        await send(ws, type="session.config", voice=VOICE, response_format="pcm", timestamp_type="word",
                   pronunciations=BRANDS, text_markup="ssml")
        await ws.recv()
        await send(ws, type="input.text", text="Voxgate ships <spell>AB</spell> today.", context_id="c")
        await send(ws, type="input.done", context_id="c")
        await receive_until(ws, "utterance.done")
        await send(ws, type="input.cancel", context_id="c", played_ms=60_000)
        cancelled = (await receive_until(ws, "context.cancelled"))[-1]
    assert cancelled["spoken_text"] == "Voxgate ships AB today."


async def test_replicas_share_dictionaries_and_a_resume_applies_the_recorded_rules(redis_prefix):  # noqa: F811
    options = dict(api_keys=[KEY_A], store="redis", redis_url=REDIS_URL, redis_key_prefix=redis_prefix)
    one, two = RecordingBackend(SyntheticSynthesizer()), RecordingBackend(SyntheticSynthesizer())
    with running_gateway(one, **options) as first, running_gateway(two, **options) as second:
        url = "/v1/audio/pronunciations"
        # More entries together (1,202) than one config may carry inline: the session records them all.
        filler = [{"text": f"filler{i}", "say": "f"} for i in range(600)]
        assert httpx.post(first.url + url, headers=auth(KEY_A),
                          json={"name": "brands", "entries": [*BRANDS, *filler]}).is_success
        assert httpx.post(first.url + url, headers=auth(KEY_A), json={"name": "more", "entries": filler}).is_success
        assert [d["name"] for d in httpx.get(second.url + url, headers=auth(KEY_A)).json()["data"]] == ["brands", "more"]
        # A session on the first replica, its text still open (no sentence end yet) when its connection drops.
        async with websockets.connect(first.ws_url, additional_headers=auth(KEY_A)) as ws:
            await send(ws, type="session.config", voice=VOICE, response_format="pcm", pronunciations=["brands", "more"])
            session_id = json.loads(await ws.recv())["session_id"]
            await send(ws, type="input.text", text="Voxgate runs SQL")
            await send(ws, type="ping")
            await receive_until(ws, "pong")
        # The dictionary changes; the session keeps the rules it started with, on the other replica.
        assert httpx.delete(second.url + url + "/brands", headers=auth(KEY_A)).is_success
        async with websockets.connect(second.ws_url, additional_headers=auth(KEY_A)) as ws:
            await send(ws, type="session.resume", session_id=session_id)
            assert json.loads(await ws.recv())["type"] == "session.started"
            await send(ws, type="input.done")
            await receive_until(ws, "session.done")
        # The key's byte bound holds across replicas (checked and written in one Lua script).
        assert httpx.delete(second.url + url + "/more", headers=auth(KEY_A)).is_success
        fill_to_the_byte_bound(second.url)
        assert len(httpx.get(first.url + url, headers=auth(KEY_A)).json()["data"]) == 5
    assert said(one) == [] and said(two) == ["vox gate runs sequel"]


async def test_piper_says_the_rewrite_and_times_the_written_words():
    from tts_backend.piper import PiperSynthesizer

    backend = RecordingBackend(PiperSynthesizer())
    with running_gateway(backend) as server:
        voice = backend.voices()[0].id
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await send(ws, type="session.config", voice=voice, response_format="pcm", timestamp_type="word",
                       pronunciations=BRANDS, text_markup="ssml")
            await ws.recv()
            await send(ws, type="input.text", text="Voxgate code <spell>AB7</spell> <break time='400ms'/> is ready.")
            await send(ws, type="input.done")
            messages = await receive_until(ws, "session.done")
        assert said(backend) == ["vox gate code A B 7 ", " is ready."]
        # Over HTTP, with a registered dictionary.
        backend.records.clear()
        url = server.url + "/v1/audio/pronunciations"
        assert httpx.post(url, json={"name": "brands", "entries": BRANDS}).is_success
        response = httpx.post(server.url + "/v1/audio/speech", timeout=60, json={
            "input": "Voxgate knows SQL.", "voice": voice, "response_format": "pcm", "timestamp_type": "word",
            "pronunciations": ["brands"]})
        assert response.status_code == 200, response.text
        assert said(backend) == ["vox gate knows sequel."]
        assert json.loads(response.headers["X-Word-Timestamps"])["words"] == ["Voxgate", "knows", "SQL."]
    done = of_type(messages, "audio.done")[0]
    alignment = done["timestamp_info"]["word_alignment"]
    assert alignment["words"] == ["Voxgate", "code", "AB7", "is", "ready."]
    gap = alignment["word_start_times_seconds"][3] - alignment["word_end_times_seconds"][2]
    assert gap >= 0.4


def fill_to_the_byte_bound(url: str) -> list[str]:
    """Register dictionaries of key A's up to its 256 KiB (5 of about 51 KiB of the longest entries); one
    more is refused. Their names."""
    url += "/v1/audio/pronunciations"
    names = []
    for d in range(6):
        entries = [{"text": f"{d}{i:04d}" + "q" * 123, "say": "y"} for i in range(270)]
        made = httpx.post(url, headers=auth(KEY_A), json={"name": f"long{d}", "entries": entries})
        if d == 5:
            assert made.status_code == 403 and made.json()["error"]["code"] == "pronunciation_limit_reached"
            assert "bytes" in made.json()["error"]["message"]
        else:
            assert made.status_code == 200, made.text
            names.append(f"long{d}")
    return names


def test_the_largest_rules_are_built_without_stalling_the_event_loop(synthetic):
    """A key's rules at their bound (256 KiB of the longest entries, about 170,000 trie nodes) take the
    matcher a good part of a second to build: a session naming them must not hold the server's event loop
    (other sessions' audio, /health) for that long."""
    server, _ = synthetic
    names = fill_to_the_byte_bound(server.url)
    stop = threading.Event()

    async def worst_lag() -> float:
        lag = 0.0
        while not stop.is_set():
            before = time.perf_counter()
            await asyncio.sleep(0.005)
            lag = max(lag, time.perf_counter() - before - 0.005)
        return lag

    probe = asyncio.run_coroutine_threadsafe(worst_lag(), server.loop)

    async def configure() -> dict:
        async with websockets.connect(server.ws_url, additional_headers=auth(KEY_A)) as ws:
            await send(ws, type="session.config", voice=VOICE, pronunciations=names)
            return json.loads(await ws.recv())

    try:
        started = asyncio.run(configure())
    finally:
        stop.set()
    assert started["type"] == "session.started", started
    assert probe.result(10) < 0.1


async def wait_for(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_token_streaming_holds_back_only_what_a_rule_still_needs():
    """The open sentence reaches the backend as its words arrive, except a word that may begin a longer
    entry ("New" of "New York"), until the next word decides it; a markup tag waits for its end, and its
    warnings (known once the sentence's text is whole) come in audio.done."""
    backend = RecordingBackend(SyntheticSynthesizer())
    with running_gateway(backend) as server:
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await send(ws, type="session.config", voice=VOICE, response_format="pcm", stream_audio=True,
                       split_granularity="token", text_markup="ssml",
                       pronunciations=[{"text": "New York", "say": "new york city"}])
            await ws.recv()

            messages: list = []

            async def given(text: str) -> None:
                await send(ws, type="input.text", text=text)
                await send(ws, type="ping", id=text)
                messages.extend(await receive_until(ws, "pong"))

            await given("Call me in New ")
            await wait_for(lambda: backend.records, "the sentence's synthesis to start")
            assert backend.records[0].text == "Call me in "
            await given("York or <spell>AB")
            assert backend.records[0].text == "Call me in new york city or"
            await given("</spell> <bad> ok. ")
            await send(ws, type="input.done")
            messages += await receive_until(ws, "session.done")
    assert said(backend) == ["Call me in new york city or A B <bad> ok."]
    [start], [done] = of_type(messages, "audio.start"), of_type(messages, "audio.done")
    assert "warnings" not in start
    assert [w["code"] for w in done["warnings"]] == ["markup_ignored"]


async def test_no_sentence_ends_inside_markup(synthetic):
    """A sentence end inside a tag or its content would cut the markup in two (each half read as text):
    with markup on, the splitter takes no boundary there, over the WebSocket, in token mode and over HTTP."""
    server, backend = synthetic
    text = ('Call <sub alias="Doctor Who. The show">DW</sub> today. Spell <spell>A. B</spell> now. '
            'And a < b. Done.')
    said_whole = ["Call Doctor Who. The show today.", "Spell A, B now.", "And a < b.", "Done."]
    for granularity in ("sentence", "token"):
        backend.records.clear()
        messages = await session(server.ws_url, [text], KEY_A, text_markup="ssml", split_granularity=granularity)
        assert said(backend) == said_whole, granularity
        assert [words_of(d) for d in of_type(messages, "audio.done")][:2] == [
            ["Call", "DW", "today."], ["Spell", "A. B", "now."]]
    backend.records.clear()
    response = httpx.post(server.url + "/v1/audio/speech", headers=auth(KEY_A), timeout=30, json={
        "input": text, "voice": VOICE, "response_format": "pcm", "text_markup": "ssml"})
    assert response.status_code == 200 and said(backend) == said_whole
