"""What real `voxgate serve` and `voxgate worker` processes write: every logger goes through the one formatter
(the cloning audit line and the backends' warnings included), text lines carry the fields JSON lines have,
and a Redis password given on the command line never appears in the output, whatever the path it takes
(a log line, an error, the exit line).

Each case runs the real command as a process and reads its whole output."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
import websockets

from tests.cloning_fixtures import encode_clip, tone_clip
from tests.gateway_server import free_port, receive_until, wait_until_ready
from tests.redis_fixtures import private_redis

REPO = Path(__file__).resolve().parent.parent
KEY = "sk-log-output-" + "k" * 16
PASSWORD = "Pw-" + "9" * 12 + "-secret"  # what must never be printed


@dataclass
class Process:
    process: subprocess.Popen
    output_path: str
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return Path(self.output_path).read_text()

    def wait_for(self, needle: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while needle not in (text := self.output()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{needle!r} never came (exit {self.process.poll()}):\n{text}")
            time.sleep(0.05)
        return text


@contextlib.contextmanager
def run(argv: list[str], *, prelude: str = "") -> Iterator[Process]:
    """`python -m gateway.cli ARGV` (stdout and stderr together in a file); `prelude` runs first in the same
    interpreter. Killed on exit if still running."""
    port = free_port()
    argv = [a.replace("{port}", str(port)) for a in argv]
    code = f"{prelude}\nimport sys\nfrom gateway.cli import main\nsys.exit(main({argv!r}))"
    output = tempfile.NamedTemporaryFile(prefix="voxgate-log-output-", suffix=".log", delete=False)
    process = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=output, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        yield Process(process, output.name, port)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        os.unlink(output.name)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]  # every line is one JSON object


def stop(process: Process) -> str:
    process.process.send_signal(signal.SIGTERM)
    process.process.wait(30)
    return process.output()


# ------------------------------------------------------------------------------------ one formatter

# The test-only backend that clones (tests/cloning_fixtures.py) in a real `voxgate serve`.
CLONING_BACKEND = ("import gateway.app\nfrom tests.cloning_fixtures import PitchCloneSynthesizer\n"
                   "gateway.app.create_backend = lambda name, **options: PitchCloneSynthesizer()")


def test_the_voice_registered_audit_line_is_written_formatted():
    """Before: gateway.voices had no handler, so its info line went nowhere (Python's last-resort handler
    prints warnings only): who cloned which voice was never recorded."""
    with run(["serve", "--backend", "pitch-clone", "--port", "{port}", "--api-key", KEY, "--log-level", "info",
              "--log-format", "json"], prelude=CLONING_BACKEND) as served:
        wait_until_ready(served.url, 60, lambda: None if served.process.poll() is None else served.output())
        clip = encode_clip(tone_clip(220.0, 4.0), 24000, "wav")
        made = httpx.post(served.url + "/v1/audio/voices", headers={"Authorization": f"Bearer {KEY}"},
                          data={"name": "audited", "consent": "recording-1", "ref_text": "Hello, it is me."},
                          files={"audio_sample": ("audited.wav", clip, "audio/wav")}, timeout=30)
        assert made.status_code == 200, made.text
        output = stop(served)
    audit = [e for e in json_lines(output) if e["message"] == "voice registered"]
    assert len(audit) == 1, output
    assert audit[0]["logger"].startswith("gateway.") and audit[0]["level"] == "info"
    assert audit[0]["voice"] == "audited" and audit[0]["prompt_bytes"] > 0 and audit[0]["key_id"]
    assert KEY not in output


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_text_lines_carry_the_fields_json_lines_have(fmt):
    """Before: --log-format text wrote "session started" with neither its session id nor its voice or
    format, which only the JSON line had."""
    with run(["serve", "--backend", "synthetic", "--port", "{port}", "--log-level", "info",
              "--log-format", fmt]) as served:
        wait_until_ready(served.url, 60, lambda: None if served.process.poll() is None else served.output())

        async def one_session() -> str:
            async with websockets.connect(f"ws://127.0.0.1:{served.port}/v1/audio/speech/stream") as ws:
                await ws.send(json.dumps({"type": "session.config", "voice": "tone-high", "response_format": "mp3"}))
                started = (await receive_until(ws, "session.started"))[-1]
                await ws.send(json.dumps({"type": "session.close"}))
                await receive_until(ws, "session.done")
            return started["session_id"]

        import asyncio

        session_id = asyncio.run(one_session())
        output = stop(served)
    if fmt == "json":
        started = [e for e in json_lines(output) if e["message"] == "session started"]
        assert [(e["session_id"], e["voice"], e["format"]) for e in started] == [(session_id, "tone-high", "mp3")]
    else:
        started = [line for line in output.splitlines() if "voxgate.session: session started" in line]
        assert len(started) == 1, output
        assert f"session_id={session_id}" in started[0] and "voice=tone-high" in started[0], started
        assert "format=mp3" in started[0], started
        ended = [line for line in output.splitlines() if "session ended" in line]
        assert len(ended) == 1 and f"session_id={session_id}" in ended[0] and "sentences=0" in ended[0], output


# ------------------------------------------------------------------------------------ Redis passwords


@contextlib.contextmanager
def redis_with_password() -> Iterator[str]:
    """A private redis-server that requires PASSWORD; yields its URL with the password in it."""
    with private_redis() as server:
        redis.Redis(port=server.port).config_set("requirepass", PASSWORD)
        yield f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"


def test_discovery_warnings_are_formatted_and_the_exit_line_masks_the_registry_password(tmp_path):
    """A gateway discovering workers in a Redis with a password: the registry holds a record that is not
    a worker's, and no worker comes. Before: the discovery module's warning reached Python's last-resort
    handler as bare text (no JSON, no masking), and the exit line printed the URL with its password."""
    token = tmp_path / "token"
    token.write_text("t" * 32)
    with redis_with_password() as url:
        prefix = "voxgate-log-test:"
        client = redis.Redis.from_url(url)
        client.zadd(f"{prefix}{{workers}}:leases", {"intruder": int(time.time() * 1000) + 600_000})
        client.hset(f"{prefix}{{workers}}:info", "intruder", "not a worker's record")
        with run(["serve", "--backend", "remote", "--port", "{port}", "--log-format", "json", "-o", f"discover={url}",
                  "-o", f"discover_prefix={prefix}", "-o", f"token_file={token}", "-o", "connect_timeout_s=3"]) as served:
            assert served.process.wait(60) == 1
            output = served.output()
    assert PASSWORD not in output, output
    *logged, exit_line = output.strip().splitlines()
    entries = json_lines("\n".join(logged))
    warnings = [e for e in entries if e["logger"] == "tts_backend.remote.discovery"]
    assert warnings and all(e["level"] == "warning" for e in warnings), output
    assert exit_line.startswith("voxgate: ") and "no ready worker" in exit_line, exit_line
    assert f"redis://:[redacted]@127.0.0.1:" in exit_line, exit_line


def test_the_worker_logs_an_unreachable_registry_without_its_password(tmp_path):
    """Before: `cannot register in redis://:PASSWORD@... yet` was logged as given."""
    token = tmp_path / "token"
    token.write_text("t" * 32)
    with run(["worker", "--backend", "synthetic", "--listen", "tcp://127.0.0.1:{port}", "--token-file", str(token),
              "--registry", f"redis://:{PASSWORD}@127.0.0.1:1/0"]) as worker:
        worker.wait_for("cannot register")
        output = stop(worker)
    assert PASSWORD not in output, output
    line = next(line for line in output.splitlines() if "cannot register" in line)
    assert "redis://:[redacted]@127.0.0.1:1/0" in line and " WARNING tts_backend.remote.worker: " in line, line
