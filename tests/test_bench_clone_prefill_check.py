"""bench/clone_prefill_check.py end to end on the CPU with a tiny Base checkpoint, so that the command run on the
H100 is known to work: every voice and batch is checked against the uncaptured path, and each prefill's parts are
timed, an in-context voice's with its codec priming and its voice prefix copy, an x-vector voice's without."""

from __future__ import annotations

import json

from bench import clone_prefill_check
from tests.qwen3_fixtures import single_torch_thread, tiny_base  # noqa: F401 - fixtures


def test_each_voice_prefill_is_checked_and_timed_by_part(tiny_base, tmp_path):
    output = tmp_path / "clone_prefill.json"
    assert clone_prefill_check.main(["--model", str(tiny_base), "--device", "cpu", "--iters", "2",
                                     "--output", str(output)]) == 0
    rows = json.loads(output.read_text())["rows"]
    assert [(r["voice"], r["batch"]) for r in rows] == [
        (voice, batch) for voice in ("x_vector", "icl_3s", "icl_10s", "icl_30s") for batch in (1, 4)]
    for row in rows:
        stages = row["stages"]
        assert row["same_first_code"] and row["max_rel_diff"] < 3e-2
        assert {"_fresh_slots", "prompts_embeds", "_voice_prefixes", "_prefill_rest"} <= set(stages)
        assert all(s["done_ms"] >= s["host_ms"] > 0 for s in stages.values())
        icl = row["voice"].startswith("icl")
        # Only an in-context voice primes its codec with the reference frames (each request's slot) and has a
        # prefix to keep.
        assert (row["voice_prefix"] > 0) == icl
        assert stages.get("_prime_codec", {}).get("calls_per_prefill", 0) == (row["batch"] if icl else 0)
        assert all(stages[name]["calls_per_prefill"] == 1 for name in stages if name != "_prime_codec")
        # The whole prefill's host time is reported; the timing behind a busy device needs one (CUDA only).
        assert row["prefill_host_ms"] >= stages["_prefill_rest"]["host_ms"] and row["behind_busy_device"] is None
        assert row["synchronising_calls"] is None
    assert "_prefill_rest" in output.with_suffix(".md").read_text()
