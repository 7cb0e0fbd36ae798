"""Admission: who may start a session or send more text now, and whether the backend can take more.

One `Admission` per app instance. It answers, in this order:
- overload (`overloaded`, retryable): the backend says it is near capacity (`Synthesizer.load()`), or the
  gateway's own measure says streams are no longer made in real time (`SynthesisMonitor`, WebSocket and
  HTTP alike), or too many streams are synthesizing at once, counting work admitted whose synthesis has
  not started yet (`AdmissionClaim`). New sessions are refused early so that the open ones keep real time;
- `max_sessions` open WebSocket sessions in this process (`too_many_sessions`);
- per API key: concurrent sessions (`too_many_sessions`), new sessions per minute and characters per
  minute (`rate_limited`, with the seconds to wait).

Per-key counts live in memory, or in Redis when `store == "redis"`, so that every replica enforces one
shared limit: rates are token buckets updated by a Lua script (one round trip, atomic, Redis's clock),
concurrent sessions are members of a sorted set scored by an expiry that the holding replica renews, so
a replica that dies stops counting within `SLOT_TTL_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import math
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Protocol

from tts_backend.base import Synthesizer

from .auth import Principal
from .protocol import CloseCode, ErrorCode, ProtocolError
from .settings import GatewaySettings

log = logging.getLogger("voxgate.limits")

SLOT_TTL_S = 30.0  # a replica's claim on a concurrent-session slot in Redis, renewed every third of it
TAKE_MEMORY_MS = 60_000  # how long Redis remembers a rate take's answer, for a retry of the same take
MONITOR_WINDOW_S = 5.0  # the real-time measure looks at this much recent synthesis
MONITOR_MIN_AUDIO_S = 1.0  # ... and judges only with at least this much audio made in the window
REFUSAL_LOG_INTERVAL_S = 10.0  # at most one log line about overload refusals per this many seconds
TRIM_INTERVAL_S = 30.0  # how often freed session memory is handed back to the OS (see Admission._trim_forever)


class LimitExceeded(ProtocolError):
    """A limit refused the request; `retry_after_s` is when trying again may succeed."""

    def __init__(self, code: ErrorCode, message: str, *, retry_after_s: float, close: CloseCode | None = None,
                 context_id: str | None = None) -> None:
        super().__init__(code, message, close=close, context_id=context_id)
        self.retry_after_s = retry_after_s

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after_s)))


# ------------------------------------------------------------------------------------ real-time monitor


class StreamMeter:
    """One running stream's pulls from the backend, by whole second: the audio each pull held and the
    wall time it took (time paused by back-pressure is not a pull)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._seconds: deque[list[float]] = deque()  # [whole second, audio s, pull s]

    def produced(self, audio_s: float, pull_s: float, now: float | None = None) -> None:
        second = math.floor(now if now is not None else time.monotonic())
        if self._seconds and self._seconds[-1][0] == second:
            self._seconds[-1][1] += audio_s
            self._seconds[-1][2] += pull_s
        else:
            self._seconds.append([second, audio_s, pull_s])
        self.trim(second)

    def trim(self, now: float) -> None:
        while self._seconds and self._seconds[0][0] <= now - self.window_s:
            self._seconds.popleft()

    def totals(self, now: float) -> tuple[float, float]:
        """(audio s, pull s) within the window."""
        self.trim(now)
        return sum(s[1] for s in self._seconds), sum(s[2] for s in self._seconds)


