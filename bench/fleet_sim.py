"""Fleet simulation (issue 17): 3 gateways and 6 workers on loopback with Redis discovery, under an open
loop that needs most of the fleet, while one worker is SIGKILLed, another drained (SIGTERM) and a new one
added.

The workers run the synthetic backend paced like a GPU engine: `--capacity` streams produce at once at
`--speed` times real time, a further one waits for a slot (tts_backend/synthetic.py `capacity`). The
gateways (`voxgate serve --backend remote -o discover=...`, `--store redis`, their overload refusal on)
find the workers in the registry. The load is Poisson arrivals of sessions, round robin over the
gateways, at the rate that offers `--utilisation` of the 6 workers' slots; each session sends its 2-3
sentences whole, reads until `session.done`, and its audio is checked byte for byte against the same
synthetic backend run here (per sentence, by the `sentence_text` of each `audio.start`).

Timeline: warm-up, then at --kill-at the worker with the most streams is SIGKILLed, at --drain-at the
next most loaded gets SIGTERM (it hands its streams over and exits), at --add-at a new worker is started.
A failed-over or handed-over sentence goes on from the codes of its delivered chunks on another worker
(issue 33, tts_backend/remote/pool.py): the delivered part is not made again.
Every 250 ms each worker's /metrics (its health port) is read; every second the gateways' /metrics.

Reported (bench/results/fleet_sim.{json,md,png}): streams per worker over time; load balance (max/min of
the workers' mean streams) per phase; sessions admitted / completed / lost (admitted but not ending with
the full expected audio: must be 0); the pause at the kill (client side: the session's gap across the kill
minus its usual inter-frame gap, for the sessions the gateways logged as failed over), and the same at the
drain's hand-over, each with its p50 and p99 against issue 33's targets; refusals and the
fleet's utilisation when each happened; CPU of the machine and of each process; the commands.

    python bench/fleet_sim.py --output-dir bench/results

Every frame's arrival, every sample and the gateways' failover log lines go to NAME_raw.json.gz beside the
report; `--report-only RAW` re-makes the report and plot from it. Other work on the machine skews the
pauses: `--quiet-wait S` waits up to S seconds for it to go idle first, and the report splits the
machine's CPU into this run's processes and the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_load import free_port, write_token_file  # noqa: E402
from bench.loadgen import (  # noqa: E402
    DEFAULT_PROMPTS,
    LoopLagProbe,
    Workload,
    hardware,
    json_safe,
    load_average,
    load_prompts,
    nearest_rank,
    parse_range,
    poisson_schedule,
)

ROOT = Path(__file__).resolve().parents[1]
VOICE = "tone-mid"
SAMPLE_INTERVAL_S = 0.25
FAILOVER_LINE = re.compile(
    r"failover session=(?P<session>\S+) sentence=(?P<sentence>\d+) from=(?P<src>\S+) to=(?P<dst>\S+)"
    r" pause_ms=(?P<pause>[\d.]+)(?: resumed=(?P<resumed>\w+))?")
# Issue 33's targets for the pause a failover costs a listener (client side).
PAUSE_TARGET_P50_MS = 50.0
PAUSE_TARGET_P99_MS = 150.0


# -- processes -----------------------------------------------------------------------------------------


@dataclass
class Child:
    """One child process in its own process group, its log in the run folder."""

    name: str
    kind: str  # "worker" or "gateway"
    command: list[str]
    log_path: Path
    port: int  # the worker's listen port or the gateway's HTTP port
    health_port: int | None = None
    process: subprocess.Popen | None = None
    started_at: float | None = None  # seconds from the run start
    ready_at: float | None = None
    exited_at: float | None = None
    returncode: int | None = None
    cpu_s: float | None = None  # user + system CPU seconds, last read

    def start(self, run_start: float) -> None:
        log = open(self.log_path, "ab")
        try:
            self.process = subprocess.Popen(self.command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        finally:
            log.close()
        self.started_at = time.perf_counter() - run_start

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        """To the whole process group (a worker or gateway started nothing else, but nothing may outlive us)."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    def read_cpu(self) -> None:
        if self.process is not None:
            self.cpu_s = process_cpu_s(self.process.pid) or self.cpu_s

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (/proc/PID/stat), None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


class Fleet:
    def __init__(self, args: argparse.Namespace, folder: Path, token_file: Path, run_start: float) -> None:
        self.args = args
        self.folder = folder
        self.token_file = token_file
        self.run_start = run_start
        self.ports: set[int] = set()
        self.workers: dict[str, Child] = {}
        self.gateways: list[Child] = []
        self.redis_pid: int | None = None  # the (shared) Redis server's, when it runs on this machine

    def now(self) -> float:
        return time.perf_counter() - self.run_start

    def worker_command(self, worker_id: str, port: int, health_port: int) -> list[str]:
        a = self.args
        return [sys.executable, "-m", "gateway.cli", "worker", "--backend", "synthetic",
                "--option", f"capacity={a.capacity}", "--option", f"speed={a.speed}",
                "--option", f"chunk_ms={a.chunk_ms}", "--option", f"first_chunk_delay_s={a.first_chunk_delay}",
                "--listen", f"tcp://127.0.0.1:{port}", "--token-file", str(self.token_file),
                "--registry", a.registry_url, "--worker-id", worker_id, "--health-port", str(health_port),
                "--drain-timeout-s", str(a.worker_drain_timeout), "--log-level", "info"]

    def gateway_command(self, port: int) -> list[str]:
        a = self.args
        return [sys.executable, "-m", "gateway.cli", "serve", "--backend", "remote",
                "-o", f"discover={a.registry_url}", "-o", f"token_file={self.token_file}",
                "--port", str(port), "--store", "redis", "--redis-url", a.store_url,
                "--redis-key-prefix", "voxgate-fleet-sim:", "--log-level", "info", "--log-format", "text",
                *a.gateway_arg]

    def add_worker(self, worker_id: str) -> Child:
        port, health = free_port(self.ports), free_port(self.ports)
        child = Child(worker_id, "worker", self.worker_command(worker_id, port, health),
                      self.folder / f"{worker_id}.log", port, health)
        self.workers[worker_id] = child
        child.start(self.run_start)
        return child

    def add_gateway(self) -> Child:
        port = free_port(self.ports)
        child = Child(f"g{len(self.gateways) + 1}", "gateway", self.gateway_command(port),
                      self.folder / f"g{len(self.gateways) + 1}.log", port)
        self.gateways.append(child)
        child.start(self.run_start)
        return child

    def children(self) -> list[Child]:
        return [*self.workers.values(), *self.gateways]

    def stop_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM every group still running, SIGKILL what is left after `grace_s`; reap all."""
        for child in self.children():
            if child.alive:
                child.read_cpu()
                child.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children():
            if child.process is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(max(0.1, deadline - time.monotonic()))
            child.signal(signal.SIGKILL)  # the group, even if its leader has exited
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(5)


async def http_get(client: Any, url: str, timeout_s: float = 1.0) -> tuple[int, str] | None:
    try:
        response = await client.get(url, timeout=timeout_s)
        return response.status_code, response.text
    except Exception:  # noqa: BLE001 - down, starting, or killed: the caller records it
        return None


async def wait_ready(client: Any, children: list[Child], timeout_s: float, run_start: float,
                     url_of, ready_line: str | None = None) -> None:
    """Until every child answers 200 at url_of(child) (and printed `ready_line` where given); a child that
    exits first, or the timeout, raises with its log's tail."""
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    while pending:
        for child in list(pending):
            if not child.alive:
                raise RuntimeError(f"{child.kind} {child.name} exited with {child.process.returncode} before it"
                                   f" was ready: {shlex.join(child.command)}\n{child.log_tail()}")
            if ready_line is not None and ready_line not in child.log_text():
                continue
            answer = await http_get(client, url_of(child))
            if answer is not None and answer[0] == 200:
                child.ready_at = time.perf_counter() - run_start
                pending.remove(child)
        if pending and time.monotonic() > deadline:
            child = pending[0]
            raise RuntimeError(f"{child.kind} {child.name} not ready after {timeout_s:.0f} s:"
                               f" {shlex.join(child.command)}\n{child.log_tail()}")
        await asyncio.sleep(0.1)


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(metrics: dict, name: str, **labels: str) -> float | None:
    want = tuple(sorted(labels.items()))
    return metrics.get((name, want))


