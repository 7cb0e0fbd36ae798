"""What a failover's resume costs the engine that takes the streams over (issue 33), split where the time goes.

An H100 kill run (bench/engine_load.py --tcp-workers 2 --kill-worker-at 12, 20 requests/s) paused every moved
stream for 101 ms: about 23 ms from the loss to the survivor's resume call, 54 ms in the resume of 7 requests
(its host time: 23 ms queuing the codec priming, 19 ms the Talker pass; one request alone took 9 ms), then
25 ms to the first chunk. This bench takes the survivor's part alone, in one process, with the engine as served:

    python bench/resume_cost.py --model /tmp/ckpt --output resume_cost.json
    bash bench/h200.sh setup resumecost

For each --streams count N and --beside count B: N requests run whole, each cut after its --cut-chunk'th chunk;
then B long requests start and, once they all speak, the N cut requests are submitted together, resumed from
their delivered codes. Per case the report gives, in ms:
  admission_ms     the first submit to the start of the runner's resume call (the scheduler's wait);
  resume_ms        the resume call's host time, and `resume_log`, the runner's own split of it;
  after_ms         the resume call's end to each request's first audio (the first chunk's frames and codec);
  first_audio_ms   each request's submit to its first audio (what the listener's pause adds up from);
  repeats          each of the --repeats runs' resume calls and first audio: the first run of a shape in the
                   process is what a failover's survivor meets; the later ones are warm;
  profile, profile_cumulative   the resume call's hottest functions on the engine thread by their own and by
                   their cumulative time (cProfile, of the last of --repeats runs).
Runs on the CPU with a tiny checkpoint too (tests/test_bench_resume_cost.py).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import logging
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.resume_check import add_engine_arguments, device_report, read_prompts, report_of, serving  # noqa: E402


class ResumeTimer:
    """Times and profiles the runner's resume calls on the engine thread (wraps runner._resume)."""

    def __init__(self, runner) -> None:
        self.calls: list[dict] = []
        self.profile: pstats.Stats | None = None
        self.profiling = False
        inner = runner._resume

        def timed(requests):
            profiler = cProfile.Profile() if self.profiling else None
            started = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            try:
                return inner(requests)
            finally:
                if profiler is not None:
                    profiler.disable()
                    self.profile = pstats.Stats(profiler)
                self.calls.append({"start": started, "end": time.perf_counter(), "requests": len(requests)})

        runner._resume = timed


