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

Whoever can write to that Redis must not be able to add a worker: a gateway sends sessions' text to the
workers it finds there. So each record is signed, an HMAC-SHA256 with a key derived from the workers'
shared token (which Redis never sees), over the record and the time it was signed:

  {"record": "<the record's JSON>", "sig": hex}      the record's JSON holds "signed_at" (Unix seconds)

A gateway ignores (and logs) a record that is not signed so, and one signed more than
RECORD_MAX_AGE_S from its own clock (a record copied from the registry replays for at most that long, and
only ever names the worker that signed it at an address that worker answers to, which the connection's
handshake checks again: connection.py). Workers re-sign theirs at every heartbeat.

Whoever writes to that Redis can also fill it with entries. A gateway reads at most MAX_RECORDS live
entries per read (those whose lease runs out first: a worker's own lease is a few seconds), skips any entry
over MAX_RECORD_BYTES and stops at MAX_READ_BYTES in all (in the script, before anything crosses the
network), and checks what it read in a thread, an entry not shaped as a signed one without parsing it, so
that the read costs every gateway a bounded, small amount of work whatever the registry holds.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from typing import Any

log = logging.getLogger(__name__)

RECORD_MAX_AGE_S = 30.0  # also the clock difference between a worker's host and a gateway's that is tolerated
# What one read of the registry takes at most (module doc): a record is a few hundred bytes (plus its voices).
MAX_RECORDS = 1024
MAX_RECORD_BYTES = 64 * 1024
MAX_READ_BYTES = 4 * 1024 * 1024
_SIGNED_PREFIX = b'{"record":"'  # how sign_record's envelopes start
_REFUSAL_LOG_EVERY_S = 10.0  # a refused record is logged at most this often (a gateway reads the registry every second)


def registry_key(token: str) -> bytes:
    """The key records are signed with: derived from the workers' token, labelled so that it is no use
    anywhere else (the token's handshake proofs use other labels)."""
    return hmac.new(token.encode(), b"voxgate registry record v1", hashlib.sha256).digest()


def sign_record(record: dict, key: bytes, now: float | None = None) -> str:
    body = json.dumps({**record, "signed_at": time.time() if now is None else now}, separators=(",", ":"))
    return json.dumps({"record": body, "sig": hmac.new(key, body.encode(), hashlib.sha256).hexdigest()},
                      separators=(",", ":"))


def open_record(raw: str | bytes, key: bytes, now: float | None = None) -> dict:
    """The record a signed entry holds; ValueError saying why it is refused."""
    if not (raw.encode() if isinstance(raw, str) else raw).startswith(_SIGNED_PREFIX):
        raise ValueError("not signed")  # refused without parsing what may be a costly JSON document
    try:
        envelope = json.loads(raw)
    except (ValueError, RecursionError):
        raise ValueError("not JSON") from None
    if not isinstance(envelope, dict) or not isinstance(envelope.get("record"), str) \
            or not isinstance(envelope.get("sig"), str):
        raise ValueError("not signed")
    body = envelope["record"]
    expected = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(envelope["sig"].encode(), expected.encode()):
        raise ValueError("bad signature")
    record = json.loads(body)
    if not isinstance(record, dict) or not isinstance(record.get("id"), str) or not isinstance(record.get("address"), str):
        raise ValueError("signed, but no id and address")
    signed_at = record.get("signed_at")
    now = time.time() if now is None else now
    if not isinstance(signed_at, (int, float)) or not abs(now - signed_at) <= RECORD_MAX_AGE_S:
        raise ValueError(f"signed at {signed_at!r}, more than {RECORD_MAX_AGE_S:g} s from now")
    return record

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

# KEYS: leases, info. ARGV: MAX_RECORDS, MAX_RECORD_BYTES, MAX_READ_BYTES. The records of the first
# MAX_RECORDS workers whose lease has not run out (soonest to run out first) within the byte bounds, the
# count of live entries not read (past MAX_RECORDS), and of those left out for their size.
_LIVE = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local live = redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf', 'LIMIT', 0, tonumber(ARGV[1]))
if #ids == 0 then return {0, 0, {}} end
local raws = redis.call('HMGET', KEYS[2], unpack(ids))
local kept, total, oversize = {}, 0, 0
for i = 1, #ids do
  local raw = raws[i]
  if raw then
    local size = string.len(raw)
    if size > tonumber(ARGV[2]) or total + size > tonumber(ARGV[3]) then
      oversize = oversize + 1
    else
      total = total + size
      kept[#kept + 1] = raw
    end
  end
end
return {live - #ids, oversize, kept}
"""


def open_records(raws: list[bytes], key: bytes, now: float) -> tuple[list[dict], list[str]]:
    """The records of `raws` that are signed with `key` and fresh, and why each other one was refused."""
    records, refusals = [], []
    for raw in raws:
        try:
            records.append(open_record(raw, key, now))
        except ValueError as exc:
            refusals.append(str(exc))
    return records, refusals


def connect(url: str, cluster: bool = False) -> Any:
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import RedisCluster

    # Bounded waits: a heartbeat or a gateway's read must not hang on a Redis that stopped answering.
    timeouts = {"socket_connect_timeout": 5, "socket_timeout": 5}
    return RedisCluster.from_url(url, **timeouts) if cluster else aioredis.Redis.from_url(url, **timeouts)


class WorkerRegistry:
    """The registry on one Redis (or Redis Cluster) at `url`. Workers call `announce`/`withdraw`,
    gateways `live`; `key` (registry_key) signs and checks the records."""

    def __init__(self, url: str, cluster: bool = False, prefix: str = "voxgate:", lease_s: float = 3.0, *,
                 key: bytes) -> None:
        if "{" in prefix or "}" in prefix:
            raise ValueError("the registry's key prefix must hold no braces (they are the hash tag)")
        self.url = url
        self.key = key
        self.refused = 0  # entries left out of live(): unsigned, badly signed or stale
        self._last_refusal_logged = float("-inf")
        self.lease_ms = int(lease_s * 1000)
        self.keys = [f"{prefix}{{workers}}:leases", f"{prefix}{{workers}}:info"]
        self._redis = connect(url, cluster)
        self._announce = self._redis.register_script(_ANNOUNCE)
        self._live = self._redis.register_script(_LIVE)
        self._withdraw = self._redis.register_script(_WITHDRAW)

    async def announce(self, record: dict) -> None:
        await self._announce(keys=self.keys, args=[record["id"], self.lease_ms, sign_record(record, self.key)])

    async def withdraw(self, worker_id: str) -> None:
        await self._withdraw(keys=self.keys, args=[worker_id])

    async def live(self) -> list[dict]:
        """The records of the live workers that are signed with the key, read and checked within the bounds
        of the module doc; any other entry is logged (at most every few seconds) and left out. (A lease
        with no record, written by hand or by something that is no worker, is skipped.)"""
        unread, oversize, raws = await self._live(keys=self.keys,
                                                  args=[MAX_RECORDS, MAX_RECORD_BYTES, MAX_READ_BYTES])
        # Off the event loop, which serves every session of this gateway: a few workers' records take
        # microseconds, a registry filled by someone else milliseconds.
        records, refusals = await asyncio.to_thread(open_records, raws, self.key, time.time())
        self.refused += len(refusals) + oversize
        if oversize:
            refusals.append(f"{oversize} over {MAX_RECORD_BYTES} bytes, or past {MAX_READ_BYTES} in all")
        if refusals or unread:
            self._log_refused(refusals[0] if refusals else "", unread)
        return records

    def _log_refused(self, why: str, unread: int) -> None:
        now = time.monotonic()
        if now - self._last_refusal_logged < _REFUSAL_LOG_EVERY_S:
            return
        self._last_refusal_logged = now
        if why:
            log.warning("registry: ignored a worker record (%s; %d refused so far); only records signed with the "
                        "workers' token count", why, self.refused)
        if unread:
            log.warning("registry: %d live entries past the first %d were not read; a registry that large is "
                        "someone else's doing", unread, MAX_RECORDS)

    async def close(self) -> None:
        await self._redis.aclose()
