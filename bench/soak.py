"""Soak benchmark: hundreds of concurrent WebSocket sessions on one gateway process, for minutes.

The gateway runs as its own process (`voxgate serve`) with the *synthetic real-time backend*
(tts_backend/synthetic.py, paced like a streaming engine: first chunk after --first-chunk-delay, then
--backend-speed times faster than real time, --chunk-ms chunks), so what is measured is the gateway, not a
model. Client processes hold --sessions sessions open for --duration seconds; each session is a voice
agent conversation: a turn of two sentences (`input.text` + `input.done` on a fresh `context_id`), the
audio arrives and is "played" (zero pre-buffer playback simulated from arrival times), then the user
talks for a while (--think-time) and the next turn starts. At the end every session sends
`session.close`.

Per turn: gateway-added latency = (first audio byte received - turn text sent) - the backend's first
chunk delay, i.e. everything the gateway, the loopback network and the client loop add; playback
underruns and stall time. Over time: the gateway's CPU (from /proc/PID/stat) and resident memory
(VmRSS), sessions open, and the machine's load average. After the sessions end, memory is sampled for
--settle seconds more to show whether it returns to the baseline taken before the sessions started;
with --bursts N the whole thing repeats N times, so that memory after each burst shows any growth.

    python bench/soak.py --sessions 500 --duration 600 --output bench/results/soak.json --plot bench/results/soak.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen import LoopLagProbe, distribution, hardware, simulate_playback  # noqa: E402

SAMPLE_RATE = 24000  # the synthetic backend's rate; sessions ask for its native pcm
SENTENCES = [
    "Thanks for calling, I can help you with that order right away.",
    "Your package left our warehouse this morning and should arrive on Thursday.",
    "Let me check whether the blue model is still available in your size.",
    "I have updated the delivery address to the one you just gave me.",
    "Is there anything else you would like me to look at while we are on the call?",
    "The refund will show up on your statement within three to five business days.",
    "I can book the technician for Tuesday between nine and eleven in the morning.",
    "That plan includes unlimited calls and twenty gigabytes of mobile data.",
]


# ------------------------------------------------------------------------------------------ clients


async def run_session(index: int, url: str, deadline: float, think: tuple[float, float], first_chunk_delay: float,
                      turns: list[dict[str, Any]], failures: list[str], rng: random.Random) -> None:
    import websockets

    voice = ("tone-low", "tone-mid", "tone-high")[index % 3]
    async with websockets.connect(url, max_size=None, compression=None, open_timeout=60, ping_interval=None) as ws:
        await ws.send(json.dumps({"type": "session.config", "voice": voice, "stream_audio": True,
                                  "response_format": "pcm"}))
        started = json.loads(await ws.recv())
        if started.get("type") != "session.started":
            raise RuntimeError(f"session {index}: {started}")
        turn_number = 0
        while time.time() < deadline:
            turn_number += 1
            context = f"turn-{turn_number}"
            text = " ".join(rng.sample(SENTENCES, 2))
            sent_at = time.time()
            await ws.send(json.dumps({"type": "input.text", "text": text, "context_id": context}))
            await ws.send(json.dumps({"type": "input.done", "context_id": context}))
            pieces: list[tuple[float, float]] = []
            sentences = 0
            errors = 0
            while True:
                frame = await asyncio.wait_for(ws.recv(), 60)
                if isinstance(frame, bytes):
                    pieces.append((time.time(), len(frame) / 2 / SAMPLE_RATE))
                    continue
                message = json.loads(frame)
                kind = message.get("type")
                if kind == "audio.done":
                    sentences += 1
                elif kind == "error":
                    errors += 1
                    failures.append(f"session {index}: {message.get('code')}: {message.get('message')}")
                elif kind == "utterance.done":
                    break
            audio_s = sum(d for _, d in pieces)
            playback = simulate_playback(pieces)
            turns.append({
                "t": sent_at,
                "gateway_added_s": (pieces[0][0] - sent_at - first_chunk_delay) if pieces else None,
                "underruns": playback.underruns,
                "stall_s": playback.total_stall_s,
                "audio_s": audio_s,
                "sentences": sentences,
                "errors": errors,
            })
            # The listener hears the turn to its end, then talks for a while.
            plays_until = (pieces[0][0] + audio_s + playback.total_stall_s) if pieces else time.time()
            pause = max(0.0, plays_until - time.time()) + rng.uniform(*think)
            if time.time() + pause >= deadline:
                break
            await asyncio.sleep(pause)
        await ws.send(json.dumps({"type": "session.close"}))
        while True:
            frame = await asyncio.wait_for(ws.recv(), 60)
            if isinstance(frame, str) and json.loads(frame).get("type") == "session.done":
                break


async def client_process_main(first: int, count: int, total: int, url: str, start_at: float, ramp_s: float,
                              deadline: float, think: tuple[float, float], first_chunk_delay: float) -> dict[str, Any]:
    turns: list[dict[str, Any]] = []
    failures: list[str] = []
    lag = LoopLagProbe(0.1)
    probe = asyncio.create_task(lag.run())
    opened = 0

    async def one(i: int) -> None:
        nonlocal opened
        await asyncio.sleep(max(0.0, start_at + ramp_s * i / max(1, total) - time.time()))  # sessions open evenly
        rng = random.Random(i)
        try:
            opened += 1
            await run_session(i, url, deadline, think, first_chunk_delay, turns, failures, rng)
        except Exception as exc:  # counted, not fatal to the others
            failures.append(f"session {i}: {type(exc).__name__}: {exc}")

    await asyncio.gather(*(one(i) for i in range(first, first + count)))
    probe.cancel()
    return {"turns": turns, "failures": failures, "client_loop_lag_s": distribution(lag.lags), "opened": opened}


def _client_process(first: int, count: int, total: int, url: str, start_at: float, ramp_s: float, deadline: float,
                    think: tuple[float, float], first_chunk_delay: float, out: str) -> None:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    result = asyncio.run(client_process_main(first, count, total, url, start_at, ramp_s, deadline, think,
                                             first_chunk_delay))
    Path(out).write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------ gateway process


class ProcessSampler:
    """CPU (percent of one core) and resident memory of a process, from /proc, once a second."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[dict[str, float]] = []
        self._ticks = os.sysconf("SC_CLK_TCK")

    def _cpu_s(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self._ticks  # utime + stime

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    async def run(self, sessions_open) -> None:
        last_t, last_cpu = time.time(), self._cpu_s()
        while True:
            await asyncio.sleep(1.0)
            now, cpu = time.time(), self._cpu_s()
            self.samples.append({
                "t": now, "cpu_percent": 100 * (cpu - last_cpu) / (now - last_t), "rss_mb": self.rss_mb(),
                "sessions": sessions_open(), "load_1m": os.getloadavg()[0],
            })
            last_t, last_cpu = now, cpu


def gateway_metric(url: str, name: str) -> float | None:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def start_gateway(port: int, args: argparse.Namespace) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "gateway.cli", "serve", "--backend", "synthetic", "--port", str(port),
        "-o", f"speed={args.backend_speed}", "-o", f"first_chunk_delay_s={args.first_chunk_delay}",
        "-o", f"chunk_ms={args.chunk_ms}",
        "--log-level", "warning", "--idle-timeout", "120",
    ]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return subprocess.Popen(command, env=env)


