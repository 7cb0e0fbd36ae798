"""What decoding a reference clip in a decoder process costs (gateway/audio/decoder.py), against
decoding it in the gateway's own process as before.

    python bench/reference_decode_cost.py [--clips 40] [--seconds 10] [--container flac]

For a clip of `--seconds` (24 kHz mono tone, encoded as `--container`), reports per clip:
- in process: decode_clip called directly (what the gateway did, on a worker thread);
- decoder process, warm: ReferenceDecoder with its processes already started (the steady state);
- decoder process, cold: a fresh ReferenceDecoder each time (after a crash, or the first clip);
and the event loop's worst lag while the warm decodes ran (a 1 ms ticker), which must stay near zero:
the gateway only waits on the pipes. Median and p95 over `--clips`; one line of JSON at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gateway.audio.reference import decode_clip  # noqa: E402
from gateway.audio.decoder import ReferenceDecoder  # noqa: E402
from tests.cloning_fixtures import encode_clip, tone_clip  # noqa: E402

RATE = 24000


def summary(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {"median_ms": round(statistics.median(ordered) * 1000, 2),
            "p95_ms": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] * 1000, 2)}


async def measure(data: bytes, clips: int) -> dict[str, object]:
    in_process = []
    for _ in range(clips):
        started = time.perf_counter()
        decode_clip(data, 1.0, 30.0, RATE)
        in_process.append(time.perf_counter() - started)

    decoder = ReferenceDecoder(processes=1)
    await decoder.decode(data, 1.0, 30.0, RATE)  # started
    lag = 0.0
    ticking = True

    async def ticker() -> None:
        nonlocal lag
        while ticking:
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            lag = max(lag, time.perf_counter() - before - 0.001)

    tick = asyncio.create_task(ticker())
    warm = []
    for _ in range(clips):
        started = time.perf_counter()
        await decoder.decode(data, 1.0, 30.0, RATE)
        warm.append(time.perf_counter() - started)
    ticking = False
    await tick
    await decoder.stop()

    cold = []
    for _ in range(max(3, clips // 8)):
        fresh = ReferenceDecoder(processes=1)
        started = time.perf_counter()
        await fresh.decode(data, 1.0, 30.0, RATE)
        cold.append(time.perf_counter() - started)
        await fresh.stop()
    return {"in_process": summary(in_process), "process_warm": summary(warm), "process_cold": summary(cold),
            "worst_loop_lag_ms_while_warm": round(lag * 1000, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--container", default="flac", choices=["wav", "flac", "mp3", "ogg"])
    args = parser.parse_args()
    data = encode_clip(tone_clip(220.0, args.seconds, RATE), RATE, args.container)
    result = {"clip_bytes": len(data), "clip_s": args.seconds, "container": args.container, "clips": args.clips,
              "cpus": os.cpu_count(), **asyncio.run(measure(data, args.clips))}
    for name in ("in_process", "process_warm", "process_cold"):
        print(f"{name:>14}: median {result[name]['median_ms']:8.2f} ms   p95 {result[name]['p95_ms']:8.2f} ms")
    print(f"worst event-loop lag during the warm decodes: {result['worst_loop_lag_ms_while_warm']} ms")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
