"""Pacing of the Twilio bridge under concurrent calls (run from the repository root):

    python clients/telephony/pacing_bench.py --calls 20 --seconds 8 [--gateway ws://127.0.0.1:8000]

Starts a gateway with the synthetic backend (named as such; real-time-ish pacing is the bridge's, not
the backend's), one bridge, and N fake Twilio calls (tests/test_telephony_twilio.FakeTwilio, which
plays Twilio's side as documented). Each call speaks a text of about `--seconds` of audio. Reports the
intervals between media frames as Twilio received them (after the lead), whether every payload was 160
bytes, and how often the simulated Twilio player ran out of audio (an audible gap).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import voxgate_client as vg
import voxgate_telephony as vt

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for tests.*
from tests.gateway_server import free_port, running_gateway
from tests.test_telephony_twilio import FakeTwilio


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(gateway_url: str, calls: int, seconds: float, lead_ms: int) -> None:
    bridge = vt.TwilioBridge(gateway_url, config=vg.SessionConfig(voice="tone-mid"), lead_ms=lead_ms)
    port = free_port()
    server = await bridge.serve("127.0.0.1", port)
    url = f"ws://127.0.0.1:{port}/twilio"
    sentence = "This is a sentence of synthetic speech for the pacing check. "
    text = sentence * max(1, round(seconds * 15 / len(sentence)))  # the synthetic backend speaks 15 chars/s

    async def one_call(n: int) -> tuple[list[float], bool, float, list[float]]:
        sid = f"CA{n:032d}"
        async with FakeTwilio(url, stream_sid=f"MZ{n:032d}", call_sid=sid) as twilio:
            call = await bridge.wait_for_call(sid, timeout_s=10)
            speech = await call.say(text)
            assert await speech.played(timeout_s=seconds * 3 + 10)
        media = twilio.media()
        times = [m.at for m in media][lead_ms // 20 :]
        sizes_ok = all(len(twilio.payload(m)) == 160 for m in media) and not twilio.problems
        span = times[-1] - times[0]
        return [b - a for a, b in zip(times, times[1:])], sizes_ok, span / ((len(times) - 1) * 0.02), twilio.underruns

    started = time.monotonic()
    results = await asyncio.gather(*(one_call(n) for n in range(calls)))
    server.close()
    await server.wait_closed()
    gaps_ms = [g * 1000 for r in results for g in r[0]]
    ratios = [r[2] for r in results]
    print(f"{calls} calls x {seconds:.0f} s of audio, lead {lead_ms} ms, wall {time.monotonic() - started:.1f} s")
    print(f"frames {len(gaps_ms) + calls}, all 160-byte and well-formed: {all(r[1] for r in results)}")
    print(
        f"inter-frame gap ms: median {statistics.median(gaps_ms):.2f}, p1 {percentile(gaps_ms, 0.01):.2f}, "
        f"p99 {percentile(gaps_ms, 0.99):.2f}, max {max(gaps_ms):.2f}"
    )
    print(f"send span / real time: min {min(ratios):.4f}, max {max(ratios):.4f}")
    dry = [gap * 1000 for r in results for gap in r[3]]
    print(
        f"Twilio player underruns (buffer ran empty): {len(dry)} in {sum(1 for r in results if r[3])} of {calls} calls"
        + (f", total {sum(dry):.0f} ms, worst {max(dry):.0f} ms" if dry else "")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--lead-ms", type=int, default=100)
    parser.add_argument(
        "--gateway", help="URL of a running gateway (e.g. `voxgate serve --backend synthetic` in another "
        "process); default: one in this process, which shares its CPU and GIL with the bridge"
    )
    args = parser.parse_args()
    if args.gateway:
        asyncio.run(run(args.gateway, args.calls, args.seconds, args.lead_ms))
        return
    with running_gateway(backend="synthetic") as gateway:
        asyncio.run(run(gateway.url, args.calls, args.seconds, args.lead_ms))


if __name__ == "__main__":
    main()
