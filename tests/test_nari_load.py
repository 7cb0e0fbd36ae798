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


def run_nari_load(tmp_path, flags: list[str], timeout: float) -> tuple[dict, Path]:
    """bench/nari_load.py with `flags` and the cached harness (failing in CI where it is missing, skipped
    elsewhere), its work folder, report and gateway log in `tmp_path`: (the report, the report's path)."""
    try:
        src = source_dir() / "tts_bench" / "src"
    except HarnessUnavailable as exc:
        if IN_CI:
            pytest.fail(f"{exc}; CI must provide it", pytrace=False)
        pytest.skip(str(exc))
    output = tmp_path / "nari_load.json"
    result = subprocess.run(
        [sys.executable, "bench/nari_load.py", *flags, "--harness-src", str(src),
         "--harness-python", str(harness_python()), "--work", str(tmp_path / "work"), "--output", str(output),
         "--log", str(tmp_path / "gateway.log")],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads(output.read_text()), output


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the harness's source needs Python 3.11 (asyncio.timeout)")
@pytest.mark.third_party
def test_the_harness_runs_against_a_gateway_and_worker(tmp_path):
    report, output = run_nari_load(tmp_path, ["--backend", "synthetic", "--voice", "tone-mid", "--rates", "2,4",
                                              "--warmup", "1", "--duration", "3"], timeout=600)
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
        # The gateway's own first-byte times for the same requests and the harness's warm-up ones (its
        # histogram), which the client's include;
        # the synthetic worker has no engine, so no engine part.
        gateway = entry["latency_split"]["gateway_ttfa_ms"]["http"]
        assert gateway["count"] >= entry["started_requests"] and gateway["p50"] <= entry["audible_ttfa_ms"]["p50"]
        assert entry["latency_split"]["engine_first_chunk_ms"] is None
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


def run_harness_on_two_workers(tmp_path, flag: str) -> tuple[dict, dict]:
    # Paced at 1.5x real time: each stream lasts seconds, as an engine's do, so the signal finds some open.
    report, _ = run_nari_load(tmp_path, ["--backend", "synthetic", "-o", "speed=1.5", "--voice", "tone-mid",
                                         "--rates", "4", "--warmup", "1", "--duration", "4", "--gpus", "0,1", flag,
                                         "3"], timeout=300)
    assert " worker --gpus 0,1 --backend synthetic " in report["worker_command"]
    assert " serve --backend remote -o workers=tcp://127.0.0.1:" in report["gateway_command"]
    assert [w["gpu"] for w in report["workers"]] == ["0", "1"] and len({w["pid"] for w in report["workers"]}) == 2
    (entry,) = report["rates"]
    assert entry["started_requests"] >= 10, entry
    return report, entry


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the harness's source needs Python 3.11 (asyncio.timeout)")
@pytest.mark.third_party
@pytest.mark.parametrize("flag", ["--kill-worker-at", "--drain-worker-at"])
def test_the_harness_through_one_launcher_of_two_workers_with_one_killed_or_drained(tmp_path, flag):
    """--gpus 0,1 (CUDA_VISIBLE_DEVICES means nothing on the CPU): one launcher, two children behind the static
    pool; the first GPU's child is SIGKILLed or SIGTERMed mid-run, the other serves on, and the entry says what
    the listeners heard, from the pool's log and the harness's own requests.jsonl."""
    report, entry = run_harness_on_two_workers(tmp_path, flag)
    disturbed = entry["killed_worker" if flag == "--kill-worker-at" else "drained_worker"]
    assert disturbed["sent"] is True and disturbed["gpu"] == "0" and disturbed["pid"] == report["workers"][0]["pid"]
    assert disturbed["streams_at_signal"] >= 1 and disturbed["sent_at_s"] >= 3
    # The synthetic backend costs next to nothing: one worker carries the whole load, nothing refused.
    assert disturbed["requests"] >= entry["started_requests"] and disturbed["requests_cut"] == 0
    assert entry["failed_requests"] == 0 and disturbed["requests_refused"] == 0
    by_gpu = {w["gpu"]: w["running"] for w in entry["workers"]}
    assert by_gpu == {"0": False, "1": True}
    pool = disturbed["pool"]
    if flag == "--kill-worker-at":
        assert pool["failovers"] >= 1 and 1 <= disturbed["pause_ms"]["n"] <= pool["failovers"]
        assert 0 < disturbed["pause_ms"]["p50"] <= disturbed["pause_ms"]["p99"] <= disturbed["pause_ms"]["max"]
        assert report["worker_exit_code"] == 9  # the launcher's: its worst child's, the SIGKILLed one
    else:
        assert pool["failovers"] == 0 and disturbed["exited"] is True and disturbed["no_stream_cut"] is True
        # Its open streams went on on the other worker from their codes (the synthetic backend tells codes).
        assert pool["handovers"] >= 1 and pool["resumed_from_codes"] >= 1, pool
        assert report["worker_exit_code"] == 0
    assert not Path(report["token_file"]).exists()


def test_h200_multigpu_step_runs_baseline_scaling_kill_and_drain(tmp_path):
    result = subprocess.run(["bash", "bench/h200.sh", "multigpu:20 --seed 3"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60,
                            env=dict(os.environ, DRY_RUN="1", OUT=str(tmp_path), WARMUP="5", DURATION="15"))
    assert result.returncode == 0, result.stdout + result.stderr
    commands = [shlex.split(line[2:]) for line in result.stdout.splitlines() if line.startswith("+ ")]
    runs = [c for c in commands if "bench/nari_load.py" in c]
    assert len(runs) == 4

    def flag(command, name):
        return command[command.index(name) + 1] if name in command else None

    assert [(flag(c, "--gpus"), flag(c, "--rates"), flag(c, "--kill-worker-at"), flag(c, "--drain-worker-at"),
             flag(c, "--output")) for c in runs] == [
        ("0", "20", None, None, f"{tmp_path}/multigpu_1gpu.json"),
        ("0,1", "40", None, None, f"{tmp_path}/multigpu_2gpu.json"),
        ("0,1", "40", "12.5", None, f"{tmp_path}/multigpu_kill.json"),  # the middle of the measured window
        ("0,1", "40", None, "12.5", f"{tmp_path}/multigpu_drain.json")]
    for c in runs:
        assert flag(c, "--model") == "/tmp/ckpt" and flag(c, "--warmup") == "5" and flag(c, "--duration") == "15"
        assert flag(c, "--seed") == "3" and flag(c, "--harness-site") == "/tmp/nari-site:/tmp/site"
        # The script's own parser takes every run's flags (the harness folder aside, which carry.sh builds).
        args = c[c.index("bench/nari_load.py") + 1:]
        args[args.index("--harness-src") + 1] = str(tmp_path)
        (tmp_path / "tts_bench").mkdir(exist_ok=True)
        from bench import nari_load

        parsed = nari_load.parse_args(args)
        assert parsed.gpu_list == flag(c, "--gpus").split(",")
    # KILL_AT and GPUS move the disturbance and the pair; one GPU is refused.
    moved = subprocess.run(["bash", "bench/h200.sh", "multigpu:20"], cwd=ROOT, capture_output=True, text=True,
                           timeout=60, env=dict(os.environ, DRY_RUN="1", OUT=str(tmp_path), KILL_AT="9",
                                                GPUS="2,3"))
    assert " --gpus 2 --rates 20 " in moved.stdout and " --gpus 2\\,3 --rates 40 --kill-worker-at 9 " in moved.stdout
    lone = subprocess.run(["bash", "bench/h200.sh", "multigpu:20"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, DRY_RUN="1", OUT=str(tmp_path), GPUS="0"))
    assert lone.returncode != 0 and "two GPUs" in lone.stdout