# -- sampling ------------------------------------------------------------------------------------------


class CpuMeter:
    """The machine's CPU use from /proc/stat, as busy cores, between reads."""

    def __init__(self) -> None:
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[float, float] | None:
        try:
            values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        except (OSError, ValueError, IndexError):
            return None
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        return float(sum(values[:8])), float(idle)

    def busy_cores(self) -> float | None:
        now = self._read()
        last, self._last = self._last, now
        if now is None or last is None or now[0] <= last[0]:
            return None
        total, idle = now[0] - last[0], now[1] - last[1]
        return (total - idle) / total * (os.cpu_count() or 1)


async def sample_fleet(fleet: Fleet, client: Any, samples: list[dict], gateway_samples: list[dict],
                       cpu_samples: list[dict], stop: asyncio.Event) -> None:
    """Every SAMPLE_INTERVAL_S: each started worker's /metrics (streams, capacity, queued, draining; up =
    answered). Every second: the gateways' /metrics and the machine's CPU."""
    cpu = CpuMeter()
    tick, began = 0, time.perf_counter()
    while not stop.is_set():
        planned = began + (tick + 1) * SAMPLE_INTERVAL_S
        tick += 1
        workers = list(fleet.workers.values())
        answers = await asyncio.gather(*(
            http_get(client, f"http://127.0.0.1:{w.health_port}/metrics", 0.5) if w.alive else _none()
            for w in workers))
        entry: dict[str, Any] = {"t": round(fleet.now(), 3), "workers": {}}
        for w, answer in zip(workers, answers):
            record: dict[str, Any] = {"up": False}
            if answer is not None and answer[0] == 200:
                with contextlib.suppress(Exception):
                    m = parse_metrics(answer[1])
                    record = {"up": True, "streams": metric(m, "voxgate_worker_streams"),
                              "capacity": metric(m, "voxgate_worker_capacity"),
                              "queued": metric(m, "voxgate_worker_queued"),
                              "draining": bool(metric(m, "voxgate_worker_draining") or 0)}
            entry["workers"][w.name] = record
        samples.append(entry)
        if tick % round(1 / SAMPLE_INTERVAL_S) == 0:
            busy = cpu.busy_cores()
            for child in fleet.children():
                if child.alive:
                    child.read_cpu()
            redis_cpu = process_cpu_s(fleet.redis_pid) if fleet.redis_pid else None
            cpu_samples.append({"t": entry["t"], "busy_cores": busy,
                                "process_cpu_s": {c.name: c.cpu_s for c in fleet.children()},
                                "client_cpu_s": time.process_time(), "redis_cpu_s": redis_cpu,
                                "load_average_1m": load_average()})
            g_answers = await asyncio.gather(*(
                http_get(client, f"http://127.0.0.1:{g.port}/metrics", 1.0) if g.alive else _none()
                for g in fleet.gateways))
            g_entry: dict[str, Any] = {"t": round(fleet.now(), 3), "gateways": {}}
            for g, answer in zip(fleet.gateways, g_answers):
                if answer is None or answer[0] != 200:
                    g_entry["gateways"][g.name] = None
                    continue
                with contextlib.suppress(Exception):
                    m = parse_metrics(answer[1])
                    g_entry["gateways"][g.name] = {
                        "pool_workers": {dict(k[1]).get("state"): v for k, v in m.items()
                                         if k[0] == "voxgate_pool_workers"},
                        "pool_streams": {dict(k[1]).get("worker"): v for k, v in m.items()
                                         if k[0] == "voxgate_pool_streams"},
                        "failovers": metric(m, "voxgate_pool_failovers_total"),
                        "sessions_active": metric(m, "voxgate_sessions_active"),
                    }
            gateway_samples.append(g_entry)
        delay = planned - time.perf_counter()
        if delay > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)


async def _none() -> None:
    return None


# -- sessions ------------------------------------------------------------------------------------------


class ExpectedAudio:
    """The synthetic backend's audio for a sentence, made here with the workers' options and the seed."""

    def __init__(self, chunk_ms: int, seed: int, voice: str = VOICE) -> None:
        from tts_backend.synthetic import SyntheticSynthesizer

        self.backend = SyntheticSynthesizer(chunk_ms=chunk_ms)
        self.seed, self.voice = seed, voice
        self._cache: dict[str, bytes] = {}

    def __call__(self, sentence_text: str) -> bytes:
        if sentence_text not in self._cache:
            from tts_backend.base import SynthesisRequest

            request = SynthesisRequest(text=sentence_text, voice=self.voice, seed=self.seed)
            self._cache[sentence_text] = self.backend.render(request).tobytes()
        return self._cache[sentence_text]


@dataclass
class SessionRecord:
    index: int
    gateway: str
    planned_s: float
    chars: int
    started_s: float | None = None  # connect began, from the run start
    admitted_s: float | None = None  # session.started
    session_id: str | None = None
    refused: bool = False
    refused_s: float | None = None
    refusal_code: str | None = None
    refusal_message: str | None = None
    completed: bool = False  # session.done
    done_s: float | None = None
    sentences: int = 0
    audio_ok: bool | None = None  # every sentence's bytes == the expected bytes
    mismatched_sentences: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    frames: list[tuple[float, int, int]] = field(default_factory=list)  # (arrival from run start, bytes, sentence)

    @property
    def admitted(self) -> bool:
        return self.session_id is not None

    @property
    def lost(self) -> bool:
        return self.admitted and not (self.completed and self.audio_ok and not self.errors)


async def run_session(record: SessionRecord, url: str, text: str, seed: int, expected: ExpectedAudio,
                      run_start: float, timeout_s: float) -> SessionRecord:
    """One session, never raising: connect, config, the text whole, input.done, read to session.done."""
    from websockets.asyncio.client import connect

    record.started_s = time.perf_counter() - run_start
    audio: dict[int, bytearray] = {}
    texts: dict[int, str] = {}
    current: int | None = None

    async def session() -> None:
        nonlocal current
        from websockets.exceptions import ConnectionClosed

        async with connect(url, max_size=None, compression=None, open_timeout=timeout_s) as ws:
            # A gateway that refuses at once sends its error and closes as soon as the socket is open, maybe
            # before the config is out: the send fails, the error is still there to read.
            with contextlib.suppress(ConnectionClosed):
                await ws.send(json.dumps({"type": "session.config", "voice": VOICE, "response_format": "pcm",
                                          "stream_audio": True, "seed": seed}))
            try:
                first = json.loads(await ws.recv())
            except ConnectionClosed as exc:
                if exc.rcvd is None or exc.rcvd.code != 1013:
                    raise
                first = {"type": "error", "code": exc.rcvd.reason, "message": f"closed {exc.rcvd.code} without an error"}
            if first.get("type") != "session.started":
                record.refused = True
                record.refused_s = time.perf_counter() - run_start
                record.refusal_code = str(first.get("code"))
                record.refusal_message = str(first.get("message"))[:300]
                return
            record.session_id = first["session_id"]
            record.admitted_s = time.perf_counter() - run_start
            await ws.send(json.dumps({"type": "input.text", "text": text}))
            await ws.send(json.dumps({"type": "input.done"}))
            async for message in ws:
                now = time.perf_counter() - run_start
                if isinstance(message, bytes):
                    if current is None:
                        record.errors.append("audio_outside_sentence")
                        continue
                    audio[current] += message
                    record.frames.append((round(now, 4), len(message), current))
                    continue
                event = json.loads(message)
                kind = event.get("type")
                if kind == "audio.start":
                    current = event["sentence_index"]
                    texts[current] = event["sentence_text"]
                    audio.setdefault(current, bytearray())
                    record.sentences += 1
                elif kind == "audio.done":
                    if event.get("error"):
                        record.errors.append(f"sentence_error:{event['sentence_index']}")
                    if event.get("total_bytes") != len(audio.get(event["sentence_index"], b"")):
                        record.errors.append(f"total_bytes_mismatch:{event['sentence_index']}")
                    current = None
                elif kind == "error":
                    record.errors.append(f"error:{event.get('code')}:{str(event.get('message'))[:120]}")
                elif kind == "session.done":
                    record.completed = True
                    record.done_s = now
                    break

    try:
        await asyncio.wait_for(session(), timeout_s)
    except asyncio.TimeoutError:
        record.errors.append("timeout")
    except Exception as exc:  # noqa: BLE001 - recorded: one failed session must not stop the run
        record.errors.append(f"{type(exc).__name__}: {exc}"[:200])
    if record.admitted:
        if not record.completed and "timeout" not in record.errors:
            record.errors.append("closed_before_session_done")
        record.mismatched_sentences = [i for i in sorted(audio) if bytes(audio[i]) != expected(texts[i])]
        record.audio_ok = record.completed and bool(audio) and not record.mismatched_sentences
    return record


