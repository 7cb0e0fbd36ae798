"""Load generator for the Voxgate streaming WebSocket, measured the way bench/README.md describes.

Each request is one WebSocket session: connect, `session.config` (streaming PCM), wait for
`session.started`, then time zero, `input.text` (whole, or in token-sized pieces at a set rate with
--stream-tokens), `input.done`, and every `audio.start` / binary frame / `audio.done` until
`session.done`. The client notes when each binary frame arrived and derives, per request: time to first
byte, to the first complete sample, to the first audible sample (as a listener with a zero pre-buffer
would hear it), playback underruns, end to end time, real-time factor.

Load is either closed loop (--concurrency N sessions, each starting its next request when the last one
ends) or open loop (--rps R Poisson arrivals that never wait for completions). Every random draw (arrival
times, prompt order, sentences per turn) comes from the seed, so the same seed and rate give the same
schedule and the same prompts against any system. A warm-up phase runs first and is not measured.

    python bench/loadgen.py --url ws://127.0.0.1:8000/v1/audio/speech/stream --concurrency 4 \\
        --warmup 10 --duration 60 --output bench/results/run.json

The metric functions (`nearest_rank`, `audible_onset`, `simulate_playback`, `request_metrics`,
`summarize`) are importable and have no network dependencies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make `gateway` and `bench` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_URL = "ws://127.0.0.1:8000/v1/audio/speech/stream"
DEFAULT_PROMPTS = Path(__file__).resolve().parent / "data" / "arctic_en.jsonl"
# session.config's split_granularity values (token: each sentence's synthesis starts at its first words).
GRANULARITIES = ("token", "sentence", "clause", "none")

# Audible onset (bench/README.md): the first of two consecutive 20 ms windows, 10 ms hop, DC removed,
# with RMS at least -45 dBFS. dBFS here is relative to 32768 (a full-scale square wave is 0 dBFS).
ONSET_WINDOW_S = 0.020
ONSET_HOP_S = 0.010
ONSET_THRESHOLD_DBFS = -45.0
# Only the start of each request's audio is kept for onset detection.
ONSET_SEARCH_S = 10.0
QUANTILES = (50, 95, 99)


# -- metrics -------------------------------------------------------------------------------------------


def nearest_rank(values: Sequence[float], percentile: float) -> float:
    """Nearest-rank percentile: the smallest value with at least `percentile` % of values at or below it."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(percentile / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def audible_onset(
    samples: np.ndarray,
    sample_rate: int,
    threshold_dbfs: float = ONSET_THRESHOLD_DBFS,
    window_s: float = ONSET_WINDOW_S,
    hop_s: float = ONSET_HOP_S,
) -> float | None:
    """Seconds into `samples` (int16 or float in [-1, 1)) of the audible onset, or None if never audible."""
    x = np.asarray(samples)
    x = x.astype(np.float64) / 32768.0 if x.dtype.kind in "iu" else x.astype(np.float64)
    window = max(1, round(window_s * sample_rate))
    hop = max(1, round(hop_s * sample_rate))
    if len(x) < window:
        return None
    starts = np.arange(0, len(x) - window + 1, hop)
    frames = np.lib.stride_tricks.sliding_window_view(x, window)[starts]
    frames = frames - frames.mean(axis=1, keepdims=True)
    rms = np.sqrt(np.mean(frames * frames, axis=1))
    loud = rms >= 10 ** (threshold_dbfs / 20)
    both = np.flatnonzero(loud[:-1] & loud[1:])
    if len(both) == 0:
        return None
    return float(starts[both[0]] / sample_rate)


@dataclass
class Playback:
    underruns: int = 0
    total_stall_s: float = 0.0
    longest_stall_s: float = 0.0
    # When each piece starts playing, on the same clock as the arrivals.
    play_starts: list[float] = field(default_factory=list)
    # Each underrun: when the silence began (the deadline the late piece missed) and how long it lasted.
    stalls: list[tuple[float, float]] = field(default_factory=list)


def simulate_playback(pieces: Sequence[tuple[float, float]]) -> Playback:
    """Zero pre-buffer playback of pieces given as (arrival time, duration in seconds).

    Playback starts when the first piece arrives; each piece pushes the deadline forward by its duration;
    a piece that arrives after the deadline is an underrun (the listener hears a gap of arrival - deadline)
    and the timeline restarts from its arrival.
    """
    result = Playback()
    deadline: float | None = None
    for arrival, duration in pieces:
        if deadline is None:
            start = arrival
        elif arrival > deadline:
            stall = arrival - deadline
            result.underruns += 1
            result.total_stall_s += stall
            result.longest_stall_s = max(result.longest_stall_s, stall)
            result.stalls.append((deadline, stall))
            start = arrival
        else:
            start = deadline
        result.play_starts.append(start)
        deadline = start + duration
    return result


