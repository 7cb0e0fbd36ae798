"""Cost of the forced aligner (word timestamps) per sentence: wall time per batch, and the ops it runs.

    python bench/aligner_cost.py --size tiny                           # CPU, a tiny random checkpoint
    python bench/aligner_cost.py --model /tmp/aligner --device cuda    # the full-size random one on a GPU
    python bench/aligner_cost.py --model /tmp/aligner --device cuda --contend-ms 2 --output aligner_cost.json
    python bench/aligner_cost.py --size tiny --process --contend-ms 2   # the hand-over to an aligner process

On CUDA every batch size is measured captured (CUDA graphs of the bucketed passes, ForcedAligner.capture) and
eagerly (the same padded passes, op by op); --capture on|off picks one.

Each batch holds --batches sentences of --seconds of speech-like audio (int16 at the TTS rate, 24 kHz, as the
Qwen3 backend hands it over) with about 2.7 words per second of text. Per batch size: the median wall time of
`ForcedAligner.align` over --repeats runs after two warm-up runs (the device synchronised after each), per
batch and per sentence; the aten ops it dispatches from Python (every op the CPU hands to the device is a
kernel launch, or several, on a GPU; a CUDA graph's replay counts as none) per batch and per sentence, and how
many of those wait for the device (nonzero, item: a host synchronisation each). On CUDA also the device kernels
run (torch.profiler) and the synchronising calls (torch.cuda.set_sync_debug_mode's warnings).

--contend-ms N: the same runs again beside a thread standing in for the speech engine's (pure Python holding
the GIL N ms at a time, then a short sleep that releases it, as a step loop does between launches). Reported:
the aligner's time under that contention, and the share of the stand-in's work lost while the aligner ran. An
aligner thread that launches thousands of ops per batch waits for the GIL at each, and takes it from the
engine's thread as often.

--process: also the same batches through an aligner process (tts_backend/aligner/process.py), as the server
hands them over: the wall time per batch from hand-over to words back, and what the hand-over costs the
serving process (its CPU time per sentence: the event loop's put, the queue's feeder thread pickling the
audio into the pipe, the reader thread taking the words back), with --contend-ms the stand-in's work lost.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tts_backend.aligner import AlignRequest, load_aligner

TTS_RATE = 24000
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches near "
         "our river bank today").split()
# Ops that copy a device value to the host and so wait for everything queued before them.
SYNC_OPS = {"nonzero", "_local_scalar_dense", "item", "masked_select", "unique", "_unique2"}


def speech_like(seconds: float, seed: int) -> np.ndarray:
    n = int(round(seconds * TTS_RATE))
    t = np.arange(n) / TTS_RATE
    rng = np.random.default_rng(seed)
    envelope = np.clip(np.sin(2 * np.pi * (2.5 + seed % 3) * t), 0, None) ** 2
    tone = np.sin(2 * np.pi * (140 + 60 * np.sin(t * (1 + seed))) * t)
    signal = 0.5 * envelope * (0.7 * tone + 0.3 * rng.standard_normal(n))
    return np.round(np.clip(signal, -1, 1) * 32767).astype(np.int16)


def requests(count: int, seconds: float) -> list[AlignRequest]:
    words = max(1, round(2.7 * seconds))
    out = []
    for i in range(count):
        text = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words)).capitalize() + "."
        # Lengths differ a little, as real sentences do, so batches pad.
        out.append(AlignRequest(speech_like(seconds * (1 + 0.05 * (i % 4)), i), TTS_RATE, text))
    return out


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class EngineStandIn:
    """A thread that holds the GIL `hold_ms` at a time in Python, then sleeps 0.1 ms (releasing it)."""

    def __init__(self, hold_ms: float) -> None:
        self.hold_s = hold_ms / 1000
        self.work = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            until = time.perf_counter() + self.hold_s
            while time.perf_counter() < until:
                self.work += 1
            time.sleep(0.0001)

    def __enter__(self) -> "EngineStandIn":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def rate(self, seconds: float) -> float:
        """Work per second over the next `seconds`."""
        before, started = self.work, time.perf_counter()
        time.sleep(seconds)
        return (self.work - before) / (time.perf_counter() - started)


def timed_runs(aligner, batch: list[AlignRequest], repeats: int, device: torch.device) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        aligner.align(batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return times


def kernel_count(aligner, batch: list[AlignRequest]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        aligner.align(batch)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def host_syncs(aligner, batch: list[AlignRequest]) -> int:
    """Synchronising CUDA calls (copies to pageable host memory, .item(), nonzero...), as torch warns of them."""
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            aligner.align(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum(1 for w in caught if "synchroniz" in str(w.message))


def measure(aligner, size: int, seconds: float, repeats: int, device: torch.device, contend_ms: float | None,
            captured: bool = False) -> dict:
    batch = requests(size, seconds)
    timed_runs(aligner, batch, 2, device)  # warm-up: allocator, kernels chosen, graphs replayed once
    times = timed_runs(aligner, batch, repeats, device)
    counter = OpCounter()
    with counter:
        aligner.align(batch)
    ops = sum(counter.ops.values())
    syncs = sum(n for name, n in counter.ops.items() if name in SYNC_OPS)
    ms = 1000 * statistics.median(times)
    row = {"batch": size, "captured": captured, "ms_per_batch": round(ms, 2), "ms_per_sentence": round(ms / size, 2),
           "ops_per_batch": ops, "ops_per_sentence": round(ops / size, 1), "sync_ops_per_batch": syncs,
           "top_ops": dict(counter.ops.most_common(8))}
    if captured:  # the graphs' words against the same padded passes run op by op
        graphs, aligner.graphs = aligner.graphs, None
        try:
            eager = aligner.align(batch)
        finally:
            aligner.graphs = graphs
        row["same_words_as_eager"] = aligner.align(batch) == eager
    if device.type == "cuda":
        row["kernels_per_batch"] = kernel_count(aligner, batch)
        row["host_syncs_per_batch"] = host_syncs(aligner, batch)
    if contend_ms is not None:
        with EngineStandIn(contend_ms) as engine:
            alone = engine.rate(0.5)
            rates, contended = [], []
            for _ in range(repeats):
                before, started = engine.work, time.perf_counter()
                contended += timed_runs(aligner, batch, 1, device)
                rates.append((engine.work - before) / (time.perf_counter() - started))
        ms_contended = 1000 * statistics.median(contended)
        row.update({"contended_ms_per_batch": round(ms_contended, 2),
                    "contended_ms_per_sentence": round(ms_contended / size, 2),
                    # As handover() reports it: a stand-in that ran faster beside the aligner than alone (a busy
                    # machine's noise in the 0.5 s baseline) lost nothing, not a negative share.
                    "engine_work_lost": round(max(0.0, 1 - statistics.median(rates) / alone), 3)})
    return row


def handover(folder: Path, args, sizes: list[int], dtype: str, device: torch.device) -> list[dict]:
    """Each batch size through an AlignerProcess: `size` sentences handed over at once, awaited together."""
    import asyncio
    import resource

    from tts_backend.aligner.process import AlignerProcess

    def cpu_s() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    async def run_batches(process: AlignerProcess, batch: list[AlignRequest], count: int) -> list[float]:
        times = []
        for _ in range(count):
            started = time.perf_counter()
            await asyncio.gather(*(process.align(r) for r in batch))
            times.append(time.perf_counter() - started)
        return times

    process = AlignerProcess(str(folder), str(device), dtype, max_batch=max(sizes), torch_threads=args.threads or 2)
    rows = []
    try:
        process.wait_ready()
        for size in sizes:
            batch = requests(size, args.seconds)
            asyncio.run(run_batches(process, batch, 2))  # warm-up
            before = cpu_s()
            times = asyncio.run(run_batches(process, batch, args.repeats))
            cpu = cpu_s() - before
            ms = 1000 * statistics.median(times)
            row = {"batch": size, "ms_per_batch": round(ms, 2), "ms_per_sentence": round(ms / size, 2),
                   "serving_cpu_ms_per_sentence": round(1000 * cpu / (size * args.repeats), 3)}
            if args.contend_ms is not None:
                with EngineStandIn(args.contend_ms) as engine:
                    alone = engine.rate(0.5)
                    before_work, started = engine.work, time.perf_counter()
                    asyncio.run(run_batches(process, batch, args.repeats))
                    rate = (engine.work - before_work) / (time.perf_counter() - started)
                row["engine_work_lost"] = round(max(0.0, 1 - rate / alone), 3)
            rows.append(row)
    finally:
        process.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--model", type=Path, help="a Qwen3-ForcedAligner folder (bench/make_checkpoint.py --aligner)")
    where.add_argument("--size", choices=["tiny", "tiny-windowed", "0.6b"], default="tiny",
                       help="without --model: write a random checkpoint of this size to a temporary folder")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--batches", default="1,4,16", help="sentences per batch, comma-separated")
    parser.add_argument("--seconds", type=float, default=3.0, help="audio per sentence")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--contend-ms", type=float, default=None,
                        help="also run beside an engine stand-in holding the GIL this long at a time")
    parser.add_argument("--capture", choices=["both", "on", "off"], default="both",
                        help="CUDA graphs: measure with and without (CUDA only; the CPU runs eagerly)")
    parser.add_argument("--process", action="store_true", help="also through an aligner process (the hand-over)")
    parser.add_argument("--output", type=Path, help="write the report as JSON here")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model
        if folder is None:
            from tts_backend.aligner.testing.checkpoint import write_aligner_checkpoint

            folder = write_aligner_checkpoint(Path(tmp) / "aligner", args.size, seed=0)
        started = time.perf_counter()
        aligner = load_aligner(folder, device, dtype)
        load_s = time.perf_counter() - started
        sizes = [int(b) for b in args.batches.split(",")]
        modes = [False] if device.type != "cuda" else {"both": [False, True], "on": [True], "off": [False]}[args.capture]
        rows, capture_s = [], None
        for captured in modes:
            if captured:
                started = time.perf_counter()
                aligner.capture(max(sizes))
                capture_s = time.perf_counter() - started
                if aligner.graphs is None:  # the capture failed (logged): no captured rows to report
                    print("capturing the aligner failed: see the log above", file=sys.stderr)
                    capture_s = "failed"
                    continue
            rows += [measure(aligner, size, args.seconds, args.repeats, device, args.contend_ms, captured)
                     for size in sizes]
        del aligner
        process_rows = (handover(folder, args, sizes, str(dtype).removeprefix("torch."), device)
                        if args.process else None)
    report = {
        "command": " ".join(["python", "bench/aligner_cost.py", *(argv if argv is not None else sys.argv[1:])]),
        "checkpoint": str(args.model) if args.model else f"random {args.size}",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__, "seconds_per_sentence": args.seconds,
        "load_s": round(load_s, 2), "capture_s": round(capture_s, 2) if isinstance(capture_s, float) else capture_s, "rows": rows,
    }
    if process_rows is not None:
        report["process_rows"] = process_rows
    print(table(report))
    if args.output:
        args.output.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


def table(report: dict) -> str:
    contended = "contended_ms_per_batch" in report["rows"][0]
    head = "| batch | captured | ms / batch | ms / sentence | ops / batch | ops / sentence | syncing ops |"
    if "kernels_per_batch" in report["rows"][0]:
        head += " kernels / batch | host syncs / batch |"
    if contended:
        head += " ms / batch, contended | engine work lost |"
    lines = [f"{report['checkpoint']} on {report['device']}, {report['dtype']}, {report['seconds_per_sentence']} s"
             " per sentence", "", head, "|" + "---|" * (head.count("|") - 1)]
    for r in report["rows"]:
        line = (f"| {r['batch']} | {'yes' if r.get('captured') else 'no'} | {r['ms_per_batch']} | {r['ms_per_sentence']} | {r['ops_per_batch']} | "
                f"{r['ops_per_sentence']} | {r['sync_ops_per_batch']} |")
        if "kernels_per_batch" in r:
            line += f" {r['kernels_per_batch']} | {r['host_syncs_per_batch']} |"
        if contended:
            line += f" {r['contended_ms_per_batch']} | {100 * r['engine_work_lost']:.0f} % |"
        lines.append(line)
    if report.get("process_rows"):
        lines += ["", "Through an aligner process (hand-over, words back):", "",
                  "| batch | ms / batch | ms / sentence | serving process CPU ms / sentence | engine work lost |",
                  "|---|---|---|---|---|"]
        for r in report["process_rows"]:
            lost = r.get("engine_work_lost")
            lines.append(f"| {r['batch']} | {r['ms_per_batch']} | {r['ms_per_sentence']} | "
                         f"{r['serving_cpu_ms_per_sentence']} | {'-' if lost is None else f'{100 * lost:.0f} %'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
