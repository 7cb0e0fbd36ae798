"""Workers on TCP and the gateway's pool of them (issue 17), against real `voxgate worker` processes
(the synthetic backend, named as such: paced like an engine, deterministic per seed) and, where a session is
involved, a real gateway on loopback with real WebSocket clients.

- authentication: a token per connection, refused without it; a network address needs one;
- TLS: the worker's certificate checked against the CA the gateway is given;
- routing: each session to the worker with the most headroom, and kept there; `overloaded` only when every
  worker is full;
- worker death: a SIGKILLed worker's sentence goes on on another worker byte for byte;
- drain: SIGTERM hands the open stream over (it goes on from its codes elsewhere), sends new sessions
  elsewhere, exits 0 without waiting for the stream.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import signal
import time

import pytest

from bench.ports import consecutive_free_ports
from tests.gateway_server import audio_by_sentence, free_port, open_session, receive_until, running_gateway
from tests.worker_fixtures import (  # noqa: F401 (token_file: a fixture)
    POOL_TOKEN,
    WorkerProcess,
    pool,
    synthetic_worker_args,
    token_file,
    wait_for,
    wait_for_async,
    workers,
)
from tts_backend.base import SynthesisError, SynthesisRequest
from tts_backend.remote import RemoteSynthesizer, framing
from tts_backend.remote.connection import Dialer, WorkerAddress
from tts_backend.synthetic import SyntheticSynthesizer

TOKEN = POOL_TOKEN
LONG_TEXT = ("This sentence runs long enough that its audio takes several seconds to stream, so that a worker "
             "can be stopped while it is speaking")


def request(session: str, text: str = LONG_TEXT, utterance: int = 0, seed: int = 7) -> SynthesisRequest:
    return SynthesisRequest(text=text, voice="tone-mid", seed=seed, session_key=session,
                            utterance_key=f"{session}/{utterance}", request_id=f"{session}/0")


async def raw_exchange(address: str, *frames: bytes) -> dict | None:
    target = WorkerAddress.parse(address)
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        for frame in frames:
            writer.write(frame)
        await writer.drain()
        answer = await asyncio.wait_for(framing.read_frame(reader, framing.MAX_ANSWER_FRAME), 10)
        return framing.decode_json(answer[1]) if answer else None
    finally:
        writer.close()


# ---------------------------------------------------------------------------------------- authentication


async def test_a_tcp_worker_wants_its_token_proved_on_every_connection(token_file):
    with workers(synthetic_worker_args("--token-file", token_file)) as (worker,):
        info = framing.encode_json({"op": "info"})
        assert (await raw_exchange(worker.address, info))["code"] == "unauthorized"
        # The token itself is never what a worker takes (a gateway never sends it).
        old_style = framing.encode_json({"op": "auth", "token": TOKEN})
        assert (await raw_exchange(worker.address, old_style, info))["code"] == "unauthorized"
        # A hello with a wrong proof after it.
        target = WorkerAddress.parse(worker.address)
        reader, writer = await asyncio.open_connection(target.host, target.port)
        writer.write(framing.encode_json({"op": "hello", "nonce": framing.new_nonce()}))
        hello = framing.decode_json((await framing.read_frame(reader, framing.MAX_AUTH_FRAME))[1])
        assert hello["op"] == "hello" and hello["id"] == worker.worker_id and "token" not in json.dumps(hello)
        writer.write(framing.encode_json({"op": "auth", "proof": "0" * 64}) + info)
        refused = framing.decode_json((await framing.read_frame(reader, framing.MAX_AUTH_FRAME))[1])
        assert refused["code"] == "unauthorized"
        writer.close()
        # The Dialer's handshake gets in.
        dialer = Dialer(token=TOKEN)
        reader, writer = await dialer.open(target)
        writer.write(info)
        assert framing.decode_json((await framing.read_frame(reader, framing.MAX_ANSWER_FRAME))[1])["op"] == "info"
        writer.close()
        # A peer that is not authenticated cannot make the worker read a large frame: refused on its header.
        huge = framing._HEADER.pack(8 * 1024 * 1024, framing.JSON[0])
        assert (await raw_exchange(worker.address, huge))["code"] == "bad_request"

        with pytest.raises(SynthesisError, match="no ready worker"):
            await RemoteSynthesizer(workers=worker.address, token="not-it", connect_timeout_s=1).start()
        remote = pool(worker.address)
        await remote.start()
        try:
            chunks = [c async for c in remote.synthesize(request("s1", "Hello there."))]
            assert b"".join(c.pcm for c in chunks) == SyntheticSynthesizer().render(request("s1", "Hello there.")).tobytes()
        finally:
            await remote.stop()


def test_a_worker_on_a_network_address_refuses_to_start_without_a_token():
    worker = WorkerProcess("--backend", "synthetic", "--listen", f"tcp://0.0.0.0:{free_port()}")
    assert worker.wait(30) != 0
    assert any("without a token" in line for line in worker.output), worker.output


def _self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "voxgate-test-worker")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "worker.crt", tmp_path / "worker.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


async def test_a_tls_worker_is_checked_against_the_given_ca(tmp_path, token_file):
    cert, key = _self_signed(tmp_path)
    args = synthetic_worker_args("--token-file", token_file, "--tls-cert", cert, "--tls-key", key,
                                 listen="tls://127.0.0.1:0")
    with workers(args) as (worker,):
        assert worker.address.startswith("tls://127.0.0.1:")
        remote = pool(worker.address, tls_ca=cert)
        await remote.start()
        try:
            text = "Over TLS."
            audio = b"".join([c.pcm async for c in remote.synthesize(request("t1", text))])
            assert audio == SyntheticSynthesizer().render(request("t1", text)).tobytes()
        finally:
            await remote.stop()
        # Without the CA the certificate does not verify: no worker is usable.
        with pytest.raises(SynthesisError, match="no ready worker"):
            await RemoteSynthesizer(workers=worker.address, token=TOKEN, connect_timeout_s=1).start()


# ---------------------------------------------------------------------------------------- routing


async def test_sessions_go_to_the_worker_with_most_headroom_and_stay_there(token_file):
    args = synthetic_worker_args("--token-file", token_file, speed=4.0, capacity=3)
    with workers(args, args) as procs:
        remote = pool(*(w.address for w in procs))
        await remote.start()
        streams = []
        try:
            # Two sessions, then four in the same moment: each placement counts before the next is made, long
            # before the workers report them, so they alternate.
            streams = [remote.synthesize(request(f"s{n}")) for n in range(2)]
            await asyncio.gather(*(anext(stream) for stream in streams))
            assert sorted(m.streams for m in remote.members.values()) == [1, 1]
            assert remote.load() == pytest.approx(1 / 3, abs=0.01)
            # Session s0 keeps its worker for its next utterance although the other is no emptier.
            first = remote._bindings["s0"].worker
            await streams.pop(0).aclose()
            again = remote.synthesize(request("s0", utterance=1))
            await anext(again)
            streams.append(again)
            assert remote._bindings["s0"].worker is first
            burst = [remote.synthesize(request(f"b{n}")) for n in range(4)]
            await asyncio.gather(*(anext(stream) for stream in burst))
            streams += burst
            assert sorted(m.streams for m in remote.members.values()) == [3, 3]
            assert remote.load() >= 1.0
        finally:
            for stream in streams:
                await stream.aclose()
            await remote.stop()


async def test_a_worker_says_it_is_full_to_a_gateway_that_has_not_heard_yet(token_file):
    """Two gateways' pools: B's picture of the workers is from before A placed a session on one of them.
    The worker refuses B's placement ("full") and B places the session on the other one."""
    args = synthetic_worker_args("--token-file", token_file, speed=2.0, capacity=1)
    with workers(args, args) as procs:
        addresses = [w.address for w in procs]
        a = pool(*addresses)
        b = RemoteSynthesizer(workers=",".join(addresses), token=TOKEN, connect_timeout_s=20, info_refresh_s=3600)
        await a.start()
        await b.start()
        streams = []
        try:
            for n in range(3):
                streams.append(a.synthesize(request(f"a{n}")) if n == 0 else b.synthesize(request(f"b{n}")))
                await anext(streams[-1])
                if n == 0:
                    taken = a._bindings["a0"].worker.id
                    assert all(m.info["streams"] == 0 for m in b.members.values())  # B knows nothing of it
            assert b._bindings["b1"].worker.id != taken
            # Both full now: the third placement is refused by both and still served, waiting for a place.
            assert b.placements_refused >= 2
        finally:
            for stream in streams:
                await stream.aclose()
            await a.stop()
            await b.stop()