class SynthesisMonitor:
    """The gateway's own view of whether the streams running now keep real time. Each stream, while it
    runs, has a `StreamMeter`; speed = their audio seconds / their pull seconds over the recent window;
    below 1 the streams underrun. A finished stream's pulls leave with it: with nothing running there is
    nothing to protect and nothing to judge (a lone client opening sessions one after another is never
    refused for its own previous sentence)."""

    def __init__(self, window_s: float = MONITOR_WINDOW_S) -> None:
        self.window_s = window_s
        self._running: set[StreamMeter] = set()

    @property
    def active_streams(self) -> int:
        return len(self._running)

    @contextlib.contextmanager
    def stream(self) -> Iterator[StreamMeter]:
        """A stream running for the body; its pulls count until it ends."""
        meter = StreamMeter(self.window_s)
        self._running.add(meter)
        try:
            yield meter
        finally:
            self._running.discard(meter)

    def realtime_speed(self, now: float | None = None) -> float | None:
        """Audio seconds made per second of pulling by the running streams, over the window; None without
        enough evidence (under MONITOR_MIN_AUDIO_S of their audio)."""
        now = now if now is not None else time.monotonic()
        audio = pull = 0.0
        for meter in self._running:
            a, p = meter.totals(now)
            audio, pull = audio + a, pull + p
        if audio < MONITOR_MIN_AUDIO_S or pull <= 0:
            return None
        return audio / pull


class AdmissionClaim:
    """A session or HTTP request admitted under `max_active_synthesis` whose synthesis has not started yet:
    it counts against the cap (so arrivals at the same moment cannot all pass it) until `release()` -
    called when its first synthesis starts (its stream counts from then on) or when it ends - or until
    `admission_hold_s` has passed (a session that says nothing for that long holds nothing)."""

    def __init__(self, waiting: dict["AdmissionClaim", float] | None = None) -> None:
        self._waiting = waiting
        if waiting is not None:
            waiting[self] = time.monotonic()

    def release(self) -> None:
        if self._waiting is not None:
            self._waiting.pop(self, None)
            self._waiting = None


