"""bench/scheduler_cost.py: the loaded population reaches every kind of decision it is meant to time, and the
comparison mode runs a scheduler loaded from a file beside the current one."""

from __future__ import annotations

import json
from pathlib import Path

from bench import scheduler_cost
from tts_backend.engine import scheduler as current_scheduler


def test_the_loaded_population_is_busy_and_mixed():
    scheduler = scheduler_cost.loaded_scheduler(128, seed=0, now=1000.0)
    holders = list(scheduler._active.values())
    assert len(holders) == 128
    assert any(r.playback_start is None for r in holders) and any(r.playback_start is not None for r in holders)
    batch = scheduler.decide(1000.0)
    assert batch is not None and len(batch.requests) > 1  # an anchor and fill, not a lone request
    rules = {scheduler_cost.loaded_scheduler(64, seed, 1000.0).decide(1000.0 + dt).rule
             for seed in range(8) for dt in (0.0, 0.5, 3.0)}
    assert {"urgent_codec", "urgent_generation", "startup"} <= rules


def test_comparison_against_a_scheduler_file(tmp_path):
    output = tmp_path / "cost.json"
    scheduler_cost.main(["--requests", "4,16", "--repetitions", "2", "--calls", "3", "--rounds", "2",
                         "--baseline", current_scheduler.__file__, "--json", str(output)])
    result = json.loads(output.read_text())
    assert [row["requests"] for row in result["rows"]] == [4, 16]
    for row in result["rows"]:
        assert row["baseline_median_us"] > 0 and row["current_median_us"] > 0
        assert all(len(v) == 2 for v in row["round_medians_us"].values())
    assert Path(result["command"].split()[1]).name == "scheduler_cost.py"