def play_time_of(offset_s: float, pieces: Sequence[tuple[float, float]], playback: Playback) -> float:
    """When the sample `offset_s` seconds into the audio plays, under `playback` of `pieces`."""
    before = 0.0
    for (_, duration), start in zip(pieces, playback.play_starts):
        if before <= offset_s < before + duration:
            return start + (offset_s - before)
        before += duration
    return math.nan


@dataclass
class RequestResult:
    """One request as the client saw it. Times are seconds from time zero unless named otherwise."""

    index: int
    prompt_ids: list[str]
    chars: int
    measured: bool
    planned_s: float | None = None  # planned start, seconds from the run start (open loop)
    schedule_lag_s: float | None = None  # actual - planned start (open loop)
    setup_s: float | None = None  # connect + session.config until session.started
    ttfb_s: float | None = None
    first_playable_s: float | None = None
    audible_ttfa_s: float | None = None
    audible_offset_s: float | None = None  # onset position within the audio
    e2e_s: float | None = None  # last audio byte
    # Agent workload (--agent-sentences): when the first sentence's last word was sent, and the audible
    # TTFA counted from then instead of from time zero (what waiting for the sentence's end costs).
    first_sentence_sent_s: float | None = None
    audible_ttfa_after_sentence_s: float | None = None
    done_s: float | None = None  # session.done
    audio_s: float = 0.0
    rtf: float | None = None
    bytes: int = 0
    frames: int = 0
    sentences: int = 0
    underruns: int = 0
    total_stall_s: float = 0.0
    longest_stall_s: float = 0.0
    # Each underrun as [when the silence began, its length] in seconds, the time on the clock of
    # `audio_origin_perf` (time.perf_counter() when the text went; frame arrivals count from it): a disturbance
    # at a known moment (bench/engine_load.py's kill or drain) finds the silences it caused.
    stalls: list[list[float]] = field(default_factory=list)
    audio_origin_perf: float | None = None
    arrivals: list[float] = field(default_factory=list)  # each binary frame's arrival, on the same clock
    session_id: str | None = None  # session.started's, to find the session in the gateway's log
    whole_samples: bool = True
    completed: bool = False
    errors: list[str] = field(default_factory=list)
    # session.started's warnings as "code:field": options the server did not honour (e.g. a granularity
    # its backend cannot stream), so a report shows which mode was really measured.
    warnings: list[str] = field(default_factory=list)
    started_at: float | None = None  # seconds from the run start
    finished_at: float | None = None

    @property
    def ok(self) -> bool:
        return self.completed and not self.errors and self.bytes > 0 and self.whole_samples


def request_metrics(
    result: RequestResult,
    frames: Sequence[tuple[float, int]],
    bytes_per_sample: int,
    sample_rate: int,
    audio_prefix: np.ndarray,
    completed: bool = True,
) -> RequestResult:
    """Fill in the timing metrics of `result` from its frames: (arrival s from time zero, byte count).
    `audio_prefix`: the first samples of the audio (at least up to the onset); `completed`: whether the
    request ended normally, so that its last frame is its last byte."""
    result.frames = len(frames)
    result.bytes = sum(n for _, n in frames)
    result.whole_samples = all(n % bytes_per_sample == 0 for _, n in frames)
    result.audio_s = result.bytes / bytes_per_sample / sample_rate
    if frames:
        result.ttfb_s = frames[0][0]
        received = 0
        for arrival, n in frames:
            received += n
            if received >= bytes_per_sample:
                result.first_playable_s = arrival
                break
        result.arrivals = [arrival for arrival, _ in frames]
        pieces = [(arrival, n / bytes_per_sample / sample_rate) for arrival, n in frames]
        playback = simulate_playback(pieces)
        result.underruns = playback.underruns
        result.total_stall_s = playback.total_stall_s
        result.longest_stall_s = playback.longest_stall_s
        result.stalls = [[at, length] for at, length in playback.stalls]
        onset = audible_onset(audio_prefix, sample_rate)
        if onset is not None:
            result.audible_offset_s = onset
            result.audible_ttfa_s = play_time_of(onset, pieces, playback)
    if completed and frames:
        result.e2e_s = frames[-1][0]
        if result.audio_s > 0:
            result.rtf = result.e2e_s / result.audio_s
    return result


