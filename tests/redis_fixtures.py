"""A real Redis for the resume tests (127.0.0.1:6379, or VOXGATE_TEST_REDIS_URL): skipped when none
answers, except in CI, where a missing Redis fails the tests. Every test gets its own key prefix."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from tests.conftest import IN_CI

REDIS_URL = os.environ.get("VOXGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def redis_available() -> bool:
    try:
        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def require_redis() -> None:
    if redis_available():
        return
    if IN_CI:
        pytest.fail(f"no Redis answers at {REDIS_URL}; CI must provide one (.ci/run starts it)")
    pytest.skip(f"no Redis at {REDIS_URL}")


@pytest.fixture
def redis_prefix():
    """A unique key prefix; the test's keys are deleted afterwards."""
    require_redis()
    prefix = f"voxgate-test-{uuid.uuid4().hex[:12]}:"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)


class PrivateRedis:
    """A redis-server of the test's own on a free loopback port (never the shared one), which the test may
    stop and start again on the same port: a Redis restart."""

    def __init__(self) -> None:
        from tests.gateway_server import free_port

        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(redis.RedisError):
                if client.ping():
                    return
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


@contextlib.contextmanager
def private_redis() -> Iterator[PrivateRedis]:
    """A started PrivateRedis, stopped on exit; skipped without the redis-server binary."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = PrivateRedis()
    server.start()
    try:
        yield server
    finally:
        server.stop()
