"""Issue 24, items 2 and 3: what a gateway believes of the worker tier.

Item 2: whoever can write to the discovery Redis, or answer at an address a gateway dials, must not get a
session's text or the worker token. Against a real worker process, a real Redis and a gateway in its own
process: a forged record is ignored, a forged worker is sent nothing but a nonce, and the token never
crosses the wire (a recording proxy sits between a pool and a real worker).

Item 3: a worker that does hold the token (compromised, or broken) is bounded: audio and word timings per
sentence, frame sizes, sample rates, deadlines, and the pool's refresh survives any answer. Each attack
runs against `voxgate serve --backend remote` in a process of its own whose peak RSS and /health are
measured, with a raw-socket fake worker (tests/worker_fakes.py) doing the attack."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest
import redis

from tests.gateway_server import open_session, receive_until
from tests.hostile_fixtures import HealthProbe, MemoryWatch, served_gateway
from tests.redis_fixtures import REDIS_URL, redis_prefix  # noqa: F401 (fixture)
from tests.worker_fakes import FakeWorker
from tests.worker_fixtures import synthetic_worker_args, wait_for_async, workers
from tts_backend.base import SynthesisError, SynthesisRequest
from tts_backend.remote import RemoteSynthesizer, framing
from tts_backend.synthetic import SyntheticSynthesizer

TOKEN = "trust-test-token-9c2a41"
CONFIG = {"type": "session.config", "voice": "tone-mid", "response_format": "pcm", "seed": 5}


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return str(path)


async def speak(gateway, text: str, config: dict = CONFIG, timeout: float = 30) -> list:
    ws, started, _ = await open_session(gateway.ws_url, config)
    assert ws is not None, started
    try:
        await ws.send(json.dumps({"type": "input.text", "text": text}))
        await ws.send(json.dumps({"type": "input.done"}))
        return await receive_until(ws, "session.done", "error", timeout=timeout)
    finally:
        await ws.close()


def assert_spoken(texts: list[str], answers: list[list]) -> None:
    """Each of `speak`'s answers is its text spoken whole and right (the synthetic backend's audio)."""
    expected = SyntheticSynthesizer()
    for text, answer in zip(texts, answers):
        assert answer[-1]["type"] == "session.done", answer[-1]
        audio = b"".join(m for m in answer if isinstance(m, bytes))
        assert audio == expected.render(SynthesisRequest(text=text, voice="tone-mid", seed=5)).tobytes()


# ---------------------------------------------------------------------------------------- item 2


async def test_a_forged_registry_record_is_ignored_and_its_worker_gets_nothing(redis_prefix, token_file):
    """Before: the forged record joined the pool, its worker got the auth frame with the real token and
    was sent sessions' text (2 of 6)."""
    registered = synthetic_worker_args("--registry", REDIS_URL, "--registry-prefix", redis_prefix, "--token-file",
                                       token_file, "--heartbeat-s", "0.2", "--lease-s", "1", speed=0)
    async with FakeWorker(token=None, worker_id="forged") as forged:
        # What anyone who can write to that Redis can do: a record and a lease that never runs out.
        client = redis.Redis.from_url(REDIS_URL)
        info_key, leases_key = f"{redis_prefix}{{workers}}:info", f"{redis_prefix}{{workers}}:leases"
        client.hset(info_key, "forged", json.dumps({"id": "forged", "address": forged.address, "backend": "synthetic",
                                                    "voices": ["tone-mid"], "capacity": None, "streams": 0,
                                                    "draining": False, "ready": True}))
        client.zadd(leases_key, {"forged": 2**52})
        with workers(registered) as (worker,), served_gateway(
                "--backend", "remote", "-o", f"discover={REDIS_URL}", "-o", f"discover_prefix={redis_prefix}",
                "-o", f"token={TOKEN}", "-o", "discover_refresh_s=0.2") as gateway:
            texts = [f"Session number {n} says something private." for n in range(6)]
            assert_spoken(texts, await asyncio.gather(*(speak(gateway, text) for text in texts)))
            log = gateway.log()
        client.close()
    assert TOKEN.encode() not in forged.received
    assert not any(text.encode() in forged.received for text in texts)
    assert forged.connections == 0  # never even dialled
    assert "ignored a worker record" in log and TOKEN not in log


