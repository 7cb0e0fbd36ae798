"""bench/startup_load.py on the tiny checkpoint: it loads, times each phase and writes the JSON a GPU call reads."""

from __future__ import annotations

import json

from bench import startup_load
from tests.qwen3_fixtures import tiny_custom_voice  # noqa: F401


def test_reports_every_phase_of_the_load(tiny_custom_voice, tmp_path):
    out = tmp_path / "startup_load.json"
    assert startup_load.main(["--model", str(tiny_custom_voice), "--device", "cpu", "--runner", "--max-slots", "2",
                              "--max-len", "64", "--profile", "5", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu"
    assert set(report["weights_bytes"]) == {"model.safetensors", "speech_tokenizer/model.safetensors"}
    seconds = report["seconds"]
    phases = [seconds[f"from_pretrained.{name}"] for name in
              ("config", "model_weights", "codec_decoder", "tokenizer", "identity")]
    assert all(s >= 0 for s in phases) and sum(phases) <= seconds["from_pretrained"] + 1e-3
    assert seconds["runner.allocate"] > 0 and seconds["total"] >= seconds["from_pretrained"]
    assert len(report["profile"]) == 5
