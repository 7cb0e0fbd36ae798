"""Tests and tools on Redis honour the configured Redis (VOXGATE_TEST_REDIS_URL, database included) and
leave no keys behind: the fixtures' proxy named database 0 whatever the URL said, and a voice-registry test
and docker/lb_smoke.py wrote to 127.0.0.1:6379/0 whatever was configured, leaving keys without a TTL."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from tests.conftest import IN_CI
from tests.redis_fixtures import RedisProxy, private_redis

REPO = Path(__file__).resolve().parent.parent


def test_the_proxy_keeps_the_configured_database_and_password():
    proxy = RedisProxy("redis://:secret@127.0.0.1:6379/4")
    try:
        assert proxy.url == f"redis://:secret@127.0.0.1:{proxy.port}/4"
        assert proxy.upstream == ("127.0.0.1", 6379)
    finally:
        proxy.close()


def used_and_left(url: str) -> tuple[int, list[bytes]]:
    """(script calls the Redis at `url` has run, the keys left in its database)."""
    client = redis.Redis.from_url(url)
    stats = client.info("commandstats")
    calls = sum(v["calls"] for k, v in stats.items() if k.split("|")[0] in ("cmdstat_evalsha", "cmdstat_eval"))
    return calls, list(client.scan_iter(count=1000))


def test_a_voice_registry_test_runs_on_the_configured_redis_and_leaves_nothing(tmp_path):
    with private_redis() as server:
        url = server.url.removesuffix("/0") + "/3"  # not database 0
        env = {**os.environ, "VOXGATE_TEST_REDIS_URL": url}
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_voice_registry.py",
             "-k", "resumed_on_another_replica"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
        )
        assert result.returncode == 0, result.stdout[-3000:]
        assert "1 passed" in result.stdout
        calls, left = used_and_left(url)
    assert calls > 0, "the test's gateways did not use the configured Redis"
    assert left == [], f"keys left behind: {left[:5]}"


def test_lb_smoke_runs_on_the_configured_redis_and_leaves_nothing():
    if shutil.which("haproxy") is None and not IN_CI:
        pytest.skip("docker/lb_smoke.py needs haproxy (apt-get install -y haproxy)")
    with private_redis() as server:
        url = server.url.removesuffix("/0") + "/5"
        result = subprocess.run([sys.executable, "docker/lb_smoke.py"], cwd=REPO, timeout=300,
                                env={**os.environ, "VOXGATE_TEST_REDIS_URL": url}, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        calls, left = used_and_left(url)
    assert calls > 0, "the replicas did not use the configured Redis"
    assert left == [], f"keys left behind: {left[:5]}"
