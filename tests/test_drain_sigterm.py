"""Graceful drain of a real `voxgate serve` process on SIGTERM: the open utterance finishes, new sessions
are refused with a clear retryable error, a session still mid-utterance at the deadline is told to resume
elsewhere (close 1012, its id as the reason) and does so on the other replica, and the process exits 0."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import websockets

from tests.redis_fixtures import REDIS_URL, redis_prefix  # noqa: F401 (fixture)
from tests.resume_fixtures import PACED, Listener, config_message, gateways, uninterrupted_pcm, until_draining

DRAIN_S = 3.0


async def test_sigterm_finishes_the_utterance_refuses_new_sessions_and_hands_over_the_rest(redis_prefix):  # noqa: F811
    with gateways(REDIS_URL, redis_prefix, 2, *PACED, "--drain-timeout", str(DRAIN_S)) as (a, b):
        finishing_text = "This utterance is finished before the replica goes away. It has two sentences."
        open_text, later = "The other client speaks one sentence now. Its second one is still", " being typed."
        reference = await uninterrupted_pcm(b.ws_url, open_text + later)

        finishing, waiting = Listener(), Listener()
        ws1 = await websockets.connect(a.ws_url, max_size=None)
        await ws1.send(config_message())
        await finishing.receive(ws1, "session.started")
        ws2 = await websockets.connect(a.ws_url, max_size=None)
        await ws2.send(config_message())
        await waiting.receive(ws2, "session.started")
        await ws2.send(json.dumps({"type": "input.text", "text": open_text}))  # no input.done: stays open
        await ws1.send(json.dumps({"type": "input.text", "text": finishing_text}))
        await ws1.send(json.dumps({"type": "input.done"}))
        while finishing.first_audio_at is None:
            finishing.feed(await asyncio.wait_for(ws1.recv(), 20))
        a.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()

        # Once the drain has begun (/ready says no), new sessions are refused, clearly and retryably.
        await until_draining(a, DRAIN_S)
        async with websockets.connect(a.ws_url) as refused:
            error = json.loads(await refused.recv())
            await refused.wait_closed()
        assert (error["code"], error["retryable"]) == ("overloaded", True)
        assert "shutting down" in error["message"] and refused.close_code == 1013

        # The open utterance finishes completely, then the session is handed over (it is idle).
        done = await finishing.receive(ws1, "session.done")
        closed = await finishing.receive_until_closed(ws1)
        assert done["total_sentences"] == 2 and sorted(finishing.audio) == [0, 1]
        assert closed.rcvd.code == 1012 and closed.rcvd.reason == finishing.session_id

        # The session still mid-utterance at the deadline is told to resume elsewhere ...
        closed = await waiting.receive_until_closed(ws2, timeout=DRAIN_S + 10)
        assert closed.rcvd.code == 1012 and closed.rcvd.reason == waiting.session_id
        assert time.monotonic() - signalled >= DRAIN_S - 0.5
        assert a.process.wait(15) == 0  # ... and the process exits cleanly

        # ... and does, on the other replica, where the rest of its text is spoken.
        ws3 = await websockets.connect(b.ws_url, max_size=None)
        await ws3.send(json.dumps({"type": "session.resume", "session_id": closed.rcvd.reason,
                                   "sentence_index": waiting.position()[0], "bytes_received": waiting.position()[1]}))
        assert (await waiting.receive(ws3, ("session.started", "error")))["type"] == "session.started"
        await ws3.send(json.dumps({"type": "input.text", "text": later}))
        await ws3.send(json.dumps({"type": "input.done"}))
        await waiting.receive(ws3, "session.done")
        await ws3.close()
    assert waiting.pcm() == reference
