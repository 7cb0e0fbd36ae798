"""Overload: when synthesis cannot keep real time for more sessions, new sessions are refused early with
`overloaded` (retryable, close 1013; HTTP 503 with Retry-After) while the open ones carry on."""

from __future__ import annotations

import asyncio
import json
import logging

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


async def judgement(monitor: SynthesisMonitor) -> tuple[int, float | None]:
    """(streams running, their speed), read on the server's loop."""
    return monitor.active_streams, monitor.realtime_speed()


async def test_slower_than_real_time_refuses_new_sessions_only_while_a_slow_stream_runs(caplog):
    # A backend making audio at half real time: a stream running now underruns, so new sessions are refused
    # (and each refusal is logged with its reason) while it runs. Once it has finished there is nothing left
    # to protect: the next session is admitted at once, not after the finished stream ages out of a window.
    with running_gateway("synthetic", backend_options={"speed": 0.5}) as server:
        monitor = server.gateway.admission.monitor
        async with websockets.connect(server.ws_url) as ws:
            await ws.send(json.dumps(CONFIG))
            await receive_until(ws, "session.started")
            await ws.send(json.dumps({"type": "input.text", "text": "A sentence that takes a few seconds to say,"
                                      " long enough to be judged while it is still being made."}))
            await ws.send(json.dumps({"type": "input.done"}))
            await receive_until(ws, "audio.start")
            while (judged := server.call(judgement, monitor))[1] is None:  # a second of its audio: enough to judge
                assert judged[0] == 1, "the stream ended before it could be judged"
                await asyncio.sleep(0.05)
            with caplog.at_level(logging.WARNING, logger="voxgate.limits"):
                error, code = await refused(server.ws_url)
                assert error["code"] == "overloaded" and code == 1013
                assert "real time" in error["message"]
                second_error, _ = await refused(server.ws_url)
            refusals = [r.getMessage() for r in caplog.records if r.name == "voxgate.limits"]
            assert len(refusals) == 1, refusals  # rate-limited: the second refusal within the interval is counted
            assert "real time" in refusals[0] and "VOXGATE_OVERLOAD_MIN_REALTIME" in refusals[0]
            await receive_until(ws, "session.done", timeout=60)
        assert server.call(judgement, monitor) == (0, None)
        assert await speaks(server.ws_url, "Hi.") > 0


async def test_a_lone_client_is_never_refused_for_its_own_finished_sessions():
    # One client opening sessions one after another, with nothing else synthesizing, on a backend slower
    # than real time (the tiny test checkpoint on a busy CPU): each session starts after the previous one
    # has ended, so none is refused.
    with running_gateway("synthetic", backend_options={"speed": 0.5}) as server:
        for n in range(3):
            assert await speaks(server.ws_url, f"Sentence number {n} of a lone client, said slowly.") > 0
        response = httpx.post(server.url + "/v1/audio/speech", json={"input": "And over HTTP.", "voice": "tone-mid"},
                              timeout=60)
        assert response.status_code == 200, response.text


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


def test_monitor_judges_running_streams_over_the_window():
    monitor = SynthesisMonitor(window_s=5.0)
    assert monitor.realtime_speed(now=100.0) is None
    with monitor.stream() as slow:
        slow.produced(0.5, 1.0, now=100.0)
        assert monitor.realtime_speed(now=100.5) is None  # under a second of audio: no judgement
        slow.produced(0.5, 1.0, now=101.0)
        assert monitor.realtime_speed(now=101.5) == pytest.approx(0.5)
        with monitor.stream() as fast:
            fast.produced(4.0, 1.0, now=102.0)
            assert monitor.active_streams == 2
            assert monitor.realtime_speed(now=102.5) == pytest.approx(5.0 / 3.0)
        assert monitor.realtime_speed(now=102.5) == pytest.approx(0.5)  # the finished stream left with its pulls
        assert monitor.realtime_speed(now=110.0) is None  # aged out
    slow.produced(2.0, 4.0, now=111.0)  # a finished stream's meter no longer counts
    assert monitor.active_streams == 0 and monitor.realtime_speed(now=111.0) is None
