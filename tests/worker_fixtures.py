"""Real `voxgate worker` processes for the pool tests: started on a free port (the ready line names it),
stopped by PID (SIGTERM: a drain; SIGKILL: a death)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_READY = re.compile(r"voxgate worker ready: backend=(\S+) listen=(\S+) id=(\S+)")


class WorkerProcess:
    def __init__(self, *args: str, env: dict | None = None, expect_ready: int = 1) -> None:
        self.args = args
        self.output: list[str] = []
        self.ready_lines: list[tuple[str, str]] = []  # (listen, id) per worker that said it is ready
        self._ready = threading.Event()
        self._expect = expect_ready
        self.proc = subprocess.Popen([sys.executable, "-m", "tts_backend.remote.worker", *args], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line.rstrip("\n"))
            match = _READY.search(line)
            if match:
                self.ready_lines.append((match.group(2), match.group(3)))
                if len(self.ready_lines) >= self._expect:
                    self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout_s: float = 60.0) -> "WorkerProcess":
        if not self._ready.wait(timeout_s) or len(self.ready_lines) < self._expect:
            self.kill()
            raise RuntimeError("the worker did not get ready:\n" + "\n".join(self.output[-30:]))
        return self

    @property
    def address(self) -> str:
        return self.ready_lines[0][0]

    @property
    def worker_id(self) -> str:
        return self.ready_lines[0][1]

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def wait(self, timeout_s: float = 30.0) -> int:
        return self.proc.wait(timeout_s)


@contextlib.contextmanager
def workers(*arg_lists: tuple[str, ...]) -> Iterator[list[WorkerProcess]]:
    """Start one worker per argument list, all at once; every one is killed on the way out."""
    started = [WorkerProcess(*args) for args in arg_lists]
    try:
        for worker in started:
            worker.wait_ready()
        yield started
    finally:
        for worker in started:
            worker.kill()


def synthetic_worker_args(*extra: str, speed: float = 2.0, capacity: int | None = None,
                          listen: str = "tcp://127.0.0.1:0") -> tuple[str, ...]:
    args = ["--backend", "synthetic", "--listen", listen, "--option", f"speed={speed}", "--drain-linger-s", "0.5"]
    if capacity is not None:
        args += ["--option", f"capacity={capacity}"]
    return (*args, *extra)


def wait_for(condition, timeout_s: float = 15.0, what: str = "the condition") -> None:
    """Poll until `condition()` is true (a wait for something to happen, never a timing check)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(0.02)


async def wait_for_async(condition, timeout_s: float = 15.0, what: str = "the condition") -> None:
    import asyncio

    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s:g} s")
        await asyncio.sleep(0.02)


POOL_TOKEN = "pool-test-token-5d1e"  # the workers' shared token in the pool tests


@pytest.fixture
def token_file(tmp_path):
    """A file whose first line is POOL_TOKEN (--token-file)."""
    path = tmp_path / "token"
    path.write_text(POOL_TOKEN + "\n")
    return str(path)


def pool(*addresses: str, **options):
    """The gateway's pool of the workers at `addresses`, with POOL_TOKEN, following them closely."""
    from tts_backend.remote import RemoteSynthesizer

    options.setdefault("token", POOL_TOKEN)
    return RemoteSynthesizer(workers=",".join(addresses), connect_timeout_s=20, info_refresh_s=0.1, **options)