def session_busy_s(text: str, args: argparse.Namespace) -> float:
    """Roughly how long a session holds a worker slot: its audio at --speed, a first-chunk delay per
    sentence (counted as sentences = full stops)."""
    sentences = max(1, len(re.findall(r"[.!?](\s|$)", text)))
    return len(text) / 15.0 / args.speed + sentences * args.first_chunk_delay


# -- the run -------------------------------------------------------------------------------------------


async def flush_redis(*urls: str) -> int | None:
    """FLUSHDB each of `urls` (the run's own databases); the server's process id when it is on this host."""
    import redis.asyncio as aioredis

    pid = None
    for url in urls:
        r = aioredis.Redis.from_url(url)
        try:
            await r.flushdb()
            with contextlib.suppress(Exception):
                info = await r.info("server")
                if Path(f"/proc/{info['process_id']}").exists():
                    pid = int(info["process_id"])
        finally:
            await r.aclose()
    return pid


async def wait_for_quiet(max_wait_s: float, below_cores: float, readings_needed: int = 3) -> list[float]:
    """Busy cores of the machine, per 2 s, until `readings_needed` readings in a row are under
    `below_cores` or `max_wait_s` passed: other work on the box would make the pauses measured here CPU
    starvation."""
    meter, readings, deadline, quiet = CpuMeter(), [], time.monotonic() + max_wait_s, 0
    while time.monotonic() < deadline:
        await asyncio.sleep(2.0)
        busy = meter.busy_cores()
        if busy is not None:
            readings.append(round(busy, 2))
            quiet = quiet + 1 if busy < below_cores else 0
            if quiet >= readings_needed:
                break
    return readings


def latest_streams(samples: list[dict], names: list[str]) -> dict[str, float]:
    for entry in reversed(samples):
        out = {n: r.get("streams") or 0.0 for n, r in entry["workers"].items() if n in names and r.get("up")}
        if out:
            return out
    return {}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    quiet = await wait_for_quiet(args.quiet_wait, args.quiet_below)
    print(f"machine busy before the run (cores, per 2 s): {quiet}", flush=True)
    folder = Path(tempfile.mkdtemp(prefix="voxgate-fleet-sim-"))
    token_file = write_token_file()
    redis_pid = await flush_redis(args.registry_url, args.store_url)
    run_start = time.perf_counter()
    fleet = Fleet(args, folder, token_file, run_start)
    fleet.redis_pid = redis_pid
    prompts = load_prompts(args.prompts)[: args.prompt_count]
    workload = Workload(prompts, args.seed, args.sentences)
    mean_busy = statistics.fmean(session_busy_s(workload.request(i).text, args) for i in range(2000))
    fleet_slots = args.workers * args.capacity
    rate = args.rate or args.utilisation * fleet_slots / mean_busy
    expected = ExpectedAudio(args.chunk_ms, args.seed)
    samples: list[dict] = []
    gateway_samples: list[dict] = []
    cpu_samples: list[dict] = []
    events: dict[str, Any] = {}
    records: list[SessionRecord] = []
    stop = asyncio.Event()
    load_before = load_average()
    print(f"fleet sim: logs in {folder}; rate {rate:.2f} sessions/s (mean slot time {mean_busy:.2f} s,"
          f" {fleet_slots} slots, target {args.utilisation:.0%})", flush=True)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
    async with httpx.AsyncClient(limits=limits) as client:
        try:
            for i in range(args.workers):
                fleet.add_worker(f"w{i + 1}")
            await wait_ready(client, list(fleet.workers.values()), args.start_timeout, run_start,
                             lambda w: f"http://127.0.0.1:{w.health_port}/ready", "voxgate worker ready")
            for _ in range(args.gateways):
                fleet.add_gateway()
            await wait_ready(client, fleet.gateways, args.start_timeout, run_start,
                             lambda g: f"http://127.0.0.1:{g.port}/ready")
            await wait_pool(client, fleet, args.workers, args.start_timeout)
            print(f"fleet ready at {fleet.now():.1f} s", flush=True)
            # The load's clock starts now: every time below is from here.
            load_start = time.perf_counter()
            offset = load_start - run_start
            sampler = asyncio.create_task(sample_fleet(fleet, client, samples, gateway_samples, cpu_samples, stop))
            probe = LoopLagProbe()
            probe_task = asyncio.create_task(probe.run())
            timeline = asyncio.create_task(drive_timeline(fleet, client, samples, events, args, offset))
            arrivals = poisson_schedule(rate, args.duration, args.seed)
            tasks = []
            for index, planned in enumerate(arrivals):
                delay = load_start + planned - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                spec = workload.request(index)
                gateway = fleet.gateways[index % len(fleet.gateways)]
                record = SessionRecord(index, gateway.name, round(planned + offset, 4), len(spec.text))
                records.append(record)
                url = f"ws://127.0.0.1:{gateway.port}/v1/audio/speech/stream"
                tasks.append(asyncio.create_task(
                    run_session(record, url, spec.text, args.seed, expected, run_start, args.session_timeout)))
            if tasks:
                await asyncio.wait(tasks, timeout=args.session_timeout + 5)
            for task in tasks:
                task.cancel()
            await asyncio.wait_for(timeline, 60)
            stop.set()
            await asyncio.wait_for(sampler, 10)
            probe_task.cancel()
        finally:
            stop.set()
            ended = fleet.now()
            logs = {c.name: c.log_text() for c in fleet.children()}
            fleet.stop_all()
            token_file.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                token_file.parent.rmdir()
    failovers = [dict(m.groupdict(), gateway=name) for name, text in logs.items() if name.startswith("g")
                 for m in FAILOVER_LINE.finditer(text)]
    problems = {name: [line for line in text.splitlines()
                       if re.search(r"\b(ERROR|CRITICAL|Traceback)\b", line)][:20] for name, text in logs.items()}
    return {
        "tool": "bench/fleet_sim.py",
        "command": "python " + shlex.join([str(Path(sys.argv[0])), *sys.argv[1:]]),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rate_sessions_per_s": rate,
        "mean_slot_time_s": mean_busy,
        "fleet_slots": fleet_slots,
        "load_start_s": offset,
        "run_s": ended,
        "hardware": hardware() | {"load_average_1m_before": load_before, "busy_cores_before": quiet},
        "children": [{"name": c.name, "kind": c.kind, "command": shlex.join(c.command), "started_s": c.started_at,
                      "ready_s": c.ready_at, "exited_s": c.exited_at, "returncode": c.returncode,
                      "cpu_s": c.cpu_s, "log": str(c.log_path)} for c in fleet.children()],
        "events": events,
        "samples": samples,
        "gateway_samples": gateway_samples,
        "cpu_samples": cpu_samples,
        "client_loop_lag_s": probe.lags if 'probe' in locals() else [],
        "client_cpu_s": time.process_time(),
        "failover_log": failovers,
        "log_problems": {k: v for k, v in problems.items() if v},
        "sessions": [asdict(r) for r in records],
        "logs_folder": str(folder),
    }


