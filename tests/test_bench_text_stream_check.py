"""bench/text_stream_check.py (the GPU check of text streaming) end to end on the CPU with a tiny checkpoint, so
that the command the coordinator runs on the H200 is known to work: fp32, the pieces' codes equal the
whole text's, and the report carries the timing and the engine's text-wait counters."""

from __future__ import annotations

import json

from bench import text_stream_check
from tests.qwen3_fixtures import single_torch_thread, tiny_custom_voice  # noqa: F401 - fixtures


def test_the_check_passes_on_the_cpu_and_reports_timing(tiny_custom_voice, tmp_path):
    output = tmp_path / "text_stream.json"
    assert text_stream_check.main([
        "--model", str(tiny_custom_voice), "--device", "cpu", "--dtype", "float32", "--sentences", "2",
        "--others", "2", "--words-per-s", "20", "--max-active", "4", "--max-len", "256",
        "--frame-cap-chars-per-second", "60", "--output", str(output),
    ]) == 0
    report = json.loads(output.read_text())
    assert [s["pass"] for s in report["sentences"]] == [True, True]
    assert all(s["pieces_equal_whole"] and s["frames"] > 2 for s in report["sentences"])
    assert report["timing_ms"]["pieces_first_audio_from_first_word"]["median"] > 0
    assert set(report["engine_text"]) == {"waits", "wait_s", "gaps", "gap_s"}
    assert report["fast_path"]["cuda_graphs"] is False