async def test_a_forged_worker_is_sent_only_a_nonce():
    """A peer at an address the gateway dials (a static list, a spoofed name) that does not hold the token:
    before, it received the token in the auth frame and the request with its text."""
    async with FakeWorker(token=None) as forged:
        remote = RemoteSynthesizer(workers=forged.address, token=TOKEN, connect_timeout_s=1.5, info_refresh_s=0.1)
        with pytest.raises(SynthesisError, match="no ready worker"):
            await remote.start()
        await remote.stop()
        assert forged.connections >= 1
    hello = framing.encode_json({"op": "hello"})[5:5 + 8]
    assert forged.received.startswith(b"\0\0\0") and hello in bytes(forged.received)
    assert TOKEN.encode() not in forged.received
    assert b'"auth"' not in forged.received and b"synthesize" not in forged.received and b"info" not in forged.received


async def test_the_token_never_crosses_the_wire(token_file):
    """A recording proxy between a pool and a real worker: the pool works, and no byte sequence of the
    token passes in either direction (before: in every connection's first frame)."""
    seen = bytearray()

    async def pipe(reader, writer):
        try:
            while data := await reader.read(65536):
                seen.extend(data)
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    upstream: list[str] = []

    async def relay(reader, writer):
        upstream_reader, upstream_writer = await asyncio.open_connection(*upstream)
        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

    proxy = await asyncio.start_server(relay, "127.0.0.1", 0)
    address = f"tcp://127.0.0.1:{proxy.sockets[0].getsockname()[1]}"
    # A forwarder in front of a worker: the worker is told the address gateways reach it by (issue 30, item 2).
    with workers(synthetic_worker_args("--token-file", token_file, "--reachable-at", address)) as (worker,):
        upstream += worker.address.removeprefix("tcp://").rsplit(":", 1)
        remote = RemoteSynthesizer(workers=address, token=TOKEN, connect_timeout_s=20, info_refresh_s=0.1)
        await remote.start()
        try:
            request = SynthesisRequest(text="Through the proxy.", voice="tone-mid", seed=2)
            audio = b"".join([c.pcm async for c in remote.synthesize(request)])
            assert audio == SyntheticSynthesizer().render(request).tobytes()
        finally:
            await remote.stop()
            proxy.close()
    assert len(seen) > len(audio)
    assert TOKEN.encode() not in seen


async def test_registry_records_are_signed_fresh_and_bound_to_their_worker(redis_prefix, token_file):
    from tts_backend.remote.connection import Dialer, WorkerAddress, WorkerNotProven
    from tts_backend.remote.discovery import WorkerRegistry, registry_key, sign_record

    good = WorkerRegistry(REDIS_URL, prefix=redis_prefix, key=registry_key(TOKEN))
    other = WorkerRegistry(REDIS_URL, prefix=redis_prefix, key=registry_key("another-token"))
    try:
        await good.announce({"id": "w1", "address": "tcp://127.0.0.1:1"})
        await other.announce({"id": "w2", "address": "tcp://127.0.0.1:2"})  # signed with another key
        client = redis.Redis.from_url(REDIS_URL)
        info_key, leases_key = f"{redis_prefix}{{workers}}:info", f"{redis_prefix}{{workers}}:leases"
        stale = sign_record({"id": "w3", "address": "tcp://127.0.0.1:3"}, registry_key(TOKEN), now=time.time() - 300)
        tampered = json.loads(sign_record({"id": "w4", "address": "tcp://127.0.0.1:4"}, registry_key(TOKEN)))
        tampered["record"] = tampered["record"].replace("127.0.0.1:4", "10.6.6.6:4")
        client.hset(info_key, mapping={"w3": stale, "w4": json.dumps(tampered),
                                       "w5": json.dumps({"id": "w5", "address": "tcp://127.0.0.1:5"})})
        client.zadd(leases_key, {"w3": 2**52, "w4": 2**52, "w5": 2**52})
        client.close()
        assert [r["id"] for r in await good.live()] == ["w1"]
        assert good.refused == 4
    finally:
        await good.close()
        await other.close()
    # A record copied onto another worker's address names the wrong worker: the handshake says so.
    with workers(synthetic_worker_args("--token-file", token_file)) as (worker,):
        target = WorkerAddress.parse(worker.address)
        with pytest.raises(WorkerNotProven, match="proved to be worker"):
            await Dialer(token=TOKEN).open(target, expect_id="some-other-worker")
        _, writer = await Dialer(token=TOKEN).open(target, expect_id=worker.worker_id)
        writer.close()