class RefusalLog:
    """Overload refusals, logged with their reason: the first at once, then at most one line per
    `interval_s` that counts the refusals since the previous line (a flood of clients cannot flood the log)."""

    def __init__(self, interval_s: float = REFUSAL_LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._logged_at = -math.inf
        self._unlogged = 0

    def record(self, reason: str) -> None:
        now = time.monotonic()
        if now - self._logged_at < self.interval_s:
            self._unlogged += 1
            return
        more = f"; {self._unlogged} more refused since the previous line" if self._unlogged else ""
        log.warning("refused new work as overloaded: %s%s", reason, more)
        self._logged_at, self._unlogged = now, 0


# ------------------------------------------------------------------------------------ counters


class Counters(Protocol):
    """Per-key counters: token buckets for rates, slots for concurrent sessions."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def take(self, name: str, capacity: float, cost: float) -> float:
        """Take `cost` tokens from a bucket that holds `capacity` and refills `capacity` per minute.
        Returns 0 when taken, else the seconds until it could be (nothing is taken then)."""

    async def acquire_slot(self, name: str, limit: int) -> str | None:
        """One of `limit` slots under `name`, as an id for release_slot; None when all are held."""

    async def release_slot(self, slot: str) -> None: ...


@dataclass
class _Bucket:
    tokens: float
    updated: float


class MemoryCounters:
    """Per-key counters of one process."""

    def __init__(self) -> None:
        self._buckets: dict[str, _Bucket] = {}
        self._slots: Counter[str] = Counter()

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def take(self, name: str, capacity: float, cost: float) -> float:
        now = time.monotonic()
        bucket = self._buckets.setdefault(name, _Bucket(capacity, now))
        rate = capacity / 60.0
        bucket.tokens = min(capacity, bucket.tokens + (now - bucket.updated) * rate)
        bucket.updated = now
        if bucket.tokens >= cost:
            bucket.tokens -= cost
            return 0.0
        return (cost - bucket.tokens) / rate

    async def acquire_slot(self, name: str, limit: int) -> str | None:
        if self._slots[name] >= limit:
            return None
        self._slots[name] += 1
        return name  # one process: a slot is only a count under its name

    async def release_slot(self, slot: str) -> None:
        self._slots[slot] -= 1
        if self._slots[slot] <= 0:
            del self._slots[slot]


# Token bucket: KEYS[1] hash {tokens, ms}; ARGV capacity, cost, ttl ms. Refills capacity per 60 s.
# Returns 0 when taken, else milliseconds to wait. Uses Redis's clock so replicas agree.
# KEYS[2] names this take and keeps its answer for TAKE_MEMORY_MS: a take delivered twice (a retry after
# the connection broke before the reply came) answers as before and takes nothing more.
_TAKE_LUA = """
local answered = redis.call('GET', KEYS[2])
if answered then return tonumber(answered) end
local capacity = tonumber(ARGV[1])
local cost = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ms')
local tokens = tonumber(state[1]) or capacity
local updated = tonumber(state[2]) or now
local rate = capacity / 60000
tokens = math.min(capacity, tokens + math.max(0, now - updated) * rate)
local wait = 0
if tokens >= cost then
  tokens = tokens - cost
else
  wait = math.ceil((cost - tokens) / rate)
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ms', now)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('SET', KEYS[2], wait, 'PX', ARGV[4])
return wait
"""

# Concurrency slots: KEYS[1] sorted set of slot -> expiry ms; ARGV limit, slot, ttl ms. 1 taken, 0 full.
# A slot already held (the same call delivered twice) is taken.
_ACQUIRE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[2]) then return 1 end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS[1] one key's sorted set; ARGV ttl ms, then the slots held in it (one key per call: on a Redis
# Cluster the keys of different API keys live on different nodes).
_RENEW_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i, slot in ipairs(ARGV) do
  if i > 1 then redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), slot) end
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""


class RedisCounters:
    """Per-key counters shared by every replica using one Redis (or Redis Cluster). Each counter's keys
    share a hash tag, `{prefix}limits:{<kind>:<key>}`, so its script calls land on one cluster node."""

    def __init__(self, url: str, prefix: str, cluster: bool = False) -> None:
        self.url = url
        self.cluster = cluster
        self.prefix = prefix + "limits:"
        self._client = None
        self._held: dict[str, str] = {}  # slot id -> zset key, renewed while held
        self._renewer: asyncio.Task | None = None

    async def start(self) -> None:
        from .store.redis_connection import connect

        self._client = connect(self.url, cluster=self.cluster)
        self._take = self._client.register_script(_TAKE_LUA)
        self._acquire = self._client.register_script(_ACQUIRE_LUA)
        self._renew = self._client.register_script(_RENEW_LUA)
        self._renewer = asyncio.create_task(self._renew_forever(), name="limits-renew")

    async def stop(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(BaseException):
                await self._renewer
        if self._client is not None:
            from .store.redis_connection import close

            await close(self._client)

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(SLOT_TTL_S / 3)
            if not self._held:
                continue
            by_key: dict[str, list[str]] = {}
            for slot, key in self._held.items():
                by_key.setdefault(key, []).append(slot)
            try:
                await asyncio.gather(*[self._renew(keys=[key], args=[int(SLOT_TTL_S * 1000), *slots])
                                       for key, slots in by_key.items()])
            except Exception as exc:  # Redis away: slots expire there on their own; keep trying
                log.warning("could not renew session slots in Redis: %r", exc)

    def _key(self, name: str) -> str:
        return f"{self.prefix}{{{name}}}"

    async def take(self, name: str, capacity: float, cost: float) -> float:
        bucket = self._key(name)
        wait_ms = await self._take(keys=[bucket, f"{bucket}:take:{uuid.uuid4().hex}"],
                                   args=[capacity, cost, 120_000, TAKE_MEMORY_MS])
        return int(wait_ms) / 1000.0

    async def acquire_slot(self, name: str, limit: int) -> str | None:
        slot, key = uuid.uuid4().hex, self._key(name)
        if not int(await self._acquire(keys=[key], args=[limit, slot, int(SLOT_TTL_S * 1000)])):
            return None
        self._held[slot] = key
        return slot

    async def release_slot(self, slot: str) -> None:
        key = self._held.pop(slot)
        try:
            await self._client.zrem(key, slot)
        except Exception as exc:  # it expires on its own
            log.warning("could not release a session slot in Redis: %r", exc)


# ------------------------------------------------------------------------------------ admission


class Admission:
    def __init__(self, settings: GatewaySettings, backend: Synthesizer | None = None) -> None:
        self.settings = settings
        self.backend = backend
        self.open_sessions = 0
        self.monitor = SynthesisMonitor()
        self.counters: Counters = (
            RedisCounters(settings.redis_url, settings.redis_key_prefix, settings.redis_cluster)
            if settings.store == "redis" else MemoryCounters()
        )
        self._ended_since_trim = 0
        self._peak_since_trim = 0
        self._trimmer: asyncio.Task | None = None
        self._claims: dict[AdmissionClaim, float] = {}  # admitted, synthesis not started yet -> since when
        self._refusals = RefusalLog()

    async def start(self) -> None:
        await self.counters.start()
        if _malloc_trim is not None:
            self._trimmer = asyncio.create_task(self._trim_forever(), name="malloc-trim")

    async def stop(self) -> None:
        if self._trimmer is not None:
            self._trimmer.cancel()
            with contextlib.suppress(BaseException):
                await self._trimmer
        await self.counters.stop()

    async def _trim_forever(self) -> None:
        """Sessions allocate audio in many small blocks (frames, replay logs); when they end, glibc keeps
        the freed pages in the heap, so the process would stay at its peak size after a burst. malloc_trim
        gives the free pages back once the sessions open have fallen to half their peak since the last trim
        (a trim walks the heap holding its lock: not while a steady load churns through sessions)."""
        while True:
            await asyncio.sleep(TRIM_INTERVAL_S)
            if self._ended_since_trim and self.open_sessions <= self._peak_since_trim // 2:
                self._ended_since_trim, self._peak_since_trim = 0, self.open_sessions
                await asyncio.to_thread(_malloc_trim, 0)

    @staticmethod
    def _key(principal: Principal) -> str:
        return principal.key_id or "anonymous"

    def check_overload(self) -> AdmissionClaim:
        """Raises LimitExceeded(overloaded) when more work would push synthesis past real time; else the
        new work's claim on the active-synthesis cap, taken at once (to release when its synthesis starts
        or it ends). Each refusal is logged with its reason (at most one line per REFUSAL_LOG_INTERVAL_S)."""
        settings, reason, setting = self.settings, None, ""
        load = self.backend.load() if self.backend is not None else 0.0
        speed = self.monitor.realtime_speed()
        if load >= settings.overload_backend_load:
            reason = f"the speech backend is at {load:.0%} of its real-time capacity"
            setting = "VOXGATE_OVERLOAD_BACKEND_LOAD"
        elif settings.overload_min_realtime and speed is not None and speed < settings.overload_min_realtime:
            reason = (f"the {self.monitor.active_streams} streams running are made at {speed:.2f}x real time,"
                      f" under {settings.overload_min_realtime:g}x")
            setting = "VOXGATE_OVERLOAD_MIN_REALTIME"
        elif settings.max_active_synthesis:
            waiting = self.waiting_claims()
            if self.monitor.active_streams + waiting >= settings.max_active_synthesis:
                reason = (f"{self.monitor.active_streams} streams are being synthesized and {waiting} more were"
                          " just admitted")
                setting = "VOXGATE_MAX_ACTIVE_SYNTHESIS"
        if reason is not None:
            self._refusals.record(f"{reason} (setting: {setting})")
            raise LimitExceeded(
                ErrorCode.overloaded, f"the gateway is overloaded ({reason}); retry shortly",
                retry_after_s=2.0, close=CloseCode.try_again_later,
            )
        return AdmissionClaim(self._claims if settings.max_active_synthesis else None)

    def waiting_claims(self) -> int:
        """Work admitted whose synthesis has not started, within admission_hold_s of its admission."""
        expired = time.monotonic() - self.settings.admission_hold_s
        for claim in [c for c, since in self._claims.items() if since <= expired]:
            claim.release()
        return len(self._claims)

    async def _take_rate(self, principal: Principal, kind: str, limit: int, cost: int, context_id: str | None = None,
                         close: CloseCode | None = None) -> None:
        if not limit:
            return
        wait = await self._counted(self.counters.take(f"{kind}:{self._key(principal)}", limit, cost), close)
        if wait > 0:
            what = "new sessions" if kind == "sessions" else "characters"
            hint = (
                f"{cost} characters exceed the whole per-minute allowance; send smaller pieces"
                if cost > limit else f"retry in {math.ceil(wait)} s"
            )
            raise LimitExceeded(
                ErrorCode.rate_limited,
                f"this API key may use {limit} {what} per minute; {hint}",
                retry_after_s=wait, close=close, context_id=context_id,
            )

    @staticmethod
    async def _counted(call, close: CloseCode | None):
        """A counter operation; an unreachable Redis refuses the request (retryable) rather than letting
        it through unlimited or failing with a traceback."""
        try:
            return await call
        except Exception as exc:
            log.error("limit counters unavailable: %r", exc)
            raise LimitExceeded(
                ErrorCode.internal, "usage limits cannot be checked right now (counter store unreachable); retry shortly",
                retry_after_s=5.0, close=close,
            ) from None

    @contextlib.asynccontextmanager
    async def session(self, principal: Principal) -> AsyncIterator[AdmissionClaim]:
        """Hold a session slot for the body, which gets the session's claim on the active-synthesis cap
        (released at the latest when the body ends). Raises LimitExceeded (overloaded, too_many_sessions,
        rate_limited), fatal with close code 1013."""
        claim = self.check_overload()
        try:
            async with self._session_slot(principal):
                yield claim
        finally:
            claim.release()

    @contextlib.asynccontextmanager
    async def _session_slot(self, principal: Principal) -> AsyncIterator[None]:
        max_sessions, per_key = self.settings.max_sessions, self.settings.max_sessions_per_key
        if max_sessions and self.open_sessions >= max_sessions:
            raise LimitExceeded(
                ErrorCode.too_many_sessions,
                f"the gateway is serving its maximum of {max_sessions} sessions; try again later",
                retry_after_s=5.0, close=CloseCode.try_again_later,
            )
        slot = None
        if per_key:
            slot = await self._counted(
                self.counters.acquire_slot(f"open:{self._key(principal)}", per_key), CloseCode.try_again_later
            )
            if slot is None:
                raise LimitExceeded(
                    ErrorCode.too_many_sessions,
                    f"this API key already has {per_key} open sessions",
                    retry_after_s=5.0, close=CloseCode.try_again_later,
                )
        self.open_sessions += 1
        self._peak_since_trim = max(self._peak_since_trim, self.open_sessions)
        try:
            await self._take_rate(principal, "sessions", self.settings.sessions_per_minute, 1,
                                  close=CloseCode.try_again_later)
            yield
        finally:
            self.open_sessions -= 1
            self._ended_since_trim += 1
            if slot is not None:
                await self.counters.release_slot(slot)

    async def admit_request(self, principal: Principal, chars: int) -> AdmissionClaim:
        """An HTTP speech request: one session and `chars` characters. Returns its claim on the
        active-synthesis cap, to release when its synthesis starts or the request ends."""
        claim = self.check_overload()
        try:
            await self._take_rate(principal, "sessions", self.settings.sessions_per_minute, 1)
            await self.charge_chars(principal, chars)
        except BaseException:
            claim.release()
            raise
        return claim

    async def charge_chars(self, principal: Principal, chars: int, context_id: str | None = None) -> None:
        """Count text about to be accepted; raises LimitExceeded(rate_limited) (nothing counted) if over."""
        await self._take_rate(principal, "chars", self.settings.chars_per_minute, chars, context_id=context_id)


def _load_malloc_trim():
    """glibc's malloc_trim, or None on other C libraries."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


_malloc_trim = _load_malloc_trim()
