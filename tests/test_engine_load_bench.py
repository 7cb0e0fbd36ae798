"""bench/engine_load.py end to end on the CPU: a real gateway on --backend remote with the qwen3 engine in a
`voxgate worker` on a tiny checkpoint, the open-loop client, and the report, with several seeds combined as
bench/README.md says and the engine's breakdown read from the gateway's /metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.qwen3_fixtures import tiny_custom_voice  # noqa: F401 - session fixture

ROOT = Path(__file__).resolve().parents[1]
# The bench's gateway without admission control: a tiny CPU engine on a busy 2-core machine can fall under real
# time, and the gateway then refuses new sessions as overloaded, which is right there and not what these runs
# check (the GPU runs keep it: there it is part of the measurement).
NO_ADMISSION_LIMITS = dict(os.environ, VOXGATE_OVERLOAD_BACKEND_LOAD="1e9", VOXGATE_OVERLOAD_MIN_REALTIME="0")


def test_several_seeds_are_reported_as_the_median_of_each_seeds_percentiles(tiny_custom_voice, tmp_path):
    output = tmp_path / "load.json"
    proc = subprocess.run(
        [sys.executable, "bench/engine_load.py", "--model", str(tiny_custom_voice), "--device", "cpu",
         "--rates", "2", "--warmup", "0.5", "--duration", "2", "--seed", "0", "--seed", "1",
         "--fail-ttfa-ms", "100000", "--output", str(output), "--log", str(tmp_path / "gateway.log"), "--worker"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(output.read_text())
    (entry,) = report["rates"]
    assert entry["seeds"] == [0, 1] and len(entry["per_seed"]) == 2
    runs, combined = entry["per_seed"], entry["summary"]
    assert combined["requests"] == sum(r["requests"] for r in runs) > 0
    assert combined["failed"] == 0
    for q in ("p50", "p95", "p99"):
        values = sorted(r["audible_ttfa_s"][q] for r in runs)
        assert combined["audible_ttfa_s"][q] == (values[0] + values[1]) / 2  # the median of two
    assert "| 2 |" in output.with_suffix(".md").read_text()
    # The worker's engine counters, through the gateway's /metrics: every request of both seeds went through
    # prefill, and the thread's sections (shares) add up to its wall time.
    engine = entry["engine"]
    stages = engine["stages"]
    assert stages["prefill"]["batches"] >= 1 and stages["frame"]["batches"] > stages["prefill"]["batches"]
    assert stages["codec"]["mean_batch"] >= 1
    assert engine["decisions"] == sum(st["batches"] for st in stages.values()) == sum(engine["rules"].values())
    shares = sum(st["thread_share"] for st in stages.values()) + engine["schedule_share"] + engine["idle_share"]
    assert 0.9 <= shares <= 1.0 + 1e-9
    assert "Engine thread" in output.with_suffix(".md").read_text()
    # The gateway's event-loop lag over the same window: its watch samples every 50 ms (5 s of runs here).
    lag = entry["gateway_loop_lag"]
    assert lag["samples"] >= 20 and lag["over_100ms"] <= lag["over_25ms"] <= lag["over_5ms"] <= lag["samples"]


def test_cloned_voice_and_word_timestamp_runs_report_voice_add_and_the_aligner(tmp_path):
    """--clone registers one voice per clip length through POST /v1/audio/voices (timed, twice each) and the
    load speaks in one of them; --timestamps with -o aligner= has every session ask for words, and the rate's
    entry carries the aligner's sentences and share, read from the worker's counters through the gateway. A
    --variant runs again on the same server: here x-vector clones without timestamps."""
    from tts_backend.aligner.testing.checkpoint import write_aligner_checkpoint
    from tts_backend.qwen3.testing.checkpoint import write_checkpoint

    base = write_checkpoint(tmp_path / "base", "tiny", model_type="base", seed=2)
    aligner = write_aligner_checkpoint(tmp_path / "aligner", "tiny")
    output = tmp_path / "load.json"
    proc = subprocess.run(
        [sys.executable, "bench/engine_load.py", "--model", str(base), "--device", "cpu", "--rates", "1",
         "--warmup", "0.5", "--duration", "2", "--fail-ttfa-ms", "100000", "--clone", "icl",
         "--clone-seconds", "3,4", "--clone-voice-s", "4", "--timestamps", "async", "-o", f"aligner={aligner}",
         "--variant", "xvec --clone x_vector --timestamps none --rates 1", "--output", str(output), "--log", str(tmp_path / "gateway.log"), "--worker"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(output.read_text())
    adds = report["voice_add"]
    assert [(a["clip_s"], a["attempt"]) for a in adds[:4]] == [(3, "first"), (4, "first"), (3, "again"), (4, "again")]
    assert [a["name"] for a in adds[4:6]] == ["bench-x_vector-3s", "bench-x_vector-4s"]
    assert all(a["ms"] > 0 and a["voice"]["name"] == a["name"] for a in adds)
    assert report["load"]["session_config"]["voice"] == "bench-icl-4s"
    assert report["load"]["session_config"]["timestamp_transport_strategy"] == "async"
    (entry,) = report["rates"]
    assert entry["summary"]["failed"] == 0 and entry["summary"]["completed"] > 0
    aligned = entry["aligner"]
    assert aligned["sentences"] >= entry["summary"]["completed"]
    assert aligned["ms_per_sentence"] > 0 and 0 < aligned["share_of_engine_wall"] < 1
    (variant,) = report["variants"]
    assert variant["label"] == "xvec" and variant["load"]["session_config"]["voice"] == "bench-x_vector-4s"
    assert "timestamp_type" not in variant["load"]["session_config"]
    (ventry,) = variant["rates"]
    assert ventry["summary"]["failed"] == 0 and ventry["summary"]["completed"] > 0
    assert ventry["aligner"]["sentences"] == 0  # no session asked for words
    assert len(report["voice_add"]) == 8  # 2 lengths x 2 attempts, for each clone mode
    markdown = output.with_suffix(".md").read_text()
    assert "Variant xvec" in markdown and "Forced aligner" in markdown


def test_the_agent_workload_runs_through_a_worker_with_token_splitting(tiny_custom_voice, tmp_path):
    """What the H200 agent runs do (bench/README.md): replies of N sentences streamed word by word into
    `--granularity token` sessions, the engine in a `voxgate worker`; token splitting takes effect there
    (no session.started warning) and both TTFAs are reported."""
    output = tmp_path / "agent.json"
    proc = subprocess.run(
        [sys.executable, "bench/engine_load.py", "--model", str(tiny_custom_voice), "--device", "cpu",
         "--rates", "1", "--warmup", "0.5", "--duration", "2", "--agent-sentences", "2", "--words-per-s", "40",
         "--granularity", "token", "--keep-going", "--fail-ttfa-ms", "100000", "--worker",
         "--variant", "sentence --granularity sentence --words-per-s 100",
         "--output", str(output), "--log", str(tmp_path / "gateway.log")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=NO_ADMISSION_LIMITS,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(output.read_text())
    assert report["load"]["agent_sentences"] == 2 and report["load"]["words_per_s"] == 40
    assert report["load"]["session_config"]["split_granularity"] == "token"
    (entry,) = report["rates"]
    summary = entry["summary"]
    assert summary["requests"] > 0 and summary["failed"] == 0 and summary["errors"] == []
    assert summary["warnings"] == []  # the worker's engine takes text while it speaks
    assert summary["audible_ttfa_after_sentence_s"]["n"] == summary["audible_ttfa_s"]["n"] == summary["requests"]
    table = output.with_suffix(".md").read_text()
    assert "2 sentences per session, 40 words/s, split_granularity token" in table
    # The variant on the same server: sentence splitting at 100 words/s.
    (variant,) = report["variants"]
    assert variant["load"]["session_config"]["split_granularity"] == "sentence"
    assert variant["load"]["words_per_s"] == 100
    (rate,) = variant["rates"]
    assert rate["summary"]["failed"] == 0 and rate["summary"]["audible_ttfa_after_sentence_s"]["n"] > 0
    assert "2 sentences per session, 100 words/s, split_granularity sentence" in table


def test_a_result_says_whether_start_up_found_a_compile_cache(tmp_path, monkeypatch):
    from bench.loadgen import accelerator

    cache = tmp_path / "inductor"
    cache.mkdir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    facts = accelerator()
    assert facts["compile_cache"] == "cold" and "gpu" in facts
    (cache / "fxgraph").mkdir()
    assert accelerator()["compile_cache"] == "warm"