async def wait_pool(client: Any, fleet: Fleet, count: int, timeout_s: float) -> None:
    """Until every gateway's pool has `count` ready workers (voxgate_pool_workers{state="ready"})."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = []
        for g in fleet.gateways:
            answer = await http_get(client, f"http://127.0.0.1:{g.port}/metrics")
            ready = None
            if answer is not None and answer[0] == 200:
                ready = metric(parse_metrics(answer[1]), "voxgate_pool_workers", state="ready")
            seen.append(ready)
        if all(v is not None and v >= count for v in seen):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"gateways' pools did not reach {count} ready workers: {seen}")
        await asyncio.sleep(0.2)


async def drive_timeline(fleet: Fleet, client: Any, samples: list[dict], events: dict, args: argparse.Namespace,
                         offset: float) -> None:
    """Kill, drain, add at their times (seconds of load, `offset` = when the load started in run time)."""
    async def at(t: float) -> None:
        delay = offset + t - fleet.now()
        if delay > 0:
            await asyncio.sleep(delay)

    original = [f"w{i + 1}" for i in range(args.workers)]
    if args.kill_at is not None:
        await at(args.kill_at)
        streams = latest_streams(samples, original)
        victim = max(streams, key=streams.get) if streams else original[0]
        child = fleet.workers[victim]
        events["kill"] = {"t": fleet.now(), "worker": victim, "streams_before": streams.get(victim)}
        child.read_cpu()
        child.signal(signal.SIGKILL)
        child.process.wait(10)
        child.exited_at, child.returncode = fleet.now(), child.process.returncode
        print(f"t={fleet.now() - offset:.1f}s SIGKILL {victim} ({streams.get(victim)} streams)", flush=True)
    if args.drain_at is not None:
        await at(args.drain_at)
        streams = latest_streams(samples, [w for w in original if fleet.workers[w].alive])
        target = max(streams, key=streams.get) if streams else next(w for w in original if fleet.workers[w].alive)
        child = fleet.workers[target]
        events["drain"] = {"t": fleet.now(), "worker": target, "streams_before": streams.get(target)}
        child.read_cpu()
        child.process.send_signal(signal.SIGTERM)
        print(f"t={fleet.now() - offset:.1f}s SIGTERM {target} ({streams.get(target)} streams)", flush=True)
        waiter = asyncio.create_task(watch_exit(fleet, child, events["drain"], args.worker_drain_timeout + 15))
    else:
        waiter = None
    if args.add_at is not None:
        await at(args.add_at)
        name = f"w{args.workers + 1}"
        child = fleet.add_worker(name)
        events["add"] = {"t": fleet.now(), "worker": name}
        print(f"t={fleet.now() - offset:.1f}s started {name}", flush=True)
        try:
            await wait_ready(client, [child], args.start_timeout, fleet.run_start,
                             lambda w: f"http://127.0.0.1:{w.health_port}/ready", "voxgate worker ready")
            events["add"]["ready_t"] = child.ready_at
        except RuntimeError as exc:
            events["add"]["error"] = str(exc)[:2000]
    if waiter is not None:
        await waiter


async def watch_exit(fleet: Fleet, child: Child, event: dict, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while child.alive and time.monotonic() < deadline:
        child.read_cpu()
        await asyncio.sleep(0.1)
    if child.alive:
        event["exit_t"] = None
        event["error"] = f"still running {timeout_s:.0f} s after SIGTERM"
        return
    child.exited_at, child.returncode = fleet.now(), child.process.returncode
    event["exit_t"], event["returncode"] = child.exited_at, child.returncode
    print(f"{child.name} exited {child.returncode} {child.exited_at - event['t']:.1f} s after SIGTERM", flush=True)


# -- analysis ------------------------------------------------------------------------------------------


def dist(values: list[float], scale: float = 1.0, digits: int = 1) -> dict[str, Any]:
    clean = sorted(v * scale for v in values if v is not None and not math.isnan(v))
    if not clean:
        return {"n": 0}
    return {"n": len(clean), "min": round(clean[0], digits), "median": round(statistics.median(clean), digits),
            "p95": round(nearest_rank(clean, 95), digits), "p99": round(nearest_rank(clean, 99), digits),
            "max": round(clean[-1], digits)}


def phases(raw: dict) -> list[dict]:
    """The windows of the timeline with a fixed set of workers serving new sessions: from the load's start
    (after --warmup) to the kill; kill to drain; drain to the new worker's readiness (+ --settle); then to the
    end of the arrivals. Each with the workers up and accepting (not killed, not draining)."""
    cfg, ev = raw["config"], raw["events"]
    start = raw["load_start_s"]
    original = [f"w{i + 1}" for i in range(cfg["workers"])]
    end = start + cfg["duration"]
    cuts: list[tuple[str, float]] = []
    if "kill" in ev:
        cuts.append(("kill", ev["kill"]["t"]))
    if "drain" in ev:
        cuts.append(("drain", ev["drain"]["t"]))
    if "add" in ev:
        cuts.append(("add", ev["add"].get("ready_t") or ev["add"]["t"]))
    out = []
    serving = list(original)
    begin, label = start + cfg["warmup"], "all 6 up" if cfg["workers"] == 6 else f"all {cfg['workers']} up"
    for kind, t in cuts:
        out.append({"name": label, "from": begin, "to": t, "workers": list(serving)})
        if kind == "kill":
            serving.remove(ev["kill"]["worker"])
            label = f"after kill of {ev['kill']['worker']}"
            begin = t + cfg["settle"]
        elif kind == "drain":
            serving.remove(ev["drain"]["worker"])
            label = f"{ev['drain']['worker']} draining"
            begin = t + cfg["settle"]
        else:
            serving.append(ev["add"]["worker"])
            label = f"{ev['add']['worker']} added"
            begin = t + cfg["settle"]
    out.append({"name": label, "from": begin, "to": end, "workers": list(serving)})
    return [p for p in out if p["to"] > p["from"]]


def balance(raw: dict, phase: dict) -> dict:
    per: dict[str, list[float]] = {w: [] for w in phase["workers"]}
    util: list[float] = []
    for entry in raw["samples"]:
        if not phase["from"] <= entry["t"] < phase["to"]:
            continue
        used = cap = 0.0
        for w in phase["workers"]:
            r = entry["workers"].get(w) or {}
            if r.get("up") and r.get("streams") is not None:
                per[w].append(r["streams"])
                used += r["streams"] - (r.get("queued") or 0)
                cap += r.get("capacity") or 0
        if cap:
            util.append(used / cap)
    means = {w: statistics.fmean(v) for w, v in per.items() if v}
    ratio = (max(means.values()) / min(means.values())) if means and min(means.values()) > 0 else None
    return {"name": phase["name"], "from_s": round(phase["from"] - raw["load_start_s"], 2),
            "to_s": round(phase["to"] - raw["load_start_s"], 2), "workers": phase["workers"],
            "mean_streams": {w: round(v, 2) for w, v in means.items()},
            "max_over_min": round(ratio, 3) if ratio else None,
            "fleet_utilisation_mean": round(statistics.fmean(util), 3) if util else None, "samples": len(util)}


def add_report(raw: dict) -> dict | None:
    add = raw["events"].get("add")
    if not add:
        return None
    known = known_since(raw).get(add["worker"])
    return {**add, "in_every_gateway_pool_t": known if known is not None and math.isfinite(known) else None}


def known_since(raw: dict) -> dict[str, float]:
    """When each worker was in every running gateway's pool (voxgate_pool_streams has its label), by the
    gateways' 1 s samples; the first workers were before the load started (the run waits for that)."""
    original = {f"w{i + 1}" for i in range(raw["config"]["workers"])}
    since = {w: -math.inf for w in original}
    for g in raw.get("gateway_samples", []):
        pools = [v.get("pool_streams") or {} for v in g["gateways"].values() if v is not None]
        if not pools:
            continue
        for w in set.intersection(*(set(p) for p in pools)):
            since.setdefault(w, g["t"])
    return since


