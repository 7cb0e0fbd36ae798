"""bench/fleet_sim.py without its fleet: the session client against one in-process gateway (the byte-exact
check passes on true audio and fails on other audio, a refusal is recorded as one), and the analysis,
report and plot from a made-up timeline whose answers are known."""

from __future__ import annotations

import asyncio
import json
import time

from bench import fleet_sim
from tests.gateway_server import running_gateway
from tts_backend.synthetic import SyntheticSynthesizer

TEXT = "The first sentence is here. A second one follows it. And a third."


def test_a_session_is_checked_byte_for_byte_per_sentence():
    with running_gateway(SyntheticSynthesizer(speed=20.0, chunk_ms=200)) as server:
        good = fleet_sim.SessionRecord(0, "g1", 0.0, len(TEXT))
        asyncio.run(fleet_sim.run_session(good, server.ws_url, TEXT, 5, fleet_sim.ExpectedAudio(200, 5),
                                          time.perf_counter(), 30))
        other_seed = fleet_sim.SessionRecord(1, "g1", 0.0, len(TEXT))
        asyncio.run(fleet_sim.run_session(other_seed, server.ws_url, TEXT, 5, fleet_sim.ExpectedAudio(200, 6),
                                          time.perf_counter(), 30))
    assert good.admitted and good.completed and good.audio_ok and not good.errors and not good.lost
    assert good.sentences == 3 and good.frames and {f[2] for f in good.frames} == {0, 1, 2}
    assert other_seed.completed and other_seed.audio_ok is False and other_seed.mismatched_sentences == [0, 1, 2]
    assert other_seed.lost


def test_a_refusal_is_recorded_with_its_code():
    with running_gateway(SyntheticSynthesizer(), overload_backend_load=0.5) as server:
        server.gateway.backend.load = lambda: 1.0  # the backend says it is full
        record = fleet_sim.SessionRecord(0, "g1", 0.0, len(TEXT))
        asyncio.run(fleet_sim.run_session(record, server.ws_url, TEXT, 5, fleet_sim.ExpectedAudio(80, 5),
                                          time.perf_counter(), 30))
    assert record.refused and record.refusal_code == "overloaded" and not record.admitted and not record.lost


def fake_raw() -> dict:
    """Two workers of capacity 4 for 20 s of load (starting at run time 10): w1 carries 3 streams and w2 2
    until w2 is killed at 8 s; a session on w2 pauses 600 ms (usual gap 100 ms) and is logged as failed
    over; one session is refused when the fleet is full, one is lost."""
    start = 10.0
    samples = []
    for i in range(int(20 / 0.25)):
        t = start + i * 0.25
        killed = t >= start + 8
        samples.append({"t": t, "workers": {
            "w1": {"up": True, "streams": 4.0 if killed else 3.0, "capacity": 4.0, "queued": 0.0, "draining": False},
            "w2": {"up": False} if killed else {"up": True, "streams": 2.0, "capacity": 4.0, "queued": 0.0,
                                                "draining": False}}})
    frames = [(start + 5 + k * 0.1, 4800, 0) for k in range(31)]  # 5.0 .. 8.0
    frames += [(start + 8.6 + k * 0.1, 4800, 0) for k in range(10)]
    sessions = [
        {"index": 0, "gateway": "g1", "planned_s": start + 4.9, "admitted_s": start + 4.95,
         "session_id": "s-failed-over", "completed": True,
         "audio_ok": True, "errors": [], "refused": False, "refused_s": None, "refusal_code": None,
         "refusal_message": None, "frames": frames, "mismatched_sentences": []},
        {"index": 1, "gateway": "g2", "planned_s": start + 12, "session_id": None, "completed": False,
         "audio_ok": None, "errors": [], "refused": True, "refused_s": start + 12.1, "refusal_code": "overloaded",
         "refusal_message": "full", "frames": [], "mismatched_sentences": []},
        {"index": 2, "gateway": "g3", "planned_s": start + 3, "admitted_s": start + 3.1, "session_id": "s-lost",
         "completed": False,
         "audio_ok": False, "errors": ["closed_before_session_done"], "refused": False, "refused_s": None,
         "refusal_code": None, "refusal_message": None, "frames": [], "mismatched_sentences": []},
    ]
    config = {"workers": 2, "gateways": 3, "capacity": 4, "speed": 2.0, "chunk_ms": 200, "first_chunk_delay": 0.05,
              "utilisation": 0.8, "duration": 20.0, "warmup": 2.0, "settle": 1.0, "sentences": [2, 3]}
    return {
        "tool": "bench/fleet_sim.py", "command": "python bench/fleet_sim.py --fake", "config": config,
        "rate_sessions_per_s": 1.0, "mean_slot_time_s": 4.0, "fleet_slots": 8, "load_start_s": start, "run_s": 35.0,
        "hardware": {"cpus_usable": 2}, "events": {"kill": {"t": start + 8, "worker": "w2"}},
        "children": [{"name": "w1", "kind": "worker", "command": "python -m gateway.cli worker", "started_s": 1.0,
                      "ready_s": 2.0, "exited_s": None, "returncode": None, "cpu_s": 3.0, "log": ""}],
        "samples": samples, "gateway_samples": [],
        "cpu_samples": [{"t": start + i, "busy_cores": 1.0, "load_average_1m": 0.5} for i in range(20)],
        "client_loop_lag_s": [0.001, 0.002], "client_cpu_s": 4.0,
        "failover_log": [{"session": "s-failed-over", "sentence": "0", "src": "w2", "dst": "w1", "pause": "580.0",
                          "resumed": "True", "gateway": "g1"}],
        "log_problems": {}, "sessions": sessions,
    }


