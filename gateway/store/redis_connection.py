"""How Voxgate talks to Redis: one place for the client options the session store and the limits share,
on a single Redis or on a Redis Cluster (`--redis-cluster`: redis-py's cluster client, which learns the
nodes and slots from the node the URL names and follows them through a failover).

Every key Voxgate writes carries a hash tag (`{...}`), and every script call, transaction and pipeline
names keys of one tag only, so on a cluster each lands on one node: a session's keys are
`{prefix}{<session_id>}:...`, a voice owner's `{prefix}{voices:<owner>}:...`, a limit counter's
`{prefix}limits:{<kind>:<key>}...`. The key prefix itself must hold no braces. Pipelines of script calls
that span sessions (the store's group commit) are split by node by the cluster client.

After a Redis restart every pooled connection is dead, and the first command on each finds out: a
connection error is retried once, at once, on a new connection. A connection may also break after Redis
ran a command and before its reply arrived, so a retry may deliver a command twice: every write Voxgate
sends is idempotent (see gateway/store/redis.py and gateway/limits.py), and a pipeline of them may run
again whole. Timeouts are not retried (none is set: a command waits for its answer).
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError


def retry_once() -> Retry:
    return Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))


def connect(url: str, *, cluster: bool, max_connections: int | None = None) -> Any:
    """A client for `url`: a RedisCluster (its own retries: it re-reads the cluster's slots after a
    connection error, so a failover is followed), else a Redis whose callers wait for one of
    `max_connections` (a plain pool raises "Too many connections" past its limit instead)."""
    if cluster:
        return RedisCluster.from_url(url)
    if max_connections is None:
        return aioredis.Redis.from_url(url, retry=retry_once())
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=10,
                                                    retry=retry_once())
    return aioredis.Redis(connection_pool=pool)


async def close(client: Any) -> None:
    if isinstance(client, RedisCluster):
        await client.aclose()
    else:
        await client.aclose(close_connection_pool=True)