def utilisation_at(raw: dict, t: float) -> dict | None:
    """The fleet at the last sample at or before t, over the workers that take new sessions: up, not
    draining, and known to every gateway's pool by then (a worker just started is ready a little before the
    gateways discover it): utilisation = streams producing (streams - queued) / capacity, demand = streams
    (queued included) / capacity."""
    if "_known" not in raw:
        raw["_known"] = known_since(raw)
    known = raw["_known"]
    best = None
    for entry in raw["samples"]:
        if entry["t"] <= t:
            best = entry
        else:
            break
    if best is None:
        return None
    streams = cap = queued = 0.0
    for name, r in best["workers"].items():
        if r.get("up") and not r.get("draining") and r.get("capacity") and known.get(name, math.inf) <= t:
            streams += r.get("streams") or 0
            cap += r["capacity"]
            queued += r.get("queued") or 0
    producing = streams - queued  # a worker's streams include those waiting for a slot
    return {"sample_t_s": round(best["t"] - raw["load_start_s"], 3), "streams": streams, "queued": queued,
            "capacity": cap, "utilisation": round(producing / cap, 3) if cap else None,
            "demand": round(streams / cap, 3) if cap else None}


def pauses_at_kill(raw: dict) -> dict:
    return pauses_at(raw, "kill")


def pauses_at(raw: dict, event_name: str) -> dict:
    """Per session live at the event (the kill, the drain): the gap between its last frame before the event
    and its first after, minus its usual gap (median inter-frame gap of the session). 'failed over' = the
    gateways logged a failover (or hand-over) of the session from the event's worker; 'control' = the other
    sessions live at the event."""
    event = raw["events"].get(event_name)
    if not event:
        return {}
    k = event["t"]
    logged: dict[str, list[dict]] = {}
    for f in raw["failover_log"]:
        if f.get("src") == event["worker"]:
            logged.setdefault(f["session"], []).append(f)
    affected, control = [], []
    for s in raw["sessions"]:
        frames = s["frames"]
        if not s["session_id"] or len(frames) < 3:
            continue
        before = [f for f in frames if f[0] <= k]
        after = [f for f in frames if f[0] > k]
        if not before or not after:
            continue
        gaps = [b[0] - a[0] for a, b in zip(frames, frames[1:])]
        usual = statistics.median(gaps)
        gap = after[0][0] - before[-1][0]
        # The largest gap within 10 s after the event: a failover may happen a little later than the kill
        # (the stream's read returns an error when the gateway notices the dead socket).
        window = [b[0] - a[0] for a, b in zip(frames, frames[1:]) if k - 0.5 <= b[0] <= k + 10]
        largest = max(window) if window else gap
        # The sentence goes on from the codes of its delivered chunks (issue 33): how much of it had been
        # delivered no longer adds to the pause, as it did when the sentence was made again from its start
        # (at --speed x real time, delivered / speed). It may be the sentence playing, or the next one.
        lines = logged.get(s["session_id"], [])
        cut = int(lines[0]["sentence"]) if lines else before[-1][2]
        delivered_s = sum(f[1] for f in before if f[2] == cut) / 2 / 24000
        row = {"session_id": s["session_id"], "gateway": s["gateway"], "gap_ms": round(gap * 1000, 1),
               "playing_sentence": before[-1][2], "failed_over_sentence": int(lines[0]["sentence"]) if lines else None,
               "pool_pause_ms": float(lines[0]["pause"]) if lines else None,
               "resumed_from_codes": lines[0].get("resumed") == "True" if lines else None,
               "failed_over_audio_delivered_s": round(delivered_s, 3),
               "largest_gap_ms": round(largest * 1000, 1), "usual_gap_ms": round(usual * 1000, 1),
               "pause_ms": round((largest - usual) * 1000, 1),
               "pause_across_ms": round((gap - usual) * 1000, 1), "lost": bool(s["session_id"] and not
                                                                              (s["completed"] and s["audio_ok"]))}
        (affected if s["session_id"] in logged else control).append(row)
    near = [c for c in raw["cpu_samples"] if k - 2 <= c["t"] <= k + 4 and c.get("busy_cores") is not None]
    client = dist([r["pause_ms"] for r in affected])
    across = dist([r["pause_across_ms"] for r in affected])
    lines_here = [f for fs in logged.values() for f in fs]
    return {
        f"{event_name}_t_s": round(k - raw["load_start_s"], 3),
        "machine_busy_cores_around": [round(c["busy_cores"], 2) for c in near],  # per second, event-2 .. event+4 s
        "worker": event["worker"],
        "failed_over_sessions": len(affected),
        "failover_log_lines": len(lines_here),
        "resumed_from_codes": sum(1 for f in lines_here if f.get("resumed") == "True"),
        "logged_sessions_without_client_record": sorted(set(logged) - {r["session_id"] for r in affected}),
        "client_pause_ms": client,
        "client_pause_across_ms": across,
        # Judged on the gap across the event (the failover's own pause: the pool notices a kill or a hand-over
        # at once) and, apart, on the largest gap within 10 s after it, which also takes in what follows (a
        # next sentence waiting for a slot on a full worker, the machine's load).
        "target": {"p50_ms": PAUSE_TARGET_P50_MS, "p99_ms": PAUSE_TARGET_P99_MS,
                   "met": _meets(across), "met_by_largest_gap": _meets(client)},
        "pool_logged_pause_ms": dist([float(f["pause"]) for f in lines_here]),
        "control_pause_ms": dist([r["pause_ms"] for r in control]),
        "failed_over": affected,
    }


def _meets(pauses: dict) -> bool:
    return bool(pauses.get("n")) and pauses["median"] <= PAUSE_TARGET_P50_MS and pauses["p99"] <= PAUSE_TARGET_P99_MS


def analyse(raw: dict) -> dict:
    sessions = raw["sessions"]
    admitted = [s for s in sessions if s["session_id"]]
    completed = [s for s in admitted if s["completed"] and s["audio_ok"] and not s["errors"]]
    lost = [s for s in admitted if not (s["completed"] and s["audio_ok"] and not s["errors"])]
    refused = [s for s in sessions if s["refused"]]
    failed_to_start = [s for s in sessions if not s["session_id"] and not s["refused"]]
    refusals = []
    for s in refused:
        at = utilisation_at(raw, s["refused_s"]) or {}
        refusals.append({"t_s": round(s["refused_s"] - raw["load_start_s"], 3), "gateway": s["gateway"],
                         "code": s["refusal_code"], "message": s["refusal_message"], **at})
    utils = [r["utilisation"] for r in refusals if r.get("utilisation") is not None]
    cpu = [c["busy_cores"] for c in raw["cpu_samples"] if c.get("busy_cores") is not None]
    ours, others = cpu_split(raw["cpu_samples"])
    cores = raw["hardware"].get("cpus_usable") or os.cpu_count() or 1
    lag = raw.get("client_loop_lag_s") or []
    children_cpu = {c["name"]: c["cpu_s"] for c in raw["children"]}
    drain = raw["events"].get("drain") or {}
    report = {
        "sessions": {
            "offered": len(sessions), "admitted": len(admitted), "completed_byte_exact": len(completed),
            "lost": len(lost), "refused": len(refused), "failed_to_start": len(failed_to_start),
            "lost_detail": [{k: s[k] for k in ("index", "gateway", "session_id", "completed", "audio_ok", "errors",
                                               "mismatched_sentences")} for s in lost][:50],
            "failed_to_start_detail": [{k: s[k] for k in ("index", "gateway", "errors")} for s in failed_to_start][:20],
        },
        "balance": [balance(raw, p) for p in phases(raw)],
        "kill": pauses_at_kill(raw),
        "handover": pauses_at(raw, "drain"),
        "queueing": queueing(raw),
        "drain": {**drain, "exit_after_s": round(drain["exit_t"] - drain["t"], 2) if drain.get("exit_t") else None,
                  "sessions_admitted_to_it_after": None},
        "add": add_report(raw),
        "refusals": {
            "count": len(refusals),
            "codes": sorted({r["code"] for r in refusals}),
            "utilisation": dist(utils, 100, 1),
            "demand": dist([r["demand"] for r in refusals if r.get("demand") is not None], 100, 1),
            "below_90pct": sum(1 for u in utils if u < 0.9),
            "below_75pct": sum(1 for u in utils if u < 0.75),
            "by_phase": refusals_by_phase(raw, refusals),
            "list": refusals[:400],
        },
        "cpu": {
            "cores": cores,
            "busy_cores": dist(cpu, 1, 2),
            "busy_share_mean": round(statistics.fmean(cpu) / cores, 3) if cpu else None,
            "ours_cores": dist(ours, 1, 2),
            "others_cores": dist(others, 1, 2),
            "process_cpu_s": children_cpu,
            "client_cpu_s": raw.get("client_cpu_s"),
            "client_loop_lag_ms": dist(lag, 1000, 1),
            "load_average_1m": dist([c["load_average_1m"] for c in raw["cpu_samples"] if c.get("load_average_1m")], 1, 2),
        },
    }
    return report


