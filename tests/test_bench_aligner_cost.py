"""bench/aligner_cost.py on the CPU: it times every batch size asked, counts the ops each batch dispatches, and
its contention mode measures beside a running engine stand-in."""

from __future__ import annotations

import json

from bench import aligner_cost


def test_report_rows_for_each_batch_size(tmp_path):
    output = tmp_path / "cost.json"
    aligner_cost.main(["--size", "tiny", "--batches", "1,3", "--seconds", "1.5", "--repeats", "1",
                       "--contend-ms", "1", "--output", str(output)])
    report = json.loads(output.read_text())
    assert [row["batch"] for row in report["rows"]] == [1, 3]
    for row in report["rows"]:
        assert row["ms_per_batch"] > 0 and row["contended_ms_per_batch"] > 0
        assert row["ops_per_batch"] > 50  # a forward pass of the 2+2-layer model, counted at the dispatcher
        assert 0 <= row["engine_work_lost"] <= 1
    assert report["command"].startswith("python bench/aligner_cost.py --size tiny")


def test_requests_are_speech_length_with_words():
    batch = aligner_cost.requests(4, 3.0)
    assert len({len(r.audio) for r in batch}) == 4  # lengths differ, so batches pad
    assert all(r.sample_rate == 24000 and len(r.text.split()) == 8 for r in batch)
