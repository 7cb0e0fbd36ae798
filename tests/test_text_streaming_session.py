"""split_granularity "token" (issue 21): a session that asks for synthesis from each sentence's first words.
A real gateway on loopback, the real `websockets` client, the synthetic backend."""

from __future__ import annotations

import json

import pytest
import websockets

from gateway.session.segmenter import SentenceSegmenter
from tests.gateway_server import audio_by_sentence, receive_until, running_gateway

TEXT = "Hello there, friend. Dr. Smith paid $3.50 at 5 p.m. today! Is the weather nice? It is"


def send(ws, **message):
    return ws.send(json.dumps(message))


async def speak(url: str, granularity: str, words: list[str]) -> list:
    async with websockets.connect(url) as ws:
        await send(ws, type="session.config", stream_audio=True, voice="tone-mid", split_granularity=granularity)
        messages = [json.loads(await ws.recv())]
        for word in words:
            await send(ws, type="input.text", text=word)
        await send(ws, type="input.done")
        return messages + await receive_until(ws, "session.done")


def pieces(text: str) -> list[str]:
    words = text.split(" ")
    return [w + " " for w in words[:-1]] + [words[-1]]


async def test_token_granularity_is_accepted_and_says_when_it_falls_back_to_sentences():
    with running_gateway("synthetic") as server:
        token = await speak(server.ws_url, "token", pieces(TEXT))
        sentence = await speak(server.ws_url, "sentence", pieces(TEXT))
    started = token[0]
    assert started["type"] == "session.started"
    assert [w["field"] for w in started["warnings"]] == ["split_granularity"]
    assert started["warnings"][0]["code"] == "option_ignored"
    assert "warnings" not in sentence[0]
    texts = [m["sentence_text"] for m in token if isinstance(m, dict) and m["type"] == "audio.start"]
    assert texts == [m["sentence_text"] for m in sentence if isinstance(m, dict) and m["type"] == "audio.start"]
    assert audio_by_sentence(token) == audio_by_sentence(sentence)


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