def queueing(raw: dict) -> dict:
    """How often streams waited for a slot on one worker while another that takes new sessions had a free
    one (a session stays on its worker, so its next sentence queues there), from the 250 ms samples of the
    load's arrivals after --warmup; and what the clients saw: time to first audio, and each session's
    largest gap between frames (sessions failed over at the kill left out)."""
    lo = raw["load_start_s"] + raw["config"]["warmup"]
    hi = raw["load_start_s"] + raw["config"]["duration"]
    n = with_queue = misplaced = 0
    waiting_s = misplaced_s = 0.0
    for e in raw["samples"]:
        if not lo <= e["t"] < hi:
            continue
        n += 1
        up = [r for r in e["workers"].values() if r.get("up") and r.get("capacity")]
        queued = sum(r.get("queued") or 0 for r in up)
        free = sum(max(0.0, r["capacity"] - (r.get("streams") or 0)) for r in up if not r.get("draining"))
        waiting_s += queued * SAMPLE_INTERVAL_S
        if queued:
            with_queue += 1
            if free:
                misplaced += 1
                misplaced_s += queued * SAMPLE_INTERVAL_S
    failed_over = {f["session"] for f in raw["failover_log"]}
    ttfa, largest = [], []
    for x in raw["sessions"]:
        if not x["session_id"] or not x["frames"]:
            continue
        ttfa.append(x["frames"][0][0] - x["admitted_s"])
        if x["session_id"] not in failed_over and len(x["frames"]) > 1:
            largest.append(max(b[0] - a[0] for a, b in zip(x["frames"], x["frames"][1:])))
    return {"samples": n, "samples_with_streams_waiting": with_queue,
            "samples_waiting_while_a_slot_was_free_elsewhere": misplaced,
            "stream_s_waiting": round(waiting_s, 2), "stream_s_waiting_while_free_elsewhere": round(misplaced_s, 2),
            "time_to_first_audio_ms": dist(ttfa, 1000, 1), "largest_frame_gap_ms": dist(largest, 1000, 1),
            "sessions_with_a_gap_over_500ms": sum(1 for g in largest if g > 0.5)}


def cpu_split(cpu_samples: list[dict]) -> tuple[list[float], list[float]]:
    """Per interval between CPU samples: cores used by this run's processes (workers, gateways, the load
    client, the Redis server) and by everything else on the machine (busy - ours)."""
    ours, others = [], []
    def total(c: dict) -> float:
        return (sum(v for v in c["process_cpu_s"].values() if v) + (c.get("client_cpu_s") or 0)
                + (c.get("redis_cpu_s") or 0))
    for a, b in zip(cpu_samples, cpu_samples[1:]):
        dt = b["t"] - a["t"]
        if dt <= 0 or "process_cpu_s" not in a or "process_cpu_s" not in b:
            continue
        used = max(0.0, (total(b) - total(a)) / dt)
        ours.append(used)
        if b.get("busy_cores") is not None:
            others.append(max(0.0, b["busy_cores"] - used))
    return ours, others


def refusals_by_phase(raw: dict, refusals: list[dict]) -> list[dict]:
    out = []
    for p in phases(raw):
        lo, hi = p["from"] - raw["load_start_s"], p["to"] - raw["load_start_s"]
        inside = [r for r in refusals if lo <= r["t_s"] < hi]
        offered = [s for s in raw["sessions"] if lo <= (s["planned_s"] - raw["load_start_s"]) < hi]
        out.append({"name": p["name"], "refused": len(inside), "offered": len(offered)})
    return out


# -- report --------------------------------------------------------------------------------------------


