"""Prometheus metrics, one CollectorRegistry per app instance (so several apps can live in one process).

The gateway's own metrics, plus whatever its backend reports (`Synthesizer.metrics()`: the GPU engine's
batches and time shares, a worker's streams), read at each scrape and exposed as voxgate_<name>.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tts_backend.base import BackendMetric

# Time to first audio spans sub-10 ms (synthetic backend) to seconds (an overloaded GPU); 5 ms apart up to
# 100 ms, where the targets lie, so that a p95 read from the buckets is within a few ms.
TTFA_BUCKETS = (*(i / 200 for i in range(1, 21)), 0.125, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0)
# Event-loop lag: a healthy loop is late by well under a millisecond; 5 ms and more delays every session's audio.
LOOP_LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LOOP_LAG_INTERVAL_S = 0.05


class _BackendMetrics:
    """A collector of the backend metrics handed to the scrape being rendered."""

    def __init__(self) -> None:
        self.latest: Sequence[BackendMetric] = ()

    def collect(self) -> Iterator[Metric]:
        for metric in self.latest:
            family = CounterMetricFamily if metric.kind == "counter" else GaugeMetricFamily
            collected = family(f"voxgate_{metric.name}", metric.help, labels=list(metric.labels))
            for values, value in metric.samples:
                collected.add_metric(list(values), value)
            yield collected


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.sessions_active = Gauge("voxgate_sessions_active", "WebSocket sessions open now", registry=r)
        self.sessions_total = Counter("voxgate_sessions_total", "WebSocket sessions started", registry=r)
        self.sentences_total = Counter(
            "voxgate_sentences_total", "Sentences finished, by outcome (done, failed, cancelled)", ["outcome"], registry=r
        )
        self.sentences_resumed_from_codes_total = Counter(
            "voxgate_sentences_resumed_from_codes_total", "Sentences a session.resume continued from their codes "
            "(the same take) instead of making them again", registry=r
        )
        self.audio_bytes_total = Counter(
            "voxgate_audio_bytes_total", "Encoded audio bytes sent to clients", ["transport"], registry=r
        )
        self.ttfa_seconds = Histogram(
            "voxgate_ttfa_seconds",
            "Time to first audio: from an utterance's first sentence being released for synthesis (WebSocket)"
            " or the request arriving (HTTP) to its first audio byte being sent",
            ["transport"],
            buckets=TTFA_BUCKETS,
            registry=r,
        )
        self.errors_total = Counter("voxgate_errors_total", "Errors reported to clients, by code", ["code"], registry=r)
        self.word_timestamps_late_total = Counter(
            "voxgate_word_timestamps_late_total", "Sentences sent without their word timings, which came later than"
            " word_timestamps_wait_s after the audio (warning timestamps_late): the aligner is behind", ["transport"],
            registry=r,
        )
        self.http_requests_total = Counter(
            "voxgate_speech_requests_total", "POST /v1/audio/speech requests", ["stream"], registry=r
        )

        self.loop_lag_seconds = Histogram(
            "voxgate_event_loop_lag_seconds",
            f"How late the event loop ran a timer due every {LOOP_LAG_INTERVAL_S * 1000:g} ms: the time every"
            " session's frames, handshakes and text waited for the loop (issue 22: whether the gateway's loop"
            " is what stalls under load, or the engine)",
            buckets=LOOP_LAG_BUCKETS,
            registry=r,
        )
        self._backend = _BackendMetrics()
        r.register(self._backend)

    async def watch_loop_lag(self, interval_s: float = LOOP_LAG_INTERVAL_S) -> None:
        """Run for the app's life: sleep `interval_s` and record how much later than that the loop woke."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + interval_s
            await asyncio.sleep(interval_s)
            self.loop_lag_seconds.observe(max(0.0, loop.time() - due))

    def render(self, backend_metrics: Sequence[BackendMetric] = ()) -> bytes:
        """The exposition text; `backend_metrics` as read from the backend for this scrape (rendering is
        synchronous, so concurrent scrapes cannot mix each other's)."""
        self._backend.latest = backend_metrics
        try:
            return generate_latest(self.registry)
        finally:
            self._backend.latest = ()
