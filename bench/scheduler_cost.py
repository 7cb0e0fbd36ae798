"""Host cost of one scheduling decision (`Scheduler.decide`), no model and no device.

The engine thread decides between every two batches, so at high load the decision's Python cost is GPU idle
time (H200 profile run 2: 185 us per decision at 40 RPS, 4.5% of the engine thread). This builds a scheduler
holding N requests in the mix a loaded engine holds (most playing with deadlines spread over the next second
or two, some with no audio yet, some with frames waiting for the codec), then times `decide` on it. The text
mix (`--mixes playing,text`) has a share of the streams (`--text-waiting`, 0.5) speaking text that is still
being written, each waiting for its next text token (text_open, text_fed == text_ready), as in the agent
workload.

    python bench/scheduler_cost.py --requests 32,64,128 --mixes playing,text [--json FILE]
    git show REV:tts_backend/engine/scheduler.py > /tmp/scheduler_rev.py
    python bench/scheduler_cost.py --baseline /tmp/scheduler_rev.py --mixes playing,text   # before/after, interleaved

(The baseline runs on this tree's request.py, so REV's scheduler must use only what that still has.)

Each population is rebuilt per repetition from one seed, and decide() does not mutate request state, so
every timed call sees the same population. A scheduler that keeps readiness between decisions re-reads the
requests of the batch it returned last (as if it had run) at the next call, so each timed call pays that
check; here no stream moved, so none crosses a limit that makes it re-read in full (in the engine the few
that do each frame are). Each population's first decision, which reads all its holders at once, is untimed.
Reported: median and p95 microseconds per decision. A shared
VM's speed drifts by up to 2x over minutes, so a comparison alternates the two schedulers round by round
and reports the median of the rounds' medians.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import time

from tts_backend.engine import scheduler as current_scheduler
from tts_backend.engine.request import Phase, RequestState, Stage

SAMPLE_RATE = 24_000
SAMPLES_PER_FRAME = 1920
SCHEDULE = (2, 4, 8, 12)


def loaded_scheduler(requests: int, seed: int, now: float, module=current_scheduler, text_waiting: float = 0.0):
    """A scheduler (of `module`) with `requests` slot holders in a loaded engine's mix of phases and
    deadlines; `text_waiting`: the share of the playing ones waiting for text."""
    rng = random.Random(seed)
    # The frame cap as the qwen3 backend sets it: every slot holder fits one frame batch.
    max_active = max(requests, 1)
    config = module.SchedulerConfig(max_active=max_active,
                                    max_batch={Stage.PREFILL: 8, Stage.FRAME: max_active, Stage.CODEC: 16})
    scheduler = module.Scheduler(config)
    for request_id in range(1, requests + 1):
        request = RequestState(request_id=request_id, prompt=None, seed=request_id, max_frames=600,
                               chunk_schedule=SCHEDULE, arrival=now - rng.uniform(0.0, 4.0),
                               sample_rate=SAMPLE_RATE, samples_per_frame=SAMPLES_PER_FRAME)
        scheduler.add(request)
        if rng.random() < 0.1:  # just admitted or first chunk still being generated: no audio yet
            request.phase = rng.choice((Phase.NEED_PREFILL, Phase.NEED_CODE_PREDICT, Phase.NEED_DECODE))
            request.frames_generated = rng.randint(0, 1)
            continue
        request.phase = rng.choice((Phase.NEED_CODE_PREDICT, Phase.NEED_DECODE, Phase.NEED_DECODE))
        request.chunks_decoded = rng.randint(1, 8)
        decoded = sum(SCHEDULE[min(i, len(SCHEDULE) - 1)] for i in range(request.chunks_decoded))
        request.frames_decoded = decoded
        request.frames_generated = decoded + rng.randint(0, 14)
        request.output.emitted_samples = decoded * SAMPLES_PER_FRAME
        request.output.consumed_samples = request.output.emitted_samples
        # Audio left before this stream runs dry: 0.05 s .. 2 s.
        request.playback_start = now + rng.uniform(0.05, 2.0) - decoded * SAMPLES_PER_FRAME / SAMPLE_RATE
        if rng.random() < text_waiting:  # its next step needs a text token that has not come
            request.phase = Phase.NEED_DECODE
            request.text_open = True
            request.text_ready = request.text_fed = request.frames_generated
    return scheduler


def time_decisions(requests: int, repetitions: int, calls: int, module=current_scheduler,
                   text_waiting: float = 0.0) -> dict:
    now = 1000.0
    samples_us = []
    for rep in range(repetitions):
        scheduler = loaded_scheduler(requests, seed=rep, now=now, module=module, text_waiting=text_waiting)
        # Untimed: a scheduler that keeps readiness reads the holders admitted here all at once in its first
        # decision; the engine admits them one by one, each read once.
        scheduler.decide(now)
        for _ in range(calls):
            started = time.perf_counter()
            batch = scheduler.decide(now)
            samples_us.append((time.perf_counter() - started) * 1e6)
            assert batch is not None
    samples_us.sort()
    return {"requests": requests, "text_waiting": text_waiting, "decisions": len(samples_us),
            "median_us": round(statistics.median(samples_us), 1),
            "p95_us": round(samples_us[int(0.95 * (len(samples_us) - 1))], 1)}


def load_baseline(path: str):
    """A scheduler module from a file (an earlier revision), importing this package's request module."""
    spec = importlib.util.spec_from_file_location("tts_backend.engine._baseline_scheduler", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def compare(requests: int, baseline, rounds: int, repetitions: int, calls: int, text_waiting: float = 0.0) -> dict:
    medians = {"baseline": [], "current": []}
    p95s = {"baseline": [], "current": []}
    for _ in range(rounds):
        for name, module in (("baseline", baseline), ("current", current_scheduler)):
            row = time_decisions(requests, repetitions, calls, module, text_waiting)
            medians[name].append(row["median_us"])
            p95s[name].append(row["p95_us"])
    return {"requests": requests, "text_waiting": text_waiting, "rounds": rounds,
            "baseline_median_us": round(statistics.median(medians["baseline"]), 1),
            "current_median_us": round(statistics.median(medians["current"]), 1),
            "baseline_p95_us": round(statistics.median(p95s["baseline"]), 1),
            "current_p95_us": round(statistics.median(p95s["current"]), 1), "round_medians_us": medians}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", default="32,64,128", help="comma-separated slot-holder counts")
    parser.add_argument("--repetitions", type=int, default=10, help="populations per count (seeds 0..R-1)")
    parser.add_argument("--calls", type=int, default=30, help="decisions timed per population")
    parser.add_argument("--baseline", help="a scheduler.py of another revision to compare against, interleaved")
    parser.add_argument("--rounds", type=int, default=6, help="with --baseline: alternations per count")
    parser.add_argument("--mixes", default="playing", help="comma-separated: playing, text (streams waiting for text)")
    parser.add_argument("--text-waiting", type=float, default=0.5, help="the text mix's share waiting for text")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.requests.split(",")]
    mixes = [{"playing": 0.0, "text": args.text_waiting}[mix] for mix in args.mixes.split(",")]
    result = {"tool": "bench/scheduler_cost.py", "command": " ".join(["python", "bench/scheduler_cost.py", *(sys.argv[1:] if argv is None else argv)]),
              "python": platform.python_version(), "machine": platform.machine(),
              "cpus": os.cpu_count()}
    if args.baseline:
        baseline = load_baseline(args.baseline)
        result["rows"] = [compare(n, baseline, args.rounds, args.repetitions, args.calls, share)
                          for share in mixes for n in counts]
        for row in result["rows"]:
            print(f"{row['requests']:4d} requests, {row['text_waiting']:.0%} waiting for text: decide "
                  f"{row['baseline_median_us']:6.1f} / {row['baseline_p95_us']:6.1f} us (baseline) -> "
                  f"{row['current_median_us']:6.1f} / {row['current_p95_us']:6.1f} us (current), median / p95, "
                  f"median of {row['rounds']} rounds")
    else:
        result["rows"] = [time_decisions(n, args.repetitions, args.calls, text_waiting=share)
                          for share in mixes for n in counts]
        for row in result["rows"]:
            print(f"{row['requests']:4d} requests, {row['text_waiting']:.0%} waiting for text: decide "
                  f"{row['median_us']:7.1f} us median, "
                  f"{row['p95_us']:7.1f} us p95")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
