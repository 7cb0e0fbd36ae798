"""The Redis session store across a Redis restart (issue 12, item 9), on a redis-server of the test's own:
the first new session after the restart works (each pooled connection is dead, and the first command on
it is retried once on a new one), and /ready reports a store it cannot reach. A retried write may have run
already (the connection broke after Redis ran it, before the reply came): delivered twice, it changes
nothing - the audio append, the limits' token bucket and session slot alike."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging

import httpx
import redis
import websockets

from gateway import limits
from gateway.store import redis as redis_store
from tests.gateway_server import running_gateway
from tests.redis_fixtures import REDIS_URL, RedisProxy, private_redis, redis_prefix  # noqa: F401 (fixture)
from tests.resume_fixtures import Listener, config_message, start_session


def script_call(lua: str) -> bytes:
    """What a client sends to call a script by its hash (redis-py's Script.sha)."""
    return hashlib.sha1(lua.encode()).hexdigest().encode()


async def spoken_session(ws_url: str) -> dict:
    """A whole session: config, one sentence, its end; returns the last message (session.done or error)."""
    listener = Listener()
    async with websockets.connect(ws_url, max_size=None) as ws:
        await ws.send(config_message())
        started = await listener.receive(ws, ("session.started", "error"))
        if started["type"] == "error":
            return started
        await ws.send(json.dumps({"type": "input.text", "text": "Spoken through the store."}))
        await ws.send(json.dumps({"type": "input.done"}))
        return await listener.receive(ws, ("session.done", "error"))


async def test_new_sessions_work_on_the_first_try_after_a_redis_restart():
    with private_redis() as redis_server:
        with running_gateway(backend="synthetic", store="redis", redis_url=redis_server.url) as server:
            done = {"type": "session.done", "total_sentences": 1}
            # Sessions at the same time, so that the pool holds several connections.
            assert await asyncio.gather(*[spoken_session(server.ws_url) for _ in range(4)]) == [done] * 4
            redis_server.stop()
            redis_server.start()
            # Each takes pooled connections that the restart killed.
            assert await asyncio.gather(*[spoken_session(server.ws_url) for _ in range(4)]) == [done] * 4


def test_ready_reports_a_store_it_cannot_reach():
    with private_redis() as redis_server:
        with running_gateway(backend="synthetic", store="redis", redis_url=redis_server.url) as server:
            assert httpx.get(server.url + "/ready").status_code == 200
            redis_server.stop()
            down = httpx.get(server.url + "/ready", timeout=10)
            assert down.status_code == 503
            body = down.json()
            assert body["status"] == "not_ready" and "session store is unreachable" in body["store"], body
            assert httpx.get(server.url + "/health").status_code == 200  # alive, only not ready
            redis_server.start()
            assert httpx.get(server.url + "/ready").status_code == 200


async def test_an_audio_append_delivered_twice_is_recorded_once(redis_prefix):  # noqa: F811
    """The connection breaks after Redis ran the first audio append and before its reply came; the store
    retries it on a new connection. The replay log holds that audio once (before: twice, so the session's
    recorded bytes ran ahead of the audio sent and a resume replayed a frame twice) and a resume from the
    start is byte-exact."""
    text = "The first sentence is spoken through a flaky link. The second one follows it."
    proxy = RedisProxy()
    try:
        with running_gateway(backend="synthetic", store="redis", redis_url=proxy.url, redis_key_prefix=redis_prefix,
                             session_lease_s=60) as server:
            listener = Listener()
            async with websockets.connect(server.ws_url, max_size=None) as ws:
                proxy.break_after(script_call(redis_store._APPEND))
                await start_session(ws, listener, text)
                await listener.receive(ws, "session.done")
            assert proxy.broken.is_set()
            sent = {index: bytes(audio) for index, audio in listener.audio.items()}
            assert len(sent) == 2
            keys = server.gateway.store.keys(listener.session_id)
            client = redis.Redis.from_url(REDIS_URL)
            logged: dict[int, bytes] = {}
            for _, entry in client.xrange(keys[redis_store.KEY["log"] - 1]):
                index = int(entry[b"i"])
                assert int(entry[b"o"]) == len(logged.get(index, b""))
                logged[index] = logged.get(index, b"") + entry[b"d"]
            recorded = {int(i): int(n) for i, n in client.hgetall(keys[redis_store.KEY["bytes"] - 1]).items()}
            assert logged == sent
            assert recorded == {index: len(audio) for index, audio in sent.items()}
            resumed = Listener(session_id=listener.session_id)
            async with websockets.connect(server.ws_url, max_size=None) as ws:
                await ws.send(resumed.resume_message())
                while resumed.last_done < max(sent):
                    await resumed.receive(ws, "audio.done")
            assert {index: bytes(audio) for index, audio in resumed.audio.items()} == sent
    finally:
        proxy.close()


async def test_limit_counters_delivered_twice_count_once(redis_prefix):  # noqa: F811
    """Across replicas the limits are Lua scripts in Redis; the connection breaks after Redis ran one and
    before its reply came, and the call is retried. The session slot taken twice is still one slot of the
    key's one, and 60 characters charged twice are 60 of the 100 a minute. (Before, the limits' client did
    not retry at all and refused the session with internal; retried without the scripts' ids, the slot
    taken twice filled the key's slots and refused the session, and the take charged 120 characters.)"""
    proxy = RedisProxy()
    try:
        with running_gateway(backend="synthetic", store="redis", redis_url=proxy.url, redis_key_prefix=redis_prefix,
                             max_sessions_per_key=1, chars_per_minute=100) as server:
            listener = Listener()
            async with websockets.connect(server.ws_url, max_size=None) as ws:
                proxy.break_after(script_call(limits._ACQUIRE_LUA))
                await ws.send(config_message())
                assert (await listener.receive(ws, ("session.started", "error")))["type"] == "session.started"
                assert proxy.broken.is_set()
                proxy.break_after(script_call(limits._TAKE_LUA))
                for text in ("x" * 59 + " ", "y" * 29 + " ", "z" * 29 + " "):  # 60 + 30 accepted, 30 refused
                    await ws.send(json.dumps({"type": "input.text", "text": text}))
                await ws.send(json.dumps({"type": "input.done"}))
                await listener.receive(ws, "session.done")
                assert proxy.broken.is_set()
            errors = [m for m in listener.messages if m["type"] == "error"]
            assert [e["code"] for e in errors] == ["rate_limited"], errors
            spoken = " ".join(m["sentence_text"] for m in listener.messages if m["type"] == "audio.start")
            assert "x" * 59 in spoken and "y" * 29 in spoken and "z" not in spoken, spoken
    finally:
        proxy.close()


async def test_a_store_lost_mid_session_is_store_unavailable_in_one_log_line(caplog):
    # Redis stops while a session is open: the client hears store_unavailable (retryable, close 1013), naming
    # the store, and the log has one line for the session, not a traceback (nor a detach warning after it).
    with private_redis() as redis_server:
        with running_gateway(backend="synthetic", store="redis", redis_url=redis_server.url) as server:
            listener = Listener()
            with caplog.at_level(logging.INFO):
                async with websockets.connect(server.ws_url, max_size=None) as ws:
                    await ws.send(config_message())
                    started = await listener.receive(ws, "session.started")
                    redis_server.stop()
                    await ws.send(json.dumps({"type": "input.text", "text": "Spoken without a store."}))
                    await ws.send(json.dumps({"type": "input.done"}))
                    error = await listener.receive(ws, "error")
                    closed = await listener.receive_until_closed(ws)
    assert error["code"] == "store_unavailable" and error["retryable"] is True, error
    assert "Redis session store" in error["message"], error
    assert closed.rcvd is not None and closed.rcvd.code == 1013
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("voxgate")]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].exc_info is None
    assert started["session_id"] in lines[0].getMessage() and "Redis session store" in lines[0].getMessage()
