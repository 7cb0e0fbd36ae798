"""bench/resume_cost.py (where a failover's resume spends its time on the survivor) end to end on the CPU with a
tiny checkpoint, so that the command run on the H100 is known to work: the cut requests are resumed together in
one runner call, beside speaking requests, and the report splits each one's first audio and profiles the call."""

from __future__ import annotations

import json

from bench import resume_cost
from tests.qwen3_fixtures import single_torch_thread, tiny_custom_voice  # noqa: F401 - fixtures


def test_resumed_streams_are_timed_and_profiled_together(tiny_custom_voice, tmp_path):
    output = tmp_path / "resume_cost.json"
    assert resume_cost.main([
        "--model", str(tiny_custom_voice), "--device", "cpu", "--dtype", "float32", "--streams", "3",
        "--beside", "0,2", "--cut-chunk", "2", "--repeats", "2", "--max-active", "8", "--max-len", "256",
        "--frame-cap-chars-per-second", "60", "--output", str(output),
    ]) == 0
    cases = json.loads(output.read_text())["cases"]
    assert [(c["streams"], c["beside"]) for c in cases] == [(3, 0), (3, 2)]
    for case in cases:
        assert len(case["frames"]) == 3 and all(f > 0 for f in case["frames"])
        assert case["resume_calls"] >= 1 and sum(case["resume_ms"]) > 0 and case["admission_ms"] >= 0
        assert len(case["first_audio_ms"]) == 3 and case["resume_log"][0].startswith("resumed ")
        assert len(case["repeats"]) == 2 and case["repeats"][-1]["resume_ms"] == case["resume_ms"]
        # The profile is of the runner's resume call, hottest first: the runner's own functions are in it.
        rows = case["profile"]
        assert any("(_resume)" in row["function"] for row in case["profile_cumulative"])
        assert [r["own_ms"] for r in rows] == sorted((r["own_ms"] for r in rows), reverse=True)
