"""Leases with the in-memory store (one replica): a connection that sits idle notices on its next lease
renewal that its session was resumed elsewhere, and stops."""

from __future__ import annotations

import asyncio
import json
import time

import websockets

from tests.gateway_server import running_gateway
from tests.resume_fixtures import Listener, config_message


async def test_an_idle_connection_notices_the_takeover_at_its_next_renewal():
    with running_gateway(backend="synthetic", session_lease_s=0.3) as server:
        listener = Listener()
        old = await websockets.connect(server.ws_url, max_size=None)
        await old.send(config_message())
        await listener.receive(old, "session.started")
        await old.send(json.dumps({"type": "input.text", "text": "Spoken before the takeover."}))
        await old.send(json.dumps({"type": "input.done"}))
        await listener.receive(old, "session.done")  # now idle: nothing is being sent

        new = await websockets.connect(server.ws_url, max_size=None)
        await new.send(listener.resume_message())
        assert json.loads(await new.recv())["type"] == "session.started"
        taken_over = time.monotonic()
        error = json.loads(await asyncio.wait_for(old.recv(), 5))
        await old.wait_closed()
        noticed_after = time.monotonic() - taken_over
        assert error["code"] == "session_not_found" and "another connection" in error["message"]
        assert old.close_code == 1008 and noticed_after < 1.0

        # The new connection owns the session and keeps working.
        await new.send(json.dumps({"type": "input.text", "text": "Spoken after it."}))
        await new.send(json.dumps({"type": "input.done"}))
        done = await listener.receive(new, "session.done")
        assert done["total_sentences"] == 2
        await new.close()