def distribution(values: Sequence[float]) -> dict[str, float | int]:
    clean = [v for v in values if v is not None and not math.isnan(v)]
    out: dict[str, float | int] = {"n": len(clean)}
    for q in QUANTILES:
        out[f"p{q}"] = nearest_rank(clean, q)
    out["mean"] = statistics.fmean(clean) if clean else math.nan
    out["max"] = max(clean) if clean else math.nan
    return out


METRICS = ("ttfb_s", "first_playable_s", "audible_ttfa_s", "audible_ttfa_after_sentence_s", "e2e_s", "rtf",
           "setup_s", "schedule_lag_s")


BACKLOG_MIN_SAMPLES = 40  # 10 s of in-flight samples at 4 per second


def growing_backlog(in_flight: Sequence[tuple[float, int]]) -> bool:
    """Whether requests in flight grew over the measured phase: a least-squares line through the samples
    rises by more than the mean number in flight (and more than 3). A system that keeps up fluctuates
    around a level; one that does not grows by (arrival rate - service rate) x time. Phases shorter than
    BACKLOG_MIN_SAMPLES samples are too short to tell and never count as growing."""
    if len(in_flight) < BACKLOG_MIN_SAMPLES:
        return False
    t = np.array([s for s, _ in in_flight], dtype=np.float64)
    counts = np.array([c for _, c in in_flight], dtype=np.float64)
    slope = np.polyfit(t, counts, 1)[0]
    growth = slope * (t[-1] - t[0])
    return bool(growth > max(3.0, counts.mean()))


def summarize(
    results: Sequence[RequestResult],
    wall_s: float,
    scheduled: int | None = None,
    in_flight: Sequence[tuple[float, int]] = (),
    client_loop_lag: Sequence[float] = (),
) -> dict[str, Any]:
    """Distributions over the measured requests and the pass/fail verdict of bench/README.md."""
    measured = [r for r in results if r.measured]
    summary: dict[str, Any] = {name: distribution([getattr(r, name) for r in measured]) for name in METRICS}
    audio_total = sum(r.audio_s for r in measured)
    reasons = []
    scheduled = len(measured) if scheduled is None else scheduled
    failed = [r for r in measured if not r.ok]
    underrun_requests = [r for r in measured if r.underruns]
    if len(measured) < scheduled:
        reasons.append(f"{scheduled - len(measured)} scheduled requests never started")
    if failed:
        reasons.append(f"{len(failed)} requests failed or returned no / partial-sample audio")
    if underrun_requests:
        reasons.append(f"{len(underrun_requests)} requests had underruns")
    backlog = growing_backlog(in_flight)
    if backlog:
        reasons.append("requests in flight kept growing")
    if not measured:
        reasons.append("no measured requests")
    summary.update(
        requests=len(measured),
        scheduled=scheduled,
        completed=sum(r.completed for r in measured),
        failed=len(failed),
        errors=sorted({e for r in measured for e in r.errors}),
        warnings=sorted({w for r in measured for w in r.warnings}),
        underrun_events=sum(r.underruns for r in measured),
        underrun_requests=len(underrun_requests),
        total_stall_s=sum(r.total_stall_s for r in measured),
        longest_stall_s=max((r.longest_stall_s for r in measured), default=0.0),
        audio_s=audio_total,
        wall_s=wall_s,
        audio_s_per_wall_s=audio_total / wall_s if wall_s > 0 else math.nan,
        growing_backlog=backlog,
        max_in_flight=max((c for _, c in in_flight), default=0),
        client_loop_lag_s=distribution(list(client_loop_lag)),
        passed=not reasons,
        fail_reasons=reasons,
    )
    return summary


def across_seeds(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The headline form: for each metric, the median across seeds of each seed's p50 / p95 / p99."""
    out: dict[str, Any] = {}
    for name in METRICS:
        out[name] = {
            f"p{q}": statistics.median([s[name][f"p{q}"] for s in summaries]) if summaries else math.nan
            for q in QUANTILES
        }
    out["passed"] = all(s["passed"] for s in summaries)
    out["audio_s_per_wall_s"] = statistics.median([s["audio_s_per_wall_s"] for s in summaries]) if summaries else 0
    return out


# -- workload ------------------------------------------------------------------------------------------


def load_prompts(path: Path) -> list[dict[str, str]]:
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"no prompts in {path}")
    return rows


