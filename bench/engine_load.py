"""Open-loop load through the gateway's WebSocket with the Qwen3 engine behind it, rate by rate until it fails.

    python bench/engine_load.py --model /tmp/qwen3-1.7b-random --rates 1,10,20,40,60,80 \\
        --warmup 10 --duration 30 --output bench/results/engine_load_h200.json

Starts `voxgate serve --backend qwen3 --model PATH` (CUDA graphs captured at start-up; the gateway reports
ready only after capture and a warm-up request), then runs bench/loadgen.py's open-loop Poisson client at
each rate in turn and stops after the first rate that fails (any underrun, error, incomplete request, or
p95 audible TTFA above --fail-ttfa-ms). Random weights never end on their own, so each request is capped at
the frames its text takes at 15 characters per second (bench/README.md); with random weights the audio is
noise, so audible and first-playable TTFA are reported side by side. GPU memory in use is sampled at each
rate with nvidia-smi.

Where the engine runs:

    (default)          in the gateway's process: `voxgate serve --backend qwen3 --model PATH`
    --worker           one `voxgate worker` on a Unix socket, the gateway on `--backend remote -o socket=PATH`
    --tcp-workers N    N `voxgate worker` processes on the one GPU, each listening on tcp://127.0.0.1:<free
                       port> with a shared token (a random one written to a temporary file, mode 0600; only
                       its path appears in the commands, the report and the logs) and a health port, each
                       with max_active = 128 // N KV slots (the in-process run's slots shared out), and the
                       gateway on `--backend remote -o workers=tcp://127.0.0.1:P1,... -o token_file=FILE`.
                       Ready means every worker's /ready, the gateway's /ready, and (where the gateway
                       exports voxgate_pool_workers) N workers ready in its pool; a worker that exits first
                       fails the run at once. Each rate's entry adds `workers`: per worker, the engine
                       breakdown and requests by outcome read from that worker's own /metrics.
    --gpus LIST        ONE `voxgate worker --gpus LIST` launcher (tts_backend/remote/launcher.py: one child per
                       GPU with CUDA_VISIBLE_DEVICES set, ports counted up from one base), each child with all
                       max_active = 128 slots (a GPU of its own), on loopback TCP with the token file, behind
                       the gateway's static pool naming every child; each child's PID is read from /proc (the
                       launcher's children, told apart by the CUDA_VISIBLE_DEVICES it gave each). Its log is
                       FILE with suffix .workers.log (the children share the launcher's output).

A worker killed or drained mid-run (a pool of two or more): --kill-worker-at S SIGKILLs worker 1 (with --gpus, the
first GPU's child, not the launcher), --drain-worker-at S SIGTERMs it, S seconds into the first rate (or the first
moment within 5 s more that the gateway's pool runs a stream on it while a listener plays). That rate's entry adds
`killed_worker` / `drained_worker`: when it went and the streams open on it then, the gateway's pauses the pool
logged (`pause_ms`: from a worker's loss to the stream's next audio elsewhere; p50/p99/max), what the listeners
heard (`listeners_silence_ms`: the silence of each stream whose listener was playing at the signal, from its first
audio to the end of its zero pre-buffer playback, on either worker, in the 2 s after; the audio delivered ahead
covers part of the gateway's pause or all of it), bench/fleet_sim.py's client-side pause of the streams that moved
(`client_pause_across_ms`: the gap across the signal less the stream's usual gap), the pool's failovers,
hand-overs and resumes from codes, the requests cut (audio had begun and did not end whole) and refused (failed
before any audio), and for a drain whether the worker exited and `no_stream_cut`.

The agent workload (bench/README.md): --agent-sentences N --words-per-s R sends each session's reply of N
prompts one word per input.text; each rate then reports the audible TTFA from the first word and from the
first sentence's last word, and underruns over whole replies. --granularity sets the sessions'
split_granularity; --keep-going runs every rate even after one fails (a sentence-split run's first-word TTFA
is over --fail-ttfa-ms by design, yet its rates are wanted beside the token-split run's).

Cloned voices and word timestamps (issue 23), with a Base checkpoint (bench/make_checkpoint.py --model-type base)
and, for timestamps, `-o aligner=DIR` (bench/make_checkpoint.py --aligner):

    --clone x_vector|icl   once ready, register one voice per --clone-seconds clip (3,10,30 s of a synthetic voiced
                           signal) through POST /v1/audio/voices, timing each (`voice_add` in the report; the
                           first of each length is also timed again, to separate a cold first clone from the
                           steady cost), then run the load in the voice of the --clone-voice-s clip (10 s)
    --timestamps sync|async  every session asks for word timestamps (timestamp_type "word") in that transport;
                           each rate's entry adds the aligner's counters where the backend exports them

With --log FILE the workers log beside it: FILE with suffix .worker.log (--worker), .worker1.log,
.worker2.log, ... (--tcp-workers) or .workers.log (--gpus). On the H200: `LOAD_ARGS="--tcp-workers 2" bash bench/h200.sh setup
load:10,20` (bench/h200.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen import (
    DEFAULT_PROMPTS,
    GRANULARITIES,
    ClientOptions,
    Playing,
    RunPlan,
    Workload,
    accelerator,
    across_seeds,
    add_agent_arguments,
    add_output_argument,
    check_agent_arguments,
    load_prompts,
    markdown_table,
    nearest_rank,
    run_load,
    sentences_per_request,
    write_report,
)
from bench.ports import consecutive_free_ports, free_port
from tts_backend.remote.launcher import gpu_list

ROOT = Path(__file__).resolve().parents[1]

# Backend shapes for one-sentence ARCTIC prompts (prompt + frames stay under 256 positions): fewer graphs to
# capture before the gateway reports ready. 128 KV slots: at 40 RPS a request holds its slot for 3-5 s
# (generation, then its last codec chunks), so 64 slots fill up and arrivals queue for one.
BENCH_MAX_ACTIVE = 128
BENCH_MAX_LEN = 512
# No batch buckets of 1, as the runner's defaults (Qwen3RunnerConfig.decode_buckets says why).
BENCH_RUNNER_OPTIONS = {"attend_buckets": [128, 256], "decode_buckets": [2, 4, 8, 16, 24, 32, 48, 64, 96, 128],
                        "prefill_batch_buckets": [2, 4, 8], "prefill_len_buckets": [32, 64]}


def combine_seeds(summaries: list[dict]) -> dict:
    """One rate's runs under several seeds, as bench/README.md reports them: each latency metric is the
    median across seeds of each seed's percentile; counts (requests, underruns, failures) add up; a rate
    passes only if every seed passed."""
    if len(summaries) == 1:
        return summaries[0]
    combined = across_seeds(summaries)
    for key in ("requests", "scheduled", "completed", "failed", "underrun_events", "underrun_requests"):
        combined[key] = sum(s[key] for s in summaries)
    combined["total_stall_s"] = sum(s["total_stall_s"] for s in summaries)
    combined["longest_stall_s"] = max(s["longest_stall_s"] for s in summaries)
    combined["max_in_flight"] = max(s["max_in_flight"] for s in summaries)
    combined["fail_reasons"] = [reason for s in summaries for reason in s["fail_reasons"]]
    combined["warnings"] = sorted({w for s in summaries for w in s.get("warnings", [])})
    combined["seeds"] = len(summaries)
    return combined


def launcher_plan(gpus: list[str], backend_args: list[str], token_file: str, ports: set[int]) -> dict:
    """One `voxgate worker --gpus` launcher for `gpus` on loopback TCP with the token file: {"command": argv,
    "workers": [{"gpu", "address", "health", "log_suffix"}]}, child i listening on P+i with its health port
    on P+N+i (one block of 2N free ports, consecutive_free_ports). `backend_args`: the children's backend
    flags (--backend ... and its options), passed through by the launcher."""
    n = len(gpus)
    first = consecutive_free_ports(2 * n, ports)
    command = [sys.executable, "-m", "gateway.cli", "worker", "--gpus", ",".join(gpus), *backend_args,
               "--listen", f"tcp://127.0.0.1:{first}", "--token-file", token_file, "--health-port", str(first + n),
               "--worker-id", "bench", "--log-level", "info"]
    workers = [{"gpu": gpu, "address": f"tcp://127.0.0.1:{first + i}", "health": f"http://127.0.0.1:{first + n + i}",
                "log_suffix": ".workers.log"} for i, gpu in enumerate(gpus)]
    return {"command": command, "workers": workers}


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state, ppid, ...), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet waited for by its parent, does not)."""
    fields = _proc_stat(pid)
    return fields is not None and fields[0] != "Z"


