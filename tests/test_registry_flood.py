"""Issue 30, item 11: bogus registry records (whoever can write to the discovery Redis) must not stall the
gateways that read it. A real worker registered in a real Redis, thousands of unsigned records beside its
own, and a gateway in its own process reading the registry every 0.2 s: its /health is measured while it
does, and the real worker still serves."""

from __future__ import annotations

import asyncio
import json
import time

import redis

from tests.hostile_fixtures import HealthProbe, served_gateway
from tests.redis_fixtures import REDIS_URL, redis_prefix  # noqa: F401 (fixture)
from tests.test_worker_trust import TOKEN, speak, token_file  # noqa: F401 (fixture)
from tests.worker_fixtures import synthetic_worker_args, workers
from tts_backend.base import SynthesisRequest
from tts_backend.synthetic import SyntheticSynthesizer

BOGUS = 7000
BOGUS_BYTES = 16 * 1024  # each: JSON that takes long to parse (8,000 numbers), and no signature


def plant_bogus_records(prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    info_key, leases_key = f"{prefix}{{workers}}:info", f"{prefix}{{workers}}:leases"
    padding = [0] * (BOGUS_BYTES // 2)
    with client.pipeline(transaction=False) as pipe:
        for n in range(BOGUS):
            pipe.hset(info_key, f"bogus-{n}", json.dumps({"id": f"bogus-{n}", "address": "tcp://127.0.0.1:9",
                                                          "padding": padding}, separators=(",", ":")))
            pipe.zadd(leases_key, {f"bogus-{n}": 2**52})
        pipe.execute()
    client.close()


async def test_bogus_registry_records_do_not_stall_the_gateway(redis_prefix, token_file):
    """Before: 7,000 records of 16 KiB stalled the gateway's /health for 1.4 s at a read of the registry
    (all of them fetched, parsed and checked on its event loop)."""
    registered = synthetic_worker_args("--registry", REDIS_URL, "--registry-prefix", redis_prefix, "--token-file",
                                       token_file, "--heartbeat-s", "0.2", "--lease-s", "2", speed=0)
    plant_bogus_records(redis_prefix)
    with workers(registered):
        manager = served_gateway("--backend", "remote", "-o", f"discover={REDIS_URL}",
                                 "-o", f"discover_prefix={redis_prefix}", "-o", f"token={TOKEN}",
                                 "-o", "discover_refresh_s=0.2")
        gateway = await asyncio.to_thread(manager.__enter__)
        try:
            async with HealthProbe(gateway.url) as health:
                started = time.monotonic()
                answer = await speak(gateway, "The real worker still serves.")
                await asyncio.sleep(max(0.0, 3.0 - (time.monotonic() - started)))  # 15 reads of the registry
            metrics = (await asyncio.to_thread(__import__("httpx").get, gateway.url + "/metrics")).text
        finally:
            await asyncio.to_thread(manager.__exit__, None, None, None)
    print(f"/health worst {health.worst * 1000:.0f} ms over {health.answered} answers")
    assert answer[-1]["type"] == "session.done", answer[-1]
    audio = b"".join(m for m in answer if isinstance(m, bytes))
    request = SynthesisRequest(text="The real worker still serves.", voice="tone-mid", seed=5)  # speak's CONFIG
    assert audio == SyntheticSynthesizer().render(request).tobytes()
    refused = [line for line in metrics.splitlines() if line.startswith("voxgate_pool_registry_records_refused")]
    assert refused and float(refused[0].split()[-1]) > 0, refused
    assert health.worst < 0.4, health.worst  # after: 44 ms