def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    low_n, high_n = int(low), int(high or low)
    if not 1 <= low_n <= high_n:
        raise argparse.ArgumentTypeError(f"expected N or LOW-HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return low_n, high_n


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt_ids: list[str]
    text: str
    first_sentence_chars: int = 0  # len of the first prompt's text: where the first sentence ends in `text`


class Workload:
    """The seeded sequence of requests: request i always has the same text for a given seed."""

    def __init__(self, prompts: list[dict[str, str]], seed: int, sentences: tuple[int, int]) -> None:
        self.prompts = prompts
        self.sentences = sentences
        self._rng = random.Random(f"voxgate-prompts-{seed}")
        self._specs: list[RequestSpec] = []

    def request(self, index: int) -> RequestSpec:
        while len(self._specs) <= index:
            n = self._rng.randint(*self.sentences)
            start = self._rng.randrange(len(self.prompts))
            rows = [self.prompts[(start + k) % len(self.prompts)] for k in range(n)]
            self._specs.append(RequestSpec(len(self._specs), [r["id"] for r in rows], " ".join(r["text"] for r in rows),
                                           first_sentence_chars=len(rows[0]["text"])))
        return self._specs[index]


def poisson_schedule(rate: float, horizon_s: float, seed: int) -> list[float]:
    """Arrival times in [0, horizon_s) of a Poisson process of `rate` per second."""
    rng = random.Random(f"voxgate-arrivals-{seed}")
    times, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= horizon_s:
            return times
        times.append(t)


def token_pieces(text: str) -> list[str]:
    """Text cut roughly like LLM tokens: words with their leading space, long words in 4-char parts,
    punctuation on its own."""
    pieces = []
    for match in re.finditer(r"\s*(?:\w+|[^\w\s]+)", text):
        word = match.group()
        while len(word) > 6:
            pieces.append(word[:4])
            word = word[4:]
        pieces.append(word)
    tail = text[sum(len(p) for p in pieces) :]
    if tail:
        pieces.append(tail)
    return pieces


def word_pieces(text: str) -> list[str]:
    """Text one word per piece, each word with the whitespace after it (the agent workload's input.text
    messages, ../shared/bench/README.md). The pieces join back to `text`."""
    return re.findall(r"\s*\S+\s*", text) or ([text] if text else [])


def last_piece_of(pieces: Sequence[str], chars: int) -> int:
    """Index of the piece that holds character `chars - 1` of the joined text: the last word of a first
    sentence `chars` long."""
    end = 0
    for i, piece in enumerate(pieces):
        end += len(piece)
        if end >= chars:
            return i
    return len(pieces) - 1


# -- client --------------------------------------------------------------------------------------------


class Playing:
    """How many sessions are playing now: their first audio came, their end has not. A disturbance
    (bench/engine_load.py's kill or drain, from its timer thread) waits for one, or no listener is there to
    hear it."""

    def __init__(self) -> None:
        self.count = 0


@dataclass
class ClientOptions:
    url: str = DEFAULT_URL
    voice: str | None = None
    language: str | None = None
    response_format: str = "pcm"
    sample_rate: int | None = None
    split_granularity: str | None = None
    extra_config: dict[str, Any] = field(default_factory=dict)
    stream_tokens: bool = False
    token_rate: float = 40.0
    # Agent workload: each reply sent one word per input.text at this many words per second.
    words_per_s: float | None = None
    timeout_s: float = 120.0
    api_key: str | None = None
    playing: Playing | None = None  # counts this client's sessions that are playing

    def session_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {"type": "session.config", "stream_audio": True, "response_format": self.response_format}
        for key in ("voice", "language", "sample_rate", "split_granularity"):
            value = getattr(self, key)
            if value is not None:
                config[key] = value
        config.update(self.extra_config)
        return config


def _decode(fmt: str, data: bytes) -> np.ndarray:
    if fmt in ("mulaw", "alaw"):
        from gateway.audio.pcm import alaw_decode, mulaw_decode  # numpy only; no server imports

        return mulaw_decode(data) if fmt == "mulaw" else alaw_decode(data)
    return np.frombuffer(data[: len(data) & ~1], dtype="<i2")


async def run_request(spec: RequestSpec, options: ClientOptions, measured: bool, run_start: float,
                      planned_s: float | None = None) -> RequestResult:
    """One session from connect to session.done; never raises (failures are recorded in `errors`)."""
    from websockets.asyncio.client import connect

    result = RequestResult(index=spec.index, prompt_ids=spec.prompt_ids, chars=len(spec.text), measured=measured)
    began = time.perf_counter()
    result.started_at = began - run_start
    if planned_s is not None:
        result.planned_s = planned_s
        result.schedule_lag_s = result.started_at - planned_s
    frames: list[tuple[float, int]] = []
    prefix: list[bytes] = []
    stream = {"format": options.response_format, "rate": options.sample_rate or 0, "bytes_per_sample": 2}
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else None

    async def session() -> None:
        sentence_bytes: dict[int, int] = {}
        current_sentence: int | None = None
        prefix_bytes = 0
        sender: asyncio.Task | None = None
        async with connect(options.url, max_size=None, compression=None, additional_headers=headers,
                           open_timeout=options.timeout_s) as ws:
            await ws.send(json.dumps(options.session_config()))
            started = json.loads(await ws.recv())
            if started.get("type") != "session.started":
                raise RuntimeError(f"expected session.started, got {started.get('type')}: {started.get('code')}")
            stream["format"] = started.get("format", stream["format"])
            stream["rate"] = rate = int(started.get("sample_rate", stream["rate"]))
            stream["bytes_per_sample"] = bytes_per_sample = 1 if stream["format"] in ("mulaw", "alaw") else 2
            result.warnings = [f"{w.get('code')}:{w.get('field')}" for w in started.get("warnings") or []]
            result.session_id = started.get("session_id")
            t0 = time.perf_counter()
            result.audio_origin_perf = t0
            result.setup_s = t0 - began
            try:
                if options.words_per_s:
                    pieces = word_pieces(spec.text)
                    marks = {last_piece_of(pieces, spec.first_sentence_chars): "first_sentence_sent_s"}
                    sender = asyncio.create_task(_send_pieces(ws, pieces, options.words_per_s, t0, result, marks))
                elif options.stream_tokens:
                    sender = asyncio.create_task(_send_pieces(ws, token_pieces(spec.text), options.token_rate, t0))
                else:
                    await ws.send(json.dumps({"type": "input.text", "text": spec.text}))
                    await ws.send(json.dumps({"type": "input.done"}))
                async for message in ws:
                    now = time.perf_counter() - t0
                    if isinstance(message, bytes):
                        if not frames and options.playing is not None:
                            options.playing.count += 1
                        frames.append((now, len(message)))
                        if current_sentence is None:
                            result.errors.append("audio_outside_sentence")
                        else:
                            sentence_bytes[current_sentence] = sentence_bytes.get(current_sentence, 0) + len(message)
                        if prefix_bytes < ONSET_SEARCH_S * rate * bytes_per_sample:
                            prefix.append(message)
                            prefix_bytes += len(message)
                        continue
                    event = json.loads(message)
                    kind = event.get("type")
                    if kind == "audio.start":
                        current_sentence = event["sentence_index"]
                        result.sentences += 1
                        if int(event.get("sample_rate") or rate) != rate:
                            result.errors.append("sample_rate_changed")
                    elif kind == "audio.done":
                        if event.get("error"):
                            result.errors.append("sentence_error")
                        if event.get("total_bytes") != sentence_bytes.get(event["sentence_index"], 0):
                            result.errors.append("total_bytes_mismatch")
                        current_sentence = None
                    elif kind == "error":
                        result.errors.append(str(event.get("code", "error")))
                    elif kind == "session.done":
                        result.done_s = now
                        result.completed = True
                        break
            finally:
                if frames and options.playing is not None:
                    options.playing.count -= 1
                if sender is not None:
                    if sender.done() and not sender.cancelled() and sender.exception() is not None:
                        result.errors.append(f"sending text failed: {sender.exception()!r}"[:200])
                    sender.cancel()
        if not result.completed:
            result.errors.append("closed_before_session_done")

    try:
        await asyncio.wait_for(session(), options.timeout_s)
    except asyncio.TimeoutError:
        result.errors.append("timeout")
    except Exception as exc:  # recorded, never raised: one failed request must not stop a load run
        result.errors.append(f"{type(exc).__name__}: {exc}"[:200])
    result.finished_at = time.perf_counter() - run_start
    audio = _decode(stream["format"], b"".join(prefix))
    request_metrics(result, frames, stream["bytes_per_sample"], stream["rate"] or 1, audio, result.completed)
    if result.audible_ttfa_s is not None and result.first_sentence_sent_s is not None:
        result.audible_ttfa_after_sentence_s = result.audible_ttfa_s - result.first_sentence_sent_s
    return result


async def _send_pieces(ws: Any, pieces: Sequence[str], rate: float, t0: float, result: RequestResult | None = None,
                       marks: dict[int, str] | None = None) -> None:
    """Send `pieces` as input.text messages at `rate` per second from `t0`, then input.done. `marks`: piece
    index -> the RequestResult field that records when that piece was sent (seconds from t0)."""
    for i, piece in enumerate(pieces):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if marks and i in marks and result is not None:
            setattr(result, marks[i], time.perf_counter() - t0)
        await ws.send(json.dumps({"type": "input.text", "text": piece}))
    await ws.send(json.dumps({"type": "input.done"}))


class LoopLagProbe:
    """How late the client's own event loop wakes up: if this grows, the client is the bottleneck."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.lags: list[float] = []

    async def run(self) -> None:
        while True:
            planned = time.perf_counter() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.lags.append(max(0.0, time.perf_counter() - planned))


@dataclass
class RunPlan:
    seed: int
    warmup_s: float
    duration_s: float
    concurrency: int | None = None
    rps: float | None = None
    requests: int | None = None  # closed loop: measured request count instead of a duration
    drain_timeout_s: float = 120.0


async def run_load(plan: RunPlan, workload: Workload, options: ClientOptions) -> dict[str, Any]:
    """One seed: warm-up, measured phase, drain. Returns {"summary": ..., "requests": [...]}."""
    run_start = time.perf_counter()
    measure_start = plan.warmup_s
    measure_end = plan.warmup_s + plan.duration_s
    results: list[RequestResult] = []
    in_flight: list[tuple[float, int]] = []
    active = 0
    probe = LoopLagProbe()
    probe_task = asyncio.create_task(probe.run())

    async def tracked(spec: RequestSpec, measured: bool, planned: float | None = None) -> None:
        nonlocal active
        active += 1
        try:
            results.append(await run_request(spec, options, measured, run_start, planned))
        except asyncio.CancelledError:  # still running at the drain timeout
            results.append(RequestResult(index=spec.index, prompt_ids=spec.prompt_ids, chars=len(spec.text),
                                         measured=measured, planned_s=planned, errors=["drain_timeout"]))
            raise
        finally:
            active -= 1

    async def sample_in_flight() -> None:
        while True:
            now = time.perf_counter() - run_start
            if measure_start <= now <= measure_end:
                in_flight.append((now, active))
            await asyncio.sleep(0.25)

    sampler = asyncio.create_task(sample_in_flight())
    scheduled = 0
    try:
        if plan.rps:
            arrivals = poisson_schedule(plan.rps, measure_end, plan.seed)
            tasks = []
            for index, planned in enumerate(arrivals):
                delay = run_start + planned - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                measured = planned >= measure_start
                scheduled += measured
                tasks.append(asyncio.create_task(tracked(workload.request(index), measured, planned)))
            done, pending = await asyncio.wait(tasks, timeout=plan.drain_timeout_s) if tasks else (set(), set())
            for task in pending:
                task.cancel()
        else:
            counter = iter(range(10**9))
            measured_started = 0

            async def worker() -> None:
                nonlocal measured_started, scheduled
                while True:
                    now = time.perf_counter() - run_start
                    if plan.requests is not None:
                        if now >= measure_start and measured_started >= plan.requests:
                            return
                    elif now >= measure_end:
                        return
                    measured = now >= measure_start
                    if measured:
                        measured_started += 1
                        scheduled += 1
                    await tracked(workload.request(next(counter)), measured)

            # Each request has its own timeout, so the workers always finish.
            await asyncio.gather(*(worker() for _ in range(plan.concurrency or 1)))
    finally:
        sampler.cancel()
        probe_task.cancel()
    measured = [r for r in results if r.measured]
    if measured:
        first = min(r.started_at for r in measured if r.started_at is not None)
        last = max(r.finished_at or 0.0 for r in measured)
        wall = last - first
    else:
        wall = 0.0
    summary = summarize(results, wall, scheduled, in_flight, probe.lags)
    results.sort(key=lambda r: r.index)
    return {"seed": plan.seed, "summary": summary, "requests": [asdict(r) | {"ok": r.ok} for r in results]}


# -- reporting -----------------------------------------------------------------------------------------


def hardware() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "cpus_usable": affinity, "platform": platform.platform(), "python": platform.python_version(),
            "load_average_1m": load_average()}


def accelerator() -> dict[str, Any]:
    """The card a GPU result comes from (its name as torch and nvidia-smi give it) and whether the compile
    cache held anything when the run began (start-up is 93-133 s on an H100 without it, 33 s with it).
    Call it before the engine starts compiling."""
    import shutil
    import subprocess

    gpu = None
    if shutil.which("nvidia-smi"):
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=20, check=True).stdout.split("\n")
            gpu = names[0].strip() or None
        except (OSError, subprocess.SubprocessError):
            gpu = None
    folders = [os.environ.get(name) for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")]
    warm = any(folder and Path(folder).is_dir() and any(Path(folder).iterdir()) for folder in folders)
    return {"gpu": gpu, "compile_cache": "warm" if warm else "cold"}


def load_average() -> float | None:
    """The machine's 1-minute load average: other work on the box skews every latency figure."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _ms(value: float) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value * 1000:.0f}"


def markdown_table(summary: dict[str, Any], title: str = "") -> str:
    rows = [
        ("TTFB (ms)", "ttfb_s", _ms),
        ("first playable (ms)", "first_playable_s", _ms),
        ("audible TTFA (ms)", "audible_ttfa_s", _ms),
        ("audible TTFA from the 1st sentence's last word (ms)", "audible_ttfa_after_sentence_s", _ms),
        ("E2E (ms)", "e2e_s", _ms),
        ("RTF", "rtf", lambda v: "-" if v is None or math.isnan(v) else f"{v:.3f}"),
        ("setup: connect+config (ms)", "setup_s", _ms),
        ("schedule lag (ms)", "schedule_lag_s", _ms),
    ]
    lines = [f"### {title}" if title else "", "", "| metric | p50 | p95 | p99 | max | n |", "|---|---|---|---|---|---|"]
    for label, key, fmt in rows:
        d = summary[key]
        if not d.get("n", 1):
            continue
        lines.append(f"| {label} | {fmt(d['p50'])} | {fmt(d['p95'])} | {fmt(d['p99'])} | {fmt(d.get('max'))} | {d.get('n', '')} |")
    lag = summary.get("client_loop_lag_s", {})
    lines += [
        "",
        f"requests {summary['requests']} (scheduled {summary['scheduled']}), failed {summary['failed']}, "
        f"underrun events {summary['underrun_events']} in {summary['underrun_requests']} requests "
        f"(total stall {summary['total_stall_s'] * 1000:.0f} ms, longest {summary['longest_stall_s'] * 1000:.0f} ms), "
        f"audio s per wall s {summary['audio_s_per_wall_s']:.2f}, max in flight {summary['max_in_flight']}, "
        f"client loop lag p99 {_ms(lag.get('p99'))} ms"
        + (f", warnings {', '.join(summary['warnings'])}" if summary.get("warnings") else ""),
        f"**{'PASS' if summary['passed'] else 'FAIL'}**" + ("" if summary["passed"] else ": " + "; ".join(summary["fail_reasons"])),
    ]
    return "\n".join(lines).lstrip("\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    load = parser.add_mutually_exclusive_group(required=True)
    load.add_argument("--concurrency", type=int, help="closed loop: N sessions back to back")
    load.add_argument("--rps", type=float, help="open loop: Poisson arrivals per second")
    parser.add_argument("--url", default=DEFAULT_URL, help=f"gateway WebSocket URL (default {DEFAULT_URL})")
    parser.add_argument("--seed", type=int, action="append", help="random seed; repeat for several runs (default 0)")
    parser.add_argument("--warmup", type=float, default=30.0, help="warm-up seconds, not measured (default 30)")
    parser.add_argument("--duration", type=float, default=60.0, help="measured seconds (default 60)")
    parser.add_argument("--requests", type=int, help="closed loop: measure this many requests instead of --duration")
    parser.add_argument("--drain-timeout", type=float, default=120.0, help="wait this long for requests in flight")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="JSONL prompts with id and text")
    parser.add_argument("--sentences", type=parse_range, default=(1, 1), metavar="N|LOW-HIGH",
                        help="consecutive prompts joined per request, e.g. 1 or 2-6 (default 1)")
    parser.add_argument("--stream-tokens", action="store_true", help="send text in token-sized pieces")
    parser.add_argument("--token-rate", type=float, default=40.0, help="tokens per second with --stream-tokens")
    add_agent_arguments(parser)
    parser.add_argument("--voice")
    parser.add_argument("--language")
    parser.add_argument("--response-format", default="pcm", choices=["pcm", "mulaw", "alaw"])
    parser.add_argument("--sample-rate", type=int)
    parser.add_argument("--split-granularity", "--granularity", choices=GRANULARITIES,
                        help="the session's split_granularity (token: synthesis starts at a sentence's first words)")
    parser.add_argument("--config", type=json.loads, default={}, help="extra session.config fields as JSON")
    parser.add_argument("--api-key")
    parser.add_argument("--timeout", type=float, default=120.0, help="per-request limit in seconds")
    parser.add_argument("--label", default="", help="a name for this run in the report")
    parser.add_argument("--output", type=Path, help="write the JSON report here")
    parser.add_argument("--per-request", action="store_true", help="include every request in the JSON")
    return parser


def add_agent_arguments(parser: argparse.ArgumentParser) -> None:
    """The agent workload's options (also engine_load.py's)."""
    parser.add_argument("--agent-sentences", type=int, metavar="N",
                        help="agent workload: each session's reply is N consecutive prompts, sent one word per "
                             "input.text at --words-per-s; reports audible TTFA from the first word and from the "
                             "first sentence's last word")
    parser.add_argument("--words-per-s", type=float, default=40.0, help="agent workload: words sent per second")


def check_agent_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.agent_sentences is None:
        return
    if args.agent_sentences < 1:
        parser.error("--agent-sentences N needs N >= 1")
    if args.words_per_s <= 0:
        parser.error("--words-per-s must be positive")
    if getattr(args, "stream_tokens", False):
        parser.error("--agent-sentences sends words; it does not go with --stream-tokens")


def sentences_per_request(args: argparse.Namespace) -> tuple[int, int]:
    """Prompts joined per request: N exactly with --agent-sentences N, else --sentences."""
    n = args.agent_sentences
    return (n, n) if n else args.sentences


def options_from_args(args: argparse.Namespace) -> ClientOptions:
    return ClientOptions(
        url=args.url, voice=args.voice, language=args.language, response_format=args.response_format,
        sample_rate=args.sample_rate, split_granularity=args.split_granularity, extra_config=args.config,
        stream_tokens=args.stream_tokens, token_rate=args.token_rate, timeout_s=args.timeout, api_key=args.api_key,
        words_per_s=args.words_per_s if args.agent_sentences else None,
    )


async def run_seeds(args: argparse.Namespace) -> dict[str, Any]:
    prompts = load_prompts(args.prompts)
    options = options_from_args(args)
    load_before = load_average()
    runs = []
    for seed in args.seed or [0]:
        plan = RunPlan(seed=seed, warmup_s=args.warmup, duration_s=args.duration, concurrency=args.concurrency,
                       rps=args.rps, requests=args.requests, drain_timeout_s=args.drain_timeout)
        run = await run_load(plan, Workload(prompts, seed, sentences_per_request(args)), options)
        if not args.per_request:
            run.pop("requests")
        runs.append(run)
        print(markdown_table(run["summary"], f"{args.label or 'run'} seed {seed}"), flush=True)
    report = {
        "tool": "bench/loadgen.py",
        "label": args.label,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "hardware": hardware() | {"load_average_1m_before": load_before},
        "load": {"concurrency": args.concurrency, "rps": args.rps, "warmup_s": args.warmup,
                 "duration_s": args.duration, "requests": args.requests,
                 "sentences": list(sentences_per_request(args)),
                 "stream_tokens": args.stream_tokens, "token_rate": args.token_rate if args.stream_tokens else None,
                 "agent_sentences": args.agent_sentences,
                 "words_per_s": args.words_per_s if args.agent_sentences else None},
        "session_config": options.session_config(),
        "runs": runs,
        "across_seeds": across_seeds([r["summary"] for r in runs]),
    }
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_agent_arguments(args, parser)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(run_seeds(args))
    if args.output:
        write_report(args.output, report)
        print(f"wrote {args.output}")
    return 0 if report["across_seeds"]["passed"] else 1


def json_safe(value: Any) -> Any:
    """NaN (no data) becomes null so the report is strict JSON; numpy scalars become Python numbers."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (np.floating, np.integer)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def add_output_argument(parser: argparse.ArgumentParser) -> None:
    """--output as the benches that write their tables beside the JSON take it (write_report)."""
    parser.add_argument("--output", type=Path, help="write the JSON report here (and the tables beside it as .md)")


def write_report(output: Path, report: dict[str, Any], tables: str | None = None) -> None:
    """The report as strict JSON at `output` (json_safe has already made every NaN null, so allow_nan=False
    never refuses it) and, where given, its tables beside it as OUTPUT.md."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(json_safe(report), indent=2, allow_nan=False) + "\n")
    if tables is not None:
        output.with_suffix(".md").write_text(tables + "\n")


if __name__ == "__main__":
    sys.exit(main())