async def test_a_burst_of_placements_never_takes_more_than_the_workers_capacity():
    """A failover or a drain sends many streams at once, from several gateways: placements that reach a worker
    in the same moment are each checked against the places the ones before them took, so the worker takes
    exactly its capacity and answers "full" to the rest (which their pools place elsewhere), rather than
    taking them all and making the last wait for a slot."""
    with workers(synthetic_worker_args(speed=0.5, capacity=2)) as (worker,):
        target = WorkerAddress.parse(worker.address)
        connections = [await asyncio.open_connection(target.host, target.port) for _ in range(6)]
        try:
            for n, (_, writer) in enumerate(connections):
                writer.write(framing.encode_json({"op": "synthesize", "place": True,
                                                  "request": framing.request_to_json(request(f"burst{n}"))}))
            await asyncio.gather(*(writer.drain() for _, writer in connections))
            answers = []
            for reader, _ in connections:
                kind, payload = await asyncio.wait_for(framing.read_frame(reader, framing.MAX_ANSWER_FRAME), 10)
                message = framing.decode_json(payload) if kind == framing.JSON else {}
                answers.append(message.get("code") if message.get("op") == "error" else "served")
            assert sorted(answers) == ["full", "full", "full", "full", "served", "served"], answers
        finally:
            for _, writer in connections:
                writer.close()


