"""`voxgate serve` as a newcomer runs it: a real process, settings from flags and environment."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import httpx
import pytest
import websockets

from gateway.cli import build_parser, main, settings_from_args
from tests.gateway_server import free_port, receive_until, wait_until_ready


def test_flags_override_environment_which_overrides_defaults(monkeypatch):
    monkeypatch.setenv("VOXGATE_PORT", "9100")
    monkeypatch.setenv("VOXGATE_IDLE_TIMEOUT_S", "12")
    monkeypatch.setenv("VOXGATE_API_KEYS", '["a", "b"]')
    args = build_parser().parse_args(
        ["serve", "--port", "9200", "--backend", "qwen3", "--model", "/models/q", "--device", "cuda:0",
         "-o", "max_batch=8", "-o", "name=fast"]
    )
    settings = settings_from_args(args)
    assert settings.port == 9200 and settings.idle_timeout_s == 12 and settings.api_keys == ["a", "b"]
    assert (settings.backend, settings.model, settings.device) == ("qwen3", "/models/q", "cuda:0")
    assert settings.backend_options == {"max_batch": 8, "name": "fast"}
    defaults = settings_from_args(build_parser().parse_args(["serve"]))
    assert defaults.backend == "piper" and defaults.port == 9100 and defaults.host == "127.0.0.1"


def test_backend_options_reach_the_backend():
    from gateway.app import backend_options
    from gateway.settings import GatewaySettings

    settings = GatewaySettings(backend="synthetic", model="m", backend_options={"speed": 2.0})
    assert backend_options(settings) == {"model": "m", "speed": 2.0}
    assert backend_options(GatewaySettings(backend="synthetic")) == {}


def test_worker_subcommand_delegates_to_the_worker(monkeypatch):
    import tts_backend.remote.worker

    seen = {}
    monkeypatch.setattr(tts_backend.remote.worker, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    assert main(["worker", "--socket", "/tmp/x.sock"]) == 0
    assert seen["argv"] == ["--socket", "/tmp/x.sock"]


@pytest.mark.parametrize("backend_args", [[], ["--backend", "synthetic"]], ids=["default-piper", "synthetic"])
def test_voxgate_serve_process_speaks(backend_args):
    """README line 1 (`voxgate serve`) in a real process: health, readiness, then audio over the WebSocket."""
    port = free_port()
    env = dict(os.environ, VOXGATE_LOG_LEVEL="warning")
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), *backend_args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, 60, lambda: None if process.poll() is None else process.stdout.read().decode())

        async def speak():
            async with websockets.connect(url.replace("http", "ws") + "/v1/audio/speech/stream") as ws:
                await ws.send(json.dumps({"type": "session.config", "stream_audio": True}))
                await ws.send(json.dumps({"type": "input.text", "text": "Hello from a real process."}))
                await ws.send(json.dumps({"type": "input.done"}))
                return await receive_until(ws, "session.done", timeout=60)

        messages = asyncio.run(speak())
        assert sum(len(m) for m in messages if isinstance(m, bytes)) > 10000
        expected = "piper" if not backend_args else "synthetic"
        assert httpx.get(url + "/ready").json()["backend"] == expected
    finally:
        process.terminate()
        process.wait(10)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **(env or {})))


@pytest.mark.parametrize("flags,named", [
    (["--port", "99999"], "--port"), (["--port", "-1"], "--port"), (["--port", "http"], "--port"),
    (["--log-level", "loud"], "--log-level"),
])
def test_a_bad_port_or_log_level_is_one_line_and_exit_status_2(flags, named):
    """Before: `--port 99999` and `--log-level loud` ended in tracebacks (socket.bind's OverflowError,
    logging's unknown level), and `--port http` printed the whole usage synopsis above its error."""
    result = run_cli("serve", *flags)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("voxgate serve: ") and named in lines[0], result.stderr
    assert "voxgate serve --help" in lines[0]


@pytest.mark.parametrize("variable,value", [("VOXGATE_PORT", "99999"), ("VOXGATE_LOG_LEVEL", "loud")])
def test_the_same_values_from_the_environment_are_one_line(variable, value):
    result = run_cli("serve", env={variable: value})
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"voxgate: invalid settings: {variable}"), result.stderr


def test_log_levels_are_read_in_any_case():
    assert settings_from_args(build_parser().parse_args(["serve", "--log-level", "WARNING"])).log_level == "warning"
    assert settings_from_args(build_parser().parse_args(["serve", "--port", "0"])).port == 0


def test_voxgate_version_is_the_installed_package_version():
    import importlib.metadata

    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"voxgate {importlib.metadata.version('voxgate')}"
