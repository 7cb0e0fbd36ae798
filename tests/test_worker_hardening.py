"""Issue 24, items 4 and 14-17: a `voxgate worker` process against peers that never authenticate, or
authenticate and then abuse what they may send; its health port; its launcher's death. Real worker
processes on loopback, raw sockets, the worker's RSS (VmHWM) and its /health measured."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import pytest

from tests.gateway_server import free_port
from tests.hostile_fixtures import MemoryWatch, children_of
from tests.worker_fixtures import WorkerProcess, synthetic_worker_args, wait_for, workers
from tts_backend.base import SynthesisRequest
from tts_backend.remote import framing
from tts_backend.remote.connection import Dialer, WorkerAddress

TOKEN = "hardening-test-token-77e1"


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return str(path)


async def info_over(dialer: Dialer, target: WorkerAddress) -> dict:
    reader, writer = await dialer.open(target)
    try:
        writer.write(framing.encode_json({"op": "info"}))
        await writer.drain()
        frame = await asyncio.wait_for(framing.read_frame(reader, framing.MAX_ANSWER_FRAME), 10)
        return framing.decode_json(frame[1])
    finally:
        writer.close()


async def health_worst(port: int, stop: asyncio.Event) -> float:
    """The slowest /health answer of the worker's health port until `stop`."""
    worst = 0.0
    while not stop.is_set():
        asked = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.0\r\n\r\n")
        assert (await reader.read()).startswith(b"HTTP/1.0 200")
        writer.close()
        worst = max(worst, time.monotonic() - asked)
        await asyncio.sleep(0.02)
    return worst


# ---------------------------------------------------------------------------------------- item 4


async def test_idle_unauthenticated_connections_do_not_keep_a_gateway_out(token_file):
    """4,200 idle TCP connections (no byte sent), held, then 32 loops opening more: before, the worker sat
    at its 4,096-connection cap and the gateway's info query got `overloaded`. (Fewer where this process may
    not open that many files: then only the new bound is shown, not the old cap.)"""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4400 if hard == resource.RLIM_INFINITY else min(4400, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))  # the worker started below inherits it
    count = min(4200, wanted - 200)
    with workers(synthetic_worker_args("--token-file", token_file)) as (worker,):
        target = WorkerAddress.parse(worker.address)
        idle = [await asyncio.open_connection(target.host, target.port) for _ in range(count)]
        stop = asyncio.Event()

        async def churn():
            while not stop.is_set():
                try:
                    _, writer = await asyncio.open_connection(target.host, target.port)
                    await asyncio.sleep(0.05)
                    writer.close()
                except OSError:
                    await asyncio.sleep(0.01)

        flood = [asyncio.create_task(churn()) for _ in range(32)]
        dialer = Dialer(token=TOKEN)
        try:
            started = time.monotonic()
            answers = [await info_over(dialer, target) for _ in range(10)]
            took = time.monotonic() - started
        finally:
            stop.set()
            await asyncio.gather(*flood)
            for _, writer in idle:
                writer.close()
        print(f"10 info queries through the flood: {took:.2f} s")
        assert [a["op"] for a in answers] == ["info"] * 10, answers
        assert took < 10


async def test_an_idle_connection_is_dropped_at_the_handshake_deadline(token_file):
    with workers(synthetic_worker_args("--token-file", token_file)) as (worker,):
        target = WorkerAddress.parse(worker.address)
        reader, writer = await asyncio.open_connection(target.host, target.port)
        started = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 10) == b""
        took = time.monotonic() - started
        writer.close()
    assert 2.5 < took < 5, took  # AUTH_TIMEOUT_S (3 s); before: 10 s


# ---------------------------------------------------------------------------------------- item 14


async def test_a_deeply_nested_first_frame_is_one_short_refusal(token_file):
    """4,090 `[`: before, a 20-line RecursionError traceback at ERROR per connection, and no answer."""
    with workers(synthetic_worker_args("--token-file", token_file)) as (worker,):
        target = WorkerAddress.parse(worker.address)
        for _ in range(3):
            reader, writer = await asyncio.open_connection(target.host, target.port)
            writer.write(framing.encode(framing.JSON, b"[" * 4090))
            frame = await asyncio.wait_for(framing.read_frame(reader, framing.MAX_AUTH_FRAME), 10)
            answer = framing.decode_json(frame[1])
            assert answer["code"] == "bad_request" and "nested too deep" in answer["message"]
            assert await asyncio.wait_for(reader.read(), 5) == b""  # and closed
            writer.close()
        time.sleep(0.3)
        output = "\n".join(worker.output)
    assert "Traceback" not in output and "RecursionError" not in output, output


# ---------------------------------------------------------------------------------------- item 15