async def test_the_gateway_refuses_new_sessions_only_when_every_worker_is_full(token_file):
    args = synthetic_worker_args("--token-file", token_file, speed=4.0, capacity=1)
    with workers(args, args) as procs:
        remote = pool(*(w.address for w in procs))
        with running_gateway(remote) as gateway:
            config = {"type": "session.config", "voice": "tone-mid", "response_format": "pcm", "seed": 3}
            sockets = []
            try:
                for _ in range(2):
                    ws, started, _ = await open_session(gateway.ws_url, config)
                    assert ws is not None, started
                    await ws.send(json.dumps({"type": "input.text", "text": LONG_TEXT + "."}))
                    await ws.send(json.dumps({"type": "input.flush"}))
                    await receive_until(ws, "audio.start")
                    sockets.append(ws)
                # audio.start goes out as its sentence's synthesis is being asked for
                await wait_for_async(lambda: sorted(m.streams for m in remote.members.values()) == [1, 1],
                                     what="one stream on each worker")
                ws, error, code = await open_session(gateway.ws_url, config)
                assert ws is None and error["code"] == "overloaded" and code == 1013
            finally:
                for ws in sockets:
                    await ws.close()
            # Once a stream ends there is room again.
            await wait_for_async(lambda: remote.load() < 1.0, what="a worker freeing its stream")
            ws, started, _ = await open_session(gateway.ws_url, config)
            assert ws is not None, started
            await ws.close()


# ---------------------------------------------------------------------------------------- worker death


async def speak_and_disturb(gateway, remote, disturb, text: str = LONG_TEXT + ".", seed: int = 11):
    """One session speaking `text`; once a second of its audio has arrived, `disturb(worker process id)`
    runs for the worker serving it. Returns (audio by sentence, sentence texts, frame arrival times)."""
    config = {"type": "session.config", "voice": "tone-mid", "response_format": "pcm", "seed": seed,
              "stream_audio": True}
    ws, started, _ = await open_session(gateway.ws_url, config)
    assert ws is not None, started
    await ws.send(json.dumps({"type": "input.text", "text": text}))
    await ws.send(json.dumps({"type": "input.done"}))
    messages, arrivals, received, disturbed = [], [], 0, False
    while True:
        frame = await asyncio.wait_for(ws.recv(), 30)
        if isinstance(frame, bytes):
            messages.append(frame)
            arrivals.append(time.monotonic())
            received += len(frame)
            if not disturbed and received >= 2 * 24000:
                serving = [m for m in remote.members.values() if m.streams]
                assert len(serving) == 1
                disturb(serving[0].id)
                disturbed = True
            continue
        message = json.loads(frame)
        messages.append(message)
        if message["type"] == "session.done":
            break
        assert message["type"] != "error", message
    await ws.close()
    texts = {m["sentence_index"]: m["sentence_text"] for m in messages
             if isinstance(m, dict) and m["type"] == "audio.start"}
    return audio_by_sentence(messages), texts, arrivals


