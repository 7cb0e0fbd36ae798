"""What huge request heads cost a gateway before authentication (issue 24, item 5).

`voxgate serve --backend synthetic --api-key ...` in its own process; raw sockets send a 10, 20 and 40 MB
URL and a 40 MB header one after another (never a key), then 8 such connections at once while /health is
asked over and over. Reports the gateway process's CPU seconds for each, each answer's status, /health's
slowest answer during the 8, and the gateway's RSS 3 s after them against before.

    python bench/request_head_attack.py

Shared 2-core VM at load average ~12, 2026-12-03:
- before (a40b6b3, no head bound): 10/20/40 MB URL 0.18/0.56/2.17 CPU-s (answered 400 after the whole
  URL), 40 MB header 1.36 CPU-s and answered 200; 8 at once 3.13 CPU-s, /health worst 5.31 s, RSS after
  +83 MB, 5 of 8 connections reset;
- after (16 KiB line / 64 KiB head): 0.01/0.01/0.01 CPU-s (414), 40 MB header 0.03 CPU-s (431); 8 at once
  0.15 CPU-s, /health worst 0.31 s, RSS after +0 MB, every one answered 414 or 431.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.hostile_fixtures import HealthProbe, served_gateway  # noqa: E402
from tests.test_request_head_limits import KEY, cpu_seconds, long_header, long_url, pour_head, rss  # noqa: E402

MB = 1 << 20


async def answer(port: int, attack: tuple[bytes, int, bytes]) -> int | str:
    try:
        return (await pour_head(port, *attack))[0]
    except Exception as exc:  # noqa: BLE001 - a reset or a missing answer is a result here
        return type(exc).__name__


async def main() -> None:
    with served_gateway("--api-key", KEY) as gateway:
        pid = gateway.process.pid
        for name, attack in [*((f"{n} MB URL", long_url(n * MB)) for n in (10, 20, 40)),
                             ("40 MB header", long_header(40 * MB))]:
            before = cpu_seconds(pid)
            status = await answer(gateway.port, attack)
            print(f"{name}: {cpu_seconds(pid) - before:.2f} CPU-s, answered {status}")
        rss_before = rss(pid)
        async with HealthProbe(gateway.url) as health:
            before = cpu_seconds(pid)
            answers = await asyncio.gather(*(answer(gateway.port, a)
                                             for a in [long_url(40 * MB), long_header(40 * MB)] * 4))
            cpu = cpu_seconds(pid) - before
        await asyncio.sleep(3)
        print(f"8 x 40 MB at once: {cpu:.2f} CPU-s, /health worst {health.worst:.2f} s, "
              f"RSS after {(rss(pid) - rss_before) / 1e6:+.0f} MB, answers {answers}")


if __name__ == "__main__":
    asyncio.run(main())
