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

With --log FILE the workers log beside it: FILE with suffix .worker.log (--worker) or .worker1.log,
.worker2.log, ... (--tcp-workers). On the H200: `LOAD_ARGS="--tcp-workers 2" bash bench/h200.sh setup
load:10,20` (bench/h200.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen import (
    DEFAULT_PROMPTS,
    GRANULARITIES,
    ClientOptions,
    RunPlan,
    Workload,
    accelerator,
    across_seeds,
    add_agent_arguments,
    add_output_argument,
    check_agent_arguments,
    load_prompts,
    markdown_table,
    run_load,
    sentences_per_request,
    write_report,
)

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


def free_port(taken: set[int] | None = None) -> int:
    """A TCP port free on loopback now, and not one of `taken` (ports handed out but not yet bound)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if taken is None or port not in taken:
            if taken is not None:
                taken.add(port)
            return port


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


def failover_pauses(log_path: Path) -> list[float]:
    """The pool's `failover ... pause_ms=X` lines in the gateway's log: from a worker's death to the first
    audio of each of its streams on another worker."""
    import re

    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    return [float(m.group(1)) for m in re.finditer(r"failover session=\S+ .*?pause_ms=([0-9.]+)", text)]


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
               worker_health: list[str] = (), pool_size: int = 0) -> float:
    """Seconds until the gateway (and every worker) is ready. `worker`: the one --worker process;
    `workers` and `worker_health`: the --tcp-workers processes and their health servers' base URLs, each of
    which must answer /ready; `pool_size`: then wait (up to 60 s more) for that many ready workers in the
    gateway's pool, where its /metrics reports them. Any of the processes exiting first raises at once."""
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
    }


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
    buckets: dict[float, float] = {}
    for (sample, labels), value in after.items():
        if sample == "voxgate_event_loop_lag_seconds_bucket":
            bound = float(dict(labels)["le"])
            buckets[bound] = buckets.get(bound, 0.0) + value - before.get((sample, labels), 0.0)
    if not buckets:
        return None
    count = buckets.get(float("inf"), 0.0)

    def over(bound_s: float) -> int:
        return int(round(count - buckets.get(bound_s, 0.0)))

    p99 = next((bound for bound in sorted(buckets) if buckets[bound] >= 0.99 * count), None) if count else None
    return {"samples": int(count), "over_5ms": over(0.005), "over_25ms": over(0.025), "over_100ms": over(0.1),
            "p99_under_ms": None if p99 is None or p99 == float("inf") else p99 * 1000}


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
    "address": listen address or None, "health": health base URL or None, "log_suffix": ...}]}. `ports`
    holds the ports already handed out (the gateway's); worker ports are added to it."""
    python = [sys.executable, "-m", "gateway.cli"]
    if args.worker:
        socket_path = f"/tmp/voxgate-bench-{port}.sock"
        workers = [{"command": [*python, "worker", "--backend", "qwen3", "--model", args.model, "--device",
                                args.device, "--socket", socket_path,
                                *worker_options(BENCH_MAX_ACTIVE, args.option)],
                    "address": f"unix:{socket_path}", "health": None, "log_suffix": ".worker.log"}]
        gateway = remote_gateway_command(port, ["-o", f"socket={socket_path}"])
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


def worker_max_active(args: argparse.Namespace) -> int:
    """Each --tcp-workers engine's KV slots: the in-process run's shared out, unless -o max_active= says."""
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
                        help="SIGKILL worker 1 this many seconds into the first rate's run (warm-up included): "
                             "its streams fail over to the others; the report gives the pool's failover pauses")
    where.add_argument("--tcp-workers", type=int, default=0, metavar="N",
                       help=f"run N `voxgate worker` processes on the one device, on loopback TCP with a token, "
                            f"each with max_active={BENCH_MAX_ACTIVE}//N, behind the gateway's static pool "
                            "(--backend remote -o workers=...)")
    args = parser.parse_args(argv)
    if args.tcp_workers < 0:
        parser.error("--tcp-workers N needs N >= 1")
    if args.kill_worker_at is not None and args.tcp_workers < 2:
        parser.error("--kill-worker-at needs --tcp-workers 2 or more (the pool needs a worker to fail over to)")
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ports: set[int] = set()
    port = free_port(ports)
    base = f"http://127.0.0.1:{port}"
    token_file = write_token_file() if args.tcp_workers else None
    layout = plan_processes(args, port, ports, str(token_file) if token_file else None)
    command = layout["gateway"]
    if args.log:
        args.log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    workers: list[subprocess.Popen] = []
    worker_logs = []
    proc = None
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
    try:
        for spec in layout["workers"]:
            worker_log = open(args.log.with_suffix(spec["log_suffix"]), "w") if args.log else subprocess.DEVNULL
            worker_logs.append(worker_log)
            workers.append(subprocess.Popen(spec["command"], cwd=ROOT, stdout=worker_log, stderr=subprocess.STDOUT,
                                            env=env))
        log = open(args.log, "w") if args.log else subprocess.DEVNULL
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        health = [w["health"] for w in layout["workers"] if w["health"]]
        report["startup_s"] = wait_ready(base, proc, args.ready_timeout, args.log,
                                         worker=workers[0] if args.worker else None,
                                         workers=workers if args.tcp_workers else [],
                                         worker_health=health, pool_size=args.tcp_workers)
        report["gpu_memory_idle_MiB"] = gpu_memory_mib()
        print(f"gateway ready in {report['startup_s']:.1f} s, GPU memory {report['gpu_memory_idle_MiB']} MiB", flush=True)
        prompts = load_prompts(DEFAULT_PROMPTS)
        seeds = args.seed or [0]
        cloned: set[str] = set()  # clone modes whose voices are registered on this server

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
                                   words_per_s=cfg.words_per_s if cfg.agent_sentences else None)
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

                per_seed = []
                counters_before = scrape_counters(base)
                workers_before = scrape_workers()
                kill = None
                if args.kill_worker_at is not None and cfg is args and not results:
                    kill = threading.Timer(args.kill_worker_at, workers[0].kill)
                    kill.start()
                for seed in seeds:
                    per_seed.append(asyncio.run(run_with_memory(seed))["summary"])
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
                         "gateway_loop_lag": loop_lag_breakdown(counters_before, counters_after)}
                if health:
                    entry["workers"] = [
                        {"worker": i, "address": spec["address"],
                         "engine": engine_breakdown(b, a) if b is not None and a is not None else None,
                         "requests": requests_by_outcome(b, a) if b is not None and a is not None else None,
                         "exit_code": process.poll()}
                        for i, (spec, process, b, a) in enumerate(zip(layout["workers"], workers, workers_before,
                                                                       scrape_workers()), 1)]
                if kill is not None:
                    kill.cancel()
                    entry["killed_worker"] = {"worker": 1, "at_s": args.kill_worker_at,
                                              "failover_pause_ms": failover_pauses(args.log) if args.log else None}
                    print(f"worker 1 killed at {args.kill_worker_at:g} s; failover pauses (ms, the pool's log): "
                          f"{entry['killed_worker']['failover_pause_ms']}", flush=True)
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
        for process in ([proc] if proc is not None else []) + workers:
            stop(process)
        report["worker_exit_codes"] = [process.returncode for process in workers] or None
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
