"""`voxgate serve` fails loudly and clearly: whatever keeps it from serving ends the process with a non-zero
exit and one plain line on stderr (no traceback), and what it prints when it does serve is readable.

Each case runs the real command (`python -m gateway.cli serve`) as a process, as a person or a supervisor
would; the rest drive a real gateway on loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import pty
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import websockets

from gateway.cli import build_parser, settings_from_args
from tests.gateway_server import free_port, running_gateway
from tts_backend.synthetic import SyntheticSynthesizer

REPO = Path(__file__).resolve().parent.parent
SERVE = [sys.executable, "-m", "gateway.cli", "serve"]


def run_serve(*args: str, env: dict[str, str] | None = None, prelude: str | None = None) -> subprocess.CompletedProcess:
    """`voxgate serve ARGS` until it exits by itself; `prelude` runs first in the same interpreter."""
    command = SERVE + list(args) if prelude is None else [
        sys.executable, "-c", f"{prelude}\nimport sys\nfrom gateway.cli import main\nsys.exit(main({['serve', *args]!r}))"
    ]
    environ = dict(os.environ, VOXGATE_LOG_LEVEL="info", **(env or {}))
    return subprocess.run(command, env=environ, cwd=REPO, capture_output=True, text=True, timeout=120)


def assert_one_clear_line(result: subprocess.CompletedProcess, *expected: str) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("voxgate: "), result.stderr
    for part in expected:
        assert part in last, last
    return last


def test_a_backend_that_fails_at_start_up_stops_the_server():
    result = run_serve("--port", str(free_port()), "--model", "/nonexistent/voice.onnx")
    assert_one_clear_line(result, "the piper backend failed to start", "/nonexistent/voice.onnx")


def test_an_unknown_voice_stops_the_server():
    result = run_serve("--port", str(free_port()), "--backend", "synthetic", "--voice", "no-such-voice")
    assert_one_clear_line(result, "--voice", "'no-such-voice'", "tone-mid")


def test_qwen3_without_a_model_is_one_line():
    assert_one_clear_line(run_serve("--backend", "qwen3"), "--model PATH")


def test_qwen3_without_torch_names_the_install_command():
    result = run_serve("--backend", "qwen3", "--model", str(REPO), prelude="import sys; sys.modules['torch'] = None")
    assert_one_clear_line(result, "pip install -e '.[qwen3]'")


def test_a_port_in_use_is_said_plainly():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_serve("--backend", "synthetic", "--port", str(port))
    assert_one_clear_line(result, f"port {port}", "already in use", "--port")


@pytest.mark.parametrize("value", ["secret-key", '{"a": 1}', "[1, "])
def test_malformed_api_keys_are_one_line_that_does_not_repeat_them(value):
    result = run_serve("--backend", "synthetic", env={"VOXGATE_API_KEYS": value})
    line = assert_one_clear_line(result, "VOXGATE_API_KEYS", "JSON list")
    assert value not in result.stderr and line.count("\n") == 0


def test_a_redis_url_alone_selects_the_redis_store(monkeypatch):
    parser = build_parser()
    assert settings_from_args(parser.parse_args(["serve", "--redis-url", "redis://127.0.0.1:6379/3"])).store == "redis"
    assert settings_from_args(parser.parse_args(["serve"])).store == "memory"
    explicit = ["serve", "--redis-url", "redis://127.0.0.1:6379/3", "--store", "memory"]
    assert settings_from_args(parser.parse_args(explicit)).store == "memory"
    monkeypatch.setenv("VOXGATE_REDIS_URL", "redis://127.0.0.1:6379/4")
    assert settings_from_args(parser.parse_args(["serve"])).store == "redis"


def test_a_redis_url_alone_reaches_redis_in_a_real_process():
    """The URL is used, not silently replaced by the memory store: an unreachable Redis fails the start, in
    one line rather than uvicorn's traceback."""
    result = run_serve("--backend", "synthetic", "--port", str(free_port()), "--redis-url", "redis://127.0.0.1:1/0")
    assert_one_clear_line(result, "the redis session store cannot start", "127.0.0.1:1")


@pytest.mark.parametrize("userinfo", [":hunter2-pw", "voxgate:hunter2-pw", "voxgate:hunter2%40pw", "voxgate:hunter2@pw"])
@pytest.mark.parametrize("given_by", ["flag", "env"])
def test_an_unreachable_redis_url_with_a_password_is_logged_without_it(userinfo, given_by):
    """The start fails on an unreachable Redis (the log line, and the exit line naming the URL), and the
    password is in neither: a --redis-url often carries one."""
    url = f"redis://{userinfo}@127.0.0.1:1/0"
    args = ["--backend", "synthetic", "--port", str(free_port())]
    if given_by == "flag":
        result = run_serve(*args, "--redis-url", url)
    else:
        result = run_serve(*args, "--store", "redis", env={"VOXGATE_REDIS_URL": url})
    line = assert_one_clear_line(result, "the redis session store cannot start", "127.0.0.1:1/0", "[redacted]")
    logged = [json.loads(entry) for entry in result.stderr.splitlines() if entry.startswith("{")]
    assert any("session store cannot start" in entry["message"] for entry in logged), result.stderr
    for secret in ("hunter2", "pw@127"):
        assert secret not in result.stderr + result.stdout, result.stderr
    assert line.count("voxgate:[redacted]@") + line.count("//:[redacted]@") == 1, line


# ----------------------------------------------------------------------------------- what it prints


