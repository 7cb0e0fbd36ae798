"""The peer's own harness (nari-labs `tts_bench`, its `vllm-omni` target) against the gateway and a worker.

    python bench/nari_load.py --model /tmp/ckpt --rates 1,10,20,60,80,100 --warmup 10 --duration 30 \\
        --harness-site /tmp/nari-site:/tmp/site --output $OUT/nari_load.json

Starts one `voxgate worker` (the engine, on a Unix socket) and `voxgate serve --backend remote` in front of it,
with bench/engine_load.py's engine flags (its --worker run), then runs `python -m tts_bench run --target
vllm-omni` once per rate, each rate a separate harness command as its README asks, on the ARCTIC prompts
(bench/data/arctic_en.jsonl; the peer publishes its figures on Seed-TTS English). The harness POSTs each prompt
whole to /v1/audio/speech (stream, pcm) and measures audible TTFA and underruns by simulating playback itself;
its summary.json for each rate goes into the report beside the engine's counters from the gateway's /metrics.

The harness runs unmodified from its source (`--harness-src`, the folder holding the `tts_bench` package; default
.carry/nari/tts_bench/src) with its dependencies on `--harness-site` (bench/carry.sh builds both into
.carry/nari, with the pinned commit in .carry/nari/tts_bench/COMMIT; bench/h200.sh's `nari` step installs the
wheels), under `--harness-python` (this interpreter unless given). Its per-request audio is
deleted after each rate (gigabytes at 100 RPS); --keep-results keeps it under --work.

`--backend synthetic` (or piper) runs the same path on the CPU, as tests/test_nari_load.py does.

Several GPUs on one host (issue 35): `--gpus 0,1` starts ONE `voxgate worker --gpus 0,1` launcher (one child per
GPU, each with the whole run's engine flags, on loopback TCP with a random token in a 0600 file) behind the
gateway's static pool, as bench/engine_load.py --gpus does; `--gpus 0` is the single-GPU baseline on the same
path. With two GPUs or more, --kill-worker-at S SIGKILLs the first GPU's child (never the launcher) S seconds
into the first rate's harness run and --drain-worker-at S SIGTERMs it; that rate's entry then reports the
listeners' pauses the pool logged (p50/p99/max), its failovers and hand-overs, and the harness's requests that
failed, told apart as cut (audio had begun) or refused (none had), from its requests.jsonl. bench/h200.sh's
`multigpu:RATE` step runs the baseline, the scaling run at twice RATE, the kill and the drain in one call.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_load import (
    BENCH_MAX_ACTIVE,
    add_rate_arguments,
    add_server_arguments,
    disturb_first_worker,
    disturbance_report,
    engine_breakdown,
    free_port,
    gpu_memory_mib,
    latency_split,
    loop_lag_breakdown,
    launcher_children,
    launcher_plan,
    pid_alive,
    pool_deltas,
    remote_gateway_command,
    requests_by_outcome,
    scrape_counters,
    stop,
    wait_ready,
    worker_options,
    write_token_file,
)
from tts_backend.remote.launcher import gpu_list
from bench.loadgen import DEFAULT_PROMPTS, accelerator, add_output_argument, write_report

ROOT = Path(__file__).resolve().parents[1]
TARGET = "vllm-omni"


def backend_arguments(args: argparse.Namespace) -> list[str]:
    """A worker's backend flags: bench/engine_load.py's engine options for qwen3 (each worker has a GPU of its
    own: all of BENCH_MAX_ACTIVE), the caller's -o items for any other backend."""
    if args.backend == "qwen3":
        return ["--backend", "qwen3", "--model", args.model, "--device", args.device,
                *worker_options(BENCH_MAX_ACTIVE, args.option)]
    return ["--backend", args.backend, *(item for option in args.option for item in ("--option", option))]


def plan_processes(args: argparse.Namespace, port: int, token_file: str | None = None) -> dict:
    """The worker's and the gateway's commands (bench/engine_load.py --worker's, for any worker backend); with
    --gpus, {"launcher": argv, "workers": [{"gpu", "address", "health"}], "gateway": argv} (launcher_plan)."""
    if args.gpus:
        if token_file is None:
            raise ValueError("--gpus needs a token file")
        launcher = launcher_plan(args.gpu_list, backend_arguments(args), token_file, {port})
        pool = ["-o", "workers=" + ",".join(w["address"] for w in launcher["workers"]), "-o", f"token_file={token_file}"]
        return {"launcher": launcher["command"], "workers": launcher["workers"],
                "gateway": remote_gateway_command(port, pool)}
    socket_path = f"/tmp/voxgate-nari-{port}.sock"
    worker = [sys.executable, "-m", "gateway.cli", "worker", *backend_arguments(args), "--socket", socket_path]
    return {"worker": worker, "gateway": remote_gateway_command(port, ["-o", f"socket={socket_path}"])}