def launcher_children(launcher_pid: int, gpus: list[str], timeout_s: float = 60.0) -> dict[str, int]:
    """{GPU: PID} of the worker processes a `voxgate worker --gpus` launcher started: the processes whose parent
    is the launcher (read from /proc), each matched to its GPU by the CUDA_VISIBLE_DEVICES the launcher gave it
    (/proc/PID/environ). Waits until every GPU has its child; raises if the launcher exits first or a GPU has
    none after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    found: dict[str, int] = {}
    while True:
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in found.values():
                continue
            fields = _proc_stat(int(entry))
            if fields is None or int(fields[1]) != launcher_pid:
                continue
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in environ:
                if item.startswith(b"CUDA_VISIBLE_DEVICES="):
                    gpu = item.split(b"=", 1)[1].decode()
                    if gpu in gpus:
                        found[gpu] = int(entry)
        if len(found) == len(gpus):
            return {gpu: found[gpu] for gpu in gpus}
        if not pid_alive(launcher_pid):
            raise RuntimeError(f"the worker launcher exited before it started every child (found {found})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the worker launcher's children for GPUs {gpus}: found only {found} "
                               f"after {timeout_s:.0f} s")
        time.sleep(0.1)


def pause_summary(pauses_ms: list[float] | None) -> dict | None:
    """p50 / p99 / max (nearest rank) of the listeners' pauses the pool logged, and how many."""
    if pauses_ms is None:
        return None
    if not pauses_ms:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    return {"n": len(pauses_ms), "p50": nearest_rank(pauses_ms, 50), "p99": nearest_rank(pauses_ms, 99),
            "max": max(pauses_ms)}


POOL_COUNTERS = ("failovers", "handovers", "resumed_from_codes", "drain_moves")


def pool_deltas(before: dict, after: dict) -> dict[str, int] | None:
    """The pool's voxgate_pool_* counters between two scrapes of the gateway: streams failed over (a worker lost
    them: cut, then sent again), handed over by a draining worker, gone on from their codes, and sessions moved
    off a draining worker. None where the gateway has no pool."""
    out: dict[str, int] = {}
    for name in POOL_COUNTERS:
        for sample in (f"voxgate_pool_{name}_total", f"voxgate_pool_{name}"):
            if (sample, ()) in after:
                out[name] = int(round(after[(sample, ())] - before.get((sample, ()), 0.0)))
                break
    return out or None


SIGNAL_GRACE_S = 5.0
# The silences a kill or drain caused: the listeners' underruns that begin within this long after the signal.
LISTENER_WINDOW_S = 2.0


def pool_streams(base: str, worker_id: str) -> int | None:
    """The streams the gateway's pool runs on worker `worker_id` now (voxgate_pool_streams); None if unknown."""
    try:
        counters = scrape_counters(base)
    except (OSError, ValueError):
        return None
    value = counters.get(("voxgate_pool_streams", (("worker", worker_id),)))
    return None if value is None else int(value)


def signal_worker(kind: str, at_s: float, pid: int, gpu: str | None, streams: Callable[[], int | None]) -> threading.Timer:
    """A timer that sends SIGKILL (`kind` "kill") or SIGTERM ("drain") to worker process `pid` `at_s` seconds
    from now, or, where `streams()` (the streams the gateway runs on that worker) says it has none then, at the
    first moment within SIGNAL_GRACE_S more that it has one: a kill or drain that hits no stream shows nothing
    (at a GPU's rates it has dozens). Its `sent` event is set once it has sent it, `sent_at_s` says when
    (seconds from the timer's start) and `streams_at_signal` what `streams()` said just before."""
    import signal as signals

    started = time.monotonic()

    def send() -> None:
        deadline = time.monotonic() + SIGNAL_GRACE_S
        while not (open_streams := streams()) and time.monotonic() < deadline:
            if timer.finished.is_set():  # cancelled (the run ended) while waiting for a stream: send nothing
                return
            time.sleep(0.02)
        timer.streams_at_signal = open_streams
        timer.sent_at_s = round(time.monotonic() - started, 3)
        timer.sent_at_perf = time.perf_counter()  # loadgen's clock, for the silences it caused
        print(f"{'SIGKILL' if kind == 'kill' else 'SIGTERM'} to worker pid {pid}"
              f"{f' (GPU {gpu})' if gpu is not None else ''} at {timer.sent_at_s:g} s, "
              f"{timer.streams_at_signal} streams open on it", flush=True)
        os.kill(pid, signals.SIGKILL if kind == "kill" else signals.SIGTERM)
        timer.sent.set()

    timer = threading.Timer(at_s, send)
    timer.sent = threading.Event()  # set once the signal went: a run shorter than at_s sends none
    timer.streams_at_signal = timer.sent_at_s = timer.sent_at_perf = None
    timer.daemon = True
    timer.start()
    return timer


def listeners_silences(requests: list[dict], at_perf: float | None, window_s: float = LISTENER_WINDOW_S) -> dict | None:
    """What the listeners heard of a kill or drain sent at `at_perf` (time.perf_counter()): every request whose
    listener was playing then (on either worker: the survivor's streams wait while it resumes the others), from
    its first audio to the end of loadgen's zero pre-buffer playback (its audio and its silences; a listener
    whose last bytes had come plays on), with the silence each heard in the `window_s` after (its underruns
    starting in the window, summed): n, how many heard any, p50 / p99 / max in ms. The pool's pause_ms is
    another thing: loss to next chunk at the gateway, which the audio already delivered ahead of the listener
    covers in part or in whole."""
    if at_perf is None:
        return None
    silences = []
    for r in requests:
        origin, ttfb = r.get("audio_origin_perf"), r.get("ttfb_s")
        if origin is None or ttfb is None:
            continue
        if not origin + ttfb <= at_perf < origin + ttfb + r.get("audio_s", 0.0) + r.get("total_stall_s", 0.0):
            continue
        heard = sum(length for at, length in r.get("stalls") or () if at_perf <= origin + at < at_perf + window_s)
        silences.append(1000 * heard)
    if not silences:
        return {"n": 0}
    return {"n": len(silences), "heard_any": sum(1 for x in silences if x > 0),
            "p50": round(nearest_rank(silences, 50), 1), "p99": round(nearest_rank(silences, 99), 1),
            "max": round(max(silences), 1), "window_s": window_s}


def pauses_across(requests: list[dict], at_perf: float | None, sessions: set[str]) -> dict | None:
    """bench/fleet_sim.py's client-side pause for each of `sessions` (those the pool failed over or handed
    over) that was receiving audio at `at_perf`: the gap between its last binary frame before the signal and its
    first after, less its usual gap (the median gap between its frames); n, p50 / p99 / max in ms. Unlike
    listeners_silences, it does not credit the audio delivered ahead: a stream whose buffer covered the gap
    still shows it."""
    if at_perf is None:
        return None
    pauses = []
    for r in requests:
        origin, arrivals = r.get("audio_origin_perf"), r.get("arrivals") or []
        if r.get("session_id") not in sessions or origin is None or len(arrivals) < 3:
            continue
        before = [a for a in arrivals if origin + a <= at_perf]
        after = [a for a in arrivals if origin + a > at_perf]
        if not before or not after:
            continue
        usual = statistics.median(b - a for a, b in zip(arrivals, arrivals[1:]))
        pauses.append(1000 * (after[0] - before[-1] - usual))
    if not pauses:
        return {"n": 0}
    return {"n": len(pauses), "p50": round(nearest_rank(pauses, 50), 1), "p99": round(nearest_rank(pauses, 99), 1),
            "max": round(max(pauses), 1)}


