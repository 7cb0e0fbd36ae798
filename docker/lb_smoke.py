"""Smoke check of docker/haproxy.cfg without Docker: the same HAProxy config in front of two local
`voxgate serve --store redis` replicas (only the server addresses and the DNS resolver differ).

    python docker/lb_smoke.py          # needs haproxy on PATH and Redis (VOXGATE_TEST_REDIS_URL, as the
                                       # tests: 127.0.0.1:6379/0 unless set); its keys are deleted at the end

(and maxconn, lowered to fit a small open-file limit). A voxgate_client session through the load balancer speaks a turn; the replica serving it gets SIGTERM
mid-utterance. Checked: the utterance finishes, the balancer takes the draining replica out of rotation,
the client is handed over (1012) and resumes through the balancer on the other replica, and its next turn
is spoken there; all audio equals an uninterrupted run.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import voxgate_client as vg  # noqa: E402
from tests.gateway_server import free_port  # noqa: E402
from tests.redis_fixtures import REDIS_URL, delete_prefix  # noqa: E402
from tests.resume_fixtures import PACED, gateways, uninterrupted_pcm  # noqa: E402

TURN_1 = "The first turn is being spoken when its replica is told to stop. It still finishes completely."
TURN_2 = "The second turn comes from the other replica."


def local_config(ports: list[int], lb_port: int) -> str:
    text = (ROOT / "docker" / "haproxy.cfg").read_text()
    text = re.sub(r"\nresolvers docker\n(?:    .*\n)+", "\n", text)
    text = text.replace(" resolvers docker init-addr last,libc,none", "")
    text = text.replace("bind :8000", f"bind 127.0.0.1:{lb_port}")
    for number, port in enumerate(ports, start=1):
        text = text.replace(f"gateway{number}:8000", f"127.0.0.1:{port}")
    text = text.replace("maxconn 20000", "maxconn 2000")  # fits this machine's open-file limit
    return text.replace("log stdout format raw local0", "log stderr format raw local0")


def active_sessions(url: str) -> float:
    metrics = httpx.get(url + "/metrics", timeout=5).text
    match = re.search(r"^voxgate_sessions_active (\S+)$", metrics, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def main() -> int:
    prefix = f"voxgate-lb-smoke-{int(time.time())}:"
    try:
        return await smoke(prefix)
    finally:
        delete_prefix(prefix)  # the replicas' keys (voices and limits have no TTL)


async def smoke(prefix: str) -> int:
    with gateways(REDIS_URL, prefix, 2, *PACED, "--drain-timeout", "10") as replicas:
        lb_port = free_port()
        config = tempfile.NamedTemporaryFile("w", suffix=".cfg", delete=False)
        config.write(local_config([r.port for r in replicas], lb_port))
        config.close()
        subprocess.run(["haproxy", "-c", "-q", "-f", config.name], check=True)
        balancer = subprocess.Popen(["haproxy", "-db", "-f", config.name], stderr=subprocess.DEVNULL)
        lb_url = f"http://127.0.0.1:{lb_port}"
        try:
            for _ in range(100):
                try:
                    if httpx.get(lb_url + "/ready", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
            reference = await uninterrupted_pcm(replicas[1].ws_url, TURN_1 + " " + TURN_2)
            pcm = bytearray()
            events: list[str] = []
            ws_url = lb_url.replace("http", "ws") + "/v1/audio/speech/stream"
            async with vg.connect(ws_url, vg.SessionConfig(voice="tone-mid"), backoff_initial_s=0.05) as session:
                await session.send_text(TURN_1)
                await session.done()
                drained = None
                async for event in session.events():
                    events.append(type(event).__name__)
                    if isinstance(event, vg.AudioChunk):
                        pcm += event.data
                        if drained is None and event.sentence_index == 0 and event.offset > 0:
                            drained = next(r for r in replicas if active_sessions(r.url) > 0)
                            drained.process.send_signal(signal.SIGTERM)
                            signalled = time.monotonic()
                    elif isinstance(event, vg.SessionDone):
                        break
                print(f"turn 1 finished on the draining replica, {time.monotonic() - signalled:.2f} s after SIGTERM")
                assert await asyncio.to_thread(drained.process.wait, 20) == 0, "the drained replica did not exit cleanly"
                print("drained replica exited 0")
                await session.send_text(TURN_2)
                await session.done()
                async for event in session.events():
                    events.append(type(event).__name__)
                    if isinstance(event, vg.AudioChunk):
                        pcm += event.data
                    elif isinstance(event, vg.Reconnected):
                        print(f"resumed through the balancer after {event.attempts} attempt(s)")
                    elif isinstance(event, (vg.Error, vg.Disconnected)):
                        print("client event:", event)
                    elif isinstance(event, vg.SessionDone):
                        break
                assert session.reconnects >= 1, "the session never moved"
            survivor = next(r for r in replicas if r is not drained)
            assert bytes(pcm) == reference, "audio differs from an uninterrupted run"
            print(f"turn 2 spoken by the survivor on port {survivor.port}; audio equals an uninterrupted run")
            print("errors seen by the client:", [e for e in events if e == "Error"] or "none")
        finally:
            balancer.send_signal(signal.SIGTERM)
            balancer.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
