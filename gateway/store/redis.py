"""The Redis session store (`voxgate serve --store redis --redis-url ...`): any replica can resume any session.

Per session, under `{prefix}{<session_id>}:` (one hash tag, so a Redis Cluster keeps a session's keys in
one slot and Lua scripts may touch them all):

    meta      hash    config (JSON), created (unix s), attached (0/1), inputs (client inputs handled),
                      contexts (1 once a message named a context_id), key (fingerprint of the API key
                      that created the session; '' without keys), released (sentences released),
                      pruned (the next sentence the pruning looks at), trimmed (the newest sentence
                      pruned after its audio left the log), lastmarker / lastutterance (the highest
                      numbers an utterance end recorded), markerpruned (the next marker the pruning
                      looks at), endspruned (pruned ends that went out as a message), endsafter
                      (the highest `after` of a pruned end)
    lease     string  the owning connection's token, with a PX expiry of `lease_s` (renewed while it works)
    text      hash    sentence index -> {"t": text, "c": context_id, "u": utterance number}
    state     hash    sentence index -> pending | speaking | done | cancelled | failed
    bytes     hash    sentence index -> audio bytes recorded
    markers   hash    marker number -> MarkerRecord (JSON)
    open      hash    JSON context id -> {"u": utterance number, "t": unreleased text, "n": sentences,
                      "o": the open sentence's index (text streaming; left out when none)}
    log       stream  the replay log: entries (i: sentence, o: byte offset in it, t: unix ms, d: audio), with
                      ids `<position>-1`, position = bytes appended to the log before the entry
    logend    string  bytes ever appended to the log (the next entry's position)
    codes     hash    sentence index -> the codes of its audio delivered so far (binary), and
                      "<index>:at" -> the byte of its recorded audio they resume at; only while it is
                      spoken (dropped when it is done, failed or cancelled), bounded by its length
                      (gateway/store/base.py, issue 33)

Cloned voices, per owner (the API key's fingerprint, '' without keys), under `{prefix}{voices:<owner>}:`:

    meta      hash    voice name -> its metadata (JSON)
    p:<name>  string  the voice's prompt (the backend's bytes)

A voice is added (the per-owner count checked and both keys written) by one Lua script, so two replicas
adding at once never pass the limit; the keys have no expiry.

Pronunciation dictionaries, per owner, under `{prefix}{pronunciations:<owner>}:`: `meta` (name -> metadata
JSON, its "bytes" counted against the owner's total) and `entries` (name -> entries JSON), both written by
one Lua script that checks the owner's count and bytes first.

Every write is one Lua script call (one round trip): it checks that the session exists and that the
caller still holds the lease (a resume elsewhere overwrites the lease: the old owner's next write fails
with LeaseLost) and applies the change. The audio append, the hot path, stays small: since entry ids
are byte positions, keeping the last `replay_log_bytes` is one XTRIM MINID without reading any entry, and
it refreshes only the expiry of the keys it writes. The lease
renewal (every `lease_s / 3` while a connection is open) pushes every key's expiry `ttl_s` into the
future and trims the log to `replay_log_s`, so a session whose replica died without a word disappears
`ttl_s` after its last write or renewal.

Sentence records are pruned as gateway/store/base.py says: a cancelled sentence without audio when it is
cancelled, finished ones when a trim of the log passes them (the `prune` function below), and with them
the utterance ends sent before them (`prune_markers`); a cancelled end goes when it is cancelled. A resume reads
the session's hashes and only the newest entries of the log that it replays (`XREVRANGE`/`XRANGE` from the
byte position), never the whole log.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from ..logs import redact
from .base import (
    MAX_ENDS_KEPT,
    AppendMismatch,
    LeaseLost,
    MarkerRecord,
    ReplayOutOfRange,
    OpenUtterance,
    ReplayPiece,
    SentenceRecord,
    SessionChanges,
    SessionRecord,
    SessionStore,
    replay_owed,
    select_replay,
)
from .redis_connection import close, connect

UNAVAILABLE_AFTER_S = 2.0  # /ready: a store that does not answer a PING this fast is reported unreachable

KEY_NAMES = ("meta", "lease", "text", "state", "bytes", "markers", "open", "log", "logend", "codes")
KEY = {name: position for position, name in enumerate(KEY_NAMES, start=1)}  # Lua KEYS[] positions

# Shared by every script: KEYS in KEY_NAMES order; ARGV[1] owner ('' = unfenced), ARGV[2] lease ms,
# ARGV[3] ttl ms.
_PRELUDE = """
local function fence()
  if redis.call('EXISTS', KEYS[1]) == 0 then return false end
  if ARGV[1] ~= '' then
    local holder = redis.call('GET', KEYS[2])
    if not holder then
      redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])  -- lapsed (a stalled owner): take it back
    elseif holder ~= ARGV[1] then
      return false
    end
  end
  return true