def disturbance_report(kind: str, at_s: float, gpu: str | None, pid: int, log_path: Path | None,
                       pool: dict | None, requests: list[dict], at_perf: float | None = None) -> dict:
    """What a --kill-worker-at / --drain-worker-at did: which worker, when, the listeners' pauses the pool
    logged (lost to the next audio of each stream), its counters, and the disturbed rate's requests (warm-up
    included; loadgen's per-request results) that failed, told apart: `requests_cut`, whose audio had begun
    and that did not end whole (an error, no session.done); `requests_refused`, that failed before any audio
    (the gateway refusing new sessions as overloaded while one worker carries the load of two is admission
    control, not a cut stream). For a drain, whether a stream was cut: a drained worker hands each open stream
    over (it goes on elsewhere from its codes) or finishes it, so a failover (a stream lost with its worker) or
    a request cut means one was."""
    failovers = pool_failovers(log_path) if log_path else None
    pauses = [pause for _, pause in failovers if pause is not None] if failovers is not None else None
    moved = {session for session, _ in failovers} if failovers is not None else None
    failed = [r for r in requests if not r["ok"]]
    cut = [r for r in failed if r["bytes"] > 0]
    entry = {"gpu": gpu, "pid": pid, "at_s": at_s, "failover_pause_ms": pauses, "pause_ms": pause_summary(pauses),
             "listeners_silence_ms": listeners_silences(requests, at_perf),
             "client_pause_across_ms": pauses_across(requests, at_perf, moved) if moved is not None else None,
             "pool": pool, "requests": len(requests), "requests_cut": len(cut),
             "requests_refused": len(failed) - len(cut),
             "failed_errors": sorted({e for r in failed for e in r["errors"]})}
    if kind == "drain":
        deadline = time.monotonic() + 30
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        entry["exited"] = not pid_alive(pid)
        entry["streams_cut"] = None if pool is None else pool.get("failovers")
        entry["no_stream_cut"] = bool(entry["exited"] and pool is not None and pool.get("failovers") == 0
                                      and not cut)
    return entry


def gpu_memory_mib() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return float(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def pool_failovers(log_path: Path) -> list[tuple[str, float | None]]:
    """The pool's `failover session=S ... pause_ms=X` lines in the gateway's log (a kill's failovers and a
    drain's hand-overs alike): each moved session, and its pause from the worker's death to the stream's
    first audio on another worker where the line has one."""
    import re

    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    found = []
    for line in re.finditer(r"failover session=(\S+) ([^\n]*)", text):
        pause = re.search(r"pause_ms=([0-9.]+)", line.group(2))
        found.append((line.group(1), float(pause.group(1)) if pause else None))
    return found


def pool_ready_workers(base: str) -> float | None:
    """voxgate_pool_workers{state="ready"} on the gateway's /metrics; None where the gateway has no such
    family (or /metrics does not answer)."""
    try:
        counters = scrape_counters(base)
    except (OSError, ValueError):
        return None
    for (name, labels), value in counters.items():
        if name == "voxgate_pool_workers" and dict(labels).get("state") == "ready":
            return value
    return None


def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float, log_path: Path | None = None,
               worker: subprocess.Popen | None = None, workers: list[subprocess.Popen] = (),
               worker_health: list[str] = (), pool_size: int = 0, worker_pids: dict[str, int] | None = None) -> float:
    """Seconds until the gateway (and every worker) is ready. `worker`: the one --worker process (or the
    --gpus launcher); `workers` and `worker_health`: the --tcp-workers processes and their health servers' base
    URLs, each of which must answer /ready; `worker_pids`: {GPU: PID} of a launcher's children, which are not
    ours to poll; `pool_size`: then wait (up to 60 s more) for that many ready workers in the gateway's pool,
    where its /metrics reports them. Any of the processes exiting first raises at once."""
    started = time.monotonic()
    watched = [("worker", worker)] if worker is not None else []
    watched += [(f"worker {i}", w) for i, w in enumerate(workers, 1)]
    ready_workers: set[int] = set()
    gateway_ready_at = None
    while time.monotonic() - started < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.returncode} before it was ready")
        for name, process in watched:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode} before it was ready")
        for gpu, pid in (worker_pids or {}).items():
            if not pid_alive(pid):
                raise RuntimeError(f"the worker of GPU {gpu} (pid {pid}) exited before it was ready")
        if log_path is not None and "backend failed to start" in log_path.read_text(errors="replace"):
            raise RuntimeError(f"the backend failed to start; see {log_path}")
        for i, health in enumerate(worker_health, 1):
            if i not in ready_workers and http_ok(health + "/ready"):
                ready_workers.add(i)
                print(f"worker {i} ready after {time.monotonic() - started:.1f} s", flush=True)
        if len(ready_workers) == len(worker_health):
            if gateway_ready_at is None and http_ok(base + "/ready"):
                gateway_ready_at = time.monotonic()
            if gateway_ready_at is not None:
                in_pool = pool_ready_workers(base) if pool_size else None
                if not pool_size or in_pool is None or in_pool >= pool_size:
                    return time.monotonic() - started
                if time.monotonic() - gateway_ready_at > 60:
                    raise RuntimeError(f"the gateway's pool has {in_pool:g} ready workers of {pool_size} "
                                       "60 s after it was ready")
        time.sleep(0.5)
    raise RuntimeError(f"gateway not ready after {timeout_s:.0f} s")


