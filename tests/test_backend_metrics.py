"""Backend metrics on the gateway's /metrics: the Qwen3 engine's counters (tiny checkpoint on the CPU, a real
gateway and WebSocket client), and a scrape that still answers when the backend's metrics fail."""

from __future__ import annotations

import json
import time

import pytest
import websockets

from bench.engine_load import scrape_counters
from tests.gateway_server import receive_until, running_gateway
from tests.qwen3_fixtures import tiny_custom_voice  # noqa: F401 - session fixture
from tts_backend.base import BackendMetric
from tts_backend.synthetic import SyntheticSynthesizer

OPTIONS = {"max_active": 4, "max_len": 256, "greedy": True, "frame_cap_chars_per_second": 15}


def labelled(values: dict, name: str, label: str) -> dict[str, float]:
    return {dict(labels)[label]: v for (n, labels), v in values.items() if n == name}


async def test_the_engines_counters_follow_what_it_did(tiny_custom_voice):
    with running_gateway("qwen3", model=str(tiny_custom_voice), device="cpu", backend_options=OPTIONS,
                         ready_timeout_s=120) as server:
        before, started = scrape_counters(server.url), time.monotonic()
        async with websockets.connect(server.ws_url) as ws:
            await ws.send(json.dumps({"type": "session.config", "voice": "ryan", "stream_audio": True}))
            await ws.send(json.dumps({"type": "input.text", "text": "One sentence here. And a second one."}))
            await ws.send(json.dumps({"type": "input.done"}))
            messages = await receive_until(ws, "session.done")
        after, elapsed = scrape_counters(server.url), time.monotonic() - started
    assert sum(1 for m in messages if isinstance(m, dict) and m["type"] == "audio.done") == 2

    def delta(name: str, label: str) -> dict[str, float]:
        old = labelled(before, name, label)
        return {k: v - old.get(k, 0.0) for k, v in labelled(after, name, label).items()}

    assert delta("voxgate_engine_requests_total", "outcome") == {"completed": 2, "cancelled": 0, "failed": 0}
    batches, items = delta("voxgate_engine_batches_total", "stage"), delta("voxgate_engine_batch_items_total", "stage")
    assert batches["prefill"] >= 1 and batches["frame"] >= 2 and batches["codec"] >= 2
    assert all(items[stage] >= batches[stage] for stage in batches)
    decisions = after[("voxgate_engine_decisions_total", ())] - before[("voxgate_engine_decisions_total", ())]
    assert decisions == sum(batches.values())
    by_rule = {}
    for (name, labels), value in after.items():
        if name == "voxgate_engine_rule_batches_total":
            by_rule[labels] = value - before.get((name, labels), 0.0)
    assert sum(by_rule.values()) == decisions
    # The scheduler's own CPU seconds: within the schedule section's wall seconds, which also hold the drain.
    calls = after[("voxgate_engine_decide_calls_total", ())] - before[("voxgate_engine_decide_calls_total", ())]
    cpu = (after[("voxgate_engine_decide_cpu_seconds_total", ())]
           - before[("voxgate_engine_decide_cpu_seconds_total", ())])
    assert calls >= decisions and 0 < cpu <= delta("voxgate_engine_thread_seconds_total", "section")["schedule"]
    # The engine thread's sections add up to its wall time between the two scrapes.
    thread = sum(delta("voxgate_engine_thread_seconds_total", "section").values())
    assert thread == pytest.approx(elapsed, rel=0.25, abs=0.2)
    # On the CPU none of the GPU fast path serves, and the kernel check (Triton layers only) did not run.
    assert labelled(after, "voxgate_engine_fast_path", "piece") == dict.fromkeys(
        ("cuda_graphs", "fused_layers", "compiled", "triton_layers", "sampling_tail", "fused_prefill",
         "compiled_codec", "codec_stream"), 0.0)
    assert not labelled(after, "voxgate_engine_kernel_check_error", "check")
    assert after[("voxgate_engine_slots", ())] == 4
    assert after[("voxgate_engine_slots_in_use", ())] == 0 and after[("voxgate_engine_streams", ())] == 0


class MetricsFailSynthesizer(SyntheticSynthesizer):
    async def metrics(self) -> list[BackendMetric]:
        raise RuntimeError("metrics broke")


class ReportingSynthesizer(SyntheticSynthesizer):
    async def metrics(self) -> list[BackendMetric]:
        return [BackendMetric("test_queue", "gauge", "A gauge", ("lane",), ((("a",), 2.0), (("b",), 5.0))),
                BackendMetric("test_jobs", "counter", "A counter", samples=(((), 7.0),))]


def test_backend_metrics_are_exposed_and_a_failing_backend_leaves_the_gateways_own():
    with running_gateway(ReportingSynthesizer()) as server:
        values = scrape_counters(server.url)
    assert labelled(values, "voxgate_test_queue", "lane") == {"a": 2.0, "b": 5.0}
    assert values[("voxgate_test_jobs_total", ())] == 7.0
    assert ("voxgate_sessions_active", ()) in values
    with running_gateway(MetricsFailSynthesizer()) as server:
        values = scrape_counters(server.url)
    assert ("voxgate_sessions_active", ()) in values
    assert not any(name.startswith("voxgate_test_") for name, _ in values)


def test_backend_metrics_travel_as_json_and_bad_ones_are_refused():
    metric = BackendMetric("engine_batches", "counter", "Batches", ("stage",), ((("decode",), 3.0),))
    assert BackendMetric.from_json(json.loads(json.dumps(metric.to_json()))) == metric
    with pytest.raises(ValueError):
        BackendMetric.from_json({"name": "x", "kind": "histogram", "help": ""})
    with pytest.raises(ValueError):
        BackendMetric.from_json({"name": "x", "kind": "gauge", "help": "", "labels": ["a"], "samples": [[[], 1.0]]})