class LogKeeper(logging.Handler):
    """The runner's 'resumed N requests ...' lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("resumed "):
            self.lines.append(message)


def hottest(stats: pstats.Stats, top: int, key: str = "own_ms") -> list[dict]:
    rows = []
    for (path, line, name), (_calls, count, own, cumulative, _callers) in stats.stats.items():
        rows.append({"function": f"{Path(path).name}:{line}({name})", "calls": count,
                     "own_ms": round(own * 1000, 2), "cumulative_ms": round(cumulative * 1000, 2)})
    rows.sort(key=lambda r: r[key], reverse=True)
    return rows[:top]


async def first_audio(backend, request, submitted: list[float]) -> float | None:
    submitted.append(time.perf_counter())
    async for chunk in backend.synthesize(request):
        if chunk.pcm:
            return time.perf_counter()
    return None


async def drain(backend, request, speaking: asyncio.Event, count: list[int], need: int) -> None:
    first = True
    async for chunk in backend.synthesize(request):
        if chunk.pcm and first:
            first = False
            count[0] += 1
            if count[0] >= need:
                speaking.set()


async def whole(backend, request) -> list[bytes]:
    return [chunk.codes async for chunk in backend.synthesize(request) if chunk.codes]


async def case(backend, timer: ResumeTimer, logs: LogKeeper, texts: list[str], long_text: str, n: int, b: int,
               cut_chunk: int, profile: bool, top: int) -> dict:
    from tts_backend.base import SynthesisRequest

    voice = backend.default_voice
    runs = await asyncio.gather(*(whole(backend, SynthesisRequest(text=t, voice=voice, seed=100 + i))
                                  for i, t in enumerate(texts[:n])))
    cut = [b"".join(codes[: min(cut_chunk, len(codes) - 1)]) for codes in runs]
    speaking, count = asyncio.Event(), [0]
    background = [asyncio.create_task(drain(backend, SynthesisRequest(text=long_text, voice=voice, seed=900 + i),
                                            speaking, count, b)) for i in range(b)]
    if b:
        await speaking.wait()
    timer.calls.clear()
    logs.lines.clear()
    timer.profiling = profile
    submitted: list[float] = []
    heard = await asyncio.gather(*(first_audio(backend, SynthesisRequest(text=t, voice=voice, seed=100 + i,
                                                                          resume_codes=codes), submitted)
                                   for i, (t, codes) in enumerate(zip(texts, cut))))
    timer.profiling = False
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    calls = list(timer.calls)
    frames = [len(codes) // (2 * backend.codebooks) for codes in cut]
    first, last = min(submitted), (calls[-1]["end"] if calls else None)
    entry = {
        "streams": n, "beside": b, "frames": frames, "resume_calls": len(calls),
        "admission_ms": round((calls[0]["start"] - first) * 1000, 2) if calls else None,
        "resume_ms": [round((c["end"] - c["start"]) * 1000, 2) for c in calls],
        "after_ms": sorted(round((t - last) * 1000, 2) for t in heard if t is not None) if last else None,
        "first_audio_ms": sorted(round((t - s) * 1000, 2) for t, s in zip(heard, submitted) if t is not None),
        "resume_log": list(logs.lines),
    }
    if profile and timer.profile is not None:
        entry["profile"] = hottest(timer.profile, top)
        entry["profile_cumulative"] = hottest(timer.profile, top, "cumulative_ms")
    return entry


async def run(args) -> dict:
    prompts = read_prompts(args.prompts)
    rng = random.Random(args.seed)
    texts = rng.sample(prompts, max(args.streams))
    long_text = " ".join(rng.sample(prompts, 4))
    logs = LogKeeper()
    logging.getLogger("tts_backend").addHandler(logs)
    try:
        async with serving(args) as backend:
            runner = backend.engine.runner
            timer = ResumeTimer(runner)
            report = {**device_report(runner), "cut_chunk": args.cut_chunk, "cases": []}
            for b in args.beside:
                for n in args.streams:
                    entries = [await case(backend, timer, logs, texts, long_text, n, b, args.cut_chunk,
                                          profile=(i == args.repeats - 1), top=args.top) for i in range(args.repeats)]
                    entry = entries[-1]
                    entry["first_audio_ms_median_over_repeats"] = statistics.median(
                        max(e["first_audio_ms"]) for e in entries if e["first_audio_ms"])
                    # Every repeat's resume calls: the process's first resume of a shape is the one a failover's
                    # survivor meets (its first launches), the later ones are warm.
                    entry["repeats"] = [{"resume_ms": e["resume_ms"], "resume_log": e["resume_log"],
                                         "first_audio_ms": e["first_audio_ms"]} for e in entries]
                    report["cases"].append(entry)
                    print_case(entry)
            return report
    finally:
        logging.getLogger("tts_backend").removeHandler(logs)


def print_case(entry: dict) -> None:
    print(f"N={entry['streams']} beside={entry['beside']}: frames {entry['frames']}, admission "
          f"{entry['admission_ms']} ms, resume {entry['resume_ms']} ms, then first audio after {entry['after_ms']} "
          f"ms; first audio {entry['first_audio_ms']} ms", flush=True)
    for line in entry["resume_log"]:
        print("   ", line, flush=True)
    for row in entry.get("profile_cumulative", [])[:15] + entry.get("profile", [])[:12]:
        print(f"    {row['own_ms']:8.2f} own {row['cumulative_ms']:8.2f} cum {row['calls']:6d}x {row['function']}",
              flush=True)


def numbers(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_arguments(parser)
    parser.add_argument("--streams", type=numbers, default=[1, 8], help="resumed together, e.g. 1,8")
    parser.add_argument("--beside", type=numbers, default=[0, 8], help="long requests speaking meanwhile, e.g. 0,8")
    parser.add_argument("--cut-chunk", type=int, default=3, help="chunks delivered before the cut")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case (the last is profiled)")
    parser.add_argument("--top", type=int, default=25, help="functions in each profile")
    return parser


def main(argv: list[str] | None = None) -> int:
    report_of(run, build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
