"""A real Redis for the resume tests (127.0.0.1:6379, or VOXGATE_TEST_REDIS_URL): skipped when none
answers, except in CI, where a missing Redis fails the tests. Every test gets its own key prefix."""

from __future__ import annotations

import os
import uuid

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
