"""Overload: when synthesis cannot keep real time for more sessions, new sessions are refused early with
`overloaded` (retryable, close 1013; HTTP 503 with Retry-After) while the open ones carry on."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets

from gateway.limits import SynthesisMonitor
from tests.gateway_server import open_session, receive_until, running_gateway
from tts_backend.synthetic import SyntheticSynthesizer

CONFIG = {"type": "session.config", "voice": "tone-mid", "stream_audio": True}


class LoadedSynthesizer(SyntheticSynthesizer):
    """The synthetic backend reporting a settable load (what an engine reports from its batch)."""

    reported_load = 0.0

    def load(self) -> float:
        return self.reported_load


async def refused(url: str) -> tuple[dict, int]:
    ws, error, code = await open_session(url, CONFIG)
    assert ws is None, error
    return error, code


async def speaks(url: str, text: str = "Still serving.") -> int:
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps(CONFIG))
        await receive_until(ws, "session.started")
        await ws.send(json.dumps({"type": "input.text", "text": text}))
        await ws.send(json.dumps({"type": "input.done"}))
        messages = await receive_until(ws, "session.done", timeout=60)
        return sum(len(m) for m in messages if isinstance(m, bytes))


async def test_backend_load_refuses_new_sessions_but_not_open_ones():
    backend = LoadedSynthesizer(speed=4.0)
    with running_gateway(backend) as server:
        async with websockets.connect(server.ws_url) as open_one:
            await open_one.send(json.dumps(CONFIG))
            await receive_until(open_one, "session.started")
            backend.reported_load = 0.97
            error, code = await refused(server.ws_url)
            assert error["code"] == "overloaded" and error["retryable"] and code == 1013
            assert "97%" in error["message"]
            response = httpx.post(server.url + "/v1/audio/speech", json={"input": "Hi.", "voice": "tone-mid"})
            assert response.status_code == 503 and response.json()["error"]["code"] == "overloaded"
            assert int(response.headers["Retry-After"]) >= 1
            # The open session is still served in full.
            await open_one.send(json.dumps({"type": "input.text", "text": "I was here first."}))
            await open_one.send(json.dumps({"type": "input.done"}))
            messages = await receive_until(open_one, "session.done")
            assert any(isinstance(m, bytes) for m in messages)
        backend.reported_load = 0.5
        assert await speaks(server.ws_url) > 0


async def test_measured_slower_than_real_time_refuses_new_sessions():
    # A backend making audio at half real time: every stream would underrun. After a second of audio made
    # that slowly, the gateway refuses new sessions until the window (5 s) has passed.
    with running_gateway("synthetic", backend_options={"speed": 0.5}) as server:
        async with websockets.connect(server.ws_url) as ws:
            await ws.send(json.dumps(CONFIG))
            await receive_until(ws, "session.started")
            await ws.send(json.dumps({"type": "input.text", "text": "A sentence that takes a few seconds to say."}))
            await ws.send(json.dumps({"type": "input.done"}))
            await receive_until(ws, "session.done", timeout=30)
        error, code = await refused(server.ws_url)
        assert error["code"] == "overloaded" and code == 1013
        assert "real time" in error["message"]
        for _ in range(80):  # the evidence ages out of the window and sessions are admitted again
            await asyncio.sleep(0.1)
            if server.gateway.admission.monitor.realtime_speed() is None:
                break
        assert await speaks(server.ws_url, "Hi.") > 0


async def test_active_synthesis_cap():
    with running_gateway("synthetic", backend_options={"speed": 1.0}, max_active_synthesis=1) as server:
        async with websockets.connect(server.ws_url) as busy:
            await busy.send(json.dumps(CONFIG))
            await receive_until(busy, "session.started")
            await busy.send(json.dumps({"type": "input.text", "text": "Long enough to keep one stream busy a while."}))
            await busy.send(json.dumps({"type": "input.done"}))
            await receive_until(busy, "audio.start")
            error, code = await refused(server.ws_url)
            assert error["code"] == "overloaded" and "1 streams" in error["message"]


def test_monitor_window_and_evidence():
    monitor = SynthesisMonitor(window_s=5.0)
    assert monitor.realtime_speed(now=100.0) is None
    monitor.produced(0.5, 1.0, now=100.0)
    assert monitor.realtime_speed(now=100.5) is None  # under a second of audio: no judgement
    monitor.produced(0.5, 1.0, now=101.0)
    assert monitor.realtime_speed(now=101.5) == pytest.approx(0.5)
    monitor.produced(4.0, 1.0, now=102.0)
    assert monitor.realtime_speed(now=102.5) == pytest.approx(5.0 / 3.0)
    assert monitor.realtime_speed(now=110.0) is None  # aged out