def markdown(raw: dict, report: dict) -> str:
    cfg = raw["config"]
    s = report["sessions"]
    kill = report["kill"]
    lines = [
        "# Fleet simulation (issue 17)",
        "",
        "```",
        raw["command"],
        "```",
        "",
        *([f"(This report was re-made from the run's raw timeline: `python bench/fleet_sim.py --report-only"
           f" {raw['report_made_from']}`.)", ""] if raw.get("report_made_from") else []),
        f"{cfg['gateways']} gateways (`serve --backend remote -o discover=...`, `--store redis`) and {cfg['workers']}"
        f" workers (synthetic backend, capacity {cfg['capacity']} streams each at {cfg['speed']:g}x real time,"
        f" {cfg['chunk_ms']} ms chunks, first chunk after {cfg['first_chunk_delay']:g} s) on loopback, Redis"
        f" discovery. Open loop: Poisson {raw['rate_sessions_per_s']:.2f} sessions/s round robin over the gateways"
        f" ({cfg['sentences'][0]}-{cfg['sentences'][1]} sentences each, sent whole; mean slot time"
        f" {raw['mean_slot_time_s']:.2f} s), offering {cfg['utilisation']:.0%} of the {raw['fleet_slots']} slots"
        f" of 6 workers, for {cfg['duration']:g} s. Audio checked byte for byte against the synthetic backend"
        " run locally with the same options and seed.",
        "",
        f"Timeline (s of load): SIGKILL {raw['events'].get('kill', {}).get('worker')} at"
        f" {_rel(raw, raw['events'].get('kill', {}).get('t'))}, SIGTERM {raw['events'].get('drain', {}).get('worker')}"
        f" at {_rel(raw, raw['events'].get('drain', {}).get('t'))} (exited"
        f" {report['drain'].get('returncode')} after {report['drain'].get('exit_after_s')} s), started"
        f" {(report['add'] or {}).get('worker')} at {_rel(raw, (report['add'] or {}).get('t'))} (ready at"
        f" {_rel(raw, (report['add'] or {}).get('ready_t'))}, in every gateway's pool by"
        f" {_rel(raw, (report['add'] or {}).get('in_every_gateway_pool_t'))}, 1 s samples).",
        "",
        "## Headline",
        "",
        "| | |",
        "|---|---|",
        f"| sessions offered / admitted / completed byte-exact | {s['offered']} / {s['admitted']} / {s['completed_byte_exact']} |",
        f"| **sessions lost** (admitted, not completed with the expected audio) | **{s['lost']}** |",
        f"| refused (`overloaded`) / failed to start otherwise | {s['refused']} / {s['failed_to_start']} |",
    ]
    for b in report["balance"]:
        lines.append(f"| balance max/min, {b['name']} ({b['from_s']:.0f}-{b['to_s']:.0f} s, fleet"
                     f" {_pct(b['fleet_utilisation_mean'])}) | {b['max_over_min']} |")
    for label, pauses in (("at the kill", kill), ("at the drain's hand-over", report.get("handover"))):
        if pauses:
            a, p = pauses["client_pause_across_ms"], pauses["client_pause_ms"]
            met = "met" if pauses["target"]["met"] else "**not met**"
            met_largest = "met" if pauses["target"]["met_by_largest_gap"] else "not met"
            lines.append(f"| pause {label}, client side: the gap across it - the usual gap (ms, n={a.get('n', 0)};"
                         f" target p50 <= {PAUSE_TARGET_P50_MS:g}, p99 <= {PAUSE_TARGET_P99_MS:g}: {met}) | min"
                         f" {a.get('min')}, p50 {a.get('median')}, p99 {a.get('p99')}, max {a.get('max')}; the largest"
                         f" gap within 10 s after it instead: p50 {p.get('median')}, p99 {p.get('p99')} ({met_largest});"
                         f" resumed from codes {pauses['resumed_from_codes']} of {pauses['failover_log_lines']} |")
    r = report["refusals"]
    u = r["utilisation"]
    lines.append(f"| fleet utilisation (streams producing / slots) at the refusals (%, n={u.get('n', 0)}) | min {u.get('min')}, median"
                 f" {u.get('median')}, p95 {u.get('p95')}, max {u.get('max')}; below 90 %: {r['below_90pct']} |")
    c = report["cpu"]
    lines.append(f"| machine CPU busy (cores of {c['cores']}) | median {c['busy_cores'].get('median')}, p95"
                 f" {c['busy_cores'].get('p95')}, max {c['busy_cores'].get('max')} |")
    lines.append(f"| of which this run (workers, gateways, client, Redis) / other work on the machine (cores) |"
                 f" median {c['ours_cores'].get('median')}, p95 {c['ours_cores'].get('p95')} / median"
                 f" {c['others_cores'].get('median')}, p95 {c['others_cores'].get('p95')} |")
    lines += ["", "![streams per worker](fleet_sim.png)", "", "## Load balance", "",
              "Mean streams per worker over each window (samples every 250 ms from each worker's /metrics); windows"
              f" start {cfg['settle']:g} s after each event.", "",
              "| window | s | workers: mean streams | max/min | fleet utilisation |", "|---|---|---|---|---|"]
    for b in report["balance"]:
        means = ", ".join(f"{w} {v:.2f}" for w, v in b["mean_streams"].items())
        lines.append(f"| {b['name']} | {b['from_s']:.0f}-{b['to_s']:.0f} | {means} | {b['max_over_min']} |"
                     f" {_pct(b['fleet_utilisation_mean'])} |")
    for title, pauses, verb in (("The kill", kill, "SIGKILLed"), ("The drain", report.get("handover"), "SIGTERMed")):
        if not pauses:
            continue
        at = pauses.get("kill_t_s", pauses.get("drain_t_s"))
        lines += ["", f"## {title}", "",
                  f"{pauses['worker']} {verb} at {at:.1f} s. Failover (or hand-over) lines logged by the gateways"
                  f" for it: {pauses['failover_log_lines']} ({pauses['resumed_from_codes']} gone on from their codes),"
                  f" for {pauses['failed_over_sessions']} sessions the client saw live then. Machine busy cores per"
                  f" second from 2 s before to 4 s after: {pauses.get('machine_busy_cores_around')}.", "",
                  "| pause (ms) | n | min | p50 | p95 | p99 | max |", "|---|---|---|---|---|---|---|"]
        for label, key in (("client: the gap across it - usual gap, failed-over sessions", "client_pause_across_ms"),
                           ("client: largest gap within 10 s after it - usual gap, failed-over sessions",
                            "client_pause_ms"),
                           ("pool's pause_ms (log line)", "pool_logged_pause_ms"),
                           ("client, other sessions live then (control)", "control_pause_ms")):
            d = pauses[key]
            lines.append(f"| {label} | {d.get('n', 0)} | {d.get('min', '-')} | {d.get('median', '-')} |"
                         f" {d.get('p95', '-')} | {d.get('p99', '-')} | {d.get('max', '-')} |")
        lines += ["", "The pool goes on with a failed-over sentence from the codes of its delivered chunks (issue 33):"
                  " the new worker makes only the rest, so the pause is noticing the loss, dialling the next worker"
                  f" and its first chunk ({cfg['first_chunk_delay']:g} s here), whatever had been delivered.", "",
                  "| session | gateway | sentence playing / failed over | its audio delivered (s) | from codes |"
                  " client pause across / largest within 10 s (ms) | pool pause_ms |", "|---|---|---|---|---|---|---|"]
        for row in sorted(pauses["failed_over"], key=lambda r: r["pause_ms"]):
            lines.append(f"| {row['session_id'][:8]} | {row['gateway']} | {row['playing_sentence']} /"
                         f" {row['failed_over_sentence']} | {row['failed_over_audio_delivered_s']:.2f} |"
                         f" {row.get('resumed_from_codes')} | {row['pause_across_ms']:.0f} / {row['pause_ms']:.0f} |"
                         f" {_num(row['pool_pause_ms'])} |")
    q = report["queueing"]
    lines += ["", "## Waiting for a slot", "",
              f"Of {q['samples']} samples (250 ms, {cfg['warmup']:g} s to the end of the arrivals),"
              f" {q['samples_with_streams_waiting']} had streams waiting for a slot on some worker, and"
              f" {q['samples_waiting_while_a_slot_was_free_elsewhere']} of those while a worker taking new sessions"
              f" had a free slot (a session stays on its worker, so its next sentence waits there):"
              f" {q['stream_s_waiting_while_free_elsewhere']} of {q['stream_s_waiting']} stream-seconds of waiting.",
              "",
              "| client side (admitted sessions) | n | min | median | p95 | max |", "|---|---|---|---|---|---|"]
    for label, key in (("time to first audio (ms)", "time_to_first_audio_ms"),
                       ("largest gap between frames of a session, not failed over (ms)", "largest_frame_gap_ms")):
        d = q[key]
        lines.append(f"| {label} | {d.get('n', 0)} | {d.get('min', '-')} | {d.get('median', '-')} | {d.get('p95', '-')} |"
                     f" {d.get('max', '-')} |")
    lines += ["", f"Sessions (not failed over) with a gap over 500 ms: {q['sessions_with_a_gap_over_500ms']}."]
    lines += ["", "## Refusals", "",
              f"{r['count']} sessions refused ({', '.join(r['codes']) or 'none'}). At each refusal, over the workers up"
              " and not draining, at the last 250 ms sample before it: utilisation = streams producing / slots"
              f" (min {u.get('min')} %, median {u.get('median')} %, max {u.get('max')} %); demand = streams with those"
              f" waiting for a slot / slots (min {r['demand'].get('min')} %, median {r['demand'].get('median')} %).", "",
              "| window | offered | refused |", "|---|---|---|"]
    for p in r["by_phase"]:
        lines.append(f"| {p['name']} | {p['offered']} | {p['refused']} |")
    if s["lost_detail"]:
        lines += ["", "## Lost sessions", ""]
        for x in s["lost_detail"]:
            lines.append(f"- #{x['index']} on {x['gateway']} ({x['session_id']}): completed {x['completed']},"
                         f" audio_ok {x['audio_ok']}, errors {x['errors'][:3]}, mismatched {x['mismatched_sentences']}")
    hw = raw["hardware"]
    lines += ["", "## Machine and processes", "",
              f"{hw.get('cpu')}, {hw.get('cpus_usable')} CPUs usable, {hw.get('platform')}, Python {hw.get('python')}."
              f" Load average (1 min) before {hw.get('load_average_1m_before')}, during: median"
              f" {c['load_average_1m'].get('median')}, max {c['load_average_1m'].get('max')}. Client event-loop lag:"
              f" median {c['client_loop_lag_ms'].get('median')} ms, p95 {c['client_loop_lag_ms'].get('p95')} ms, max"
              f" {c['client_loop_lag_ms'].get('max')} ms. Run {raw['run_s']:.0f} s in all (start-up included).", "",
              "| process | CPU s | started / ready / exited (s of load) | exit status |", "|---|---|---|---|"]
    for child in raw["children"]:
        times = " / ".join(_rel(raw, child[k]) for k in ("started_s", "ready_s", "exited_s"))
        lines.append(f"| {child['name']} | {_num(child['cpu_s'])} | {times} | {child['returncode']} |")
    lines.append(f"| load client (this script) | {_num(raw.get('client_cpu_s'))} | | |")
    redis_cpu = [c.get("redis_cpu_s") for c in raw["cpu_samples"] if c.get("redis_cpu_s") is not None]
    if len(redis_cpu) > 1:
        lines.append(f"| redis-server (shared; during the load) | {_num(redis_cpu[-1] - redis_cpu[0])} | | |")
    lines += ["", "Commands (the first worker and gateway; the others differ in ports and ids):", "", "```"]
    for prefix in ("w1", "g1"):
        child = next((c for c in raw["children"] if c["name"] == prefix), None)
        if child:
            lines.append(_redact(child["command"]))
    lines.append("```")
    if raw.get("log_problems"):
        lines += ["", "## Error lines in the logs", ""]
        for name, items in raw["log_problems"].items():
            lines.append(f"- {name}: " + "; ".join(f"`{i[:200]}`" for i in items[:5]))
    return "\n".join(lines) + "\n"