async def test_a_killed_workers_sentence_goes_on_elsewhere_byte_for_byte(token_file):
    args = synthetic_worker_args("--token-file", token_file, speed=2.0)
    with workers(args, args) as procs:
        by_id = {w.worker_id: w for w in procs}
        remote = pool(*(w.address for w in procs))
        with running_gateway(remote) as gateway:
            audio, texts, arrivals = await speak_and_disturb(gateway, remote, lambda wid: by_id[wid].kill())
            assert remote.failovers == 1
            expected = SyntheticSynthesizer()
            for index, text in texts.items():
                want = expected.render(SynthesisRequest(text=text, voice="tone-mid", seed=11)).tobytes()
                assert audio[index] == want, f"sentence {index}: {len(audio[index])} bytes, want {len(want)}"
            gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
            print(f"longest gap between audio frames across the kill: {max(gaps) * 1000:.0f} ms")
            assert sum(1 for w in procs if w.proc.poll() is None) == 1


# ---------------------------------------------------------------------------------------- drain


async def test_a_draining_worker_hands_its_stream_over_takes_no_new_session_and_exits(token_file):
    procs_args = [synthetic_worker_args("--token-file", token_file, speed=2.0) for _ in range(2)]
    with workers(*procs_args) as procs:
        by_id = {w.worker_id: w for w in procs}
        remote = pool(*(w.address for w in procs))
        await remote.start()
        try:
            stream = remote.synthesize(request("d1"))
            first = await anext(stream)
            serving = next(m for m in remote.members.values() if m.streams)
            draining = by_id[serving.id]
            draining.terminate()
            # It hands the open stream over and exits without waiting for it: the stream goes on, from its
            # codes, on the other worker, and the audio is the uninterrupted run's.
            assert draining.wait(30) == 0
            audio = first.pcm + b"".join([c.pcm async for c in stream])
            assert audio == SyntheticSynthesizer().render(request("d1")).tobytes()
            assert remote.handovers == 1 and remote.failovers == 0
            assert remote._bindings["d1"].worker is not serving
            # New sessions go to the other worker.
            other = remote.synthesize(request("d2", "A new session."))
            await anext(other)
            assert remote._bindings["d2"].worker is not serving
            await other.aclose()
        finally:
            await remote.stop()


def test_a_worker_that_drains_is_asked_for_no_new_utterance():
    """Without a pool (the raw protocol of a gateway that takes no hand-over): the worker answers `draining`
    to an utterance it has not served, its /ready turns 503 at once, and it exits once the stream is done."""
    health = free_port()
    with workers(synthetic_worker_args("--health-port", str(health), speed=1.0)) as (worker,):
        async def scenario():
            target = WorkerAddress.parse(worker.address)
            reader, writer = await asyncio.open_connection(target.host, target.port)
            writer.write(framing.encode_json({"op": "synthesize", "request": framing.request_to_json(request("x"))}))
            await writer.drain()
            assert (await framing.read_frame(reader, framing.MAX_STREAM_FRAME))[0] == framing.AUDIO
            worker.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            fresh = framing.encode_json({"op": "synthesize", "request": framing.request_to_json(request("y"))})
            assert (await raw_exchange(worker.address, fresh))["code"] == "draining"
            probe_reader, probe = await asyncio.open_connection("127.0.0.1", health)
            probe.write(b"GET /ready HTTP/1.0\r\n\r\n")
            assert (await probe_reader.read()).startswith(b"HTTP/1.0 503")
            probe.close()
            assert worker.proc.poll() is None  # its stream is not handed over: it waits for it
            writer.close()

        asyncio.run(scenario())
        assert worker.wait(30) == 0
        wait_for(lambda: worker.proc.poll() is not None)