def scrape_or_none(url: str) -> dict | None:
    """A worker's /metrics, or None where it does not answer (a worker that was killed or drained)."""
    try:
        return scrape_counters(url)
    except (OSError, ValueError):
        return None


def harness_requests(output: Path) -> list[dict]:
    """The harness's per-request records (its requests.jsonl, warm-up included) as disturbance_report takes
    them: ok, the audio bytes received, and the error."""
    path = output / "requests.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            out.append({"ok": bool(record.get("success")), "bytes": int(record.get("output_bytes") or 0),
                        "errors": [str(record.get("error_kind") or record.get("status_code"))]
                        if not record.get("success") else []})
    return out


def harness_command(args: argparse.Namespace, base: str, rate: float, output: Path) -> list[str]:
    command = [args.harness_python, "-m", "tts_bench", "run", "--target", TARGET, "--base-url", base,
               "--dataset", str(args.dataset), "--rps", f"{rate:g}", "--warmup", f"{args.warmup:g}s",
               "--duration", f"{args.duration:g}s", "--arrival", args.arrival, "--seed", str(args.seed),
               "--timeout", f"{args.timeout:g}s", "--output", str(output)]
    if args.voice:
        command += ["--voice", args.voice]
    return command


def harness_env(args: argparse.Namespace) -> dict[str, str]:
    """The harness's own path only: none of this repository's or the gateway's site (a pydantic or numpy
    there would stand in for the ones the harness was given)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    path = [str(args.harness_src), *([args.harness_site] if args.harness_site else [])]
    env.update(PYTHONPATH=os.pathsep.join(path), PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
    return env


def rate_entry(rate: float, summary: dict, returncode: int) -> dict:
    """One rate's figures as the harness reports them (summary.json), with the ones issue 29 tabulates first."""
    audible = summary.get("audible_ttfa_ms") or {}
    started = summary.get("started_requests") or 0
    successful = summary.get("successful_requests") or 0
    return {
        "rps": rate, "harness_exit_code": returncode,
        "audible_ttfa_ms": {k: audible.get(k) for k in ("p50", "p95", "p99", "maximum", "missing")},
        "underrun_requests": summary.get("underrun_requests"), "underrun_count": summary.get("underrun_count"),
        "scheduled_requests": summary.get("scheduled_requests"), "started_requests": started,
        "successful_requests": successful, "failed_requests": started - successful,
        "predispatch_failed_requests": summary.get("predispatch_failed_requests"),
        "dropped_requests": summary.get("dropped_requests"), "actual_rps": summary.get("actual_rps"),
        "peak_in_flight": summary.get("peak_in_flight"),
        "summary": summary,
    }


