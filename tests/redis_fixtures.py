"""A real Redis for the resume tests (127.0.0.1:6379, or VOXGATE_TEST_REDIS_URL): skipped when none
answers, except in CI, where a missing Redis fails the tests. Every test gets its own key prefix."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

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


def delete_prefix(prefix: str) -> None:
    """Delete every key under `prefix` in the configured Redis."""
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture
def redis_prefix():
    """A unique key prefix; the test's keys are deleted afterwards."""
    require_redis()
    prefix = f"voxgate-test-{uuid.uuid4().hex[:12]}:"
    yield prefix
    delete_prefix(prefix)


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


class RedisProxy:
    """A TCP proxy in front of a Redis, in threads of its own (a gateway under test starts while the test's
    loop waits). It counts the bytes Redis sends back, and `break_after(marker)` breaks the next
    connection whose client sends `marker` in the worst place: the command reaches Redis, which runs it,
    and the connection drops before the reply gets back (`broken` is set then)."""

    def __init__(self, upstream_url: str = REDIS_URL) -> None:
        self.from_redis = 0
        upstream = urlsplit(upstream_url)
        self.upstream = (upstream.hostname or "127.0.0.1", upstream.port or 6379)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        # The upstream's URL with the proxy's address: its database, password and options kept.
        credentials = upstream.netloc.rpartition("@")[0]
        self.url = urlunsplit(upstream._replace(netloc=f"{credentials + '@' if credentials else ''}127.0.0.1:{self.port}"))
        self.sockets: list[socket.socket] = [self.listener]
        self._break_on: bytes | None = None
        self.broken = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def break_after(self, marker: bytes) -> None:
        self.broken.clear()
        self._break_on = marker

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(self.upstream)
                self.sockets += [client, upstream]
                doomed = threading.Event()  # this connection sent the marker: its next reply is not relayed
                threading.Thread(target=self._to_redis, args=(client, upstream, doomed), daemon=True).start()
                threading.Thread(target=self._from_redis, args=(upstream, client, doomed), daemon=True).start()

    def _to_redis(self, client: socket.socket, upstream: socket.socket, doomed: threading.Event) -> None:
        tail = b""
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                marker = self._break_on
                if marker is not None and marker in tail + data:
                    self._break_on = None
                    doomed.set()
                tail = data[-64:]
                upstream.sendall(data)
        with contextlib.suppress(OSError):
            upstream.shutdown(socket.SHUT_WR)

    def _from_redis(self, upstream: socket.socket, client: socket.socket, doomed: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                if doomed.is_set():
                    for sock in (client, upstream):  # shutdown first: the other pump is blocked in recv on it
                        with contextlib.suppress(OSError):
                            sock.shutdown(socket.SHUT_RDWR)
                        sock.close()
                    self.broken.set()
                    return
                self.from_redis += len(data)
                client.sendall(data)
        with contextlib.suppress(OSError):
            client.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def _cluster_port() -> int:
    """A free loopback port whose cluster bus port (the port + 10000) is free too."""
    while True:
        with socket.socket() as client_port, socket.socket() as bus_port:
            client_port.bind(("127.0.0.1", 0))
            port = client_port.getsockname()[1]
            if port + 10000 > 65535:
                continue
            try:
                bus_port.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
            return port


class LocalCluster:
    """A Redis Cluster of three masters (no replicas) on loopback ports of the test's own, each
    redis-server in a directory of its own; `url` names one node, from which a cluster client learns the rest."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.ports = [_cluster_port() for _ in range(3)]
        self.url = f"redis://127.0.0.1:{self.ports[0]}/0"
        self.processes: list[subprocess.Popen] = []

    def start(self) -> None:
        for port in self.ports:
            directory = os.path.join(self.root, str(port))
            os.makedirs(directory)
            self.processes.append(subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", directory,
                 "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--save", "", "--appendonly", "no"],
                stdout=subprocess.DEVNULL,
            ))
        for port in self.ports:
            self._wait(port, lambda client: client.ping())
        subprocess.run(
            ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{port}" for port in self.ports],
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, stdout=subprocess.DEVNULL, timeout=60,
        )
        for port in self.ports:
            self._wait(port, lambda client: client.cluster("INFO")["cluster_state"] == "ok")

    def _wait(self, port: int, ready) -> None:
        client = redis.Redis(port=port, socket_connect_timeout=1)
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(redis.RedisError):
                if ready(client):
                    client.close()
                    return
            if any(process.poll() is not None for process in self.processes) or time.monotonic() > deadline:
                raise RuntimeError(f"the Redis Cluster node on port {port} did not get ready")
            time.sleep(0.05)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory) -> Iterator[LocalCluster]:
    """A LocalCluster for the whole test session, stopped (by PID) at its end; skipped without redis-server
    and redis-cli."""
    missing = [tool for tool in ("redis-server", "redis-cli") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"a local Redis Cluster needs {' and '.join(missing)}, which is not installed")
    cluster = LocalCluster(str(tmp_path_factory.mktemp("redis-cluster")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@dataclass
class RedisTarget:
    """Where a test's gateways keep their state: the shared single Redis, or the local cluster."""

    url: str
    cluster: bool

    @property
    def flags(self) -> tuple[str, ...]:
        return ("--redis-cluster",) if self.cluster else ()


@pytest.fixture(params=["single", "cluster"])
def redis_target(request, redis_prefix) -> RedisTarget:
    """Each test that takes it runs on a single Redis and on a Redis Cluster of three masters."""
    if request.param == "single":
        return RedisTarget(REDIS_URL, cluster=False)
    return RedisTarget(request.getfixturevalue("redis_cluster").url, cluster=True)
