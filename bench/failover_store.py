"""Cost of recording audio for resume: RedisSessionStore.append_audio (one Lua call per frame: lease
check, stream append, trim, expiry refresh) with many sessions appending at once.

    python bench/failover_store.py --sessions 300 --seconds 10 --output bench/results/failover_store_redis.json

Each simulated session appends one 200 ms frame of 24 kHz s16le audio (9,600 bytes, the gateway's largest)
as fast as the store accepts it; the report gives frames per second over all sessions, how many times
real time that is per session on average, and the latency of one append.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import redis.asyncio as aioredis

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from gateway.store.redis import RedisSessionStore  # noqa: E402
from loadgen import hardware  # noqa: E402

FRAME = bytes(9600)  # 200 ms at 24 kHz s16le
FRAME_S = 0.2


async def session(store: RedisSessionStore, number: int, stop_at: float, latencies: list[float]) -> int:
    session_id, owner = f"bench-{number}", uuid.uuid4().hex
    await store.create(session_id, {"voice": "bench"}, owner=owner)
    await store.add_sentence(session_id, 0, "A sentence.", None, owner=owner)
    frames = 0
    while time.monotonic() < stop_at:
        started = time.monotonic()
        await store.append_audio(session_id, 0, FRAME, offset=frames * len(FRAME), owner=owner)
        latencies.append(time.monotonic() - started)
        frames += 1
    return frames


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    prefix = f"voxgate-bench-{uuid.uuid4().hex[:8]}:"
    store = RedisSessionStore(args.redis_url, key_prefix=prefix, replay_log_bytes=1024 * 1024)
    await store.start()
    latencies: list[float] = []
    try:
        stop_at = time.monotonic() + args.seconds
        frames = await asyncio.gather(*(session(store, n, stop_at, latencies) for n in range(args.sessions)))
    finally:
        client = aioredis.Redis.from_url(args.redis_url)
        keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()
        await store.stop()
    total = sum(frames)
    ordered = sorted(latencies)
    report = {
        "command": "python " + " ".join(sys.argv),
        "hardware": hardware(),
        "sessions": args.sessions,
        "frames_per_s": round(total / args.seconds, 1),
        "audio_recorded_x_realtime_per_session": round(total * FRAME_S / args.seconds / args.sessions, 2),
        "append_latency_ms": {
            "median": round(statistics.median(latencies) * 1000, 2),
            "p99": round(ordered[int(0.99 * (len(ordered) - 1))] * 1000, 2),
        },
        "note": "one Python process drives all sessions: its event loop, not Redis, may be the limit",
    }
    print(json.dumps(report, indent=1))
    if args.output:
        args.output.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