def table(entries: list[dict]) -> str:
    def ms(value):
        return "-" if value is None else f"{value:.1f}"

    lines = [f"The peer's harness (tts_bench, --target {TARGET}):", "",
             "| RPS | audible TTFA p50 / p95 / p99 (ms) | underrunning requests (underruns) | failed | requests |"
             " peak in flight | p50 / p95 (ms): engine's first chunk, gateway's first byte |",
             "|---|---|---|---|---|---|---|"]
    for e in entries:
        a = e["audible_ttfa_ms"]
        split = e.get("latency_split") or {}
        engine, gateway = split.get("engine_first_chunk_ms") or {}, (split.get("gateway_ttfa_ms") or {}).get("http") or {}
        lines.append(f"| {e['rps']:g} | {ms(a['p50'])} / {ms(a['p95'])} / {ms(a['p99'])} | "
                     f"{e['underrun_requests']} ({e['underrun_count']}) | {e['failed_requests']} | "
                     f"{e['started_requests']} | {e['peak_in_flight']} | {ms(engine.get('p50'))} / "
                     f"{ms(engine.get('p95'))}, {ms(gateway.get('p50'))} / {ms(gateway.get('p95'))} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="qwen3", help="the worker's backend (synthetic or piper on the CPU)")
    parser.add_argument("--model", help="checkpoint folder (qwen3)")
    add_server_arguments(parser, "gateway log file (the worker's goes beside it: .worker.log)")
    add_rate_arguments(parser, "1,10,20,60,80,100")
    parser.add_argument("--arrival", choices=["poisson", "constant"], default="poisson")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0, help="the harness's per-request timeout (s)")
    parser.add_argument("--voice", help="the harness's --voice (its default: Ryan)")
    parser.add_argument("--dataset", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--harness-src", type=Path, default=ROOT / ".carry" / "nari" / "tts_bench" / "src",
                        help="the folder holding the harness's tts_bench package")
    parser.add_argument("--harness-site", help="folders of the harness's dependencies (os.pathsep between them), "
                                               "put on its path after --harness-src")
    parser.add_argument("--harness-python", default=sys.executable)
    parser.add_argument("--work", type=Path, help="where the harness writes each rate's results (default: a "
                                                   "temporary folder)")
    parser.add_argument("--keep-results", action="store_true", help="keep each rate's audio under --work")
    parser.add_argument("--gpus", metavar="LIST",
                        help="ONE `voxgate worker --gpus LIST` launcher (one worker per GPU) on loopback TCP behind "
                             "the gateway's static pool, instead of one worker on a Unix socket; e.g. 0 or 0,1")
    parser.add_argument("--kill-worker-at", type=float, metavar="S",
                        help="with --gpus of two or more: SIGKILL the first GPU's worker S seconds into the first "
                             "rate's harness run (its warm-up included)")
    parser.add_argument("--drain-worker-at", type=float, metavar="S",
                        help="with --gpus of two or more: SIGTERM it instead (a drain)")
    add_output_argument(parser)
    args = parser.parse_args(argv)
    args.gpu_list = gpu_list(args.gpus) if args.gpus else []
    for flag, value in (("--kill-worker-at", args.kill_worker_at), ("--drain-worker-at", args.drain_worker_at)):
        if value is not None and len(args.gpu_list) < 2:
            parser.error(f"{flag} needs --gpus with two GPUs or more (the pool needs a worker to move streams to)")
    if args.kill_worker_at is not None and args.drain_worker_at is not None:
        parser.error("--kill-worker-at and --drain-worker-at: one disturbance a run")
    if args.backend == "qwen3" and not args.model:
        parser.error("--backend qwen3 needs --model")
    if not (args.harness_src / "tts_bench").is_dir():
        parser.error(f"no tts_bench package in {args.harness_src} (bench/carry.sh puts it in .carry/nari/tts_bench/src)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = {"tool": "bench/nari_load.py", "command": " ".join(["python", "bench/nari_load.py",
                                                                 *(argv if argv is not None else sys.argv[1:])]),
              **accelerator(), "target": TARGET, "dataset": str(args.dataset), "rates": []}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    token_file = write_token_file() if args.gpus else None
    layout = plan_processes(args, port, str(token_file) if token_file else None)
    report.update(gateway_command=" ".join(layout["gateway"]),
                  worker_command=" ".join(layout.get("launcher") or layout["worker"]))
    if args.gpus:
        report["workers"] = [{"worker": i, "gpu": w["gpu"], "address": w["address"], "health": w["health"]}
                             for i, w in enumerate(layout["workers"], 1)]
        report["token_file"] = str(token_file)  # the path only: the token itself is never written out
    commit = args.harness_src.parent / "COMMIT"
    report["harness"] = {"src": str(args.harness_src),
                         "commit": commit.read_text().strip() if commit.is_file() else None}
    work = args.work or Path(tempfile.mkdtemp(prefix="nari-load-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.log:
        args.log.parent.mkdir(parents=True, exist_ok=True)
    logs = [open(args.log.with_suffix(".worker.log"), "w"), open(args.log, "w")] if args.log else []
    sink = (lambda i: logs[i]) if logs else (lambda i: subprocess.DEVNULL)
    worker = gateway = None
    children: dict[str, int] = {}  # --gpus: {GPU: PID} of the launcher's children
    failed = False
    try:
        worker = subprocess.Popen(layout.get("launcher") or layout["worker"], cwd=ROOT, stdout=sink(0),
                                  stderr=subprocess.STDOUT, env=env)
        if args.gpus:
            children = launcher_children(worker.pid, args.gpu_list)
            for w in report["workers"]:
                w["pid"] = children[w["gpu"]]
        gateway = subprocess.Popen(layout["gateway"], cwd=ROOT, stdout=sink(1), stderr=subprocess.STDOUT, env=env)
        health = [w["health"] for w in layout.get("workers", [])]
        report["startup_s"] = wait_ready(base, gateway, args.ready_timeout, args.log, worker=worker,
                                         worker_health=health, pool_size=len(args.gpu_list), worker_pids=children)
        report["gpu_memory_idle_MiB"] = gpu_memory_mib()
        print(f"gateway ready in {report['startup_s']:.1f} s", flush=True)
        for rate in [float(r) for r in args.rates.split(",")]:
            output = work / f"rps-{rate:g}"
            command = harness_command(args, base, rate, output)
            print("+ " + " ".join(command), flush=True)
            before = scrape_counters(base)
            workers_before = [scrape_or_none(url) for url in health]
            disturbance = disturb_first_worker(args, [], children, base) if not report["rates"] else None
            started = time.monotonic()
            result = subprocess.run(command, cwd=work, env=harness_env(args), capture_output=True, text=True,
                                    timeout=args.warmup + args.duration + args.timeout + 300)
            if disturbance is not None:  # not sent by now: the harness's run ended first (the entry says so)
                disturbance[1].cancel()
            print(result.stdout[-6000:] + result.stderr[-3000:], flush=True)
            summary_path = output / "summary.json"
            if not summary_path.is_file():
                failed = True
                report["rates"].append({"rps": rate, "harness_exit_code": result.returncode,
                                        "error": (result.stderr or result.stdout)[-2000:]})
                print(f"{rate:g} RPS: the harness wrote no summary (exit {result.returncode})", flush=True)
                continue
            entry = rate_entry(rate, json.loads(summary_path.read_text()), result.returncode)
            entry["wall_s"] = round(time.monotonic() - started, 1)
            entry["gpu_memory_MiB"] = gpu_memory_mib()
            after = scrape_counters(base)
            entry["engine"] = engine_breakdown(before, after)
            entry["gateway_loop_lag"] = loop_lag_breakdown(before, after)
            entry["latency_split"] = latency_split(before, after)
            if disturbance is not None:
                kind, timer, gpu, pid = disturbance
                at_s = args.kill_worker_at if kind == "kill" else args.drain_worker_at
                entry["killed_worker" if kind == "kill" else "drained_worker"] = disturbed = {
                    "worker": 1, "sent": timer.sent.is_set(), "sent_at_s": timer.sent_at_s,
                    "streams_at_signal": timer.streams_at_signal,
                    **disturbance_report(kind, at_s, gpu, pid, args.log, pool_deltas(before, after),
                                         harness_requests(output))}
                print(f"GPU {gpu}'s worker: {kind} at {disturbed['sent_at_s']} s with {disturbed['streams_at_signal']} "
                      f"streams open: listeners' pauses (ms) {disturbed['pause_ms']}, pool {disturbed['pool']}, "
                      f"requests cut {disturbed['requests_cut']}, refused {disturbed['requests_refused']}"
                      + (f", no stream cut: {disturbed['no_stream_cut']}" if kind == "drain" else ""), flush=True)
            if children:
                entry["workers"] = [
                    {"worker": i, "gpu": w["gpu"], "pid": children[w["gpu"]], "running": pid_alive(children[w["gpu"]]),
                     "requests": requests_by_outcome(b, a) if b is not None and a is not None else None}
                    for i, (w, b, a) in enumerate(zip(layout["workers"], workers_before,
                                                      [scrape_or_none(url) for url in health]), 1)]
            report["rates"].append(entry)
            failed |= result.returncode != 0
            print(table([entry]), flush=True)
            if not args.keep_results:
                shutil.rmtree(output / "audio", ignore_errors=True)
    finally:
        for process in (gateway, worker):
            if process is not None:
                stop(process)
        # With --gpus, the launcher's: the worst of its children's (9 after a SIGKILL, 0 after drains).
        report["worker_exit_code"] = worker.returncode if worker is not None else None
        if token_file is not None:
            shutil.rmtree(token_file.parent, ignore_errors=True)
        for f in logs:
            f.close()
        if not args.keep_results and args.work is None:
            shutil.rmtree(work, ignore_errors=True)
        text = table([e for e in report["rates"] if "summary" in e])
        print(text, flush=True)
        if args.output:
            write_report(args.output, report, text)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
