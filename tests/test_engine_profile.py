"""bench/engine_profile.py end to end on the CPU: a tiny random Qwen3 checkpoint, a few requests at a low rate.

Checks the report's shape, that every scheduled request completed, and that the engine breakdown is
self-consistent: the sections of the engine thread add up to the measured wall time on the profiler's own
clock, and the histograms add up to the batch and decision counts.
"""

from __future__ import annotations

import json

import pytest

from bench import engine_profile
from tests.qwen3_fixtures import single_torch_thread, tiny_custom_voice  # noqa: F401 - fixtures

DURATION_S = 2.0


@pytest.fixture(scope="module")
def report(tiny_custom_voice, tmp_path_factory):  # noqa: F811 - fixture
    output = tmp_path_factory.mktemp("engine-profile") / "profile.json"
    # 300 characters/s: one ARCTIC sentence is capped at a handful of frames, so each request is short.
    assert engine_profile.main([
        "--model", str(tiny_custom_voice), "--device", "cpu", "--rates", "3", "--warmup", "0.5",
        "--duration", str(DURATION_S), "--seed", "1", "--frame-cap-chars-per-second", "300", "--max-active", "8",
        "--max-len", "256", "--output", str(output),
    ]) == 0
    assert output.with_suffix(".md").read_text().count("| 3 |") == 2
    return json.loads(output.read_text())


def test_every_scheduled_request_completes_with_client_metrics(report):
    assert report["device"] == "cpu" and len(report["rates"]) == 1
    entry = report["rates"][0]
    assert entry["rps"] == 3
    s = entry["summary"]
    assert s["scheduled"] > 0
    assert s["completed"] == s["requests"] == s["scheduled"]
    assert s["failed"] == 0
    for key in ("audible_ttfa_s", "ttfb_s", "e2e_s"):
        assert s[key]["n"] == s["scheduled"]
        assert 0 < s[key]["p50"] <= s[key]["p95"] <= s[key]["p99"]
    assert s["ttfb_s"]["p50"] <= s["e2e_s"]["p50"]
    for key in ("underrun_events", "underrun_requests", "total_stall_s", "peak_in_flight", "max_slots_in_use"):
        assert key in s
    assert s["peak_in_flight"] >= 1
    assert s["audio_s_per_request"]["p50"] > 0


def test_engine_breakdown_adds_up(report):
    g = report["rates"][0]["engine"]
    # The measured phase on the profiler's clock; the engine's sections fill all of it.
    assert DURATION_S * 0.95 <= g["wall_s"] <= DURATION_S + 0.5
    assert g["engine_wall_s"] == pytest.approx(g["wall_s"], rel=0.01)
    stage_share = sum(s["share"] for s in g["stages"].values())
    total = stage_share + g["schedule_share"] + g["idle_share"] + g["outside_step_share"]
    assert total == pytest.approx(1.0, abs=0.02)
    assert g["accounted_share"] == pytest.approx(total, abs=0.001)  # nothing in start-up during the run
    assert g["busy_share"] == pytest.approx(stage_share)
    assert g["idle_share"] > 0.05 and stage_share > 0.01  # 3 requests/s leave the engine waiting part of the time

    assert g["decisions"] > 0
    assert g["decisions_per_s"] == pytest.approx(g["decisions"] / g["wall_s"])
    for name, s in g["stages"].items():
        sizes = {int(k): v for k, v in s["batch_sizes"].items()}
        assert sum(sizes.values()) == s["batches"], name
        assert sum(k * v for k, v in sizes.items()) == s["items"], name
        assert s["share"] == pytest.approx(s["runner_share"] + s["post_share"])
        if s["batches"]:
            assert s["mean_batch"] == pytest.approx(s["items"] / s["batches"])
    assert sum(s["batches"] for s in g["stages"].values()) == g["decisions"]
    assert sum(g["codec_batches_by_frames"].values()) == g["stages"]["CODEC"]["batches"]
    assert sum(g["rules"].values()) == g["decisions"]
    assert g["stages"]["FRAME"]["items"] > 0 and g["stages"]["CODEC"]["items"] > 0
    # On the CPU the codec runs synchronously: each batch is collected at its launch, and no device time is
    # measured; a batch launched before the first snapshot may be collected after it.
    assert abs(g["codec_collected"] - g["stages"]["CODEC"]["batches"]) <= 1
    assert 0 < g["codec_in_flight_share"] <= g["stages"]["CODEC"]["share"] * 1.01
    assert g["codec_device_share"] is None and g["codec_device_ms_per_batch"] is None