class ServeOutput:
    """A running `voxgate serve` whose stderr lines are collected as they come."""

    def __init__(self, *args: str, tty: bool) -> None:
        self.port = free_port()
        self.lines: queue.Queue[str] = queue.Queue()
        reader, writer = pty.openpty() if tty else os.pipe()  # stderr a terminal, or a pipe as under a supervisor
        self.process = subprocess.Popen(SERVE + ["--port", str(self.port), *args], cwd=REPO,
                                        env=dict(os.environ, VOXGATE_LOG_LEVEL="info"),
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=writer)
        os.close(writer)
        threading.Thread(target=self._read, args=(reader,), daemon=True).start()

    def _read(self, fd: int) -> None:
        buffer = b""
        try:
            while chunk := os.read(fd, 4096):
                buffer += chunk
                *complete, buffer = buffer.split(b"\n")
                for line in complete:
                    self.lines.put(line.decode().rstrip("\r"))
        except OSError:  # a pty ends with an error rather than an empty read
            pass
        finally:
            os.close(fd)

    def until(self, needle: str, timeout: float = 60) -> list[str]:
        """Every line up to and including the first that contains `needle`."""
        seen: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            seen.append(line)
            if needle in line:
                return seen

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(15)


def startup_lines(*args: str, tty: bool) -> tuple[int, list[str]]:
    """`voxgate serve ARGS`'s port and its stderr lines up to the start-up line, with stderr a terminal or a pipe."""
    server = ServeOutput("--backend", "synthetic", *args, tty=tty)
    try:
        return server.port, server.until("Voxgate is up")
    finally:
        server.stop()


def test_logs_are_json_without_escape_codes_when_not_a_terminal_and_the_first_line_names_the_page():
    port, lines = startup_lines(tty=False)
    entries = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all("\x1b" not in line and "\\u001b" not in line for line in lines), lines
    assert f"http://127.0.0.1:{port}/ for the web demo" in entries[-1]["message"]


def test_logs_are_text_on_a_terminal():
    port, lines = startup_lines(tty=True)
    assert not any(line.lstrip().startswith("{") for line in lines), lines
    assert f"open http://127.0.0.1:{port}/ for the web demo" in lines[-1]
    assert " INFO " in lines[-1]


def test_log_format_flag_wins_over_the_terminal_check():
    _, lines = startup_lines("--log-format", "text", tty=False)
    assert not lines[-1].startswith("{") and "open http://127.0.0.1" in lines[-1]


def test_one_line_says_when_the_gateway_serves():
    """"Voxgate is up" is logged as uvicorn listens, while the backend still starts; a later line says that
    sessions are served, with the backend, the default voice and the start-up time."""
    server = ServeOutput("--backend", "synthetic", "--voice", "tone-high", "--log-format", "text", tty=False)
    try:
        lines = server.until("ready (")
    finally:
        server.stop()
    up = next(i for i, line in enumerate(lines) if "Voxgate is up" in line)
    assert up < len(lines) - 1
    assert re.search(r"ready \(synthetic, voice tone-high\) in \d+\.\d s$", lines[-1]), lines[-1]


def test_no_ready_line_when_start_up_fails():
    result = run_serve("--port", str(free_port()), "--backend", "synthetic", "--voice", "no-such-voice",
                       "--log-format", "text")
    assert_one_clear_line(result, "--voice")
    assert "ready (" not in result.stderr, result.stderr


# ------------------------------------------------------------------------------ HTTP and WebSocket


def test_a_websocket_to_a_wrong_path_gets_404():
    async def status(url: str) -> int | str:
        try:
            async with websockets.connect(url):
                return "accepted"
        except websockets.InvalidStatus as refused:
            return refused.response.status_code

    with running_gateway("synthetic") as server:
        ws = server.url.replace("http://", "ws://")
        for path in ("/v1/audio/speech/streem", "/", "/clients/js/voxgate.js", "/nothing/here"):
            assert asyncio.run(status(ws + path)) == 404, path
        assert asyncio.run(status(server.ws_url)) == "accepted"


class NoVoicesYet(SyntheticSynthesizer):
    """A backend that knows its voices only once loaded (as Qwen3) and never finishes loading here."""

    def __init__(self, voices_raise: bool) -> None:
        super().__init__()
        self.voices_raise = voices_raise

    async def start(self) -> None:
        await asyncio.Event().wait()

    @property
    def ready(self) -> bool:
        return False

    def voices(self):
        if self.voices_raise:
            raise RuntimeError("model not loaded")
        return []


@pytest.mark.parametrize("voices_raise", [False, True], ids=["empty", "raises"])
def test_the_voice_list_never_answers_500(voices_raise):
    with running_gateway(NoVoicesYet(voices_raise), ready_path="/health", ready_timeout_s=10) as server:
        response = httpx.get(server.url + "/v1/audio/voices")
        assert response.status_code == 200
        assert response.json()["voices"] == [] and response.json()["default"] is None


class FailsToStart(SyntheticSynthesizer):
    """Loading fails when the test says so (after the gateway answers), like a corrupt model file."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = threading.Event()

    async def start(self) -> None:
        while not self.fail.is_set():
            await asyncio.sleep(0.01)
        raise RuntimeError("the model file is corrupt")

    @property
    def ready(self) -> bool:
        return False


def test_health_speech_and_voices_name_a_failed_backend():
    backend = FailsToStart()
    with running_gateway(backend, ready_path="/health", ready_timeout_s=10) as server:
        backend.fail.set()
        deadline = time.monotonic() + 10
        while (health := httpx.get(server.url + "/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert health.status_code == 503
        assert health.json()["error"] == "the synthetic backend failed to start: the model file is corrupt"
        speech = httpx.post(server.url + "/v1/audio/speech", json={"input": "Hi.", "voice": "tone-mid"})
        assert speech.status_code == 503 and "the model file is corrupt" in speech.text
        assert httpx.get(server.url + "/v1/audio/voices").status_code == 200
