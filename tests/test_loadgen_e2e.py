"""bench/loadgen.py against a real gateway (uvicorn on a loopback port) with the synthetic backend.

The synthetic backend's output is known exactly, so the tool's byte counts and audio durations can be
checked, and slowing it below real time must make the tool report underruns and fail the run.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench.loadgen import build_parser, main, run_seeds
from tests.gateway_server import running_gateway
from tts_backend.base import SynthesisRequest
from tts_backend.synthetic import SyntheticSynthesizer

PROMPTS = [
    "The river ran high after the storm.",
    "Nobody expected the train to be on time.",
    "She opened the window and listened.",
    "Three boats waited at the harbour.",
    "It was the longest winter anyone remembered.",
    "He laughed and shook his head.",
    "The lamps were lit one by one.",
    "A dog barked somewhere in the distance.",
]


@pytest.fixture()
def prompt_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"t{i}", "text": t}) + "\n" for i, t in enumerate(PROMPTS)))
    return path


def synthetic_bytes(backend: SyntheticSynthesizer, prompt_ids: list[str], voice: str = "tone-low") -> int:
    texts = [PROMPTS[int(p[1:])] for p in prompt_ids]
    return sum(backend.render(SynthesisRequest(text=t, voice=voice)).nbytes for t in texts)


def run(args: list[str]) -> dict:
    return asyncio.run(run_seeds(build_parser().parse_args(args)))


def test_closed_loop_run_measures_every_request(prompt_file: Path, tmp_path: Path) -> None:
    backend = SyntheticSynthesizer(first_chunk_delay_s=0.05)
    with running_gateway(backend) as server:
        out = tmp_path / "report.json"
        code = main(["--url", server.ws_url, "--concurrency", "2", "--warmup", "0.3", "--requests", "6",
                     "--prompts", str(prompt_file), "--sentences", "2-3", "--seed", "7", "--per-request",
                     "--output", str(out)])
    assert code == 0
    report = json.loads(out.read_text())  # strict JSON: no NaN
    run_report = report["runs"][0]
    summary = run_report["summary"]
    assert summary["passed"] and summary["requests"] == 6 and summary["underrun_events"] == 0
    measured = [r for r in run_report["requests"] if r["measured"]]
    assert len(measured) == 6
    for r in measured:
        assert r["ok"] and r["sentences"] == len(r["prompt_ids"]) in (2, 3)
        assert r["bytes"] == synthetic_bytes(backend, r["prompt_ids"])
        assert r["audio_s"] == pytest.approx(r["bytes"] / 2 / 24000)
        # The backend waits 50 ms before its first chunk; nothing can arrive sooner.
        assert 0.05 <= r["ttfb_s"] <= r["first_playable_s"] <= r["audible_ttfa_s"] < r["e2e_s"]
        assert r["rtf"] == pytest.approx(r["e2e_s"] / r["audio_s"])
    assert summary["audible_ttfa_s"]["p50"] >= 0.05
    assert report["session_config"]["stream_audio"] is True


def test_open_loop_with_streamed_tokens(prompt_file: Path) -> None:
    with running_gateway(SyntheticSynthesizer()) as server:
        report = run(["--url", server.ws_url, "--rps", "6", "--warmup", "0.5", "--duration", "2", "--seed", "3",
                      "--prompts", str(prompt_file), "--sentences", "1-2", "--stream-tokens", "--token-rate", "60",
                      "--per-request", "--response-format", "mulaw"])
    summary = report["runs"][0]["summary"]
    # Not `passed`: on a busy CI box a late wake-up may show as an underrun, which is the machine's doing.
    assert summary["failed"] == 0 and summary["errors"] == []
    requests = report["runs"][0]["requests"]
    measured = [r for r in requests if r["measured"]]
    assert summary["scheduled"] == len(measured) > 3
    assert all(r["planned_s"] >= 0.5 for r in measured)
    assert all(r["schedule_lag_s"] < 0.25 for r in measured)
    # The same seed and rate give the same schedule and prompts.
    again = run(["--url", "ws://127.0.0.1:9/none", "--rps", "6", "--warmup", "0.5", "--duration", "2", "--seed", "3",
                 "--prompts", str(prompt_file), "--sentences", "1-2", "--per-request", "--timeout", "1"])
    planned = [(r["planned_s"], r["prompt_ids"]) for r in sorted(requests, key=lambda r: r["index"])]
    assert [(r["planned_s"], r["prompt_ids"]) for r in again["runs"][0]["requests"]] == planned
    assert not again["runs"][0]["summary"]["passed"]  # nothing listens there


def test_a_backend_slower_than_real_time_fails_with_underruns(tmp_path: Path) -> None:
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"id": "s0", "text": "Good morning to you."}) + "\n")  # 1.3 s of audio
    with running_gateway(SyntheticSynthesizer(speed=0.6, chunk_ms=40)) as server:
        report = run(["--url", server.ws_url, "--concurrency", "2", "--warmup", "0", "--requests", "2",
                      "--prompts", str(short)])
    summary = report["runs"][0]["summary"]
    assert not summary["passed"]
    assert summary["underrun_requests"] == 2 and summary["underrun_events"] > 5
    assert summary["rtf"]["p50"] > 1.0
    assert any("underruns" in reason for reason in summary["fail_reasons"])