end
local function refresh()
  for i = 1, #KEYS do
    if i ~= 2 then redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
  end
end
local function now_ms()
  local now = redis.call('TIME')
  return tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
end
local function drop_codes(index)
  redis.call('HDEL', KEYS[10], index, index .. ':at')
end
local function finished(state)
  return state == 'done' or state == 'cancelled' or state == 'failed'
end
local function drop_sentence(index)
  redis.call('HDEL', KEYS[3], index)
  redis.call('HDEL', KEYS[4], index)
  redis.call('HDEL', KEYS[5], index)
  drop_codes(index)
end
-- The utterance ends sent before sentence meta 'trimmed', and the oldest sent ones past MAX_ENDS_KEPT (see
-- gateway/store/base.py, prune_markers); they are numbered in send order, so the walk from meta 'markerpruned'
-- stops at the first one still needed.
local function prune_markers()
  local through = tonumber(redis.call('HGET', KEYS[1], 'trimmed') or '-1')
  local number = tonumber(redis.call('HGET', KEYS[1], 'markerpruned') or '1')
  local last = tonumber(redis.call('HGET', KEYS[1], 'lastmarker') or '0')
  local contexts = redis.call('HGET', KEYS[1], 'contexts') == '1'
  local ends, after = 0, tonumber(redis.call('HGET', KEYS[1], 'endsafter') or '0')
  while number <= last do
    local value = redis.call('HGET', KEYS[6], number)
    if value then
      local marker = cjson.decode(value)
      if marker['after'] > through and not (marker['sent'] and redis.call('HLEN', KEYS[6]) > MAX_ENDS_KEPT) then
        break
      end
      redis.call('HDEL', KEYS[6], number)
      -- MarkerRecord.makes_message
      if marker['after'] >= 0 and (marker['session_end'] or contexts or marker['context_id'] ~= cjson.null
                                   or not marker['by_close']) then
        ends = ends + 1
      end
      after = math.max(after, marker['after'])
    end
    number = number + 1
  end
  redis.call('HSET', KEYS[1], 'markerpruned', number, 'endsafter', after)
  if ends > 0 then redis.call('HINCRBY', KEYS[1], 'endspruned', ends) end
end
local function raise_to(name, value)
  if value > tonumber(redis.call('HGET', KEYS[1], name) or '0') then redis.call('HSET', KEYS[1], name, value) end
end
-- After a trim of the log: the finished sentences older than its oldest entry's sentence can never be
-- resumed at again (see gateway/store/base.py, prune_sentences). meta 'pruned' remembers where to go on.
local function prune()
  local head = redis.call('XRANGE', KEYS[8], '-', '+', 'COUNT', 1)[1]
  if not head then return end
  local oldest = tonumber(head[2][2])
  local index = tonumber(redis.call('HGET', KEYS[1], 'pruned') or '0')
  if index >= oldest then return end
  local trimmed = nil
  while index < oldest do
    if finished(redis.call('HGET', KEYS[4], index)) then
      drop_sentence(index)
      trimmed = index
    end
    index = index + 1
  end
  redis.call('HSET', KEYS[1], 'pruned', index)
  if trimmed then
    redis.call('HSET', KEYS[1], 'trimmed', trimmed)
    prune_markers()
  end
