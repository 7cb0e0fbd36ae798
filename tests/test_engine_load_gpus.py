"""bench/engine_load.py --gpus 0,1: the load through ONE `voxgate worker --gpus` launcher, its two children behind
the gateway's static pool, as issue 35's two-GPU run does it. First the commands (nothing started): the
launcher's ports counted up from one block, the pool naming both children, the token in no command. Then on
the CPU (CUDA_VISIBLE_DEVICES means nothing there) with the tiny qwen3 checkpoint, a real launcher, gateway and
clients: --kill-worker-at SIGKILLs the first GPU's child, found in /proc, not the launcher, and the pool fails
over; --drain-worker-at SIGTERMs it, it drains and exits, and no stream is cut."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from bench import engine_load
from tests.qwen3_fixtures import tiny_custom_voice  # noqa: F401 - session fixture


def option_values(command: list[str], flag: str) -> list[str]:
    return [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == flag]


def test_one_launcher_for_two_gpus_and_a_pool_naming_both_children():
    args = engine_load.parse_args(["--model", "/tmp/ckpt", "--gpus", "0,1", "--drain-worker-at", "5"])
    token_file = engine_load.write_token_file()
    try:
        ports = {8000}
        layout = engine_load.plan_processes(args, 8000, ports, str(token_file))
        launcher = layout["launcher"]
        assert launcher[launcher.index("-m") + 1:][:2] == ["gateway.cli", "worker"]
        assert option_values(launcher, "--gpus") == ["0,1"]
        (listen,) = option_values(launcher, "--listen")
        base = int(listen.rsplit(":", 1)[1])
        assert listen == f"tcp://127.0.0.1:{base}"
        assert option_values(launcher, "--health-port") == [str(base + 2)]
        assert option_values(launcher, "--token-file") == [str(token_file)]
        # Each child has a GPU of its own: the in-process run's slots, not a share of them.
        assert f"max_active={engine_load.BENCH_MAX_ACTIVE}" in option_values(launcher, "--option")
        workers = layout["workers"]
        assert [(w["gpu"], w["address"], w["health"]) for w in workers] == [
            ("0", f"tcp://127.0.0.1:{base}", f"http://127.0.0.1:{base + 2}"),
            ("1", f"tcp://127.0.0.1:{base + 1}", f"http://127.0.0.1:{base + 3}")]
        assert ports == {8000, base, base + 1, base + 2, base + 3}
        gateway = layout["gateway"]
        assert option_values(gateway, "-o") == [f"workers=tcp://127.0.0.1:{base},tcp://127.0.0.1:{base + 1}",
                                                f"token_file={token_file}"]
        token = token_file.read_text().strip()
        assert token not in " ".join(launcher + gateway)
    finally:
        token_file.unlink()
        token_file.parent.rmdir()


@pytest.mark.parametrize("flags", [["--gpus", "0", "--kill-worker-at", "3"], ["--gpus", "0", "--drain-worker-at", "3"],
                                   ["--gpus", "0,1", "--kill-worker-at", "3", "--drain-worker-at", "4"],
                                   ["--gpus", "0,1", "--tcp-workers", "2"], ["--gpus", "0,0"]])
def test_bad_combinations_are_refused(flags):
    with pytest.raises(SystemExit):
        engine_load.parse_args(["--model", "m", *flags])


def test_consecutive_free_ports_are_free_and_not_taken():
    import socket

    from bench.ports import ephemeral_ports

    taken = {1}
    first = engine_load.consecutive_free_ports(4, taken)
    assert taken == {1, first, first + 1, first + 2, first + 3}
    # Below the kernel's ephemeral ports, which any socket bound to port 0 or connecting out may take.
    assert first + 3 < ephemeral_ports().start
    held = []
    try:
        for port in range(first, first + 4):  # all of them bindable together
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", port))
    finally:
        for s in held:
            s.close()


def test_the_launchers_children_are_found_by_their_gpu(tmp_path):
    """launcher_children reads the launcher's children from /proc and tells them apart by the CUDA_VISIBLE_DEVICES
    the launcher gave each: a child of another parent, or of another GPU, is not one of them."""
    script = ("import os, subprocess, sys, time\n"
              "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
              " env={**os.environ, 'CUDA_VISIBLE_DEVICES': g}) for g in ('1', '0', '7')]\n"
              "print(' '.join(str(k.pid) for k in kids), flush=True)\n"
              "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        one, zero, seven = (int(pid) for pid in parent.stdout.readline().split())
        assert engine_load.launcher_children(parent.pid, ["0", "1"], timeout_s=10) == {"0": zero, "1": one}
        with pytest.raises(RuntimeError):
            engine_load.launcher_children(parent.pid, ["0", "1", "2"], timeout_s=1)
    finally:
        for pid in (one, zero, seven):
            with __import__("contextlib").suppress(ProcessLookupError):
                __import__("os").kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait(10)


def run_disturbed(model, tmp_path, flag: str) -> tuple[dict, dict]:
    output, log = tmp_path / "load.json", tmp_path / "gateway.log"
    # 4 RPS for 6 s with the disturbance 4 s in (1 s of it warm-up): each child has streams open by then.
    assert engine_load.main(["--model", str(model), "--device", "cpu", "--rates", "4", "--warmup", "1",
                             "--duration", "6", "--fail-ttfa-ms", "100000", "--gpus", "0,1", flag, "4",
                             "--output", str(output), "--log", str(log)]) == 0
    report = json.loads(output.read_text())
    (entry,) = report["rates"]
    return report, entry


def assert_no_stream_cut(report: dict, entry: dict, disturbed: dict) -> None:
    """Every stream that had begun ended whole. Not the verdict: on a small, busy CPU machine a request may
    underrun, and while one child carries the load of two the gateway may refuse new sessions as overloaded
    (admission control, reported as refused): those are the only failures allowed."""
    summary = entry["summary"]
    assert summary["requests"] > 0 and disturbed["sent"] is True
    assert disturbed["streams_at_signal"] >= 1  # the worker had streams to lose or to drain
    assert disturbed["requests_cut"] == 0, disturbed["failed_errors"]
    assert summary["failed"] <= disturbed["requests_refused"] < disturbed["requests"]
    assert all("overloaded" in e for e in disturbed["failed_errors"]), disturbed["failed_errors"]
    assert [w["gpu"] for w in report["workers"]] == ["0", "1"]
    assert " worker --gpus 0,1 " in report["launcher_command"]


def test_a_gpus_child_killed_mid_run_fails_over(tiny_custom_voice, tmp_path):
    report, entry = run_disturbed(tiny_custom_voice, tmp_path, "--kill-worker-at")
    killed = entry["killed_worker"]
    assert_no_stream_cut(report, entry, killed)
    first, second = report["workers"]
    # The first GPU's child, as /proc named it, not the launcher (which goes on with the other child).
    assert killed["gpu"] == "0" and killed["pid"] == first["pid"] != second["pid"] and killed["at_s"] == 4
    by_gpu = {w["gpu"]: w for w in entry["workers"]}
    assert by_gpu["0"]["running"] is False and by_gpu["1"]["running"] is True
    assert report["launcher_exit_code"] == 9  # its worst child's: the SIGKILLed one
    pool = killed["pool"]
    assert pool is not None and pool["failovers"] >= 1, pool  # it had streams, and the pool moved them
    pauses = killed["failover_pause_ms"]
    assert 1 <= len(pauses) <= pool["failovers"] and all(p > 0 for p in pauses)
    assert killed["pause_ms"]["n"] == len(pauses)
    assert killed["pause_ms"]["p50"] <= killed["pause_ms"]["p99"] <= killed["pause_ms"]["max"] == max(pauses)
    # The survivor served requests after the kill; the gateway's log names the failovers.
    assert by_gpu["1"]["requests"]["completed"] >= 1
    assert "failover session=" in (tmp_path / "gateway.log").read_text()


def test_a_gpus_child_drained_mid_run_cuts_no_stream(tiny_custom_voice, tmp_path):
    report, entry = run_disturbed(tiny_custom_voice, tmp_path, "--drain-worker-at")
    drained = entry["drained_worker"]
    assert_no_stream_cut(report, entry, drained)
    assert drained["gpu"] == "0" and drained["pid"] == report["workers"][0]["pid"] and drained["at_s"] == 4
    assert drained["exited"] is True
    pool = drained["pool"]
    # Its streams went on elsewhere from their codes or finished there; none was lost with it.
    assert pool["failovers"] == 0 and drained["streams_cut"] == 0 and drained["no_stream_cut"] is True
    assert pool["resumed_from_codes"] <= pool["handovers"] and len(drained["failover_pause_ms"]) <= pool["handovers"]
    by_gpu = {w["gpu"]: w for w in entry["workers"]}
    assert by_gpu["0"]["running"] is False and by_gpu["1"]["running"] is True
    assert report["launcher_exit_code"] == 0  # the drained child exited 0, the other on the final SIGTERM
    workers_log = (tmp_path / "gateway.workers.log").read_text()
    assert "bench-gpu0: stopped" in workers_log