def test_a_worker_with_a_registry_and_no_token_refuses_to_start():
    from tests.worker_fixtures import WorkerProcess

    worker = WorkerProcess("--backend", "synthetic", "--listen", "tcp://127.0.0.1:0", "--registry", REDIS_URL)
    assert worker.wait(30) != 0
    assert any("--registry needs the token" in line for line in worker.output), worker.output
    with pytest.raises(SynthesisError, match="discover= needs the workers' token"):
        RemoteSynthesizer(discover=REDIS_URL)


# ---------------------------------------------------------------------------------------- item 3

MAX_GROWTH = 60 * 1024 * 1024  # the gateway's peak RSS may rise this much under an attack
POURED = 300 * 1024 * 1024  # what a hostile worker sends at most (before: all of it was buffered)


def pour(frame_bytes: int):
    async def synthesize(_message, _reader, writer):
        frame = framing.encode(framing.AUDIO, b"\1\0" * (frame_bytes // 2))
        sent = 0
        while sent < POURED:
            writer.write(frame)
            await writer.drain()
            sent += len(frame)
        writer.write(framing.encode_json({"op": "done"}))
        await writer.drain()
    return synthesize


async def flood_words(_message, _reader, writer):
    words = framing.encode_json({"op": "words", "words": [["w", 0, 1]] * 200})
    for _ in range(50_000):
        writer.write(words)
        await writer.drain()
    writer.write(framing.encode_json({"op": "done"}))
    await writer.drain()


async def never_answer(_message, reader, _writer):
    await reader.read()  # holds the connection until the gateway drops it


@contextlib.asynccontextmanager
async def hostile_gateway(fake: FakeWorker):
    """A gateway process whose pool is `fake`, started from a thread: the fake answers in this loop."""
    manager = served_gateway("--backend", "remote", "-o", f"workers={fake.address}", "-o", f"token={TOKEN}")
    gateway = await asyncio.to_thread(manager.__enter__)
    try:
        yield gateway
    finally:
        await asyncio.to_thread(manager.__exit__, None, None, None)


@pytest.mark.parametrize("attack", ["endless audio", "16 MiB frames", "words flood"])
async def test_a_hostile_worker_is_bounded_and_the_session_told(attack):
    """Before: endless audio of a sentence sent whole (stream_audio false) took the gateway to 4.6 GB;
    16 MiB frames reached MemoryError; a words flood stalled /health for 4.6 s."""
    synthesize = {"endless audio": pour(64 * 1024), "16 MiB frames": pour(16 * 1024 * 1024 - 8),
                  "words flood": flood_words}[attack]
    async with FakeWorker(token=TOKEN, synthesize=synthesize) as fake, hostile_gateway(fake) as gateway:
        memory = MemoryWatch(gateway.process.pid)
        memory.start()
        started = time.monotonic()
        async with HealthProbe(gateway.url) as health:
            config = {**CONFIG, "stream_audio": False, "word_timestamps": attack == "words flood"}
            answer = await speak(gateway, "A short sentence.", config, timeout=60)
        took = time.monotonic() - started
        growth = memory.growth
        log = gateway.log()
    print(f"{attack}: answered in {took:.2f} s, peak RSS +{growth / 2**20:.1f} MiB, "
          f"/health worst {health.worst * 1000:.0f} ms")
    error = answer[-1]
    assert error["type"] == "error" and error["code"] == "synthesis_failed" and error["retryable"] is True, error
    assert growth < MAX_GROWTH, growth
    assert health.worst < 0.5, health.worst
    assert took < 10, took
    assert "set aside" in log


async def test_a_worker_that_never_answers_is_an_error_not_silence():
    """Before: the session stayed silent for 25 s and more, with no error."""
    async with FakeWorker(token=TOKEN, synthesize=never_answer) as fake, hostile_gateway(fake) as gateway:
        started = time.monotonic()
        answer = await speak(gateway, "Are you there?", timeout=30)
        took = time.monotonic() - started
    print(f"error after {took:.1f} s")
    assert answer[-1]["type"] == "error" and answer[-1]["code"] == "synthesis_failed", answer[-1]
    assert answer[-1]["retryable"] is True
    assert took < 15, took  # the first-audio deadline (10 s) and the error


@pytest.mark.parametrize("rate", [1, "abc", 1_000_000, 24000.5, True])
async def test_a_worker_with_an_impossible_sample_rate_is_never_used(rate):
    """Before: `sample_rate: 1` was believed (10 ordinary frames became 3.6 GB at the client's rate)."""
    async with FakeWorker(token=TOKEN) as fake:
        fake.info["sample_rate"] = rate
        remote = RemoteSynthesizer(workers=fake.address, token=TOKEN, connect_timeout_s=1.0, info_refresh_s=0.1)
        with pytest.raises(SynthesisError, match="no ready worker"):
            await remote.start()
        await remote.stop()


async def test_the_pool_goes_on_following_its_workers_after_any_answer():
    """One info answer with `sample_rate: "abc"` (then a `voices` that is no list, then a capacity that is
    text) ended the refresh task for good, so the pool went on saying ready for a worker that says it is
    not. Now each bad answer marks that worker down, and the next good one is followed."""
    async with FakeWorker(token=TOKEN) as fake:
        remote = RemoteSynthesizer(workers=fake.address, token=TOKEN, connect_timeout_s=5, info_refresh_s=0.05)
        await remote.start()
        try:
            assert remote.ready and remote.sample_rate == 24000
            for field, bad in [("sample_rate", "abc"), ("voices", {"x": 1}), ("capacity", "8"), ("rtf", float("nan"))]:
                good = fake.info[field]
                fake.info[field] = bad
                await wait_for_async(lambda: not remote.ready, 5, f"the pool noticing {field}={bad!r}")
                fake.info[field] = good
                await wait_for_async(lambda: remote.ready, 5, "the pool following the worker again")
            fake.info["ready"] = False
            await wait_for_async(lambda: not remote.ready, 5, "the pool seeing the worker not ready")
            fake.info["ready"] = True
            await wait_for_async(lambda: remote.ready, 5, "the pool seeing the worker ready")
            assert all(not task.done() for task in remote._tasks)
        finally:
            await remote.stop()


async def test_on_a_unix_socket_the_kernel_vouches_and_no_round_trip_is_spent(tmp_path, token_file):
    """A gateway that finds, by SO_PEERCRED, the worker running as its own user sends its proof and its
    request at once (a one-way hello, bound to its nonce); a TCP worker refuses that hello, and a wrong
    proof is refused on the Unix socket too."""
    socket_path = str(tmp_path / "w.sock")
    unix = synthetic_worker_args("--token-file", token_file, listen=f"unix:{socket_path}")
    with workers(unix, synthetic_worker_args("--token-file", token_file)) as (local, tcp):
        async def ask(address: str, proof_token: str) -> dict:
            nonce = bytes.fromhex(framing.new_nonce())
            hello = framing.encode_json({"op": "hello", "nonce": nonce.hex(),
                                         "proof": framing.local_proof(proof_token, nonce)})
            if address.startswith("unix:"):
                reader, writer = await asyncio.open_unix_connection(address[5:])
            else:
                host, port = address.removeprefix("tcp://").rsplit(":", 1)
                reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(hello + framing.encode_json({"op": "info"}))  # one write, no answer awaited between
            frame = await asyncio.wait_for(framing.read_frame(reader, framing.MAX_ANSWER_FRAME), 10)
            writer.close()
            return framing.decode_json(frame[1])

        assert (await ask(local.address, TOKEN))["op"] == "info"
        assert (await ask(local.address, "not-the-token"))["code"] == "unauthorized"
        assert (await ask(tcp.address, TOKEN))["code"] == "unauthorized"
        remote = RemoteSynthesizer(socket=socket_path, token=TOKEN, connect_timeout_s=20)
        await remote.start()
        try:
            request = SynthesisRequest(text="Over the local socket.", voice="tone-mid", seed=4)
            audio = b"".join([c.pcm async for c in remote.synthesize(request)])
            assert audio == SyntheticSynthesizer().render(request).tobytes()
        finally:
            await remote.stop()
