"""bench/nari_load.py: the peer's harness (nari-labs `tts_bench`, pinned and unmodified; tests/nari_bench_env.py)
runs its vllm-omni target through a real gateway and `voxgate worker` (synthetic backend on the CPU), and the
report carries what the harness measured; bench/h200.sh's nari step is the command the GPU runs."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import IN_CI
from tests.nari_bench_env import HarnessUnavailable, harness_python, source_dir

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the harness's source needs Python 3.11 (asyncio.timeout)")
@pytest.mark.third_party
def test_the_harness_runs_against_a_gateway_and_worker(tmp_path):
    try:
        src = source_dir() / "tts_bench" / "src"
    except HarnessUnavailable as exc:
        if IN_CI:
            pytest.fail(f"{exc}; CI must provide it", pytrace=False)
        pytest.skip(str(exc))
    output = tmp_path / "nari_load.json"
    result = subprocess.run(
        [sys.executable, "bench/nari_load.py", "--backend", "synthetic", "--voice", "tone-mid", "--rates", "2,4",
         "--warmup", "1", "--duration", "3", "--harness-src", str(src), "--harness-python", str(harness_python()),
         "--work", str(tmp_path / "work"), "--output", str(output), "--log", str(tmp_path / "gateway.log")],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads(output.read_text())
    assert report["target"] == "vllm-omni" and "gpu" in report and "compile_cache" in report
    assert " worker --backend synthetic --socket " in report["worker_command"]
    assert " serve --backend remote -o socket=" in report["gateway_command"]
    assert [e["rps"] for e in report["rates"]] == [2, 4]
    for entry in report["rates"]:
        # What the harness measured, as its own summary.json says, not a figure of ours.
        harness = json.loads((tmp_path / "work" / f"rps-{entry['rps']:g}" / "summary.json").read_text())
        assert entry["summary"] == harness and harness["target"] == "vllm-omni"
        assert entry["harness_exit_code"] == 0
        assert entry["started_requests"] >= 4 and entry["failed_requests"] == 0, entry
        assert entry["successful_requests"] == harness["successful_requests"] == entry["started_requests"]
        assert entry["underrun_requests"] == harness["underrun_requests"] == 0
        assert 0 < entry["audible_ttfa_ms"]["p50"] <= entry["audible_ttfa_ms"]["p95"] == harness["audible_ttfa_ms"]["p95"]
        assert not (tmp_path / "work" / f"rps-{entry['rps']:g}" / "audio").exists()  # gigabytes on the GPU
    # The requests went through the gateway to the worker: the gateway logged them.
    assert "/v1/audio/speech" in (tmp_path / "gateway.log").read_text()
    assert "| 4 |" in output.with_suffix(".md").read_text()


def test_h200_nari_step_runs_the_harness_on_its_own_path(tmp_path):
    result = subprocess.run(["bash", "bench/h200.sh", "nari:1,10,20,60,80,100"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60,
                            env=dict(os.environ, DRY_RUN="1", OUT=str(tmp_path), WARMUP="5", DURATION="20"))
    assert result.returncode == 0, result.stdout + result.stderr
    commands = [shlex.split(line[2:]) for line in result.stdout.splitlines() if line.startswith("+ ")]
    (install,) = [c for c in commands if "pip" in c]
    assert install[install.index("--target") + 1] == "/tmp/nari-site"
    wheels = install[install.index("--target") + 2:]  # the glob where nothing is carried here (DRY_RUN)
    assert wheels and all(w.startswith(f"{ROOT}/.carry/nari/whl/") and w.endswith(".whl") for w in wheels)
    (command,) = [c for c in commands if "bench/nari_load.py" in c]
    assert command == ["python3", "bench/nari_load.py", "--model", "/tmp/ckpt", "--rates", "1,10,20,60,80,100",
                       "--warmup", "5", "--duration", "20", "--harness-src", f"{ROOT}/.carry/nari/tts_bench/src",
                       "--harness-site", "/tmp/nari-site:/tmp/site", "--harness-python", "python3",
                       "--output", f"{tmp_path}/nari_load.json", "--log", f"{tmp_path}/nari_gateway.log"]
    # The script's own parser takes these flags (the harness folder aside, which carry.sh builds).
    help_text = subprocess.run([sys.executable, "bench/nari_load.py", "--help"], cwd=ROOT, capture_output=True,
                               text=True, timeout=60).stdout
    for flag in ("--rates", "--warmup", "--duration", "--harness-src", "--harness-site", "--harness-python",
                 "--output", "--log", "--model"):
        assert flag in help_text
