"""Failover pause: how long a listener waits for audio when the replica serving it dies.

Two real `voxgate serve --store redis` processes with the synthetic backend (paced like a streaming
engine: `--speed` times real time after `--first-chunk-delay`) or Piper (`--backend piper`, the CPU
default, deterministic). Per run: a client streams a
multi-sentence turn from replica A; somewhere in the second sentence (a random byte position) A is
SIGKILLed; the client notices the dead socket, reconnects to replica B at once and sends
`session.resume {session_id, sentence_index, bytes_received}`; B takes the lease over, replays what the log
holds and re-synthesizes the interrupted sentence, dropping the bytes already delivered. Measured:

- pause: SIGKILL -> first resumed audio byte at the client (what the issue asks for)
- detect: SIGKILL -> the client sees the socket closed
- resume: reconnect + session.resume -> session.started
- first_byte: session.started -> first audio byte (replay or re-synthesis up to the resume point)

Every run also checks that the audio equals an uninterrupted run (made once at the start) byte for
byte. A replacement replica is started after each kill, so every run fails over between two warm
processes.

    python bench/failover.py --runs 30 --output bench/results/failover_synthetic_cpu.json
    python bench/failover.py --runs 30 --backend piper --output bench/results/failover_piper_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import websockets

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from loadgen import hardware  # noqa: E402
from tests.resume_fixtures import Listener, config_message, start_gateway, wait_ready  # noqa: E402

SENTENCES = [
    "The first sentence plays from the first replica without any trouble.",
    "The second sentence is the one that is cut when the replica dies.",
    "A third sentence follows, possibly synthesized ahead of time already.",
    "And the fourth one ends the turn.",
]


async def uninterrupted(ws_url: str, voice: str) -> bytes:
    listener = Listener()
    async with websockets.connect(ws_url, max_size=None) as ws:
        await ws.send(config_message(voice=voice))
        await listener.receive(ws, "session.started")
        await ws.send(json.dumps({"type": "input.text", "text": " ".join(SENTENCES)}))
        await ws.send(json.dumps({"type": "input.done"}))
        await listener.receive(ws, "session.done", timeout=120)
    return listener.pcm()


async def one_run(victim, survivor, expected: bytes, rng: random.Random, voice: str, max_cut: int) -> dict:
    listener = Listener()
    ws = await websockets.connect(victim.ws_url, max_size=None)
    await ws.send(config_message(voice=voice))
    await listener.receive(ws, "session.started")
    await ws.send(json.dumps({"type": "input.text", "text": " ".join(SENTENCES)}))
    await ws.send(json.dumps({"type": "input.done"}))
    cut_after = rng.randint(1, max_cut)  # somewhere in sentence 1
    while not (listener.open_sentence == 1 and len(listener.audio[1]) >= cut_after):
        listener.feed(await asyncio.wait_for(ws.recv(), 30))
        if listener.last_done >= 1:
            break  # the sentence was shorter than the cut point: kill between sentences
    killed = time.monotonic()
    victim.kill()
    await listener.receive_until_closed(ws)
    detected = time.monotonic()
    position = listener.position()
    ws = await websockets.connect(survivor.ws_url, max_size=None)
    listener.first_audio_at = None
    await ws.send(listener.resume_message())
    started = await listener.receive(ws, ("session.started", "error"))
    if started["type"] != "session.started":
        raise RuntimeError(f"resume refused: {started}")
    resumed = time.monotonic()
    await listener.receive(ws, "session.done")
    await ws.close()
    if listener.pcm() != expected:
        raise RuntimeError("resumed audio differs from the uninterrupted run")
    return {
        "position": list(position),
        "pause_s": listener.first_audio_at - killed,
        "detect_s": detected - killed,
        "resume_s": resumed - detected,
        "first_byte_s": listener.first_audio_at - resumed,
    }


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {
        "n": len(values),
        "median_ms": round(statistics.median(values) * 1000, 1),
        "p90_ms": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] * 1000, 1),
        "worst_ms": round(max(values) * 1000, 1),
        "best_ms": round(min(values) * 1000, 1),
    }


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--backend", choices=["synthetic", "piper"], default="synthetic")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--speed", type=float, default=8.0, help="synthetic backend: times faster than real time")
    parser.add_argument("--first-chunk-delay", type=float, default=0.05, help="synthetic backend: seconds to first chunk")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    prefix = f"voxgate-failover-{int(time.time())}:"
    if args.backend == "synthetic":
        options: tuple[str, ...] = (
            "-o", f"speed={args.speed}", "-o", "chunk_ms=40", "-o", f"first_chunk_delay_s={args.first_chunk_delay}",
        )
        voice, max_cut, backend = "tone-mid", 40 * 1920, f"synthetic, {args.speed:g}x real time after {args.first_chunk_delay:g} s, 40 ms chunks"
    else:
        options = ("--backend", "piper")  # the later flag wins over start_gateway's --backend synthetic
        voice, max_cut, backend = "joe", 60_000, "piper (en_US-joe-medium, CPU, deterministic)"
    replicas = [start_gateway(args.redis_url, prefix, *options) for _ in range(2)]
    runs = []
    try:
        wait_ready(*replicas, timeout_s=120)
        expected = await uninterrupted(replicas[1].ws_url, voice)
        for number in range(args.runs):
            victim, survivor = replicas
            run = await one_run(victim, survivor, expected, rng, voice, max_cut)
            runs.append(run)
            print(f"run {number + 1}: pause {run['pause_s'] * 1000:.1f} ms at {run['position']}", flush=True)
            replicas = [survivor, start_gateway(args.redis_url, prefix, *options)]
            wait_ready(replicas[1], timeout_s=120)
    finally:
        for replica in replicas:
            if replica.process.poll() is None:
                replica.kill()
    report = {
        "command": "python " + " ".join(sys.argv),
        "backend": backend,
        "store": "redis",
        "hardware": hardware(),
        "pause": summary([r["pause_s"] for r in runs]),
        "detect": summary([r["detect_s"] for r in runs]),
        "resume": summary([r["resume_s"] for r in runs]),
        "first_byte": summary([r["first_byte_s"] for r in runs]),
        "runs": runs,
    }
    print(json.dumps({k: report[k] for k in ("pause", "detect", "resume", "first_byte")}, indent=1))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