# ---------------------------------------------------------------------------------------- discovery

from tests.redis_fixtures import redis_cluster, redis_prefix, redis_target  # noqa: E402,F401 (fixtures)


def registered_args(target, prefix: str, token_file: str, *extra: str) -> tuple[str, ...]:
    cluster = ("--registry-cluster",) if target.cluster else ()
    return synthetic_worker_args("--registry", target.url, *cluster, "--registry-prefix", prefix, "--token-file",
                                 token_file, "--heartbeat-s", "0.2", "--lease-s", "1", *extra, speed=4.0)


async def test_gateways_find_workers_in_redis_and_see_them_come_and_go(redis_target, redis_prefix, token_file):
    target = redis_target
    remote = RemoteSynthesizer(discover=target.url, discover_cluster=target.cluster, discover_prefix=redis_prefix,
                               token=TOKEN, connect_timeout_s=20, info_refresh_s=0.1, discover_refresh_s=0.1)
    args = registered_args(target, redis_prefix, token_file)
    with workers(args, args) as (a, b):
        await remote.start()
        try:
            def ids():
                return {m.id for m in remote.members.values()}

            await wait_for_async(lambda: ids() == {a.worker_id, b.worker_id}, what="both workers in the pool")
            audio = b"".join([c.pcm async for c in remote.synthesize(request("r1", "Found in Redis."))])
            assert audio == SyntheticSynthesizer().render(request("r1", "Found in Redis.")).tobytes()
            # A dead worker stops renewing: its lease runs out and it leaves the pool.
            a.kill()
            await wait_for_async(lambda: ids() == {b.worker_id}, what="the killed worker leaving the pool")
            # A new one joins.
            c = WorkerProcess(*args).wait_ready()
            try:
                await wait_for_async(lambda: ids() == {b.worker_id, c.worker_id}, what="the new worker joining")
                # A drained one says so at once, then withdraws when it exits.
                c.terminate()
                await wait_for_async(lambda: any(m.draining for m in remote.members.values() if m.id == c.worker_id)
                                     or c.worker_id not in ids(), what="the drain being seen")
                assert c.wait(30) == 0
                await wait_for_async(lambda: ids() == {b.worker_id}, what="the drained worker withdrawing")
            finally:
                c.kill()
        finally:
            await remote.stop()


def test_one_command_starts_a_worker_per_gpu(redis_prefix, token_file):
    from tests.redis_fixtures import REDIS_URL
    from tts_backend.remote.discovery import WorkerRegistry, registry_key

    base = consecutive_free_ports(2)  # GPU i listens on base + i
    launcher = WorkerProcess("--gpus", "0,1", "--listen", f"tcp://127.0.0.1:{base}", "--backend", "synthetic",
                             "--registry", REDIS_URL, "--registry-prefix", redis_prefix, "--worker-id", "host",
                             "--token-file", token_file, expect_ready=2)
    try:
        launcher.wait_ready()
        assert sorted(launcher.ready_lines) == [(f"tcp://127.0.0.1:{base}", "host-gpu0"),
                                                (f"tcp://127.0.0.1:{base + 1}", "host-gpu1")]

        async def records():
            registry = WorkerRegistry(REDIS_URL, prefix=redis_prefix, key=registry_key(TOKEN))
            try:
                return {r["id"]: r for r in await registry.live()}
            finally:
                await registry.close()

        live = asyncio.run(records())
        assert all(r["backend"] == "synthetic" and r["capacity"] is None and r["voices"] for r in live.values())
        assert {i: (r["gpu"], r["address"]) for i, r in live.items()} == {
            "host-gpu0": ("0", f"tcp://127.0.0.1:{base}"), "host-gpu1": ("1", f"tcp://127.0.0.1:{base + 1}")}
        launcher.terminate()  # passed to both: each drains and withdraws
        assert launcher.wait(30) == 0
        assert asyncio.run(records()) == {}
    finally:
        launcher.kill()
