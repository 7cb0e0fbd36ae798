"""Per-key limits: concurrent sessions, new sessions per minute, characters per minute; over WebSocket
(protocol errors, close 1013 when fatal) and HTTP (429 with Retry-After); in one process and shared by
two replicas through Redis."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from gateway.auth import Principal
from gateway.limits import Admission, LimitExceeded
from gateway.settings import GatewaySettings
from tests import gateway_server
from tests.gateway_server import audio_by_sentence, receive_until, running_gateway
from tests.redis_fixtures import REDIS_URL, redis_cluster, redis_prefix, redis_target  # noqa: F401 (fixture)

KEY_A, KEY_B = "key-a-123", "key-b-456"
CONFIG = {"type": "session.config", "voice": "tone-mid", "stream_audio": True}


async def open_session(url: str, key: str):
    """A configured session, or the error dict and close code that refused it."""
    return await gateway_server.open_session(url, CONFIG, additional_headers={"X-API-Key": key})


async def test_concurrent_sessions_per_key():
    with running_gateway("synthetic", api_keys=[KEY_A, KEY_B], max_sessions_per_key=2) as server:
        first, _, _ = await open_session(server.ws_url, KEY_A)
        second, _, _ = await open_session(server.ws_url, KEY_A)
        refused, error, code = await open_session(server.ws_url, KEY_A)
        assert refused is None and error["code"] == "too_many_sessions" and error["retryable"] and code == 1013
        other, _, _ = await open_session(server.ws_url, KEY_B)  # another key has its own allowance
        assert other is not None
        await first.close()
        for _ in range(100):  # the slot comes back when the session ends
            again, _, _ = await open_session(server.ws_url, KEY_A)
            if again is not None:
                break
            await asyncio.sleep(0.05)
        assert again is not None
        for ws in (second, other, again):
            await ws.close()


async def test_new_sessions_per_minute_over_websocket_and_http():
    with running_gateway("synthetic", api_keys=[KEY_A, KEY_B], sessions_per_minute=3) as server:
        opened = []
        for _ in range(2):
            ws, _, _ = await open_session(server.ws_url, KEY_A)
            opened.append(ws)
        async with httpx.AsyncClient() as client:  # an HTTP speech request is a session too
            response = await client.post(server.url + "/v1/audio/speech", headers={"X-API-Key": KEY_A},
                                         json={"input": "One.", "voice": "tone-mid", "response_format": "pcm"})
            assert response.status_code == 200
            refused = await client.post(server.url + "/v1/audio/speech", headers={"X-API-Key": KEY_A},
                                        json={"input": "Two.", "voice": "tone-mid", "response_format": "pcm"})
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limited"
        assert 1 <= int(refused.headers["Retry-After"]) <= 20  # a token every 20 s at 3 per minute
        ws, error, code = await open_session(server.ws_url, KEY_A)
        assert ws is None and error["code"] == "rate_limited" and error["retryable"] and code == 1013
        assert "3 new sessions per minute" in error["message"]
        other, _, _ = await open_session(server.ws_url, KEY_B)
        assert other is not None
        for ws in [*opened, other]:
            await ws.close()


async def test_characters_per_minute_refuse_text_without_losing_accepted_text():
    with running_gateway("synthetic", api_keys=[KEY_A], chars_per_minute=60) as server:
        ws, _, _ = await open_session(server.ws_url, KEY_A)
        accepted = "Forty characters of text, spoken aloud."  # 39
        await ws.send(json.dumps({"type": "input.text", "text": accepted}))
        await ws.send(json.dumps({"type": "input.text", "text": " And this sentence is over the minute's allowance."}))
        error = (await receive_until(ws, "error"))[-1]
        assert error["code"] == "rate_limited" and error["retryable"]
        await ws.send(json.dumps({"type": "input.text", "text": " Short."}))  # fits in what is left
        await ws.send(json.dumps({"type": "input.done"}))
        messages = await receive_until(ws, "session.done")
        spoken = [m["sentence_text"] for m in messages if isinstance(m, dict) and m.get("type") == "audio.start"]
        assert spoken == [accepted, "Short."]
        assert all(len(a) > 0 for a in audio_by_sentence(messages).values())
        await ws.close()
        async with httpx.AsyncClient() as client:
            too_long = await client.post(server.url + "/v1/audio/speech", headers={"X-API-Key": KEY_A},
                                         json={"input": "x" * 61, "voice": "tone-mid"})
        assert too_long.status_code == 429 and "exceed the whole per-minute allowance" in too_long.json()["error"]["message"]


def test_buckets_refill_over_the_minute():
    async def scenario():
        admission = Admission(GatewaySettings(chars_per_minute=600))
        await admission.start()
        principal = Principal(key_id="k")
        await admission.charge_chars(principal, 600)
        with pytest.raises(LimitExceeded) as refused:
            await admission.charge_chars(principal, 20)
        assert 1.5 < refused.value.retry_after_s <= 2.0  # 10 characters a second
        await asyncio.sleep(0.5)
        await admission.charge_chars(principal, 4)  # ~5 refilled
        await admission.stop()

    asyncio.run(scenario())


async def test_limits_are_shared_by_replicas_through_redis(redis_target, redis_prefix):  # noqa: F811
    shared = dict(api_keys=[KEY_A], store="redis", redis_url=redis_target.url, redis_cluster=redis_target.cluster,
                  redis_key_prefix=redis_prefix,
                  max_sessions_per_key=2, sessions_per_minute=4, chars_per_minute=100)
    with running_gateway("synthetic", **shared) as one, running_gateway("synthetic", **shared) as two:
        a, _, _ = await open_session(one.ws_url, KEY_A)
        b, _, _ = await open_session(two.ws_url, KEY_A)
        refused, error, code = await open_session(one.ws_url, KEY_A)  # two open across the replicas
        assert refused is None and error["code"] == "too_many_sessions" and code == 1013
        refused, error, _ = await open_session(two.ws_url, KEY_A)
        assert refused is None and error["code"] == "too_many_sessions"
        # Characters: 60 on one replica leave 40 for the other.
        await a.send(json.dumps({"type": "input.text", "text": "a" * 59 + "."}))
        await a.send(json.dumps({"type": "ping", "id": 0}))
        assert not [m for m in await receive_until(a, "pong") if isinstance(m, dict) and m.get("type") == "error"]
        await b.send(json.dumps({"type": "input.text", "text": "b" * 49 + "."}))
        error = (await receive_until(b, "error"))[-1]
        assert error["code"] == "rate_limited"
        await b.send(json.dumps({"type": "input.text", "text": "c" * 29 + "."}))
        await b.send(json.dumps({"type": "ping", "id": 1}))
        replies = await receive_until(b, "pong")
        assert not [m for m in replies if isinstance(m, dict) and m.get("type") == "error"]
        await a.close()
        await b.close()
        # Sessions per minute: 2 used above (the refused ones took none); 2 more, then refused on either.
        for _ in range(100):  # wait for the slots to be released
            c, _, _ = await open_session(one.ws_url, KEY_A)
            if c is not None:
                break
            await asyncio.sleep(0.05)
        await c.close()
        for _ in range(100):
            d, error, _ = await open_session(two.ws_url, KEY_A)
            if d is not None or error["code"] == "rate_limited":
                break
            await asyncio.sleep(0.05)
        assert d is not None
        await d.close()
        await asyncio.sleep(0.2)
        refused, error, _ = await open_session(one.ws_url, KEY_A)
        assert refused is None and error["code"] == "rate_limited"


def test_unreachable_counter_store_refuses_instead_of_letting_through():
    class Unreachable:
        async def take(self, *args):
            raise ConnectionError("redis is down")

        async def acquire_slot(self, *args):
            raise ConnectionError("redis is down")

    async def scenario():
        admission = Admission(GatewaySettings(chars_per_minute=100, max_sessions_per_key=1))
        admission.counters = Unreachable()
        with pytest.raises(LimitExceeded) as chars:
            await admission.charge_chars(Principal(key_id="k"), 5)
        assert chars.value.code.value == "internal" and chars.value.retry_after_s > 0
        with pytest.raises(LimitExceeded) as session:
            async with admission.session(Principal(key_id="k")):
                pass
        assert session.value.code.value == "internal" and session.value.close == 1013
        assert admission.open_sessions == 0

    asyncio.run(scenario())
