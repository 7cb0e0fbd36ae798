"""Where the Qwen3 engine's time goes under open-loop load: the engine in-process, no gateway, no WebSocket.

    python bench/engine_profile.py --model /tmp/qwen3-1.7b-random --rates 10,20,40 \\
        --warmup 10 --duration 30 --output bench/results/engine_profile_h200.json

Builds the backend exactly as `voxgate serve --backend qwen3` does (Qwen3Synthesizer.start: model, runner,
engine thread, CUDA graphs, warm-up request), with bench/engine_load.py's options by default, so the two
benches compare. For each rate, bench/loadgen.py's seeded Poisson schedule of one-sentence ARCTIC requests
goes straight to the backend's `synthesize` (prompt, `Engine.submit`, the EngineStream) from one asyncio
loop while the engine thread runs as in production. Per request, loadgen's own functions give time to first
chunk, audible TTFA (zero pre-buffer playback simulation + audible onset), underruns and E2E.

Engine side: `Engine.stats_snapshot()` at the start and at the end of the measured phase; the difference says
how the engine thread spent that wall time (per stage: inside the runner call and in the engine's handling
of the results; scheduling = command draining + scheduler.decide; idle = waiting for work), batch sizes per
stage, codec batches by frame count, batches per urgency rule, and eager (not graph-replayed) runner steps.
Codec batches run on their own CUDA stream beside generation: the CODEC section is the engine thread's time to
launch, poll and (when nothing else can run) wait for them; the codec's wall time in flight and its device time
(CUDA events) are reported apart, as shares of the measured wall time that overlap the other sections.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_load import BENCH_MAX_ACTIVE, BENCH_MAX_LEN, add_rate_arguments, bench_runner_options
from bench.loadgen import (
    DEFAULT_PROMPTS,
    ONSET_SEARCH_S,
    LoopLagProbe,
    RequestResult,
    RequestSpec,
    Workload,
    accelerator,
    add_output_argument,
    distribution,
    load_prompts,
    poisson_schedule,
    request_metrics,
    summarize,
    write_report,
)

STAGES = ("PREFILL", "FRAME", "CODEC")
BYTES_PER_SAMPLE = 2  # the engine streams s16le


# -- one request ---------------------------------------------------------------------------------------


async def run_request(backend: Any, spec: RequestSpec, args: argparse.Namespace, measured: bool,
                      planned: float, run_start: float) -> RequestResult:
    """Synthesize one request and time its chunks from the moment it was sent (time zero)."""
    from tts_backend.base import SynthesisRequest

    sample_rate = backend.engine.runner.sample_rate
    result = RequestResult(index=spec.index, prompt_ids=spec.prompt_ids, chars=len(spec.text), measured=measured,
                           planned_s=planned)
    t0 = time.perf_counter()
    result.started_at = t0 - run_start
    result.schedule_lag_s = result.started_at - planned
    chunks: list[tuple[float, int]] = []
    prefix: list[bytes] = []
    prefix_limit = ONSET_SEARCH_S * sample_rate * BYTES_PER_SAMPLE
    prefix_bytes = 0
    request = SynthesisRequest(text=spec.text, voice=args.voice or backend.default_voice,
                               instructions=args.instructions, seed=args.seed * 1_000_003 + spec.index)

    async def consume() -> None:
        nonlocal prefix_bytes
        async for chunk in backend.synthesize(request):
            chunks.append((time.perf_counter() - t0, len(chunk.pcm)))
            if prefix_bytes < prefix_limit:
                prefix.append(chunk.pcm)
                prefix_bytes += len(chunk.pcm)
        result.completed = True

    try:
        await asyncio.wait_for(consume(), args.timeout)
    except asyncio.TimeoutError:
        result.errors.append("timeout")
    except Exception as exc:  # recorded, never raised: one failed request must not stop the run
        result.errors.append(f"{type(exc).__name__}: {exc}"[:200])
    result.finished_at = time.perf_counter() - run_start
    audio = np.frombuffer(b"".join(prefix), dtype="<i2")
    return request_metrics(result, chunks, BYTES_PER_SAMPLE, sample_rate, audio, result.completed)


# -- engine snapshots ----------------------------------------------------------------------------------


def take_snapshot(engine: Any) -> dict[str, Any]:
    """The engine's counters, the runner's graph counters, and our own clock just before."""
    wall = time.perf_counter()
    snapshot = engine.stats_snapshot()
    graphs = getattr(engine.runner, "graphs", None)
    snapshot["graph_replays"] = getattr(graphs, "replays", 0)
    snapshot["graph_eager_runs"] = getattr(graphs, "eager_runs", 0)
    snapshot["profiler_time_s"] = wall
    return snapshot


def subtract(after: Any, before: Any) -> Any:
    """after - before, key by key through nested dicts (a key only in `after` counts from zero); histogram
    entries that did not change are dropped."""
    if isinstance(after, dict):
        before = before if isinstance(before, dict) else {}
        out = {}
        for key, value in after.items():
            diff = subtract(value, before.get(key))
            if not (isinstance(key, int) and diff == 0):
                out[key] = diff
        return out
    return after - (before or 0)


def engine_breakdown(diff: dict[str, Any]) -> dict[str, Any]:
    """Shares of the measured wall time (our clock) and batch statistics from a snapshot difference."""
    wall = diff["profiler_time_s"]
    stages = {}
    for name in STAGES:
        s = diff["stages"][name]
        seconds = s["runner_s"] + s["post_s"]
        batches = s["batches"]
        stages[name] = {
            "batches": batches,
            "items": s["items"],
            "mean_batch": s["items"] / batches if batches else None,
            "share": seconds / wall,
            "runner_share": s["runner_s"] / wall,
            "post_share": s["post_s"] / wall,
            "ms_per_batch": 1000 * seconds / batches if batches else None,
            "batch_sizes": dict(sorted(s["batch_sizes"].items())),
        }
    stage_s = sum((s["runner_s"] + s["post_s"]) for s in diff["stages"].values())
    accounted = stage_s + diff["schedule_s"] + diff["idle_s"] + diff["outside_step_s"] + diff["startup_s"]
    decisions = diff["decisions"]
    codec = diff["codec"]
    return {
        "wall_s": wall,
        "engine_wall_s": diff["time_s"],
        "decisions": decisions,
        "decisions_per_s": decisions / wall,
        "stages": stages,
        "busy_share": stage_s / wall,
        "schedule_share": diff["schedule_s"] / wall,
        "schedule_us_per_decision": 1e6 * diff["schedule_s"] / decisions if decisions else None,
        "decide_cpu_us": 1e6 * diff["decide_cpu_s"] / diff["decide_calls"] if diff["decide_calls"] else None,
        "idle_share": diff["idle_s"] / wall,
        "outside_step_share": diff["outside_step_s"] / wall,
        "accounted_share": accounted / wall,
        "idle_waits": diff["idle_waits"],
        "codec_batches_by_frames": dict(sorted(diff["codec_frames"].items())),
        "codec_collected": codec["collected"],
        "codec_in_flight_share": codec["in_flight_s"] / wall,
        "codec_lane_batches": codec.get("lane_batches", 0),  # of the codec batches, those on the first-chunk lane
        "codec_device_share": codec["device_s"] / wall if codec["timed"] else None,
        "codec_device_ms_per_batch": 1000 * codec["device_s"] / codec["timed"] if codec["timed"] else None,
        "rules": {rule: sum(by_stage.values()) for rule, by_stage in sorted(diff["rules"].items())},
        "rules_by_stage": {rule: by_stage for rule, by_stage in sorted(diff["rules"].items())},
        "graph_replays": diff["graph_replays"],
        "graph_eager_runs": diff["graph_eager_runs"],
        "completed": diff["completed"],
        "failed": diff["failed"],
        "cancelled": diff["cancelled"],
    }


# -- one rate ------------------------------------------------------------------------------------------


async def run_rate(backend: Any, rate: float, args: argparse.Namespace, prompts: list[dict[str, str]]) -> dict:
    engine = backend.engine
    workload = Workload(prompts, args.seed, (1, 1))
    measure_start, measure_end = args.warmup, args.warmup + args.duration
    arrivals = poisson_schedule(rate, measure_end, args.seed)
    results: list[RequestResult] = []
    in_flight: list[tuple[float, int]] = []
    engine_load: list[tuple[int, int]] = []  # (slots in use, requests waiting for a slot)
    snapshots: dict[str, dict] = {}
    active = 0
    peak = 0  # requests in flight at most, counted at each start in the measured phase (samples can miss it)
    run_start = time.perf_counter()

    async def at(offset_s: float) -> None:
        delay = run_start + offset_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)

    async def snapshot_phase() -> None:
        await at(measure_start)
        snapshots["start"] = take_snapshot(engine)
        await at(measure_end)
        snapshots["end"] = take_snapshot(engine)

    async def sample() -> None:
        while True:
            now = time.perf_counter() - run_start
            if measure_start <= now <= measure_end:
                in_flight.append((now, active))
                slots = engine.scheduler.active
                engine_load.append((slots, len(engine.scheduler.requests) - slots))
            await asyncio.sleep(0.25)

    async def tracked(spec: RequestSpec, measured: bool, planned: float) -> None:
        nonlocal active, peak
        active += 1
        if measure_start <= time.perf_counter() - run_start <= measure_end:
            peak = max(peak, active)
        try:
            results.append(await run_request(backend, spec, args, measured, planned, run_start))
        finally:
            active -= 1

    probe = LoopLagProbe()
    background = [asyncio.create_task(probe.run()), asyncio.create_task(sample())]
    phase = asyncio.create_task(snapshot_phase())
    scheduled = 0
    tasks = []
    try:
        for index, planned in enumerate(arrivals):
            await at(planned)
            measured = planned >= measure_start
            scheduled += measured
            tasks.append(asyncio.create_task(tracked(workload.request(index), measured, planned)))
        await phase
        if tasks:
            await asyncio.wait(tasks, timeout=args.drain_timeout)
    finally:
        for task in background + tasks:
            task.cancel()
        await asyncio.gather(*background, *tasks, return_exceptions=True)

    measured = [r for r in results if r.measured]
    starts = [r.started_at for r in measured if r.started_at is not None]
    wall = max((r.finished_at or 0.0) for r in measured) - min(starts) if starts else 0.0
    summary = summarize(results, wall, scheduled, in_flight, probe.lags)
    summary["audio_s_per_request"] = distribution([r.audio_s for r in measured])
    summary["peak_in_flight"] = peak
    summary["max_slots_in_use"] = max((s for s, _ in engine_load), default=0)
    summary["max_waiting_for_slot"] = max((w for _, w in engine_load), default=0)
    entry = {"rps": rate, "summary": summary,
             "engine": engine_breakdown(subtract(snapshots["end"], snapshots["start"]))}
    if args.per_request:
        entry["requests"] = [asdict(r) | {"ok": r.ok} for r in sorted(results, key=lambda r: r.index)]
    return entry


# -- reporting -----------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value * 1000:.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def client_table(entries: list[dict]) -> str:
    lines = ["| RPS | audible TTFA p50 / p95 / p99 (ms) | first chunk p95 (ms) | underruns (events / requests) | "
             "stall total (ms) | E2E p95 (ms) | in flight max | slots max / waiting max | completed / scheduled |",
             "|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        s = e["summary"]
        a = s["audible_ttfa_s"]
        lines.append(
            f"| {e['rps']:g} | {_ms(a['p50'])} / {_ms(a['p95'])} / {_ms(a['p99'])} | {_ms(s['ttfb_s']['p95'])} | "
            f"{s['underrun_events']} / {s['underrun_requests']} | {_ms(s['total_stall_s'])} | "
            f"{_ms(s['e2e_s']['p95'])} | {s['peak_in_flight']} | {s['max_slots_in_use']} / {s['max_waiting_for_slot']} | "
            f"{s['completed']} / {s['scheduled']} |")
    return "\n".join(lines)


def engine_table(entries: list[dict]) -> str:
    """Per stage: share of wall time (runner call + result handling), mean batch size, ms per batch."""
    lines = ["| RPS | decisions/s | " + " | ".join(f"{n} share (mean batch, ms/batch)" for n in STAGES)
             + " | scheduling (host) | idle | outside step | accounted |",
             "|---|---|" + "---|" * len(STAGES) + "---|---|---|---|"]
    for e in entries:
        g = e["engine"]
        cells = []
        for name in STAGES:
            s = g["stages"][name]
            mean = "-" if s["mean_batch"] is None else f"{s['mean_batch']:.1f}"
            per = "-" if s["ms_per_batch"] is None else f"{s['ms_per_batch']:.2f}"
            cells.append(f"{_pct(s['share'])} ({mean}, {per})")
        lines.append(f"| {e['rps']:g} | {g['decisions_per_s']:.0f} | " + " | ".join(cells)
                     + f" | {_pct(g['schedule_share'])} | {_pct(g['idle_share'])} | {_pct(g['outside_step_share'])}"
                     f" | {_pct(g['accounted_share'])} |")
    return "\n".join(lines)


def details(entry: dict) -> str:
    g = entry["engine"]
    runner = ", ".join(f"{n} {_pct(g['stages'][n]['runner_share'])} + {_pct(g['stages'][n]['post_share'])}"
                       for n in STAGES)
    per_decision = g["schedule_us_per_decision"]
    decide_cpu = g["decide_cpu_us"]
    codec_ms = "-" if g["codec_device_ms_per_batch"] is None else f"{g['codec_device_ms_per_batch']:.2f}"
    return "\n".join([
        f"{entry['rps']:g} RPS: runner call + engine result handling per stage: {runner}",
        f"  scheduling per decision {'-' if per_decision is None else f'{per_decision:.0f}'} us "
        f"(the scheduler's CPU {'-' if decide_cpu is None else f'{decide_cpu:.0f}'} us); "
        f"idle waits {g['idle_waits']}; CUDA graph replays {g['graph_replays']}, runner steps run eagerly (no captured graph) "
        f"{g['graph_eager_runs']}",
        f"  codec batches by frames: {g['codec_batches_by_frames']}",
        f"  codec overlapped with the engine thread: in flight {_pct(g['codec_in_flight_share'])} of the wall time, "
        f"device time {_pct(g['codec_device_share'])} ({codec_ms} ms per batch)",
        f"  batches by rule: {g['rules']}",
        "  batch sizes: " + "; ".join(f"{n} {g['stages'][n]['batch_sizes']}" for n in STAGES),
    ])


# -- main ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="Qwen3-TTS checkpoint folder")
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    add_rate_arguments(parser, "10,20,40")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--frame-cap-chars-per-second", type=float, default=15.0,
                        help="cap each request at the frames its text takes at this speaking rate (random weights "
                             "never sample EOS); 0 turns the cap off")
    parser.add_argument("--voice", help="speaker (default: the checkpoint's first)")
    parser.add_argument("--instructions", help="voice description (VoiceDesign checkpoints)")
    parser.add_argument("--max-active", type=int, default=BENCH_MAX_ACTIVE, help="KV slots")
    parser.add_argument("--max-len", type=int, default=BENCH_MAX_LEN, help="Talker positions per slot")
    parser.add_argument("--runner-options", type=lambda text: bench_runner_options(json.loads(text)),
                        default=bench_runner_options(),
                        help="JSON object of Qwen3RunnerConfig fields, over bench/engine_load.py's field by field")
    parser.add_argument("--scheduler-options", type=json.loads, default=None,
                        help="JSON overrides of the scheduler's policy, e.g. '{\"prefill_gather_s\": 0.02}'")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--timeout", type=float, default=120.0, help="per-request limit in seconds")
    parser.add_argument("--drain-timeout", type=float, default=120.0, help="wait this long for requests in flight")
    parser.add_argument("--per-request", action="store_true", help="include every request in the JSON")
    add_output_argument(parser)
    return parser


async def profile(args: argparse.Namespace) -> dict[str, Any]:
    from tts_backend.qwen3_backend import Qwen3Synthesizer

    prompts = load_prompts(args.prompts)
    cap = args.frame_cap_chars_per_second
    backend = Qwen3Synthesizer(model=args.model, device=args.device, max_active=args.max_active,
                               max_len=args.max_len, frame_cap_chars_per_second=cap if cap and cap > 0 else None,
                               runner_options=args.runner_options, scheduler_options=args.scheduler_options)
    card = accelerator()  # before start(): whether the compile cache held anything
    started = time.perf_counter()
    await backend.start()
    runner = backend.engine.runner
    report: dict[str, Any] = {
        "tool": "bench/engine_profile.py",
        "command": " ".join(["python", "bench/engine_profile.py", *args.argv]),
        **card, "device": str(runner.device), "fused": runner.fused, "cuda_graphs": runner.graphs.enabled,
        "sampler": runner.sampler, "startup_s": time.perf_counter() - started, "rates": [],
    }
    print(f"engine ready in {report['startup_s']:.1f} s on {report['device']} (fused {runner.fused}, "
          f"CUDA graphs {runner.graphs.enabled}, sampler {runner.sampler})", flush=True)
    try:
        for rate in [float(r) for r in args.rates.split(",")]:
            entry = await run_rate(backend, rate, args, prompts)
            report["rates"].append(entry)
            print(client_table([entry]), engine_table([entry]), details(entry), sep="\n", flush=True)
    finally:
        await backend.stop()
    return report


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    # The engine's start-up log (what each kind of captured graph cost) beside the tables.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("tts_backend").setLevel(logging.INFO)
    report = asyncio.run(profile(args))
    tables = "\n\n".join([client_table(report["rates"]), engine_table(report["rates"]),
                          *(details(e) for e in report["rates"])])
    print("\n" + tables)
    if args.output:
        write_report(args.output, report, tables)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
