"""`voxgate serve` logs one JSON object per line, with the session id on a session's lines, and never the
API key (not even from a `?api_key=` request path) nor the text spoken at info level."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import websockets

from gateway.logs import JsonFormatter, redact
from tests.gateway_server import free_port, receive_until, wait_until_ready
from tests.hostile_fixtures import HealthProbe, RawHttp, served_gateway

KEY = "sk-very-secret-4242"
SPOKEN = "Zebra quartz lullaby, the secret sentence."


def test_redaction_of_credentials():
    assert redact('"WebSocket /v1/tts/stream?api_key=abc123&x=1" 403') == '"WebSocket /v1/tts/stream?api_key=[redacted]&x=1" 403'
    assert redact("GET /v1/x?token=vxt1.aaa.bbb HTTP/1.1") == "GET /v1/x?token=[redacted] HTTP/1.1"
    assert redact("Authorization: Bearer sk-123") == "Authorization: Bearer [redacted]"


def test_json_formatter_carries_extras_and_exceptions():
    import logging

    record = logging.LogRecord("voxgate.test", logging.ERROR, __file__, 1, "failed %s", ("here",), None)
    record.session_id = "s1"
    record.sentences = 3
    entry = json.loads(JsonFormatter().format(record))
    assert entry["message"] == "failed here" and entry["session_id"] == "s1" and entry["sentences"] == 3
    assert entry["level"] == "error" and entry["logger"] == "voxgate.test"


@dataclass
class ServedWithLogs:
    port: int
    stderr: str = ""  # everything the gateway logged, once it has stopped

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def served_with_logs() -> Iterator[ServedWithLogs]:
    """`voxgate serve --api-key KEY --log-level info`; its stderr is captured once it has stopped (SIGTERM)."""
    served = ServedWithLogs(free_port())
    gateway = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--backend", "synthetic", "--port", str(served.port),
         "--api-key", KEY, "--log-level", "info"],
        stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    try:
        wait_until_ready(served.url, 60,
                         lambda: None if gateway.poll() is None else f"voxgate serve exited ({gateway.returncode})")
        yield served
    finally:
        gateway.send_signal(signal.SIGTERM)
        _, served.stderr = gateway.communicate(timeout=30)


async def test_serve_logs_json_lines_without_keys_or_text():
    with served_with_logs() as served:
        url, port = served.url, served.port
        async with websockets.connect(f"ws://127.0.0.1:{port}/v1/audio/speech/stream?api_key={KEY}") as ws:
            await ws.send(json.dumps({"type": "session.config", "voice": "tone-mid", "stream_audio": True}))
            session_id = (await receive_until(ws, "session.started"))[-1]["session_id"]
            await ws.send(json.dumps({"type": "input.text", "text": SPOKEN}))
            await ws.send(json.dumps({"type": "session.close"}))
            await receive_until(ws, "session.done")
        async with websockets.connect(f"ws://127.0.0.1:{port}/v1/audio/speech/stream?api_key=wrong-{KEY}") as ws:
            await receive_until(ws, "error")
        httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    stderr = served.stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    entries = [json.loads(line) for line in lines]  # every line is one JSON object
    assert KEY not in stderr
    assert "Zebra" not in stderr and "lullaby" not in stderr
    session_lines = [e for e in entries if e.get("session_id") == session_id]
    assert {e["message"] for e in session_lines} >= {"session started", "session ended"}
    assert any("api_key=[redacted]" in e["message"] for e in entries)  # uvicorn's access line, masked


def test_redaction_reads_names_as_the_query_parser_does():
    assert redact("GET /v1/models?api%5Fkey=sk-1 HTTP/1.1") == "GET /v1/models?api%5Fkey=[redacted] HTTP/1.1"
    assert redact("GET /x?a=1&t%6Fken=vxt1.a.b&b=2") == "GET /x?a=1&t%6Fken=[redacted]&b=2"
    assert redact("GET /x?%61pi%5fkey=sk%2D1") == "GET /x?%61pi%5fkey=[redacted]"
    assert redact("GET /x?API_KEY=sk-1") == "GET /x?API_KEY=[redacted]"
    assert redact("GET /x?apikey=1&tokens=2") == "GET /x?apikey=1&tokens=2"  # names the gateway does not read
    assert redact("Authorization: Api-Key sk-1") == "Authorization: Api-Key [redacted]"


async def test_percent_encoded_credential_names_never_reach_the_access_log():
    """`?api%5Fkey=` and `?t%6Fken=` authenticate (the query parser decodes the name), so their values are
    credentials too: masked in uvicorn's access lines, over HTTP and WebSocket."""
    encoded_key = KEY.replace("-", "%2D")  # the value percent-encoded too: the same key once decoded
    with served_with_logs() as served:
        url, port = served.url, served.port
        async with httpx.AsyncClient() as client:
            for query in (f"api%5Fkey={KEY}", f"%61pi_key={encoded_key}"):
                assert (await client.get(f"{url}/v1/models?{query}")).status_code == 200, query
            minted = await client.post(f"{url}/v1/tokens", headers={"X-API-Key": KEY}, json={})
            token = minted.json()["token"]
            assert (await client.get(f"{url}/v1/models?t%6Fken={token}")).status_code == 200
        for query in (f"api%5Fkey={KEY}", f"t%6Fken={token}"):
            async with websockets.connect(f"ws://127.0.0.1:{port}/v1/audio/speech/stream?{query}") as ws:
                await ws.send(json.dumps({"type": "session.config", "voice": "tone-mid"}))
                await receive_until(ws, "session.started")
    stderr = served.stderr
    messages = [json.loads(line)["message"] for line in stderr.splitlines() if line.strip()]
    assert KEY not in stderr and encoded_key not in stderr and token not in stderr
    assert token.split(".")[-1] not in stderr  # not even the token's signature
    masked = [m for m in messages if "=[redacted]" in m]
    assert len([m for m in masked if "/v1/models" in m]) == 3, messages
    assert len([m for m in masked if "WebSocket" in m]) == 2, messages


