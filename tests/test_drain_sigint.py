"""Ctrl-C on a real `voxgate serve` process: the first SIGINT drains as SIGTERM does (the open utterance is
finished, new sessions are refused, the process exits 0), a second stops it at once (exit 130), and
neither prints a traceback. Before: the first Ctrl-C cut every session (close 1012 mid-sentence), printed
a 30-line KeyboardInterrupt traceback and exited 130."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import websockets

from tests.hostile_fixtures import served_gateway
from tests.resume_fixtures import PACED, Listener, config_message, until_draining

TWO_SENTENCES = "This utterance is finished before the gateway goes away. It has two whole sentences in it."


async def test_the_first_ctrl_c_lets_the_open_utterance_finish():
    with served_gateway(*PACED, "--drain-timeout", "20") as gateway:
        listener = Listener()
        ws = await websockets.connect(gateway.ws_url, max_size=None)
        await ws.send(config_message())
        await listener.receive(ws, "session.started")
        await ws.send(json.dumps({"type": "input.text", "text": TWO_SENTENCES}))
        await ws.send(json.dumps({"type": "input.done"}))
        while listener.first_audio_at is None:
            listener.feed(await asyncio.wait_for(ws.recv(), 20))
        gateway.process.send_signal(signal.SIGINT)

        await until_draining(gateway, 20)  # draining: no new sessions
        async with websockets.connect(gateway.ws_url) as refused:
            error = json.loads(await refused.recv())
        assert (error["code"], error["retryable"]) == ("overloaded", True)

        done = await listener.receive(ws, "session.done")
        closed = await listener.receive_until_closed(ws)
        assert done["total_sentences"] == 2 and sorted(listener.audio) == [0, 1]
        finished = [m for m in listener.messages if m.get("type") == "audio.done"]
        assert [len(listener.audio[m["sentence_index"]]) for m in finished] == [m["total_bytes"] for m in finished]
        assert closed.rcvd.code == 1012 and closed.rcvd.reason == listener.session_id  # handed over, idle
        assert gateway.process.wait(15) == 0
        log = gateway.log()
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log


async def test_a_second_ctrl_c_stops_at_once():
    with served_gateway(*PACED, "--drain-timeout", "30") as gateway:
        listener = Listener()
        ws = await websockets.connect(gateway.ws_url, max_size=None)
        await ws.send(config_message())
        await listener.receive(ws, "session.started")
        await ws.send(json.dumps({"type": "input.text", "text": TWO_SENTENCES + " And it is still being typed"}))
        while listener.first_audio_at is None:  # no input.done: the utterance stays open for the whole drain
            listener.feed(await asyncio.wait_for(ws.recv(), 20))
        gateway.process.send_signal(signal.SIGINT)
        await until_draining(gateway, 30)  # the first Ctrl-C taken: draining, the session still open
        assert gateway.process.poll() is None
        gateway.process.send_signal(signal.SIGINT)
        stopped = time.monotonic()
        assert gateway.process.wait(10) == 128 + signal.SIGINT
        assert time.monotonic() - stopped < 5  # not the 30 s drain, nor uvicorn's 5 s wait for connections
        await ws.close()
        log = gateway.log()
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    assert "stopped at once by a second SIGINT: 1 session(s) cut off" in log, log