# ------------------------------------------------------------------------------------------ main


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from tests.gateway_server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gateway = start_gateway(port, args)
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError("the gateway did not become ready")
        sampler = ProcessSampler(gateway.pid)
        sessions_open = lambda: gateway_metric(url, "voxgate_sessions_active")  # noqa: E731
        # Warm-up: a few short sessions so lazy imports and first allocations are not counted as growth.
        warm_deadline = time.time() + 3
        warm_turns: list[dict[str, Any]] = []
        await asyncio.gather(*(run_session(i, url.replace("http", "ws") + "/v1/audio/speech/stream", warm_deadline,
                                           (0.1, 0.2), args.first_chunk_delay, warm_turns, [], random.Random(i))
                               for i in range(4)))
        await asyncio.sleep(2)
        baseline_rss = sampler.rss_mb()
        sampling = asyncio.create_task(sampler.run(sessions_open))
        per = -(-args.sessions // args.client_processes)
        ctx = multiprocessing.get_context("spawn")
        results, bursts = [], []
        for burst in range(args.bursts):
            start_at = time.time() + 1
            deadline = start_at + args.duration
            processes, outputs = [], []
            for n in range(args.client_processes):
                first, count = n * per, min(per, args.sessions - n * per)
                out = f"/tmp/voxgate-soak-{os.getpid()}-{burst}-{n}.json"
                outputs.append(out)
                process = ctx.Process(target=_client_process, args=(
                    first, count, args.sessions, url.replace("http", "ws") + "/v1/audio/speech/stream", start_at,
                    args.ramp, deadline, (args.think_min, args.think_max), args.first_chunk_delay, out))
                process.start()
                processes.append(process)
            while any(p.is_alive() for p in processes):
                await asyncio.sleep(1)
            ended_at = time.time()
            await asyncio.sleep(args.settle)  # sessions are over: memory should come back
            results += [json.loads(Path(o).read_text()) for o in outputs]
            for o in outputs:
                Path(o).unlink(missing_ok=True)
            bursts.append({"start": start_at, "ramp_end": start_at + args.ramp, "deadline": deadline,
                           "ended": ended_at, "rss_mb_after": sampler.rss_mb(), "sessions_open_after": sessions_open()})
        sampling.cancel()
        final_rss = bursts[-1]["rss_mb_after"]
        final_sessions = bursts[-1]["sessions_open_after"]
    finally:
        gateway.terminate()
        try:
            gateway.wait(30)
        except subprocess.TimeoutExpired:
            gateway.kill()

    turns = [t for r in results for t in r["turns"]]
    failures = [f for r in results for f in r["failures"]]
    steady = [s for s in sampler.samples if any(b["ramp_end"] + 10 <= s["t"] <= b["deadline"] for b in bursts)]
    added = [t["gateway_added_s"] for t in turns if t["gateway_added_s"] is not None]
    peak_sessions = max((s["sessions"] or 0 for s in sampler.samples), default=0)
    return {
        "benchmark": "bench/soak.py",
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "backend": (f"synthetic real-time backend (tts_backend/synthetic.py): first chunk after"
                    f" {args.first_chunk_delay * 1000:.0f} ms, then {args.backend_speed:g}x real time, {args.chunk_ms} ms chunks,"
                    f" 24 kHz pcm"),
        "hardware": hardware(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("output", "plot")},
        "sessions_requested": args.sessions,
        "sessions_peak_open": peak_sessions,
        "sessions_failed": len(failures),
        "failures_sample": failures[:20],
        "turns": len(turns),
        "audio_hours_delivered": sum(t["audio_s"] for t in turns) / 3600,
        "gateway_added_latency_s": distribution(added),
        "underruns": {
            "turns_with_underrun": sum(1 for t in turns if t["underruns"]),
            "underruns_total": sum(t["underruns"] for t in turns),
            "stall_s_total": sum(t["stall_s"] for t in turns),
            "turns": len(turns),
        },
        "turn_errors": sum(t["errors"] for t in turns),
        "gateway_cpu_percent_steady": distribution([s["cpu_percent"] for s in steady]),
        "gateway_rss_mb": {
            "baseline_before_sessions": baseline_rss,
            "peak": max((s["rss_mb"] for s in sampler.samples), default=None),
            "steady_mean": sum(s["rss_mb"] for s in steady) / len(steady) if steady else None,
            "after_sessions_end": final_rss,
            "settle_s": args.settle,
            "returned_to_baseline_within_mb": final_rss - baseline_rss,
            "after_each_burst": [b["rss_mb_after"] for b in bursts],
        },
        "sessions_open_after_end": final_sessions,
        "load_average_1m": distribution([s["load_1m"] for s in sampler.samples]),
        "client_loop_lag_s": [r["client_loop_lag_s"] for r in results],
        "timeline": {"start": bursts[0]["start"], "bursts": bursts},
        "samples": sampler.samples,
        "turn_records": [{k: t[k] for k in ("t", "gateway_added_s", "underruns")} for t in turns],
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = result["timeline"]["start"]
    samples = result["samples"]
    t = [(s["t"] - t0) / 60 for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    axes[0].plot(t, [s["sessions"] for s in samples], color="tab:blue")
    axes[0].set_ylabel("sessions open")
    axes[1].plot(t, [s["cpu_percent"] for s in samples], color="tab:red", lw=0.8, label="gateway process")
    axes[1].plot(t, [s["load_1m"] * 100 for s in samples], color="gray", lw=0.8, label="machine load avg x100")
    axes[1].set_ylabel("CPU % of one core")
    axes[1].legend(loc="upper right", fontsize=8)
    axes[2].plot(t, [s["rss_mb"] for s in samples], color="tab:green")
    axes[2].axhline(result["gateway_rss_mb"]["baseline_before_sessions"], color="gray", ls="--", lw=0.8,
                    label="baseline before sessions")
    axes[2].set_ylabel("gateway RSS (MB)")
    axes[2].legend(loc="upper right", fontsize=8)
    # Gateway-added latency per 15 s window.
    windows: dict[int, list[float]] = {}
    for turn in result["turn_records"]:
        if turn["gateway_added_s"] is not None:
            windows.setdefault(int((turn["t"] - t0) // 15), []).append(turn["gateway_added_s"] * 1000)
    xs = sorted(windows)
    for q, style in ((50, "-"), (95, "--"), (99, ":")):
        import numpy as np

        axes[3].plot([(x * 15 + 7.5) / 60 for x in xs], [np.percentile(windows[x], q) for x in xs], style,
                     color="tab:purple", label=f"p{q}")
    axes[3].set_ylabel("gateway-added latency (ms)")
    axes[3].set_xlabel("minutes")
    axes[3].legend(loc="upper right", fontsize=8)
    for ax in axes:
        for burst in result["timeline"]["bursts"]:
            ax.axvline((burst["deadline"] - t0) / 60, color="black", lw=0.6)
        ax.grid(alpha=0.3)
    lat = result["gateway_added_latency_s"]
    fig.suptitle(
        f"Voxgate soak: {result['sessions_requested']} WebSocket sessions, synthetic real-time backend, "
        f"{result['hardware']['cpus_usable']} cores\n"
        f"gateway-added latency p50/p95/p99 {lat['p50'] * 1000:.0f}/{lat['p95'] * 1000:.0f}/{lat['p99'] * 1000:.0f} ms, "
        f"underruns {result['underruns']['underruns_total']} in {result['turns']} turns", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=500)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds the sessions run (10 min)")
    parser.add_argument("--ramp", type=float, default=30.0, help="seconds over which sessions open")
    parser.add_argument("--settle", type=float, default=30.0, help="seconds of memory sampling after the end")
    parser.add_argument("--think-min", type=float, default=1.0, help="user talk time between turns, min s")
    parser.add_argument("--think-max", type=float, default=4.0, help="user talk time between turns, max s")
    parser.add_argument("--backend-speed", type=float, default=2.0, help="synthetic backend: x real time")
    parser.add_argument("--first-chunk-delay", type=float, default=0.1, help="synthetic backend: first chunk, s")
    parser.add_argument("--chunk-ms", type=int, default=160,
                        help="synthetic backend: audio per chunk (160 ms = Qwen3-TTS's first chunk of 2 codec frames)")
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--bursts", type=int, default=1,
                        help="run the sessions this many times, --settle apart (memory must not grow from one to the next)")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    result = asyncio.run(soak(args))
    summary = {k: v for k, v in result.items() if k not in ("samples", "turn_records")}
    print(json.dumps(summary, indent=2))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
