"""`voxgate serve` logs one JSON object per line, with the session id on a session's lines, and never the
API key (not even from a `?api_key=` request path) nor the text spoken at info level."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import websockets

from gateway.logs import JsonFormatter, redact
from tests.gateway_server import free_port, receive_until, wait_until_ready

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


async def test_serve_logs_json_lines_without_keys_or_text():
    port = free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--backend", "synthetic", "--port", str(port),
         "--api-key", KEY, "--log-level", "info"],
        stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_ready(url, 60, lambda: None if gateway.poll() is None else f"voxgate serve exited ({gateway.returncode})")
        async with websockets.connect(f"ws://127.0.0.1:{port}/v1/audio/speech/stream?api_key={KEY}") as ws:
            await ws.send(json.dumps({"type": "session.config", "voice": "tone-mid", "stream_audio": True}))
            session_id = (await receive_until(ws, "session.started"))[-1]["session_id"]
            await ws.send(json.dumps({"type": "input.text", "text": SPOKEN}))
            await ws.send(json.dumps({"type": "session.close"}))
            await receive_until(ws, "session.done")
        async with websockets.connect(f"ws://127.0.0.1:{port}/v1/audio/speech/stream?api_key=wrong-{KEY}") as ws:
            await receive_until(ws, "error")
        httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        time.sleep(0.3)
    finally:
        gateway.send_signal(signal.SIGTERM)
        _, stderr = gateway.communicate(timeout=30)
    lines = [line for line in stderr.splitlines() if line.strip()]
    entries = [json.loads(line) for line in lines]  # every line is one JSON object
    assert KEY not in stderr
    assert "Zebra" not in stderr and "lullaby" not in stderr
    session_lines = [e for e in entries if e.get("session_id") == session_id]
    assert {e["message"] for e in session_lines} >= {"session started", "session ended"}
    assert any("api_key=[redacted]" in e["message"] for e in entries)  # uvicorn's access line, masked
