"""Choosing the session store by name (`--store memory|redis`).

The one module that knows every store: gateway/store/base.py defines the interface, gateway/store/memory.py
and gateway/store/redis.py build on it, and both are imported from here, never from each other's side.
"""

from __future__ import annotations

from .base import SessionStore
from .memory import MemorySessionStore


def create_store(
    kind: str,
    *,
    ttl_s: float,
    replay_log_bytes: int,
    redis_url: str | None = None,
    replay_log_s: float = 300.0,
    key_prefix: str = "voxgate:",
    lease_s: float = 10.0,
    redis_cluster: bool = False,
) -> SessionStore:
    if kind == "memory":
        return MemorySessionStore(ttl_s=ttl_s, replay_log_bytes=replay_log_bytes, replay_log_s=replay_log_s)
    if kind == "redis":
        from .redis import RedisSessionStore  # the redis package is loaded only for this store

        return RedisSessionStore(
            redis_url=redis_url or "redis://127.0.0.1:6379/0",
            ttl_s=ttl_s,
            replay_log_bytes=replay_log_bytes,
            replay_log_s=replay_log_s,
            key_prefix=key_prefix,
            lease_s=lease_s,
            cluster=redis_cluster,
        )
    raise ValueError(f"unknown session store {kind!r}; choose memory or redis")