def test_the_analysis_of_a_known_timeline():
    report = fleet_sim.analyse(fake_raw())
    assert report["sessions"]["admitted"] == 2 and report["sessions"]["lost"] == 1
    assert report["sessions"]["refused"] == 1 and report["sessions"]["completed_byte_exact"] == 1
    first = report["balance"][0]
    assert first["workers"] == ["w1", "w2"] and first["max_over_min"] == 1.5
    assert first["fleet_utilisation_mean"] == round(5 / 8, 3)
    assert report["balance"][1]["workers"] == ["w1"]
    kill = report["kill"]
    assert kill["failed_over_sessions"] == 1 and kill["client_pause_ms"]["median"] == 500.0
    assert kill["failed_over"][0]["failed_over_audio_delivered_s"] == round(31 * 4800 / 2 / 24000, 3)
    assert kill["pool_logged_pause_ms"]["median"] == 580.0
    assert kill["resumed_from_codes"] == 1 and kill["failed_over"][0]["resumed_from_codes"] is True
    assert kill["client_pause_ms"]["p99"] == 500.0 and kill["client_pause_across_ms"]["median"] == 500.0
    assert kill["target"]["met"] is False and kill["target"]["met_by_largest_gap"] is False  # 500 ms > 50 ms
    assert report["handover"] == {}  # no drain in this timeline
    assert report["queueing"]["time_to_first_audio_ms"]["median"] == 50.0
    assert report["queueing"]["samples_with_streams_waiting"] == 0
    refusal = report["refusals"]["list"][0]
    assert refusal["utilisation"] == 1.0 and report["refusals"]["below_90pct"] == 0


def test_the_report_files(tmp_path):
    report = fleet_sim.write_outputs(fake_raw(), tmp_path, "fake")
    md = (tmp_path / "fake.md").read_text()
    assert md.splitlines()[2] == "```" and md.splitlines()[3] == "python bench/fleet_sim.py --fake"
    assert "**sessions lost** (admitted, not completed with the expected audio) | **1**" in md
    assert "p50 <= 50, p99 <= 150: **not met**) | min 500.0, p50 500.0, p99 500.0, max 500.0; the largest" in md
    data = json.loads((tmp_path / "fake.json").read_text())
    assert data["report"]["sessions"] == report["sessions"]
    assert (tmp_path / "fake.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
