"""Workers find gateways through Redis: a registry of live workers under leases.

Each worker announces itself every `heartbeat_s` (its address, backend, voices, capacity and its live
load: streams, queued requests, measured real-time factor, draining) with a lease of `lease_s`; gateways
read the live ones. A worker that drains says so in its next announcement and withdraws when it exits; a
worker that dies stops renewing, and its lease runs out within `lease_s`, so gateways stop routing to it
within seconds even when they have no stream open to it (a gateway with a stream to it finds out at once).

Two keys with one hash tag, so that on a Redis Cluster both live on one node and every script is one call:

  {prefix}{workers}:leases  ZSET  worker id -> lease expiry (ms, by the Redis server's clock)
  {prefix}{workers}:info    HASH  worker id -> the worker's record (JSON)

Lease times come from Redis's own clock (TIME inside the scripts), so hosts with skewed clocks agree on
who is alive. Expired entries are removed by the next announcement of any worker.
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger(__name__)

# KEYS: leases, info. ARGV: id, lease ms, record. Renews the lease, stores the record, drops the expired.
_ANNOUNCE = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, id in ipairs(dead) do
  if id ~= ARGV[1] then redis.call('HDEL', KEYS[2], id) end
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
return #dead
"""

_WITHDRAW = """
redis.call('ZREM', KEYS[1], ARGV[1])
return redis.call('HDEL', KEYS[2], ARGV[1])
"""

# KEYS: leases, info. The records of the workers whose lease has not run out.
_LIVE = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
if #ids == 0 then return {} end
return redis.call('HMGET', KEYS[2], unpack(ids))
"""


def connect(url: str, cluster: bool = False) -> Any:
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import RedisCluster

    # Bounded waits: a heartbeat or a gateway's read must not hang on a Redis that stopped answering.
    timeouts = {"socket_connect_timeout": 5, "socket_timeout": 5}
    return RedisCluster.from_url(url, **timeouts) if cluster else aioredis.Redis.from_url(url, **timeouts)


class WorkerRegistry:
    """The registry on one Redis (or Redis Cluster) at `url`. Workers call `announce`/`withdraw`,
    gateways `live`."""

    def __init__(self, url: str, cluster: bool = False, prefix: str = "voxgate:", lease_s: float = 3.0) -> None:
        if "{" in prefix or "}" in prefix:
            raise ValueError("the registry's key prefix must hold no braces (they are the hash tag)")
        self.url = url
        self.lease_ms = int(lease_s * 1000)
        self.keys = [f"{prefix}{{workers}}:leases", f"{prefix}{{workers}}:info"]
        self._redis = connect(url, cluster)
        self._announce = self._redis.register_script(_ANNOUNCE)
        self._live = self._redis.register_script(_LIVE)
        self._withdraw = self._redis.register_script(_WITHDRAW)

    async def announce(self, record: dict) -> None:
        await self._announce(keys=self.keys, args=[record["id"], self.lease_ms, json.dumps(record, separators=(",", ":"))])

    async def withdraw(self, worker_id: str) -> None:
        await self._withdraw(keys=self.keys, args=[worker_id])

    async def live(self) -> list[dict]:
        records = []
        for raw in await self._live(keys=self.keys, args=[]):
            if raw is None:  # a lease with no record: written by hand, or by something that is no worker
                continue
            try:
                record = json.loads(raw)
            except ValueError:
                log.warning("a worker record in the registry is not JSON; ignored")
                continue
            if isinstance(record, dict) and isinstance(record.get("id"), str) and isinstance(record.get("address"), str):
                records.append(record)
        return records

    async def close(self) -> None:
        await self._redis.aclose()
