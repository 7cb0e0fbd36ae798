"""bench/engine_load.py end to end on the CPU: a real gateway with the qwen3 backend on a tiny checkpoint,
the open-loop client, and the report, with several seeds combined as bench/README.md says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.qwen3_fixtures import tiny_custom_voice  # noqa: F401 - session fixture

ROOT = Path(__file__).resolve().parents[1]


def test_several_seeds_are_reported_as_the_median_of_each_seeds_percentiles(tiny_custom_voice, tmp_path):
    output = tmp_path / "load.json"
    proc = subprocess.run(
        [sys.executable, "bench/engine_load.py", "--model", str(tiny_custom_voice), "--device", "cpu",
         "--rates", "2", "--warmup", "0.5", "--duration", "2", "--seed", "0", "--seed", "1",
         "--fail-ttfa-ms", "100000", "--output", str(output), "--log", str(tmp_path / "gateway.log")],
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