# Text shaped to make a backtracking pattern retry from every position: a long run of characters that may
# start a query name or a URL scheme, not followed by what would complete it. 48 KB each.
HOSTILE_LOG_TEXTS = {
    "a query name without '='": "GET /health?" + "a" * 48_000 + "&b=1 HTTP/1.1",
    "a dotted scheme without '://'": "GET /health?x=" + "a." * 24_000 + "@ HTTP/1.1",
    "a dashed scheme without '://'": "GET /health?" + "a-" * 24_000 + "@b=1 HTTP/1.1",
}


def test_redaction_takes_time_linear_in_the_text():
    """A log line is masked on the event loop, and a request's path is attacker's text: masking 48 KB
    takes milliseconds (0.02 s here), not the seconds (8-40 s) a pattern that backtracks over each
    position of a long run takes."""
    for shape, text in HOSTILE_LOG_TEXTS.items():
        started = time.perf_counter()
        redact(text)
        assert time.perf_counter() - started < 0.5, shape


async def test_a_long_request_path_does_not_stall_the_gateway():
    """uvicorn's access line of one request with a 48 KB query, without any key, is masked by the same
    event loop that answers everyone: /health keeps answering while it is logged. (48 KB is over the
    default request line bound, 16 KiB, which answers 414 before anything is logged: raised here so that
    masking is measured on the longest line an operator may allow.)"""
    with served_gateway("--log-level", "info", "--api-key", KEY,
                        env={"VOXGATE_MAX_REQUEST_LINE_BYTES": "65536", "VOXGATE_MAX_HEADER_BYTES": "131072"}) as gateway:
        async with HealthProbe(gateway.url) as probe:
            for text in HOSTILE_LOG_TEXTS.values():
                method, target, _ = text.split(" ")
                request = await RawHttp.send_head(gateway.port, method, target, {"Connection": "close"})
                try:
                    status, _, _ = await request.response(timeout=60)
                finally:
                    request.close()
                assert status == 200
    print(f"slowest /health answer while three 48 KB request lines were logged: {probe.worst:.3f} s")
    assert probe.worst < 2.0
