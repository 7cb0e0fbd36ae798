"""Issue 30, item 2: the worker handshake must not be relayable. A listener without the token, at an address a
gateway dials, forwards each connection to a real worker (tests/worker_fakes.py's RelayWorker): it must be
sent no session's text, and the real worker must serve it nothing, whether it stands in a static pool or at
the address a replayed signed registry record names. Real worker and gateway processes, a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import redis

from tests.hostile_fixtures import served_gateway
from tests.redis_fixtures import REDIS_URL, redis_prefix  # noqa: F401 (fixture)
from tests.test_worker_trust import TOKEN, assert_spoken, speak, token_file  # noqa: F401 (fixture)
from tests.worker_fakes import RelayWorker
from tests.worker_fixtures import WorkerProcess, synthetic_worker_args, wait_for, workers
from tts_backend.base import SynthesisRequest
from tts_backend.remote import RemoteSynthesizer, framing
from tts_backend.remote.connection import Dialer, WorkerAddress, WorkerNotProven
from tts_backend.synthetic import SyntheticSynthesizer


@contextlib.asynccontextmanager
async def gateway_process(*flags: str):
    """A gateway process, started from a thread: the relay answers in this loop."""
    manager = served_gateway("--backend", "remote", "-o", f"token={TOKEN}", *flags)
    gateway = await asyncio.to_thread(manager.__enter__)
    try:
        yield gateway
    finally:
        await asyncio.to_thread(manager.__exit__, None, None, None)


async def sessions_through(gateway, count: int) -> list[str]:
    """`count` sessions at once, each with a text of its own; each must be spoken whole and right."""
    texts = [f"Private sentence number {n} for session {n}." for n in range(count)]
    assert_spoken(texts, await asyncio.gather(*(speak(gateway, text) for text in texts)))
    return texts


def leaked(relay: RelayWorker, texts: list[str]) -> int:
    return sum(text.encode() in relay.received for text in texts)


async def test_a_relay_in_a_static_pool_gets_no_text_and_no_service(token_file):
    """Before: the relay, one of two members of a static pool, was sent 3 of 8 sessions' text, and the
    real worker behind it served it requests of its own."""
    with workers(synthetic_worker_args("--token-file", token_file, speed=0)) as (worker,):
        async with RelayWorker(worker.address) as relay, \
                gateway_process("-o", f"workers={relay.address},{worker.address}") as gateway:
            texts = []
            for _ in range(2):  # two rounds: every session placed while the relay is a member it could pick
                texts += await sessions_through(gateway, 8)
            log = gateway.log()
    print(f"relay: {relay.connections} connections, {leaked(relay, texts)} of {len(texts)} texts, "
          f"{relay.served} requests of its own served")
    assert relay.connections > 0  # it was dialled
    assert leaked(relay, texts) == 0
    assert relay.served == 0
    assert "is not reachable as" in log or "answers to" in log, log[-2000:]


async def test_a_replayed_record_naming_a_left_address_gets_no_text_and_no_service(redis_prefix, token_file):
    """A worker with a fixed id (a StatefulSet pod) restarts at another port; its last record, signed
    seconds ago, is replayed under another name, and a relay takes the address it left. Before: the relay was
    sent 4-9 of 10 sessions' text."""
    def registered(*extra: str) -> tuple[str, ...]:
        return synthetic_worker_args("--registry", REDIS_URL, "--registry-prefix", redis_prefix, "--token-file",
                                     token_file, "--heartbeat-s", "0.2", "--lease-s", "1", "--worker-id", "wx",
                                     *extra, speed=0)

    client = redis.Redis.from_url(REDIS_URL)
    info_key, leases_key = f"{redis_prefix}{{workers}}:info", f"{redis_prefix}{{workers}}:leases"
    first = WorkerProcess(*registered()).wait_ready()
    try:
        wait_for(lambda: client.hget(info_key, "wx") is not None, 10, "the worker's record")
        record = client.hget(info_key, "wx")
        left = WorkerAddress.parse(first.address)
    finally:
        first.kill()
    with workers(registered()) as (moved,):
        assert moved.address != first.address
        async with RelayWorker(moved.address, port=left.port) as relay:
            client.hset(info_key, "replayed", record)
            client.zadd(leases_key, {"replayed": 2**52})
            async with gateway_process("-o", f"discover={REDIS_URL}", "-o", f"discover_prefix={redis_prefix}",
                                       "-o", "discover_refresh_s=0.2") as gateway:
                texts = await sessions_through(gateway, 10)
                texts += await sessions_through(gateway, 10)
    client.close()
    print(f"relay: {relay.connections} connections, {leaked(relay, texts)} of {len(texts)} texts, "
          f"{relay.served} requests of its own served")
    assert relay.connections > 0
    assert leaked(relay, texts) == 0
    assert relay.served == 0