end
""".replace("MAX_ENDS_KEPT", str(MAX_ENDS_KEPT))

# ARGV[4..]: groups of (op, key position, field, value); op H = HSET, N = HSETNX, D = HDEL, S = a sentence's state
# (field: its index) if the sentence is recorded, C = cancelled: dropped if no audio was recorded for it,
# M = an utterance end (MarkerRecord JSON; field: its number), as gateway/store/base.py's record_marker.
_WRITE = _PRELUDE + """
if not fence() then return 0 end
local i = 4
while i <= #ARGV do
  local op, key, field = ARGV[i], KEYS[tonumber(ARGV[i + 1])], ARGV[i + 2]
  if op == 'H' then
    redis.call('HSET', key, field, ARGV[i + 3])
  elseif op == 'N' then
    redis.call('HSETNX', key, field, ARGV[i + 3])
  elseif op == 'M' then
    local marker = cjson.decode(ARGV[i + 3])
    raise_to('lastmarker', marker['number'])
    raise_to('lastutterance', marker['utterance'])
    if marker['after'] < 0 then
      redis.call('HDEL', key, field)
    elseif marker['after'] > tonumber(redis.call('HGET', KEYS[1], 'trimmed') or '-1')
        and marker['number'] >= tonumber(redis.call('HGET', KEYS[1], 'markerpruned') or '1') then
      -- (else pruned already, and counted: a late "sent" update, or a resume's re-send, is not kept)
      redis.call('HSET', key, field, ARGV[i + 3])
      prune_markers()
    end
  elseif op == 'D' then
    redis.call('HDEL', key, field)
  elseif redis.call('HEXISTS', KEYS[3], field) == 1 then
    if op == 'C' and tonumber(redis.call('HGET', KEYS[5], field) or '0') == 0 then
      drop_sentence(field)
    else
      redis.call('HSET', key, field, ARGV[i + 3])
      if key == KEYS[4] and finished(ARGV[i + 3]) then drop_codes(field) end  -- they resume nothing any more
    end
  end
  i = i + 4
end
refresh()
return 1
"""

# ARGV[4] sentence index, ARGV[5] audio, ARGV[6] log cap in bytes, ARGV[7] the audio's offset in its sentence.
# Idempotent: an append delivered twice (a retry after a connection broke before the reply came) finds its
# bytes recorded already and changes nothing; -1 when the sentence's recorded bytes match neither.
_APPEND = _PRELUDE + """
if not fence() then return 0 end
if redis.call('HEXISTS', KEYS[3], ARGV[4]) == 0 then return 1 end
local length = string.len(ARGV[5])
local offset = tonumber(ARGV[7])
local recorded = tonumber(redis.call('HGET', KEYS[5], ARGV[4]) or '0')
if recorded >= offset + length then return 1 end
if recorded ~= offset then return -1 end
redis.call('HSET', KEYS[5], ARGV[4], offset + length)
local finish = redis.call('INCRBY', KEYS[9], length)
local start = finish - length
redis.call('XADD', KEYS[8], string.format('%d-1', start), 'i', ARGV[4], 'o', offset, 't', now_ms(), 'd', ARGV[5])
local keep_from = math.min(finish - tonumber(ARGV[6]), start)  -- never the entry just added
if keep_from > 0 and redis.call('XTRIM', KEYS[8], 'MINID', string.format('%d-1', keep_from)) > 0 then prune() end
redis.call('PEXPIRE', KEYS[5], ARGV[3])
redis.call('PEXPIRE', KEYS[8], ARGV[3])
redis.call('PEXPIRE', KEYS[9], ARGV[3])
return 1
"""

# ARGV[4] sentence index, ARGV[5] codes, ARGV[6] their offset in the sentence's codes, ARGV[7] the byte of its
# recorded audio they resume at, ARGV[8] the most codes it may keep. Idempotent as the audio append; -1 when
# the offset is not the recorded codes' end, the limit would be passed or the audio is not recorded that far.
_CODES = _PRELUDE + """
if not fence() then return 0 end
if redis.call('HEXISTS', KEYS[3], ARGV[4]) == 0 or finished(redis.call('HGET', KEYS[4], ARGV[4])) then return 1 end
local codes = redis.call('HGET', KEYS[10], ARGV[4]) or ''
local offset, length = tonumber(ARGV[6]), string.len(ARGV[5])
if string.len(codes) >= offset + length then return 1 end
if string.len(codes) ~= offset or offset + length > tonumber(ARGV[8])
    or tonumber(ARGV[7]) > tonumber(redis.call('HGET', KEYS[5], ARGV[4]) or '0') then
  return -1
end
redis.call('HSET', KEYS[10], ARGV[4], codes .. ARGV[5], ARGV[4] .. ':at', ARGV[7])
redis.call('PEXPIRE', KEYS[10], ARGV[3])
return 1
"""

# ARGV[4] log cap in ms (the append caps bytes).
_RENEW = _PRELUDE + """
if not fence() then return 0 end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
local oldest_ms = now_ms() - tonumber(ARGV[4])
local trimmed = false
while redis.call('XLEN', KEYS[8]) > 1 do
  local head = redis.call('XRANGE', KEYS[8], '-', '+', 'COUNT', 1)[1]
  if tonumber(head[2][6]) >= oldest_ms then break end
  redis.call('XDEL', KEYS[8], head[1])
  trimmed = true
end
if trimmed then prune() end
refresh()
return 1
"""

# A resume: the caller becomes the owner whoever held the lease, if its key (ARGV[4]) created the session
# and the log still holds byte position ARGV[5] ('' = no check); else 0 (no such session) or -1 (the
# position has left the log), and nothing changes.
_CLAIM = _PRELUDE + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if (redis.call('HGET', KEYS[1], 'key') or '') ~= ARGV[4] then return 0 end
if ARGV[5] ~= '' then
  local head = redis.call('XRANGE', KEYS[8], '-', '+', 'COUNT', 1)[1]
  if head and tonumber(string.match(head[1], '^%d+')) > tonumber(ARGV[5]) then return -1 end
end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
redis.call('HSET', KEYS[1], 'attached', '1')
refresh()
return 1
"""

_DETACH = _PRELUDE + """
local holder = redis.call('GET', KEYS[2])
if ARGV[1] ~= '' and holder and holder ~= ARGV[1] then return 0 end
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'attached', '0')
redis.call('DEL', KEYS[2])
refresh()
return 1
"""

# The replay log's oldest entry id (its byte position), without its audio.
_LOG_HEAD = """
local head = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)[1]
if head then return head[1] end
return false
"""

_DELETE = _PRELUDE + """
local holder = redis.call('GET', KEYS[2])
if ARGV[1] ~= '' and holder and holder ~= ARGV[1] then return 0 end
redis.call('DEL', unpack(KEYS))
return 1
"""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class _Batcher:
    """Group commit: the script calls (audio appends, sentence and text records) of every session that
    arrive while the previous batch is in flight go to Redis together, as one pipeline (one write, one
    read), so the client's per-call cost is paid once per batch. Each caller still waits for its own
    result: a frame is recorded before it is sent."""

    def __init__(self, store: "RedisSessionStore") -> None:
        self.store = store
        self.pending: list[tuple[Any, list[str], list[Any], asyncio.Future]] = []
        self.task: asyncio.Task | None = None

    async def call(self, script, keys: list[str], args: list[Any]) -> int:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((script, keys, args, future))
        if self.task is None:
            self.task = asyncio.create_task(self._flush(), name="redis-append-batcher")
        return await future

    async def _flush(self) -> None:
        try:
            while self.pending:
                batch, self.pending = self.pending, []
                await self._send(batch)
        finally:
            self.task = None

    async def _send(self, batch) -> None:
        pipe = self.store.redis.pipeline(transaction=False)
        for script, keys, args, _ in batch:
            # (not pipe.evalsha: the cluster client refuses it in a pipeline, though it routes the command)
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        try:
            results = await pipe.execute(raise_on_error=False)
        except Exception as exc:  # the connection failed: every caller hears it
            for *_, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (script, keys, args, future), result in zip(batch, results):
            if isinstance(result, NoScriptError):  # Redis restarted and lost its scripts: load and retry
                try:
                    result = await script(keys=keys, args=args)
                except Exception as exc:
                    result = exc
            if future.done():
                continue  # the caller was cancelled
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)


