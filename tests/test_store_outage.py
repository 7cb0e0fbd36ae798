"""The Redis session store across a Redis restart (issue 12, item 9), on a redis-server of the test's own:
the first new session after the restart works (each pooled connection is dead, and the first command on
it is retried once on a new one), and /ready reports a store it cannot reach."""

from __future__ import annotations

import asyncio
import json

import httpx
import websockets

from tests.gateway_server import running_gateway
from tests.redis_fixtures import private_redis
from tests.resume_fixtures import Listener, config_message


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
