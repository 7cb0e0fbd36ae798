"""bench/resume_check.py (the GPU check of resume from codes) end to end on the CPU with a tiny checkpoint, so
that the command the coordinator runs on the H100 is known to work: every cut goes on after exactly the
delivered frames, the codec's left context at the join is theirs (a cold codec's is not), the join is within
the stream's own p99 step, and on the CPU the frames after the cut are the uninterrupted run's."""

from __future__ import annotations

import json

from bench import resume_check
from tests.qwen3_fixtures import single_torch_thread, tiny_custom_voice  # noqa: F401 - fixtures


def test_the_check_passes_on_the_cpu_and_reports_the_join(tiny_custom_voice, tmp_path):
    output = tmp_path / "resume_check.json"
    assert resume_check.main([
        "--model", str(tiny_custom_voice), "--device", "cpu", "--dtype", "float32", "--sentences", "1",
        "--cuts", "1", "--others", "2", "--others-resume", "1", "--max-active", "4", "--max-len", "256",
        "--frame-cap-chars-per-second", "60", "--output", str(output),
    ]) == 0
    report = json.loads(output.read_text())
    cuts = report["cuts"]
    assert {c["streaming_text"] for c in cuts} == {False, True} and any(c["cut_chunk"] == 1 for c in cuts)
    for cut in cuts:
        assert cut["pass"] and cut["context_is_delivered"] and cut["new_frames_equal_uninterrupted"]
        assert cut["k"] > 0 and cut["new_frames"] > 0 and cut["join_within_p99"] and cut["click_free"]
        # The continuity check tells a primed codec from a cold one.
        assert cut["codec_continuity_snr_db"] > 60 > cut["cold_continuity_snr_db"]
    assert report["resume_first_audio_ms"]["median"] > 0 and report["fast_path"]["cuda_graphs"] is False


def test_cuts_past_the_codec_context_are_checked_against_the_last_frames_decode(tiny_custom_voice, tmp_path):
    # --repeat makes the request long enough to cut past resume_codec_context (4 here; 36 on a GPU): there the
    # continuity reference is the codec's decode from the first frame the runner primes with.
    output = tmp_path / "resume_check.json"
    assert resume_check.main([
        "--model", str(tiny_custom_voice), "--device", "cpu", "--dtype", "float32", "--sentences", "1",
        "--cuts", "3", "--repeat", "3", "--streaming-text", "off", "--others", "1", "--others-resume", "1",
        "--max-active", "4", "--max-len", "384", "--frame-cap-chars-per-second", "60",
        "--runner-options", '{"resume_codec_context": 4}', "--output", str(output),
    ]) == 0
    cuts = json.loads(output.read_text())["cuts"]
    deep = [c for c in cuts if c["k"] > 4]
    assert deep and all(c["codec_context_from"] == c["k"] - 4 for c in deep)
    for cut in cuts:
        assert cut["pass"] and cut["new_frames_equal_uninterrupted"] and cut["codec_continuity_snr_db"] > 60