async def test_large_frames_after_auth_are_bounded_in_all(token_file):
    """20 authenticated connections each holding a nearly complete 8 MiB request frame: before, the
    worker buffered them all (16 MiB frames: RSS 50 -> 371 MB, never returned). Now large requests share
    one 32 MiB budget and the rest are answered `overloaded` on their header."""
    size = 8 * 1024 * 1024 - 1024
    with workers(synthetic_worker_args("--token-file", token_file)) as (worker,):
        target = WorkerAddress.parse(worker.address)
        memory = MemoryWatch(worker.proc.pid)
        memory.start()
        dialer = Dialer(token=TOKEN)
        held, refused = [], 0
        for _ in range(20):
            reader, writer = await dialer.open(target)
            writer.write(framing._HEADER.pack(size + 1, framing.JSON[0]))
            try:  # refused on its header, or read: then pour all but the last KiB and hold it
                frame = await asyncio.wait_for(framing.read_frame(reader, framing.MAX_ANSWER_FRAME), 0.3)
                refused += frame is not None and framing.decode_json(frame[1]).get("code") == "overloaded"
                writer.close()
                continue
            except asyncio.TimeoutError:
                pass
            for _ in range(size // (1024 * 1024)):
                writer.write(b" " * (1024 * 1024))
                await asyncio.wait_for(writer.drain(), 10)
            held.append(writer)
        await asyncio.sleep(0.5)
        growth = memory.growth
        for writer in held:
            writer.close()
    print(f"worker peak RSS +{growth / 2**20:.1f} MiB, {refused} of 20 refused")
    assert refused >= 15
    assert growth < 60 * 1024 * 1024, growth


async def test_the_worker_bounds_its_text_and_keeps_its_loop_free(token_file):
    """A 4,000-character synthesize is refused; one just under the bound (1,990) does not stall the
    worker's /health (before: a 4,000-character one blocked its loop for 1.9 s)."""
    health = free_port()
    args = synthetic_worker_args("--token-file", token_file, "--health-port", str(health), speed=0)
    with workers(args) as (worker,):
        target = WorkerAddress.parse(worker.address)
        dialer = Dialer(token=TOKEN)

        async def synthesize(text: str) -> tuple[int, dict | None]:
            reader, writer = await dialer.open(target)
            request = SynthesisRequest(text=text, voice="tone-mid", seed=int(time.time() * 1e6) % 2**31)
            writer.write(framing.encode_json({"op": "synthesize", "request": framing.request_to_json(request)}))
            audio = 0
            try:
                while frame := await asyncio.wait_for(framing.read_frame(reader, framing.MAX_STREAM_FRAME), 30):
                    if frame[0] == framing.AUDIO:
                        audio += len(frame[1])
                    else:
                        message = framing.decode_json(frame[1])
                        if message["op"] in ("done", "error"):
                            return audio, message
            finally:
                writer.close()
            return audio, None

        audio, answer = await synthesize("word " * 800)
        assert audio == 0 and answer["code"] == "bad_request" and "2000 characters" in answer["message"], answer
        stop = asyncio.Event()
        probe = asyncio.create_task(health_worst(health, stop))
        await asyncio.sleep(0.2)
        audio, answer = await synthesize("word " * 398)
        stop.set()
        worst = await probe
    print(f"/health worst during a 1,990-character synthesis: {worst * 1000:.0f} ms")
    assert answer["op"] == "done" and audio > 0
    assert worst < 0.4, worst


# ---------------------------------------------------------------------------------------- item 16


def listening_hosts(port: int) -> set[str]:
    """The local addresses listening on TCP `port`, from /proc/net/tcp and tcp6."""
    hosts = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:  # LISTEN
                    raw = bytes.fromhex(address)
                    if len(raw) == 4:
                        hosts.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                    else:
                        words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                        hosts.add(socket.inet_ntop(socket.AF_INET6, words))
    return hosts


def test_the_health_port_binds_where_the_worker_listens(tmp_path):
    """Before: 0.0.0.0 whatever --listen said."""
    loopback, unix, wildcard = free_port(), free_port(), free_port()
    args = [synthetic_worker_args("--health-port", str(loopback)),
            synthetic_worker_args("--health-port", str(unix), listen=f"unix:{tmp_path}/w.sock"),
            synthetic_worker_args("--health-port", str(wildcard), "--health-host", "0.0.0.0")]
    with workers(*args):
        assert listening_hosts(loopback) == {"127.0.0.1"}
        assert listening_hosts(unix) == {"127.0.0.1"}
        assert listening_hosts(wildcard) == {"0.0.0.0"}  # asked for


# ---------------------------------------------------------------------------------------- item 17


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_killed_launcher_takes_its_workers_with_it():
    """--gpus 0,1, then SIGKILL of the launcher: before, both workers kept serving (their ports and GPUs
    held, nobody to stop them). Now each gets SIGTERM from the kernel, drains and exits."""
    from bench.ports import consecutive_free_ports

    base = consecutive_free_ports(2)  # GPU i listens on base + i
    launcher = WorkerProcess("--gpus", "0,1", "--listen", f"tcp://127.0.0.1:{base}", "--backend", "synthetic",
                             "--drain-linger-s", "0.2", expect_ready=2)
    children = []
    try:
        launcher.wait_ready()
        children = children_of(launcher.proc.pid)
        assert len(children) == 2
        launcher.proc.send_signal(signal.SIGKILL)
        launcher.proc.wait(10)
        started = time.monotonic()
        wait_for(lambda: not any(alive(child) for child in children), 15, "the workers ending")
        print(f"workers gone {time.monotonic() - started:.2f} s after the launcher's SIGKILL")
    finally:
        for child in children:
            if alive(child):
                os.kill(child, signal.SIGKILL)
        launcher.kill()