def scrape_counters(base: str) -> dict[tuple[str, tuple], float]:
    """The gateway's /metrics as {(sample name, sorted label items): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def engine_breakdown(before: dict, after: dict) -> dict | None:
    """What the engine did between two scrapes (voxgate_engine_* counters, in-process or from a worker):
    each section's share of the engine thread's wall time, batches and mean batch per stage, the scheduler's
    cost per decision, the codec's device time as a share of the wall time, and batches per urgency rule.
    None when the backend reports no engine counters."""
    def delta(name: str, label: str | None = None) -> dict[str, float]:
        out = {}
        for (sample, labels), value in after.items():
            if sample == name:
                key = dict(labels).get(label, "") if label else ""
                # summed: a pool of workers may export one series per worker for each label value
                out[key] = out.get(key, 0.0) + value - before.get((sample, labels), 0.0)
        return out

    sections = delta("voxgate_engine_thread_seconds_total", "section")
    wall = sum(sections.values())
    if not sections or wall <= 0:
        return None
    batches = delta("voxgate_engine_batches_total", "stage")
    items = delta("voxgate_engine_batch_items_total", "stage")
    decisions = delta("voxgate_engine_decisions_total").get("", 0.0)
    decide_calls = delta("voxgate_engine_decide_calls_total").get("", 0.0)
    decide_cpu = delta("voxgate_engine_decide_cpu_seconds_total").get("", 0.0)
    rules: dict[str, float] = {}
    for (sample, labels), value in after.items():
        if sample == "voxgate_engine_rule_batches_total":
            rule = dict(labels)["rule"]
            rules[rule] = rules.get(rule, 0.0) + value - before.get((sample, labels), 0.0)
    stages = {}
    for stage, count in sorted(batches.items()):
        thread = sections.get(f"runner.{stage}", 0.0) + sections.get(f"post.{stage}", 0.0)
        stages[stage] = {"batches": int(count), "mean_batch": items.get(stage, 0.0) / count if count else None,
                         "thread_share": thread / wall}
    return {
        "engine_wall_s": wall,
        "decisions": int(decisions),
        "stages": stages,
        "schedule_share": sections.get("schedule", 0.0) / wall,
        "idle_share": sections.get("idle", 0.0) / wall,
        "schedule_us_per_decision": sections.get("schedule", 0.0) / decisions * 1e6 if decisions else None,
        "decide_cpu_us": 1e6 * decide_cpu / decide_calls if decide_calls else None,  # the scheduler's own cost
        "codec_device_share": delta("voxgate_engine_codec_device_seconds_total").get("", 0.0) / wall,
        "rules": {rule: int(count) for rule, count in sorted(rules.items())},
        "voice_kv": voice_kv_breakdown(delta),
        "trimmed": trimmed_breakdown(delta),
        # Device passes that found no captured graph (GraphSet.uncaptured); None where the engine captures none.
        "uncaptured": {kind: int(n) for kind, n in sorted(delta("voxgate_engine_uncaptured_passes_total",
                                                                "kind").items())} or None,
    }


def trimmed_breakdown(delta) -> dict | None:
    """Leading silence the engine dropped (voxgate_engine_trimmed_*): how many requests had some, and how much
    each of them lost on average, in ms (a frame is 80 ms of audio). None where the engine reports none."""
    requests = delta("voxgate_engine_trimmed_requests_total")
    if not requests:
        return None
    n = int(requests.get("", 0.0))
    seconds = delta("voxgate_engine_trimmed_seconds_total").get("", 0.0)
    return {"requests": n, "ms_per_trimmed_request": 1000 * seconds / n if n else None}


def voice_kv_breakdown(delta) -> dict | None:
    """Cloned voices' prompt prefixes (voxgate_engine_voice_kv_*): requests whose prefix K/V was copied (hits)
    or prefilled (misses), evictions, and the prompt positions not prefilled, per hit and in all. None where
    the engine has no voice cache (not a Base checkpoint, or turned off)."""
    requests = delta("voxgate_engine_voice_kv_requests_total", "result")
    if not requests:
        return None
    hits, saved = int(requests.get("hit", 0.0)), int(delta("voxgate_engine_voice_kv_positions_saved_total").get("", 0))
    return {"hits": hits, "misses": int(requests.get("miss", 0.0)),
            "evictions": int(delta("voxgate_engine_voice_kv_evictions_total").get("", 0)),
            "positions_saved": saved, "positions_saved_per_hit": saved / hits if hits else None}


def aligner_breakdown(before: dict, after: dict, engine: dict | None) -> dict | None:
    """The forced aligner's work between two scrapes (voxgate_aligner_*): sentences, passes, mean seconds per
    sentence and per pass, and its thread's busy time as a share of the engine thread's wall time over the same
    window. None when the backend exports no aligner counters (no -o aligner=, or no timestamps asked)."""
    def delta(name: str) -> float | None:
        total = None
        for (sample, labels), value in after.items():
            if sample == name:
                total = (total or 0.0) + value - before.get((sample, labels), 0.0)
        return total

    sentences, batches = delta("voxgate_aligner_sentences_total"), delta("voxgate_aligner_batches_total")
    seconds = delta("voxgate_aligner_seconds_total")
    if sentences is None or batches is None or seconds is None:
        return None
    wall = engine["engine_wall_s"] if engine else None
    return {"sentences": int(sentences), "batches": int(batches), "seconds": seconds,
            "ms_per_sentence": seconds / sentences * 1000 if sentences else None,
            "ms_per_batch": seconds / batches * 1000 if batches else None,
            "mean_batch": sentences / batches if batches else None,
            "share_of_engine_wall": seconds / wall if wall else None}


def loop_lag_breakdown(before: dict, after: dict) -> dict | None:
    """The gateway's event-loop lag between two scrapes (voxgate_event_loop_lag_seconds): samples, how many
    were later than 5 / 25 / 100 ms, and the bucket bound the 99th percentile lies under, in ms. Whether the
    gateway's loop is what stalls under load (issue 22). None when /metrics has no such histogram."""
    buckets = bucket_deltas(before, after, "voxgate_event_loop_lag_seconds_bucket")
    if not buckets:
        return None
    count = buckets.get(float("inf"), 0.0)

    def over(bound_s: float) -> int:
        return int(round(count - buckets.get(bound_s, 0.0)))

    p99 = next((bound for bound in sorted(buckets) if buckets[bound] >= 0.99 * count), None) if count else None
    return {"samples": int(count), "over_5ms": over(0.005), "over_25ms": over(0.025), "over_100ms": over(0.1),
            "p99_under_ms": None if p99 is None or p99 == float("inf") else p99 * 1000}


def bucket_deltas(before: dict, after: dict, sample_name: str, **match: str) -> dict[float, float]:
    """Cumulative `le` bucket counts of one histogram-like family between two scrapes, summed over the series
    whose other labels equal `match` (a pool's workers each export their own)."""
    buckets: dict[float, float] = {}
    for (sample, labels), value in after.items():
        named = dict(labels)
        if sample == sample_name and "le" in named and all(named.get(k) == v for k, v in match.items()):
            bound = float(named["le"])
            buckets[bound] = buckets.get(bound, 0.0) + value - before.get((sample, labels), 0.0)
    return buckets


def bucket_quantiles(buckets: dict[float, float], quantiles=(0.5, 0.95, 0.99)) -> dict | None:
    """Quantiles (ms) read from cumulative bucket counts as Prometheus's histogram_quantile does: linear within
    the bucket the rank falls in (the last finite bound where it falls above every bound). None without
    samples."""
    bounds = sorted(buckets)
    count = buckets.get(float("inf"), buckets[bounds[-1]] if bounds else 0.0)
    if count <= 0:
        return None
    out = {"count": int(round(count))}
    for q in quantiles:
        rank, lower, below = q * count, 0.0, 0.0
        value = None
        for bound in bounds:
            if buckets[bound] >= rank:
                if bound == float("inf"):
                    value = lower
                else:
                    inside = buckets[bound] - below
                    value = lower + (bound - lower) * ((rank - below) / inside if inside > 0 else 1.0)
                break
            lower, below = bound, buckets[bound]
        out[f"p{round(q * 100):d}"] = None if value is None else round(value * 1000, 2)
    return out


def latency_split(before: dict, after: dict) -> dict:
    """Where a request's first audio spent its time between two scrapes, each from its own histogram: the
    engine's (arrival in the engine to the first chunk shipped, voxgate_engine_first_chunks; a worker's when
    the engine runs in one) and the gateway's (request or sentence released to its first audio byte sent,
    voxgate_ttfa_seconds, by transport), p50/p95/p99 in ms. Beside the client's own TTFA the differences are
    the worker link's and the client's shares. A part whose histogram is missing is None."""
    return {"engine_first_chunk_ms": bucket_quantiles(bucket_deltas(before, after, "voxgate_engine_first_chunks_total")),
            "gateway_ttfa_ms": {transport: bucket_quantiles(bucket_deltas(
                before, after, "voxgate_ttfa_seconds_bucket", transport=transport))
                for transport in ("http", "websocket")}}


def requests_by_outcome(before: dict, after: dict) -> dict[str, int]:
    """voxgate_engine_requests_total between two scrapes, by outcome."""
    out: dict[str, int] = {}
    for (sample, labels), value in after.items():
        if sample == "voxgate_engine_requests_total":
            outcome = dict(labels).get("outcome", "")
            out[outcome] = out.get(outcome, 0) + int(round(value - before.get((sample, labels), 0.0)))
    return dict(sorted(out.items()))


def bench_runner_options(overrides: dict | None = None) -> dict:
    """The bench's Qwen3RunnerConfig fields with the caller's on top, field by field: a what-if such as
    {"codec_in_flight": 1} keeps the bench's buckets instead of falling back to the runner's defaults."""
    return {**BENCH_RUNNER_OPTIONS, **(overrides or {})}


def engine_options(max_active: int, extra: list[str]) -> list[str]:
    """The backend options every run uses (as `-o KEY=VALUE` pairs), then the caller's -o items, which
    override them (a caller's runner_options JSON object field by field, bench_runner_options)."""
    runner_options = dict(BENCH_RUNNER_OPTIONS)
    rest = []
    for item in extra:
        key, _, value = item.partition("=")
        if key == "runner_options":
            runner_options = bench_runner_options({**runner_options, **json.loads(value)})
        else:
            rest += ["-o", item]
    return ["-o", "frame_cap_chars_per_second=15", "-o", f"max_active={max_active}", "-o",
            f"max_len={BENCH_MAX_LEN}", "-o", "runner_options=" + json.dumps(runner_options), *rest]