def _rel(raw: dict, t: float | None) -> str:
    return "-" if t is None else f"{t - raw['load_start_s']:.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _redact(command: str) -> str:
    """The token file's random folder and the interpreter's path out of a command line."""
    command = re.sub(r"/[^\s=]*voxgate-bench-[^/ ]+/worker\.token", "TOKEN_FILE", command)
    return re.sub(r"^\S*python[\d.]*(?= )", "python", command)


def plot(raw: dict, report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = raw["load_start_s"]
    names = sorted({w for e in raw["samples"] for w in e["workers"]}, key=lambda n: int(n[1:]) if n[1:].isdigit() else n)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    for name in names:
        xs, ys = [], []
        for e in raw["samples"]:
            r = e["workers"].get(name)
            if r is None:
                continue
            xs.append(e["t"] - t0)
            ys.append(r.get("streams") if r.get("up") else math.nan)
        top.plot(xs, ys, label=name, linewidth=1.1)
    cap = raw["config"]["capacity"]
    top.axhline(cap, color="grey", linestyle=":", linewidth=1)
    top.text(0, cap + 0.15, f"capacity {cap}", color="grey", fontsize=8)
    util_x, util_y, inflight = [], [], []
    for e in raw["samples"]:
        u = utilisation_at(raw, e["t"])
        util_x.append(e["t"] - t0)
        util_y.append((u or {}).get("utilisation") or math.nan)
    bottom.plot(util_x, [100 * v for v in util_y], color="black", linewidth=1, label="fleet utilisation (up, not draining)")
    refusal_t = [r["t_s"] for r in report["refusals"]["list"]]
    if refusal_t:
        bottom.plot(refusal_t, [102] * len(refusal_t), "|", color="red", markersize=9, label="refusal")
    ev = raw["events"]
    for kind, color in (("kill", "red"), ("drain", "orange"), ("add", "green")):
        if kind in ev:
            x = ev[kind]["t"] - t0
            for axis in (top, bottom):
                axis.axvline(x, color=color, linestyle="--", linewidth=1.2)
            top.text(x, 1.0, f" {kind} {ev[kind]['worker']}", color=color, fontsize=9, va="bottom",
                     transform=top.get_xaxis_transform())
    top.set_ylabel("streams per worker (incl. waiting for a slot)")
    top.legend(loc="upper left", fontsize=8, bbox_to_anchor=(1.005, 1.0))
    fig.suptitle(f"{raw['config']['gateways']} gateways, {len(names)} workers (capacity {cap}), "
                  f"{raw['rate_sessions_per_s']:.1f} sessions/s; lost {report['sessions']['lost']}, "
                  f"refused {report['sessions']['refused']}")
    bottom.set_ylabel("%")
    bottom.set_ylim(0, 110)
    bottom.set_xlabel("seconds of load")
    bottom.legend(loc="upper left", fontsize=8, bbox_to_anchor=(1.005, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(raw: dict, output_dir: Path, name: str) -> dict:
    report = analyse(raw)
    output_dir.mkdir(parents=True, exist_ok=True)
    summary = {k: raw[k] for k in ("tool", "command", "config", "rate_sessions_per_s", "mean_slot_time_s",
                                   "fleet_slots", "hardware", "events", "run_s", "load_start_s")}
    summary["children"] = [{**c, "command": _redact(c["command"])} for c in raw["children"]]
    summary["command"] = raw["command"]
    summary["report"] = report
    summary["worker_samples"] = [{"t": round(e["t"] - raw["load_start_s"], 3),
                                  **{w: (r.get("streams") if r.get("up") else None) for w, r in e["workers"].items()}}
                                 for e in raw["samples"]]
    summary["failover_log"] = raw["failover_log"]
    summary["log_problems"] = raw.get("log_problems", {})
    (output_dir / f"{name}.json").write_text(json.dumps(json_safe(summary), indent=1, allow_nan=False) + "\n")
    (output_dir / f"{name}.md").write_text(markdown(raw, report))
    plot(raw, report, output_dir / f"{name}.png")
    raw.pop("_known", None)
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--gateways", type=int, default=3)
    p.add_argument("--capacity", type=int, default=8, help="streams per worker at once (synthetic capacity)")
    p.add_argument("--speed", type=float, default=2.0, help="times real time per stream after the first chunk")
    p.add_argument("--chunk-ms", type=int, default=200)
    p.add_argument("--first-chunk-delay", type=float, default=0.05)
    p.add_argument("--utilisation", type=float, default=0.8, help="offered streams / slots of the first workers")
    p.add_argument("--rate", type=float, help="sessions per second (default: from --utilisation)")
    p.add_argument("--duration", type=float, default=100.0, help="seconds of arrivals")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds before the first balance window")
    p.add_argument("--kill-at", type=float, default=35.0)
    p.add_argument("--drain-at", type=float, default=55.0)
    p.add_argument("--add-at", type=float, default=70.0)
    p.add_argument("--settle", type=float, default=5.0, help="seconds after each event not in a balance window")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sentences", type=parse_range, default=(2, 3), metavar="N|LOW-HIGH")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    p.add_argument("--prompt-count", type=int, default=120, help="first N prompts only (the render caches hold them)")
    p.add_argument("--registry-url", default="redis://127.0.0.1:6379/13", help="Redis database for discovery (flushed)")
    p.add_argument("--store-url", default="redis://127.0.0.1:6379/14", help="Redis database for sessions (flushed)")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra `serve` argument (repeatable)")
    p.add_argument("--worker-drain-timeout", type=float, default=30.0)
    p.add_argument("--start-timeout", type=float, default=60.0)
    p.add_argument("--session-timeout", type=float, default=60.0)
    p.add_argument("--quiet-wait", type=float, default=0.0,
                   help="wait up to this long for the machine to be idle (under --quiet-below busy cores) first")
    p.add_argument("--quiet-below", type=float, default=0.3)
    p.add_argument("--output-dir", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--name", default="fleet_sim", help="file name of the results (NAME.json, .md, .png)")
    p.add_argument("--raw", type=Path,
                   help="where the raw timeline goes, gzipped JSON (default OUTPUT_DIR/NAME_raw.json.gz)")
    p.add_argument("--report-only", type=Path, metavar="RAW", help="re-make the report from a raw timeline")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report_only:
        raw = json.loads(gzip.decompress(args.report_only.read_bytes()))
        raw["report_made_from"] = str(args.report_only)
    else:
        raw = asyncio.run(run(args))
        raw_path = args.raw or args.output_dir / f"{args.name}_raw.json.gz"
        raw_path.parent.mkdir(parents=True, exist_ok=True)
        # mtime=0: the same timeline gives the same bytes
        raw_path.write_bytes(gzip.compress(json.dumps(json_safe(raw)).encode(), mtime=0))
    report = write_outputs(raw, args.output_dir, args.name)
    s = report["sessions"]
    print(json.dumps({"sessions": {k: s[k] for k in ("offered", "admitted", "completed_byte_exact", "lost", "refused",
                                                      "failed_to_start")},
                      "balance": [(b["name"], b["max_over_min"]) for b in report["balance"]],
                      "kill_pause_ms": report["kill"].get("client_pause_across_ms") if report["kill"] else None,
                      "handover_pause_ms": report["handover"].get("client_pause_across_ms") if report["handover"] else None,
                      "refusal_utilisation_pct": report["refusals"]["utilisation"],
                      "cpu_busy_cores": report["cpu"]["busy_cores"]}, indent=1))
    print(f"wrote {args.output_dir / args.name}.json, .md, .png")
    return 0 if s["lost"] == 0 and s["failed_to_start"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