class RedisSessionStore(SessionStore):
    def __init__(
        self,
        redis_url: str = "redis://127.0.0.1:6379/0",
        ttl_s: float = 120.0,
        replay_log_bytes: int = 4 * 1024 * 1024,
        *,
        replay_log_s: float = 300.0,
        key_prefix: str = "voxgate:",
        lease_s: float = 10.0,
        max_connections: int = 64,
        cluster: bool = False,
    ) -> None:
        self.redis_url = redis_url
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.replay_log_bytes = replay_log_bytes
        self.replay_log_ms = max(1, int(replay_log_s * 1000))
        self.key_prefix = key_prefix
        self.lease_ms = max(1, int(lease_s * 1000))
        self.max_connections = max_connections
        self.cluster = cluster
        self._redis: aioredis.Redis | None = None

    # ------------------------------------------------------------------ connection

    async def start(self) -> None:
        # Hundreds of sessions write at once: callers wait for one of a bounded set of connections.
        # A connection error is retried (gateway/store/redis_connection.py), so a write may run twice: each is
        # idempotent (the audio append names its offset; the rest set values, or take the lease for the
        # same owner), and a batch of them may run again whole.
        self._redis = connect(self.redis_url, cluster=self.cluster, max_connections=self.max_connections)
        try:
            await self._redis.ping()
        except Exception as exc:
            await close(self._redis)
            self._redis = None
            # The URL may hold a password: the error reaches the log, /health and voxgate serve's exit line.
            raise RuntimeError(redact(f"the Redis session store at {self.redis_url} does not answer: {exc}")) from exc
        self._write = self._redis.register_script(_WRITE)
        self._append = self._redis.register_script(_APPEND)
        self._codes = self._redis.register_script(_CODES)
        self._renew = self._redis.register_script(_RENEW)
        self._claim = self._redis.register_script(_CLAIM)
        self._detach = self._redis.register_script(_DETACH)
        self._delete = self._redis.register_script(_DELETE)
        self._log_head = self._redis.register_script(_LOG_HEAD)
        # Called by hash in pipelines:
        for script in (self._write, self._append, self._codes, self._renew, self._log_head):
            await self._redis.script_load(script.script)
        self._batcher = _Batcher(self)

    async def stop(self) -> None:
        batcher = getattr(self, "_batcher", None)
        if batcher is not None and batcher.task is not None:
            await asyncio.gather(batcher.task, return_exceptions=True)
        if self._redis is not None:
            await close(self._redis)
            self._redis = None

    async def unavailable(self) -> str | None:
        try:
            await asyncio.wait_for(self.redis.ping(), UNAVAILABLE_AFTER_S)
        except Exception as exc:  # noqa: BLE001 - any failure means sessions cannot be served
            reason = f"no answer within {UNAVAILABLE_AFTER_S:g} s" if isinstance(exc, asyncio.TimeoutError) else exc
            return f"the Redis session store is unreachable: {reason}"  # not the URL: it may hold a password
        return None

    @property
    def redis(self) -> aioredis.Redis:
        if self._redis is None:
            raise RuntimeError("the Redis session store is not started")
        return self._redis

    def keys(self, session_id: str) -> list[str]:
        return [f"{self.key_prefix}{{{session_id}}}:{name}" for name in KEY_NAMES]

    def _args(self, owner: str | None, *rest: Any) -> list[Any]:
        return [owner or "", self.lease_ms, self.ttl_ms, *rest]

    async def _run(self, script, session_id: str, owner: str | None, *rest: Any) -> int:
        return int(await script(keys=self.keys(session_id), args=self._args(owner, *rest)))

    async def _fenced(self, script, session_id: str, owner: str | None, *rest: Any) -> int:
        """A write (or renewal) through the batcher; LeaseLost if `owner` no longer holds the session."""
        result = int(await self._batcher.call(script, self.keys(session_id), self._args(owner, *rest)))
        if not result and owner is not None:
            raise LeaseLost(session_id)
        return result

    # ------------------------------------------------------------------ sessions

    async def create(
        self, session_id: str, config: dict[str, Any], *, owner: str | None = None, key_id: str | None = None
    ) -> None:
        keys = self.keys(session_id)
        meta = {"config": json.dumps(config), "created": repr(time.time()), "attached": "1", "key": key_id or ""}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(*keys)
            pipe.hset(keys[0], mapping=meta)
            pipe.pexpire(keys[0], self.ttl_ms)
            if owner is not None:
                pipe.set(keys[1], owner, px=self.lease_ms)
            await pipe.execute()

    async def get(self, session_id: str) -> SessionRecord | None:
        keys = self.keys(session_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(keys[0])
            pipe.get(keys[1])
            for name in ("text", "state", "bytes", "markers", "open", "codes"):
                pipe.hgetall(keys[KEY[name] - 1])
            pipe.get(keys[KEY["logend"] - 1])
            pipe.execute_command("EVALSHA", self._log_head.sha, 1, keys[KEY["log"] - 1])
            try:
                meta, lease, texts, states, sizes, markers, opened, codes, log_end, log_head = await pipe.execute()
            except NoScriptError:  # Redis restarted and lost its scripts
                await self.redis.script_load(_LOG_HEAD)
                return await self.get(session_id)
        if not meta:
            return None
        record = SessionRecord(
            session_id=session_id,
            config=json.loads(meta[b"config"]),
            created_at=float(meta.get(b"created", b"0")),
            last_active=time.time(),
            attached=meta.get(b"attached") == b"1",
            owner=_text(lease) if lease else None,
            key_id=_text(meta[b"key"]) if meta.get(b"key") else None,
            inputs_received=int(meta.get(b"inputs", b"0")),
            uses_contexts=meta.get(b"contexts") == b"1",
            released=int(meta.get(b"released", len(texts))),
            trimmed_through=int(meta.get(b"trimmed", -1)),
            ends_pruned=int(meta.get(b"endspruned", 0)),
            ends_pruned_after=int(meta.get(b"endsafter", 0)),
            last_marker=int(meta.get(b"lastmarker", 0)),
            last_utterance=int(meta.get(b"lastutterance", 0)),
            log_end=int(log_end or 0),
        )
        record.log_start = int(_text(log_head).split("-")[0]) if log_head else record.log_end
        for field, value in texts.items():
            index = int(field)
            data = json.loads(value)
            record.sentences[index] = SentenceRecord(
                index=index,
                text=data["t"],
                context_id=data["c"],
                state=_text(states.get(field, b"pending")),  # type: ignore[arg-type]
                bytes_sent=int(sizes.get(field, 0)),
                utterance=data["u"],
                codes=codes.get(field, b""),
                codes_at=int(codes.get(field + b":at", 0)),
            )
        record.sentences = dict(sorted(record.sentences.items()))
        for value in markers.values():
            marker = MarkerRecord(**json.loads(value))
            record.markers[marker.number] = marker
        record.markers = dict(sorted(record.markers.items()))
        for field, value in opened.items():
            context_id = json.loads(field)
            data = json.loads(value)
            record.open_utterances[context_id] = OpenUtterance(context_id, data["u"], data["t"], data.get("n", 0),
                                                               data.get("o"))
        return record

    async def claim(
        self, session_id: str, owner: str, *, key_id: str | None = None, log_from: int | None = None
    ) -> SessionRecord | None:
        claimed = await self._run(self._claim, session_id, owner, key_id or "", "" if log_from is None else log_from)
        if claimed < 0:
            raise ReplayOutOfRange(f"the replay log no longer holds position {log_from}")
        if not claimed:
            return None
        return await self.get(session_id)

    async def renew(self, session_id: str, owner: str) -> None:
        await self._fenced(self._renew, session_id, owner, self.replay_log_ms)

    async def append_audio(
        self, session_id: str, index: int, data: bytes, *, offset: int, owner: str | None = None
    ) -> None:
        if await self._fenced(self._append, session_id, owner, index, data, self.replay_log_bytes, offset) < 0:
            raise AppendMismatch(session_id, index, offset)

    async def append_codes(
        self, session_id: str, index: int, codes: bytes, *, offset: int, at: int, limit: int,
        owner: str | None = None,
    ) -> None:
        if await self._fenced(self._codes, session_id, owner, index, codes, offset, at, limit) < 0:
            raise AppendMismatch(session_id, index, offset)

    async def apply(self, session_id: str, changes: SessionChanges, *, owner: str | None = None) -> None:
        ops: list[Any] = []
        if changes.config is not None:
            ops += ["H", KEY["meta"], "config", json.dumps(changes.config)]
        for sentence in changes.sentences:
            value = json.dumps({"t": sentence.text, "c": sentence.context_id, "u": sentence.utterance})
            ops += ["H", KEY["text"], sentence.index, value, "H", KEY["state"], sentence.index, sentence.state]
            ops += ["N", KEY["bytes"], sentence.index, 0]  # not over audio a retried batch recorded already
        for sentence in changes.sentence_texts:  # S: only where the sentence is recorded
            value = json.dumps({"t": sentence.text, "c": sentence.context_id, "u": sentence.utterance})
            ops += ["S", KEY["text"], sentence.index, value]
        if changes.sentences:
            ops += ["H", KEY["meta"], "released", max(s.index for s in changes.sentences) + 1]
        for index, state in changes.states.items():
            ops += ["C" if state == "cancelled" else "S", KEY["state"], index, state]
        for marker in changes.markers:
            ops += ["M", KEY["markers"], marker.number, json.dumps(vars(marker))]
        for context_id, opened in changes.open_text.items():
            if opened is None:
                ops += ["D", KEY["open"], json.dumps(context_id), ""]
            else:
                value = {"u": opened.utterance, "t": opened.text, "n": opened.sentences}
                if opened.open_sentence is not None:
                    value["o"] = opened.open_sentence
                ops += ["H", KEY["open"], json.dumps(context_id), json.dumps(value)]
        if changes.inputs_received is not None:
            ops += ["H", KEY["meta"], "inputs", changes.inputs_received]
        if changes.uses_contexts is not None:
            ops += ["H", KEY["meta"], "contexts", int(changes.uses_contexts)]
        if ops:
            await self._fenced(self._write, session_id, owner, *ops)

    async def replay(
        self, session_id: str, sentence_index: int, byte_offset: int, *, record: SessionRecord | None = None
    ) -> list[ReplayPiece]:
        record = record or await self.get(session_id)
        if record is None:
            raise KeyError(session_id)
        owed = replay_owed(record, sentence_index, byte_offset)
        entries = []
        if owed:
            # The owed bytes are the log's newest as `record` knows it, from position `start`: the entry
            # holding that byte (the last one starting at or before it) and every later one up to the end
            # `record` saw (a live owner may have appended more since).
            start, log_key = record.log_end - owed, self.keys(session_id)[KEY["log"] - 1]
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.xrevrange(log_key, f"{start}-1", "-", count=1)
                pipe.xrange(log_key, f"({start}-1", f"{record.log_end - 1}-1")
                first, rest = await pipe.execute()
            entries = first + rest
        log = [ReplayPiece(int(fields[b"i"]), int(fields[b"o"]), fields[b"d"]) for _, fields in entries]
        return select_replay(record, log, sentence_index, byte_offset)

    async def detach(self, session_id: str, *, owner: str | None = None) -> None:
        await self._run(self._detach, session_id, owner)

    async def delete(self, session_id: str, *, owner: str | None = None) -> None:
        await self._run(self._delete, session_id, owner)

    # ------------------------------------------------------------------ voices

    def _voice_keys(self, owner: str, name: str) -> list[str]:
        base = f"{self.key_prefix}{{voices:{owner}}}:"
        return [base + "meta", base + "p:" + name]

    async def put_voice(self, owner: str, name: str, meta: dict[str, Any], prompt: bytes, max_voices: int) -> bool:
        added = await self.redis.eval(_PUT_VOICE, 2, *self._voice_keys(owner, name), name, json.dumps(meta), prompt,
                                      max_voices)
        return bool(int(added))

    async def voice_meta(self, owner: str, name: str) -> dict[str, Any] | None:
        raw = await self.redis.hget(self._voice_keys(owner, name)[0], name)
        return json.loads(raw) if raw is not None else None

    async def voice_metas(self, owner: str) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in (await self.redis.hgetall(self._voice_keys(owner, "")[0])).values()]

    async def voice_prompt(self, owner: str, name: str) -> bytes | None:
        return await self.redis.get(self._voice_keys(owner, name)[1])

    async def delete_voice(self, owner: str, name: str) -> bool:
        meta, prompt = self._voice_keys(owner, name)
        async with self.redis.pipeline(transaction=True) as pipe:
            removed, _ = await pipe.hdel(meta, name).delete(prompt).execute()
        return bool(removed)

    # ------------------------------------------------------------------ pronunciation dictionaries

    def _dictionary_keys(self, owner: str) -> list[str]:
        base = f"{self.key_prefix}{{pronunciations:{owner}}}:"
        return [base + "meta", base + "entries"]

    async def put_dictionary(self, owner: str, name: str, meta: dict[str, Any], entries: str, max_count: int,
                             max_bytes: int) -> int:
        return int(await self.redis.eval(_PUT_DICTIONARY, 2, *self._dictionary_keys(owner), name, json.dumps(meta),
                                         entries, max_count, max_bytes))

    async def dictionary(self, owner: str, name: str) -> tuple[dict[str, Any], str] | None:
        meta_key, entries_key = self._dictionary_keys(owner)
        async with self.redis.pipeline(transaction=True) as pipe:
            meta, entries = await pipe.hget(meta_key, name).hget(entries_key, name).execute()
        if meta is None or entries is None:
            return None
        return json.loads(meta), entries.decode() if isinstance(entries, bytes) else entries

    async def dictionary_metas(self, owner: str) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in (await self.redis.hgetall(self._dictionary_keys(owner)[0])).values()]

    async def delete_dictionary(self, owner: str, name: str) -> bool:
        meta_key, entries_key = self._dictionary_keys(owner)
        async with self.redis.pipeline(transaction=True) as pipe:
            removed, _ = await pipe.hdel(meta_key, name).hdel(entries_key, name).execute()
        return bool(removed)


# KEYS: meta hash, entries hash. ARGV: name, meta JSON, entries JSON, max count, max bytes. 1 stored, 0 over
# the count, -1 over the bytes (the metas' "bytes", the new one's instead of the one it replaces).
_PUT_DICTIONARY = """
local exists = redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1
if not exists and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[4]) then
  return 0
end
local total = cjson.decode(ARGV[2])['bytes']
local metas = redis.call('HGETALL', KEYS[1])
for i = 1, #metas, 2 do
  if metas[i] ~= ARGV[1] then
    total = total + cjson.decode(metas[i + 1])['bytes']
  end
end
if total > tonumber(ARGV[5]) then
  return -1
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
return 1
"""

# KEYS: meta hash, prompt string. ARGV: name, meta JSON, prompt, max voices. 1 stored, 0 over the limit.
_PUT_VOICE = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[4]) then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[3])
return 1
"""