def worker_options(max_active: int, extra: list[str]) -> list[str]:
    """engine_options for a `voxgate worker` command line, which spells -o only as --option."""
    return ["--option" if a == "-o" else a for a in engine_options(max_active, extra)]


def remote_gateway_command(port: int, pool: list[str]) -> list[str]:
    """`voxgate serve --backend remote` on `port`, its pool of workers given by `pool`'s -o items."""
    return [sys.executable, "-m", "gateway.cli", "serve", "--backend", "remote", *pool, "--port", str(port),
            "--log-level", "info"]


def plan_processes(args: argparse.Namespace, port: int, ports: set[int], token_file: str | None = None) -> dict:
    """The commands of one run, without starting anything: {"gateway": argv, "workers": [{"command": argv,
    "address": listen address or None, "health": health base URL or None, "log_suffix": ...}]}; with --gpus,
    "launcher": the one `voxgate worker --gpus` argv, and each worker names its "gpu" instead of a command.
    `ports` holds the ports already handed out (the gateway's); worker ports are added to it."""
    python = [sys.executable, "-m", "gateway.cli"]
    if args.worker:
        socket_path = f"/tmp/voxgate-bench-{port}.sock"
        workers = [{"command": [*python, "worker", "--backend", "qwen3", "--model", args.model, "--device",
                                args.device, "--socket", socket_path,
                                *worker_options(BENCH_MAX_ACTIVE, args.option)],
                    "address": f"unix:{socket_path}", "health": None, "log_suffix": ".worker.log"}]
        gateway = remote_gateway_command(port, ["-o", f"socket={socket_path}"])
    elif args.gpus:
        if token_file is None:
            raise ValueError("--gpus needs a token file")
        launcher = launcher_plan(args.gpu_list, ["--backend", "qwen3", "--model", args.model, "--device", args.device,
                                                 *worker_options(worker_max_active(args), args.option)],
                                 token_file, ports)
        workers = launcher["workers"]
        gateway = remote_gateway_command(port, ["-o", "workers=" + ",".join(w["address"] for w in workers),
                                                "-o", f"token_file={token_file}"])
        return {"gateway": gateway, "workers": workers, "launcher": launcher["command"]}
    elif args.tcp_workers:
        if token_file is None:
            raise ValueError("--tcp-workers needs a token file")
        n = args.tcp_workers
        options = worker_options(max(1, BENCH_MAX_ACTIVE // n), args.option)
        workers = []
        for i in range(1, n + 1):
            listen_port, health_port = free_port(ports), free_port(ports)
            address = f"tcp://127.0.0.1:{listen_port}"
            workers.append({
                "command": [*python, "worker", "--backend", "qwen3", "--model", args.model, "--device", args.device,
                            "--listen", address, "--token-file", token_file, "--health-port", str(health_port),
                            "--worker-id", f"bench-worker{i}", "--log-level", "info", *options],
                "address": address, "health": f"http://127.0.0.1:{health_port}", "log_suffix": f".worker{i}.log"})
        gateway = remote_gateway_command(port, ["-o", "workers=" + ",".join(w["address"] for w in workers),
                                                "-o", f"token_file={token_file}"])
    else:
        workers = []
        gateway = [*python, "serve", "--backend", "qwen3", "--model", args.model, "--device", args.device,
                   "--port", str(port), "--log-level", "info", *engine_options(BENCH_MAX_ACTIVE, args.option)]
    return {"gateway": gateway, "workers": workers}


def cpu_worker_env(env: dict[str, str], workers: int) -> dict[str, str]:
    """The environment of each of `workers` CPU engines on this host: the cores shared out among them and one
    more share for the gateway and the load generator. Each OpenMP runtime otherwise starts a thread per core
    and spins its idle threads waiting for the next parallel region, so beside other busy processes an engine
    on the 2-core CI machine ran every frame 10-30 times slower, its pace passed the pool's limit and the
    gateway shed the run as overloaded. A caller's own OMP_NUM_THREADS is kept."""
    if "OMP_NUM_THREADS" in env:
        return env
    return dict(env, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // (max(1, workers) + 1))))


def worker_max_active(args: argparse.Namespace) -> int:
    """Each --tcp-workers engine's KV slots: the in-process run's shared out, unless -o max_active= says. A
    --gpus worker has a GPU of its own, so all of them."""
    slots = max(1, BENCH_MAX_ACTIVE // max(1, args.tcp_workers))
    for item in args.option:
        key, _, value = item.partition("=")
        if key.strip() == "max_active":
            slots = int(value)
    return slots


def write_token_file() -> Path:
    """A fresh random token in a file only this user can read, in a new temporary folder."""
    folder = Path(tempfile.mkdtemp(prefix="voxgate-bench-"))
    path = folder / "worker.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path


def stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(40)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def add_rate_arguments(parser: argparse.ArgumentParser, rates: str) -> None:
    """The rate sweep of the engine benches (this one, engine_profile.py, nari_load.py): each rate in turn, its
    warm-up, then its measured window."""
    parser.add_argument("--rates", default=rates, help="requests per second, comma separated")
    parser.add_argument("--warmup", type=float, default=10.0,
                        help="seconds of load per rate before the measured window")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds measured per rate")


def add_server_arguments(parser: argparse.ArgumentParser, log_help: str) -> None:
    """How a bench starts the gateway and its workers (this one, nari_load.py), and where their logs go."""
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--option", "-o", action="append", default=[], help="extra backend option KEY=VALUE")
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--log", type=Path, help=log_help)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    add_server_arguments(parser, "gateway log file (the workers' go beside it: .worker.log, .worker1.log, ...)")
    add_rate_arguments(parser, "1,10,20,40,60,80")
    parser.add_argument("--seed", type=int, action="append",
                        help="schedule seed; repeat for several runs per rate, reported as bench/README.md says "
                             "(the median across seeds of each seed's percentiles); default 0")
    parser.add_argument("--voice", default="ryan")
    parser.add_argument("--fail-ttfa-ms", type=float, default=100.0, help="p95 audible TTFA above this fails a rate")
    parser.add_argument("--keep-going", action="store_true",
                        help="run every rate even after one fails (to compare modes at the same rates)")
    add_agent_arguments(parser)
    parser.add_argument("--granularity", choices=GRANULARITIES,
                        help="the sessions' split_granularity (default: the gateway's, sentence)")
    parser.add_argument("--clone", choices=["x_vector", "icl"],
                        help="speak in a cloned voice of this kind (needs a Base checkpoint)")
    parser.add_argument("--clone-seconds", default="3,10,30", help="clip lengths registered with --clone")
    parser.add_argument("--clone-voice-s", type=float, default=10.0, help="the clip length whose voice is spoken")
    parser.add_argument("--timestamps", choices=["sync", "async"], help="ask every session for word timestamps")
    parser.add_argument("--variant", action="append", default=[], metavar="'LABEL FLAGS'",
                        help="after the main run, run again on the same server (no second start-up) with these "
                             "client flags instead: a label, then any of --rates --voice --clone --timestamps "
                             "--granularity --agent-sentences --words-per-s, e.g. 'ts-async --timestamps async "
                             "--rates 10,20,40'; repeatable; reported under `variants`")
    add_output_argument(parser)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--worker", action="store_true",
                       help="run the engine in a `voxgate worker` process and the gateway on --backend remote "
                            "(the deployment that keeps the engine thread and the event loop in separate "
                            "interpreters)")
    parser.add_argument("--kill-worker-at", type=float, metavar="S",
                        help="SIGKILL worker 1 (with --gpus: the first GPU's worker, not the launcher) this many "
                             "seconds into the first rate's run (warm-up included): its streams fail over to the "
                             "others; the report gives the pool's failover pauses (p50/p99/max)")
    parser.add_argument("--drain-worker-at", type=float, metavar="S",
                        help="SIGTERM that worker instead: it drains, its streams finish or go on elsewhere from "
                             "their codes; the report says whether any was cut (a failover or a failed request)")
    where.add_argument("--gpus", metavar="LIST",
                       help="run the engines as ONE `voxgate worker --gpus LIST` (one child per GPU, each with "
                            f"max_active={BENCH_MAX_ACTIVE}) on loopback TCP with a token, behind the gateway's "
                            "static pool; e.g. 0,1")
    where.add_argument("--tcp-workers", type=int, default=0, metavar="N",
                       help=f"run N `voxgate worker` processes on the one device, on loopback TCP with a token, "
                            f"each with max_active={BENCH_MAX_ACTIVE}//N, behind the gateway's static pool "
                            "(--backend remote -o workers=...)")
    args = parser.parse_args(argv)
    if args.tcp_workers < 0:
        parser.error("--tcp-workers N needs N >= 1")
    args.gpu_list = gpu_list(args.gpus) if args.gpus else []
    pooled = max(args.tcp_workers, len(args.gpu_list))
    for flag, value in (("--kill-worker-at", args.kill_worker_at), ("--drain-worker-at", args.drain_worker_at)):
        if value is not None and pooled < 2:
            parser.error(f"{flag} needs --tcp-workers 2 or --gpus with two GPUs or more (the pool needs a worker "
                         "to move streams to)")
    if args.kill_worker_at is not None and args.drain_worker_at is not None:
        parser.error("--kill-worker-at and --drain-worker-at: one disturbance a run")
    args.sentences = (1, 1)
    check_agent_arguments(args, parser)
    args.clone_seconds_text = args.clone_seconds
    args.clone_seconds = [float(x) for x in args.clone_seconds.split(",")]
    if args.clone_voice_s not in args.clone_seconds:
        parser.error("--clone-voice-s must be one of --clone-seconds")
    args.label = "main"
    try:
        args.variants = [parse_variant(text, args) for text in args.variant]
    except SystemExit:
        parser.error(f"bad --variant in {args.variant!r}")
    return args


VARIANT_FLAGS = ("rates", "voice", "clone", "timestamps", "granularity", "agent_sentences", "words_per_s")


def parse_variant(text: str, main: argparse.Namespace) -> argparse.Namespace:
    """A --variant's label and client flags, on top of the main run's values for the flags it leaves out."""
    import shlex

    label, *flags = shlex.split(text)
    parser = argparse.ArgumentParser(prog=f"--variant {label}", add_help=False)
    parser.add_argument("--rates")
    parser.add_argument("--voice")
    parser.add_argument("--clone", choices=["x_vector", "icl", "none"])
    parser.add_argument("--timestamps", choices=["sync", "async", "none"])
    parser.add_argument("--granularity", choices=[*GRANULARITIES, "default"])
    parser.add_argument("--agent-sentences", type=int)
    parser.add_argument("--words-per-s", type=float)
    given = parser.parse_args(flags)
    variant = argparse.Namespace(**vars(main))
    variant.label = label
    for name in VARIANT_FLAGS:
        value = getattr(given, name)
        if value is not None:
            setattr(variant, name, None if value in ("none", "default") or value == 0 else value)
    return variant


REF_TEXT = "This is the reference recording of the voice that the benchmark clones."


def reference_wav(seconds: float, seed: int = 0) -> bytes:
    """A voiced-like clip (a gliding 100-180 Hz pitch with five harmonics, amplitude-modulated, plus a little
    noise) as a 24 kHz mono s16 WAV: what the speaker encoder and the codec's encoder need to do their full
    work (random weights make any clip's voice noise anyway)."""
    import io
    import wave

    import numpy as np

    rng = np.random.default_rng(seed)
    n = int(seconds * 24000)
    t = np.arange(n) / 24000
    phase = 2 * np.pi * np.cumsum(140 + 40 * np.sin(2 * np.pi * 0.7 * t)) / 24000
    x = sum(0.3 / k * np.sin(k * phase) for k in range(1, 6)) * (0.6 + 0.4 * np.sin(2 * np.pi * 2.1 * t))
    pcm = np.clip((x + 0.02 * rng.standard_normal(n)) * 32767, -32768, 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes(pcm.tobytes())
    return buffer.getvalue()


def register_clones(base: str, mode: str, lengths: list[float]) -> list[dict]:
    """POST /v1/audio/voices once per clip length, then once more per length under another name: the time of
    each (the first may include the encoders' first use on the device). Returns the report's entries."""
    import base64

    entries = []
    for attempt in ("first", "again"):
        for seconds in lengths:
            name = f"bench-{mode}-{seconds:g}s" + ("" if attempt == "first" else "-again")
            body = {"name": name, "consent": "benchmark clip, synthetic", "x_vector_only_mode": mode == "x_vector",
                    "audio_sample": base64.b64encode(reference_wav(seconds)).decode()}
            if mode == "icl":
                body["ref_text"] = REF_TEXT
            request = urllib.request.Request(base + "/v1/audio/voices", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"}, method="POST")
            started = time.perf_counter()
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    answer = json.loads(response.read())
            except urllib.error.HTTPError as error:
                raise RuntimeError(f"voice.add {name} failed: {error.code} {error.read()[:500]!r}") from None
            elapsed_ms = (time.perf_counter() - started) * 1000
            entries.append({"name": name, "clip_s": seconds, "attempt": attempt, "ms": elapsed_ms,
                            "voice": answer.get("voice")})
            print(f"voice.add {name}: {elapsed_ms:.0f} ms", flush=True)
    return entries


def disturb_first_worker(args: argparse.Namespace, workers: list[subprocess.Popen], children: dict[str, int],
                         base: str,
                         playing: Playing | None = None) -> tuple[str, threading.Timer, str | None, int] | None:
    """Start --kill-worker-at's or --drain-worker-at's timer on worker 1: the first --tcp-workers process, or
    with --gpus the first GPU's child of the launcher (found in /proc, launcher_children), never the launcher.
    It waits for a stream on worker 1, and where the client counts them (`playing`, this bench's loadgen; not
    bench/nari_load.py's harness) while a listener plays: a stream opened there may not have begun its audio
    yet. Returns (kind, timer, GPU or None, PID), or None when neither flag is given."""
    if args.kill_worker_at is None and args.drain_worker_at is None:
        return None
    kind, at_s = ("kill", args.kill_worker_at) if args.kill_worker_at is not None else ("drain", args.drain_worker_at)
    if args.gpus:
        gpu = args.gpu_list[0]
        pid, worker_id = children[gpu], f"bench-gpu{gpu}"  # the launcher's id for GPU gpu's child
    else:
        gpu, pid, worker_id = None, workers[0].pid, "bench-worker1"

    def streams() -> int | None:
        open_streams = pool_streams(base, worker_id)  # a scrape: milliseconds, in which a listener may stop
        return open_streams if playing is None or playing.count else 0

    return kind, signal_worker(kind, at_s, pid, gpu, streams), gpu, pid


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ports: set[int] = set()
    port = free_port(ports)
    base = f"http://127.0.0.1:{port}"
    token_file = write_token_file() if args.tcp_workers or args.gpus else None
    layout = plan_processes(args, port, ports, str(token_file) if token_file else None)
    command = layout["gateway"]
    if args.log:
        args.log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    workers: list[subprocess.Popen] = []
    worker_logs = []
    proc = launcher = None
    children: dict[str, int] = {}  # --gpus: {GPU: PID} of the launcher's children
    report = {"tool": "bench/engine_load.py", "command": " ".join(["python", "bench/engine_load.py", *(argv or sys.argv[1:])]),
              "gateway_command": " ".join(command),
              "worker_command": " ".join(layout["workers"][0]["command"]) if args.worker else None,
              **accelerator(), "rates": []}
    if args.tcp_workers:
        report["worker_commands"] = [" ".join(w["command"]) for w in layout["workers"]]
        report["workers"] = [{"worker": i, "address": w["address"], "health": w["health"],
                              "max_active": worker_max_active(args),
                              "log": str(args.log.with_suffix(w["log_suffix"])) if args.log else None}
                             for i, w in enumerate(layout["workers"], 1)]
        report["token_file"] = str(token_file)  # the path only: the token itself is never written out
    if args.gpus:
        report["launcher_command"] = " ".join(layout["launcher"])
        report["workers"] = [{"worker": i, "gpu": w["gpu"], "address": w["address"], "health": w["health"],
                              "max_active": worker_max_active(args)} for i, w in enumerate(layout["workers"], 1)]
        report["workers_log"] = str(args.log.with_suffix(".workers.log")) if args.log else None
        report["token_file"] = str(token_file)
    try:
        if args.gpus:
            worker_log = open(args.log.with_suffix(".workers.log"), "w") if args.log else subprocess.DEVNULL
            worker_logs.append(worker_log)
            launcher = subprocess.Popen(layout["launcher"], cwd=ROOT, stdout=worker_log, stderr=subprocess.STDOUT,
                                        env=env)
            children = launcher_children(launcher.pid, args.gpu_list)
            for w in report["workers"]:
                w["pid"] = children[w["gpu"]]
        cpu_workers = args.tcp_workers or (1 if args.worker else 0)
        worker_env = cpu_worker_env(env, cpu_workers) if args.device == "cpu" and cpu_workers else env
        for spec in ([] if args.gpus else layout["workers"]):
            worker_log = open(args.log.with_suffix(spec["log_suffix"]), "w") if args.log else subprocess.DEVNULL
            worker_logs.append(worker_log)
            workers.append(subprocess.Popen(spec["command"], cwd=ROOT, stdout=worker_log, stderr=subprocess.STDOUT,
                                            env=worker_env))
        log = open(args.log, "w") if args.log else subprocess.DEVNULL
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        health = [w["health"] for w in layout["workers"] if w["health"]]
        report["startup_s"] = wait_ready(base, proc, args.ready_timeout, args.log,
                                         worker=workers[0] if args.worker else launcher,
                                         workers=workers if args.tcp_workers else [],
                                         worker_health=health, pool_size=args.tcp_workers or len(args.gpu_list),
                                         worker_pids=children)
        report["gpu_memory_idle_MiB"] = gpu_memory_mib()
        print(f"gateway ready in {report['startup_s']:.1f} s, GPU memory {report['gpu_memory_idle_MiB']} MiB", flush=True)
        prompts = load_prompts(DEFAULT_PROMPTS)
        seeds = args.seed or [0]
        cloned: set[str] = set()  # clone modes whose voices are registered on this server
        playing = Playing()  # the sessions playing now, of every run (a kill or drain waits for one)

        def scrape_workers() -> list[dict | None]:
            out = []
            for url in health:
                try:
                    out.append(scrape_counters(url))
                except (OSError, ValueError):
                    out.append(None)  # a worker that died or whose /metrics does not answer
            return out

        def run_configuration(cfg: argparse.Namespace, results: list[dict]) -> dict:
            """Every rate of one client configuration (the main run's or a --variant's) against the running
            server; each rate's entry is appended to `results` as it completes."""
            voice = cfg.voice
            if cfg.clone:
                if cfg.clone not in cloned:
                    report.setdefault("voice_add", []).extend(register_clones(base, cfg.clone, cfg.clone_seconds))
                    cloned.add(cfg.clone)
                voice = f"bench-{cfg.clone}-{cfg.clone_voice_s:g}s"
            extra_config = {}
            if cfg.timestamps:
                extra_config = {"timestamp_type": "word", "timestamp_transport_strategy": cfg.timestamps}
            client = ClientOptions(url=f"ws://127.0.0.1:{port}/v1/audio/speech/stream", voice=voice, timeout_s=60,
                                   extra_config=extra_config, split_granularity=cfg.granularity,
                                   words_per_s=cfg.words_per_s if cfg.agent_sentences else None, playing=playing)
            load = {"label": cfg.label, "sentences": list(sentences_per_request(cfg)),
                    "agent_sentences": cfg.agent_sentences, "words_per_s": client.words_per_s,
                    "session_config": client.session_config()}
            for rate in [float(r) for r in cfg.rates.split(",")]:
                memory: list[float] = []

                async def run_with_memory(seed: int):
                    async def sample():
                        while True:
                            value = await asyncio.to_thread(gpu_memory_mib)
                            if value is not None:
                                memory.append(value)
                            await asyncio.sleep(2.0)

                    sampler = asyncio.create_task(sample())
                    plan = RunPlan(seed=seed, warmup_s=args.warmup, duration_s=args.duration, rps=rate,
                                   drain_timeout_s=60)
                    try:
                        return await run_load(plan, Workload(prompts, seed, sentences_per_request(cfg)), client)
                    finally:
                        sampler.cancel()

                per_seed, requests = [], []
                counters_before = scrape_counters(base)
                workers_before = scrape_workers()
                disturbance = None
                if cfg is args and not results:  # the first rate of the main run only
                    disturbance = disturb_first_worker(args, workers, children, base, playing)
                for seed in seeds:
                    result = asyncio.run(run_with_memory(seed))
                    per_seed.append(result["summary"])
                    requests += result["requests"]
                    if len(seeds) > 1:
                        print(markdown_table(per_seed[-1], f"{rate:g} RPS, seed {seed}"), flush=True)
                summary = combine_seeds(per_seed)
                p95 = summary["audible_ttfa_s"]["p95"]
                passed = bool(summary["passed"]) and p95 is not None and p95 * 1000 <= args.fail_ttfa_ms
                # Over the whole of this rate's runs (every seed's warm-up, measured window and drain).
                counters_after = scrape_counters(base)
                engine = engine_breakdown(counters_before, counters_after)
                entry = {"rps": rate, "passed": passed, "gpu_memory_max_MiB": max(memory) if memory else None,
                         "seeds": seeds, "summary": summary, "engine": engine,
                         "aligner": aligner_breakdown(counters_before, counters_after, engine),
                         "gateway_loop_lag": loop_lag_breakdown(counters_before, counters_after),
                         "latency_split": latency_split(counters_before, counters_after)}
                if disturbance is not None:
                    kind, timer, gpu, pid = disturbance
                    timer.cancel()
                    key = "killed_worker" if kind == "kill" else "drained_worker"
                    # First: a drain's report waits (30 s at most) for the drained worker to exit.
                    entry[key] = {"worker": 1, "sent": timer.sent.is_set(), "sent_at_s": timer.sent_at_s,
                                  "streams_at_signal": timer.streams_at_signal, **disturbance_report(
                        kind, args.kill_worker_at if kind == "kill" else args.drain_worker_at, gpu, pid, args.log,
                        pool_deltas(counters_before, scrape_counters(base)), requests, timer.sent_at_perf)}
                    print(f"worker 1{f' (GPU {gpu})' if gpu is not None else ''} {kind} at "
                          f"{entry[key]['at_s']:g} s with {entry[key]['streams_at_signal']} streams open: gateway's pauses (ms, the pool's log) {entry[key]['pause_ms']}, "
                          f"listeners' silences (ms, zero pre-buffer playback) {entry[key]['listeners_silence_ms']}, "
                          f"the moved streams' gap across it less their usual gap (ms, as bench/fleet_sim.py) "
                          f"{entry[key]['client_pause_across_ms']}, "
                          f"pool {entry[key]['pool']}, requests cut {entry[key]['requests_cut']}, refused "
                          f"{entry[key]['requests_refused']}"
                          + (f", no stream cut: {entry[key]['no_stream_cut']}" if kind == "drain" else ""),
                          flush=True)
                if health:
                    entry["workers"] = [
                        {"worker": i, "address": spec["address"],
                         "engine": engine_breakdown(b, a) if b is not None and a is not None else None,
                         "requests": requests_by_outcome(b, a) if b is not None and a is not None else None,
                         **({"gpu": spec["gpu"], "pid": children[spec["gpu"]],
                             "running": pid_alive(children[spec["gpu"]])} if args.gpus else
                            {"exit_code": workers[i - 1].poll()})}
                        for i, (spec, b, a) in enumerate(zip(layout["workers"], workers_before, scrape_workers()), 1)]
                if len(seeds) > 1:
                    entry["per_seed"] = per_seed
                results.append(entry)
                if len(seeds) == 1:
                    print(markdown_table(summary, f"{rate:g} RPS"), flush=True)
                print(f"GPU memory max {entry['gpu_memory_max_MiB']} MiB; verdict {'PASS' if passed else 'FAIL'}", flush=True)
                if engine is not None:
                    print(engine_table([entry]), flush=True)
                if entry["gateway_loop_lag"] is not None:
                    print(f"gateway event-loop lag: {entry['gateway_loop_lag']}", flush=True)
                for w in entry.get("workers", []):
                    print(f"worker {w['worker']} ({w['address']}): requests {w['requests']}", flush=True)
                if not passed and not args.keep_going:
                    break
            return load

        report["load"] = run_configuration(args, report["rates"])
        for variant in args.variants:
            entry = {"label": variant.label, "rates": []}
            report.setdefault("variants", []).append(entry)
            entry["load"] = run_configuration(variant, entry["rates"])
    finally:
        for process in ([proc] if proc is not None else []) + workers + ([launcher] if launcher is not None else []):
            stop(process)
        report["worker_exit_codes"] = [process.returncode for process in workers] or None
        if launcher is not None:  # the worst of its children's: 9 after a SIGKILL, 0 after drains
            report["launcher_exit_code"] = launcher.returncode
        for f in worker_logs:
            if f is not subprocess.DEVNULL:
                f.close()
        if token_file is not None:
            shutil.rmtree(token_file.parent, ignore_errors=True)
    table = summary_table(report)
    if any(entry.get("engine") for entry in report["rates"]):
        table += "\n\nEngine thread, over each rate's runs (voxgate_engine_* from /metrics):\n\n"
        table += engine_table(report["rates"])
    if any(entry.get("workers") for entry in report["rates"]):
        table += "\n\n" + workers_table(report["rates"])
    for variant in report.get("variants", []):
        table += f"\n\nVariant {variant['label']} ({json.dumps(variant['load']['session_config'])}):\n\n"
        table += summary_table(variant)
        if any(entry.get("engine") for entry in variant["rates"]):
            table += "\n\n" + engine_table(variant["rates"])
    table += aligner_table(report)
    print(table)
    if args.output:
        write_report(args.output, report, table)
    return 0


def workers_table(entries: list[dict]) -> str:
    """Per worker and rate (--tcp-workers), from each worker's own /metrics: requests that left its engine
    and its engine thread's breakdown."""
    rows = []
    for entry in entries:
        for w in entry.get("workers") or []:
            if w.get("engine"):
                rows.append({"rps": f"{entry['rps']:g} (worker {w['worker']}, "
                                    f"{sum((w.get('requests') or {}).values())} requests)", "engine": w["engine"]})
    if not rows:
        return "Workers' /metrics reported no engine counters."
    return "Engine thread per worker (its own /metrics):\n\n" + engine_table(rows)


def summary_table(report: dict) -> str:
    def ms(d, key):
        v = d.get(key)
        return "-" if v is None or v != v else f"{v * 1000:.1f}"

    if (report.get("load") or {}).get("agent_sentences"):
        return agent_table(report, ms)
    lines = ["| RPS | audible TTFA p50 / p95 / p99 (ms) | first playable p95 (ms) | TTFB p95 (ms) | E2E p95 (ms) | "
             "underruns | failed | requests | max in flight | GPU MiB | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for entry in report["rates"]:
        s = entry["summary"]
        a = s["audible_ttfa_s"]
        lines.append(
            f"| {entry['rps']:g} | {ms(a, 'p50')} / {ms(a, 'p95')} / {ms(a, 'p99')} | {ms(s['first_playable_s'], 'p95')} | "
            f"{ms(s['ttfb_s'], 'p95')} | {ms(s['e2e_s'], 'p95')} | {s['underrun_events']} | {s['failed']} | "
            f"{s['requests']} | {s['max_in_flight']} | {entry['gpu_memory_max_MiB']} | "
            f"{'PASS' if entry['passed'] else 'FAIL'} |")
    return "\n".join(lines)


def agent_table(report: dict, ms) -> str:
    """The agent workload's table: sessions/s, audible TTFA from the first word and from the first sentence's
    last word, E2E, underruns over whole replies, and which options the server did not honour."""
    load = report["load"]
    lines = [f"{load['agent_sentences']} sentences per session, {load['words_per_s']:g} words/s, "
             f"split_granularity {load['session_config'].get('split_granularity', 'sentence (default)')}", "",
             "| sessions/s | audible TTFA from the first word p50 / p95 / p99 (ms) | from the first sentence's last "
             "word p50 / p95 / p99 (ms) | E2E p95 (ms) | underruns (sessions) | failed | sessions | "
             "max in flight | warnings | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for entry in report["rates"]:
        s = entry["summary"]
        a, b = s["audible_ttfa_s"], s["audible_ttfa_after_sentence_s"]
        lines.append(
            f"| {entry['rps']:g} | {ms(a, 'p50')} / {ms(a, 'p95')} / {ms(a, 'p99')} | "
            f"{ms(b, 'p50')} / {ms(b, 'p95')} / {ms(b, 'p99')} | {ms(s['e2e_s'], 'p95')} | "
            f"{s['underrun_events']} ({s['underrun_requests']}) | {s['failed']} | {s['requests']} | "
            f"{s['max_in_flight']} | {', '.join(s.get('warnings') or []) or '-'} | "
            f"{'PASS' if entry['passed'] else 'FAIL'} |")
    return "\n".join(lines)


def aligner_table(report: dict) -> str:
    """The forced aligner's cost per rate, for every configuration that asked for word timestamps."""
    rows = [(cfg.get("label") or "main", entry) for cfg in [{"label": (report.get("load") or {}).get("label"),
                                                             "rates": report["rates"]}, *report.get("variants", [])]
            for entry in cfg["rates"] if entry.get("aligner")]
    if not rows:
        return ""
    lines = ["", "", "Forced aligner (voxgate_aligner_*):", "",
             "| run | RPS | sentences | mean batch | ms per sentence | share of the engine thread's wall |",
             "|---|---|---|---|---|---|"]
    def num(value, scale=1.0):
        return "-" if value is None else f"{value * scale:.1f}"

    for label, entry in rows:
        a = entry["aligner"]
        lines.append(f"| {label} | {entry['rps']:g} | {a['sentences']} | {num(a['mean_batch'])} | "
                     f"{num(a['ms_per_sentence'])} | {num(a['share_of_engine_wall'], 100)}% |")
    return "\n".join(lines)


def engine_table(entries: list[dict]) -> str:
    def pct(value):
        return "-" if value is None else f"{value * 100:.1f}%"

    def stage(e, name):
        st = e["stages"].get(name)
        if not st or not st["batches"]:
            return "-"
        return f"{pct(st['thread_share'])} ({st['mean_batch']:.1f})"

    lines = ["| RPS | frame (mean batch) | codec thread | codec device | prefill | schedule "
             "(us/decision; the scheduler's CPU us) | idle | decisions | rules |", "|---|---|---|---|---|---|---|---|---|"]
    for entry in entries:
        e = entry.get("engine")
        if not e:
            continue
        us = e["schedule_us_per_decision"]
        cpu = e.get("decide_cpu_us")
        rules = ", ".join(f"{rule} {count}" for rule, count in e["rules"].items())
        rps = entry["rps"] if isinstance(entry["rps"], str) else f"{entry['rps']:g}"
        lines.append(f"| {rps} | {stage(e, 'frame')} | {stage(e, 'codec')} | "
                     f"{pct(e['codec_device_share'])} | {stage(e, 'prefill')} | {pct(e['schedule_share'])} "
                     f"({'-' if us is None else f'{us:.0f}'}; {'-' if cpu is None else f'{cpu:.0f}'}) | {pct(e['idle_share'])} | {e['decisions']} | {rules} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
