"""bench/engine_load.py --tcp-workers: the commands it would start (no process started, no GPU): N workers on
distinct loopback TCP ports with the token file and a health port each, the in-process run's KV slots shared
out between them, the gateway's static pool naming every worker, and the token itself in no command. Then
the whole run on the CPU: two qwen3 workers on a tiny checkpoint behind a real gateway, both serving, each
one's engine counters in the report, and the token in neither the report nor any log."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from bench import engine_load
from tests.qwen3_fixtures import tiny_custom_voice  # noqa: F401 - session fixture


def option_values(command: list[str], flag: str) -> list[str]:
    return [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == flag]


def options(command: list[str]) -> dict[str, str]:
    pairs = option_values(command, "--option") + option_values(command, "-o")
    return dict(pair.split("=", 1) for pair in pairs)


def test_two_tcp_workers_share_the_slots_and_the_pool_names_both(tmp_path):
    args = engine_load.parse_args(["--model", "/tmp/ckpt", "--tcp-workers", "2", "-o", "cuda_graphs=false"])
    token_file = engine_load.write_token_file()
    try:
        token = token_file.read_text().strip()
        assert len(token) >= 32 and stat.S_IMODE(token_file.stat().st_mode) == 0o600
        ports = {8000}
        layout = engine_load.plan_processes(args, 8000, ports, str(token_file))
        workers = layout["workers"]
        assert len(workers) == 2
        listen = [option_values(w["command"], "--listen")[0] for w in workers]
        health = [int(option_values(w["command"], "--health-port")[0]) for w in workers]
        assert [w["address"] for w in workers] == listen
        assert all(a.startswith("tcp://127.0.0.1:") for a in listen)
        every_port = [int(a.rsplit(":", 1)[1]) for a in listen] + health + [8000]
        assert len(set(every_port)) == 5 and set(every_port) == ports
        assert [w["log_suffix"] for w in workers] == [".worker1.log", ".worker2.log"]
        for w in workers:
            command = w["command"]
            assert command[command.index("-m") + 1:][:2] == ["gateway.cli", "worker"]
            assert option_values(command, "--token-file") == [str(token_file)]
            assert option_values(command, "--model") == ["/tmp/ckpt"]
            opts = options(command)
            assert opts["max_active"] == str(engine_load.BENCH_MAX_ACTIVE // 2)
            assert opts["cuda_graphs"] == "false"  # the caller's -o items reach every worker
            assert json.loads(opts["runner_options"]) == engine_load.BENCH_RUNNER_OPTIONS
        assert engine_load.worker_max_active(args) == engine_load.BENCH_MAX_ACTIVE // 2
        gateway = layout["gateway"]
        assert option_values(gateway, "--backend") == ["remote"]
        gateway_opts = options(gateway)
        assert gateway_opts == {"workers": ",".join(listen), "token_file": str(token_file)}
        for command in [gateway, *(w["command"] for w in workers)]:
            assert token not in " ".join(command)
    finally:
        token_file.unlink()
        token_file.parent.rmdir()


def test_one_unix_worker_and_in_process_are_unchanged():
    ports = {9000}
    worker = engine_load.plan_processes(engine_load.parse_args(["--model", "m", "--worker"]), 9000, ports)
    (spec,) = worker["workers"]
    assert option_values(spec["command"], "--socket") == ["/tmp/voxgate-bench-9000.sock"]
    assert options(spec["command"])["max_active"] == str(engine_load.BENCH_MAX_ACTIVE)
    assert options(worker["gateway"]) == {"socket": "/tmp/voxgate-bench-9000.sock"}
    local = engine_load.plan_processes(engine_load.parse_args(["--model", "m"]), 9000, ports)
    assert local["workers"] == [] and option_values(local["gateway"], "--backend") == ["qwen3"]
    assert options(local["gateway"])["max_active"] == str(engine_load.BENCH_MAX_ACTIVE)
    assert ports == {9000}


def test_worker_and_tcp_workers_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        engine_load.parse_args(["--model", "m", "--worker", "--tcp-workers", "2"])


def test_two_tcp_workers_both_serve_on_the_cpu(tiny_custom_voice, tmp_path, monkeypatch):
    tokens = []
    write = engine_load.write_token_file

    def recording_write():
        path = write()
        tokens.append(path.read_text().strip())
        return path

    monkeypatch.setattr(engine_load, "write_token_file", recording_write)
    output, log = tmp_path / "load.json", tmp_path / "logs" / "gateway.log"
    # 3 RPS for 4 s: a new session goes to an idle worker (ties broken at random), so each gets some.
    assert engine_load.main(["--model", str(tiny_custom_voice), "--device", "cpu", "--rates", "3", "--warmup", "1",
                             "--duration", "4", "--fail-ttfa-ms", "100000", "--tcp-workers", "2",
                             "--output", str(output), "--log", str(log)]) == 0
    (token,) = tokens
    report = json.loads(output.read_text())
    assert len(report["worker_commands"]) == 2 and report["worker_exit_codes"] == [0, 0]
    assert not Path(report["token_file"]).exists()  # removed with its folder at the end
    (entry,) = report["rates"]
    # Not the verdict: on a small, busy CPU machine a request may underrun. Every request must be served.
    summary = entry["summary"]
    assert summary["failed"] == 0 and summary["completed"] == summary["requests"] > 0
    served = [w["requests"]["completed"] for w in entry["workers"]]
    assert all(n >= 1 for n in served), served
    assert sum(served) >= entry["summary"]["requests"]  # warm-up requests go through the engines too
    for w in entry["workers"]:
        assert w["engine"]["stages"]["prefill"]["batches"] >= 1
    # The gateway's /metrics sums the workers' counters.
    assert entry["engine"]["decisions"] == sum(w["engine"]["decisions"] for w in entry["workers"])
    files = [output, output.with_suffix(".md"), log, log.with_suffix(".worker1.log"), log.with_suffix(".worker2.log")]
    for f in files:
        assert token not in f.read_text(), f
    assert "Engine thread per worker" in output.with_suffix(".md").read_text()


def test_a_worker_killed_mid_run_loses_no_request(tiny_custom_voice, tmp_path):
    """--kill-worker-at: worker 1 is SIGKILLed during the run; every request is still served (its streams
    fail over to worker 2), and the report says when and what the pool logged."""
    output, log = tmp_path / "load.json", tmp_path / "gateway.log"
    assert engine_load.main(["--model", str(tiny_custom_voice), "--device", "cpu", "--rates", "3", "--warmup", "1",
                             "--duration", "5", "--fail-ttfa-ms", "100000", "--tcp-workers", "2",
                             "--kill-worker-at", "3", "--output", str(output), "--log", str(log)]) == 0
    report = json.loads(output.read_text())
    (entry,) = report["rates"]
    summary = entry["summary"]
    assert summary["failed"] == 0 and summary["completed"] == summary["requests"] > 0
    assert entry["killed_worker"]["at_s"] == 3 and isinstance(entry["killed_worker"]["failover_pause_ms"], list)
    # What the listeners heard: the streams playing at the kill (the signal waits for one on worker 1).
    heard = entry["killed_worker"]["listeners_silence_ms"]
    assert heard["n"] >= 1 and 0 <= heard["heard_any"] <= heard["n"] and heard["max"] >= heard["p50"] >= 0
    # And the streams that failed over, as the fleet simulator measures them, found in the pool's log (a stream
    # that had no audio yet at the kill has no gap across it: n may be below the failovers, or 0).
    across = entry["killed_worker"]["client_pause_across_ms"]
    assert 0 <= across["n"] <= len(entry["killed_worker"]["failover_pause_ms"])
    assert across["n"] == 0 or across["max"] >= across["p50"]
    assert report["worker_exit_codes"][0] == -9


def test_runner_options_override_the_bench_fields_one_by_one():
    # A what-if names only the field it changes: the bench's buckets stay, the last -o wins per field.
    args = engine_load.parse_args(["--model", "m", "--worker", "-o", 'runner_options={"codec_in_flight": 1}',
                                   "-o", 'runner_options={"codec_dtype": "float32", "codec_in_flight": 2}'])
    (spec,) = engine_load.plan_processes(args, 9100, {9100})["workers"]
    opts = options(spec["command"])
    assert json.loads(opts["runner_options"]) == {**engine_load.BENCH_RUNNER_OPTIONS, "codec_dtype": "float32",
                                                  "codec_in_flight": 2}
    assert option_values(spec["command"], "--option").count(f"runner_options={opts['runner_options']}") == 1


def test_cpu_workers_share_the_cores_out_and_a_callers_thread_count_is_kept():
    cores = os.cpu_count() or 1
    assert engine_load.cpu_worker_env({}, 2)["OMP_NUM_THREADS"] == str(max(1, cores // 3))
    assert engine_load.cpu_worker_env({}, 4 * cores)["OMP_NUM_THREADS"] == "1"
    assert engine_load.cpu_worker_env({"OMP_NUM_THREADS": "3"}, 2) == {"OMP_NUM_THREADS": "3"}
