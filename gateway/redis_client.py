"""How Voxgate talks to Redis: one place for the client options the session store and the limits share.

After a Redis restart every pooled connection is dead, and the first command on each finds out: a
connection error is retried once, at once, on a new connection. A connection may also break after Redis
ran a command and before its reply arrived, so a retry may deliver a command twice: every write Voxgate
sends is idempotent (see gateway/redis_store.py and gateway/limits.py), and a pipeline of them may run
again whole. Timeouts are not retried (none is set: a command waits for its answer).
"""

from __future__ import annotations

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError


def retry_once() -> Retry:
    return Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