async def test_a_static_member_may_pin_the_id_it_must_prove(token_file):
    """`workers=ID@ADDRESS`: the worker at that address must prove it is ID, on every connection."""
    with workers(synthetic_worker_args("--token-file", token_file, speed=0)) as (worker,):
        pinned = RemoteSynthesizer(workers=f"{worker.worker_id}@{worker.address}", token=TOKEN, connect_timeout_s=20)
        await pinned.start()
        try:
            request = SynthesisRequest(text="Pinned.", voice="tone-mid", seed=3)
            assert b"".join([c.pcm async for c in pinned.synthesize(request)]) == \
                SyntheticSynthesizer().render(request).tobytes()
        finally:
            await pinned.stop()
        wrong = RemoteSynthesizer(workers=f"another-worker@{worker.address}", token=TOKEN, connect_timeout_s=1.0)
        with pytest.raises(Exception, match="no ready worker"):
            await wrong.start()
        await wrong.stop()


async def test_a_worker_behind_a_forwarder_answers_to_the_address_it_is_given(token_file):
    """A forwarder the operator put in front of a worker (a load balancer, a port mapping) is a relay to the
    worker until the worker is told that address: `--reachable-at`."""
    async with RelayWorker("tcp://127.0.0.1:1") as forwarder:  # the upstream is set once the worker is up
        target = WorkerAddress.parse(forwarder.address)
        by_name = f"tcp://localhost:{target.port}"  # a host name: the worker resolves it as it starts
        with workers(synthetic_worker_args("--token-file", token_file, "--reachable-at", by_name,
                                           speed=0)) as (worker,):
            forwarder.upstream = worker.address.removeprefix("tcp://").rsplit(":", 1)
            deadline = time.monotonic() + 10
            while True:  # until the name is resolved, in the background of the worker's start
                try:
                    _, writer = await Dialer(token=TOKEN).open(target, expect_id=worker.worker_id)
                    break
                except WorkerNotProven:
                    assert time.monotonic() < deadline, "the worker never answered to its --reachable-at"
                    await asyncio.sleep(0.05)
            writer.close()
        with workers(synthetic_worker_args("--token-file", token_file, speed=0)) as (worker,):
            forwarder.upstream = worker.address.removeprefix("tcp://").rsplit(":", 1)
            with pytest.raises(WorkerNotProven, match="not reachable as"):
                await Dialer(token=TOKEN).open(WorkerAddress.parse(forwarder.address))


async def test_a_relay_cannot_downgrade_the_handshake_to_an_older_gateways(token_file):
    """A worker still answers an older gateway's hello (no address in it) with the proofs of v1, so that
    workers can be upgraded first; a relay that strips the address from this version's hello gets such a
    proof, which this version's gateway refuses: it writes nothing more."""
    with workers(synthetic_worker_args("--token-file", token_file, speed=0)) as (worker,):
        target = WorkerAddress.parse(worker.address)
        reader, writer = await asyncio.open_connection(target.host, target.port)
        nonce = bytes.fromhex(framing.new_nonce())
        writer.write(framing.encode_json({"op": "hello", "nonce": nonce.hex()}))
        hello = framing.decode_json((await framing.read_frame(reader, framing.MAX_AUTH_FRAME))[1])
        worker_nonce = bytes.fromhex(hello["nonce"])
        assert hello["proof"] == framing.v1_worker_proof(TOKEN, nonce, worker_nonce, worker.worker_id)
        writer.write(framing.encode_json({"op": "auth", "proof": framing.v1_gateway_proof(TOKEN, worker_nonce, nonce)})
                     + framing.encode_json({"op": "info"}))
        answer = await asyncio.wait_for(framing.read_frame(reader, framing.MAX_ANSWER_FRAME), 10)
        assert framing.decode_json(answer[1])["op"] == "info"
        writer.close()
        async with RelayWorker(worker.address, strip_to=True) as relay:
            with pytest.raises(WorkerNotProven, match="did not prove"):
                await Dialer(token=TOKEN).open(WorkerAddress.parse(relay.address), expect_id=worker.worker_id)
            await asyncio.sleep(0.2)
        assert relay.connections == 1 and relay.served == 0
        assert b'"auth"' not in relay.received
