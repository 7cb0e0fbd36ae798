"""Resume from codes through the worker pool (issue 33), against real `voxgate worker` processes (the synthetic
backend, named as such: deterministic, one frame of codes a chunk) and a real gateway on loopback:

- a worker killed at a random frame, through a gateway with its sessions in Redis: the sentence goes on from
  the delivered codes on the other worker (not made again), and the client's audio is the uninterrupted
  run's, byte for byte;
- a draining worker (SIGTERM) with 100 open streams hands them all over and exits without waiting for them:
  none is cut, every one is byte-exact;
- a worker is a peer: codes that are not whole frames, or more than the text can make, set it aside; a
  gateway's resume codes that are not whole frames or too many are refused by the worker.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from tests.gateway_server import running_gateway, speak_first_sentence
from tests.redis_fixtures import REDIS_URL, redis_prefix  # noqa: F401 (fixture)
from tests.worker_fakes import FakeWorker
from tests.worker_fixtures import POOL_TOKEN, pool, synthetic_worker_args, token_file, workers  # noqa: F401 (fixture)
from gateway.store.redis import RedisSessionStore
from tts_backend.base import SynthesisError, SynthesisRequest
from tts_backend.remote import RemoteSynthesizer, framing
from tts_backend.remote.connection import Dialer, WorkerAddress
from tts_backend.remote.worker import WorkerServer
from tts_backend.synthetic import CODEBOOKS, SyntheticSynthesizer

TOKEN = POOL_TOKEN
TEXT = ("This sentence runs long enough that its audio takes several seconds to stream, so that a worker can be "
        "stopped while it is speaking.")


def uninterrupted(text: str = TEXT, seed: int = 11) -> bytes:
    return SyntheticSynthesizer().render(SynthesisRequest(text=text, voice="tone-mid", seed=seed)).tobytes()


async def test_a_worker_killed_at_a_random_frame_goes_on_from_its_codes_through_a_gateway(token_file, redis_prefix):  # noqa: F811
    """Through a real gateway whose sessions are in Redis: the sentence's codes are recorded as they go out,
    and the pool's failover goes on from the codes it was given."""
    cut_at = random.Random().randrange(2, 40)  # audio frames of the client's before the kill
    print(f"killing the worker after {cut_at} audio frames")
    args = synthetic_worker_args("--token-file", token_file, speed=2.0)
    with workers(args, args) as procs:
        by_id = {w.worker_id: w for w in procs}
        remote = pool(*(w.address for w in procs))
        with running_gateway(remote, store="redis", redis_url=REDIS_URL, redis_key_prefix=redis_prefix) as gateway:
            config = {"type": "session.config", "voice": "tone-mid", "response_format": "pcm", "seed": 11,
                      "stream_audio": True}

            async def kill(session_id: str) -> None:
                serving = [m for m in remote.members.values() if m.streams]
                assert len(serving) == 1
                by_id[serving[0].id].kill()
                await assert_codes_recorded(session_id, redis_prefix)

            audio, _ = await speak_first_sentence(gateway.ws_url, config, TEXT, 30, (cut_at, kill))
            assert audio == uninterrupted()
            assert remote.failovers == 1 and remote.resumed_from_codes == 1
            assert len(remote.pauses_ms) == 1


async def assert_codes_recorded(session_id: str, prefix: str) -> None:
    """The store holds the codes of the sentence being spoken, whole frames, resuming at a byte it has."""
    store = RedisSessionStore(REDIS_URL, key_prefix=prefix)
    await store.start()
    try:
        sentence = (await store.get(session_id)).sentences[0]
    finally:
        await store.stop()
    assert sentence.state == "speaking" and sentence.codes and len(sentence.codes) % (2 * CODEBOOKS) == 0
    assert 0 < sentence.codes_at <= sentence.bytes_sent


async def test_draining_a_worker_with_100_open_streams_cuts_none(token_file):
    args = synthetic_worker_args("--token-file", token_file, speed=2.0)
    with workers(args, args) as procs:
        by_id = {w.worker_id: w for w in procs}
        remote = pool(*(w.address for w in procs))
        await remote.start()
        try:
            streams = 100
            received = [bytearray() for _ in range(streams)]
            started = [asyncio.Event() for _ in range(streams)]

            async def listen(i: int) -> float:
                request = SynthesisRequest(text=TEXT, voice="tone-mid", seed=11, session_key=f"s{i}",
                                           utterance_key=f"s{i}/0", request_id=f"s{i}/0")
                async for chunk in remote.synthesize(request):
                    received[i] += chunk.pcm
                    started[i].set()
                return time.monotonic()

            tasks = [asyncio.create_task(listen(i)) for i in range(streams)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            loads = {m.id: m.streams for m in remote.members.values()}
            draining_id = max(loads, key=loads.get)
            assert loads[draining_id] >= 10, loads
            draining = by_id[draining_id]
            draining.terminate()
            exit_code = await asyncio.to_thread(draining.wait, 30)
            exited_at = time.monotonic()
            ended = await asyncio.gather(*tasks)
            assert exit_code == 0
            # It did not wait for its streams: they were all still running on the other worker when it exited.
            assert sum(1 for t in ended if t > exited_at) >= loads[draining_id]
            want = uninterrupted()
            assert [bytes(r) == want for r in received] == [True] * streams
            assert remote.handovers == loads[draining_id] == remote.resumed_from_codes
            assert remote.failovers == 0
        finally:
            await remote.stop()


async def _serve_with_codes(codes_frame: bytes):
    async def synthesize(_message, _reader, writer):
        writer.write(framing.encode(framing.AUDIO, b"\0\0" * 1920) + codes_frame + framing.encode_json({"op": "done"}))
        await writer.drain()
    return synthesize


@pytest.mark.parametrize("codes", [b"\1" * 33, b"\1" * 32 * 100_000], ids=["partial frame", "too many"])
async def test_a_worker_whose_codes_break_the_bounds_is_set_aside(codes):
    frames = framing.encode_codes(codes, 16) if len(codes) % 32 == 0 else framing.encode(framing.CODES, codes)
    info = {"honours": ["seed", "resume_codes"], "codebooks": 16, "frame_rate": 12.5}
    async with FakeWorker(TOKEN, await _serve_with_codes(frames)) as fake:
        fake.info.update(info)
        remote = pool(fake.address)
        await remote.start()
        try:
            with pytest.raises(SynthesisError, match="no other worker"):
                async for _ in remote.synthesize(SynthesisRequest(text="Hello.", voice="tone-mid")):
                    pass
            assert remote.quarantined == 1
        finally:
            await remote.stop()


async def test_a_worker_refuses_resume_codes_that_are_not_whole_frames_or_too_many(token_file):
    with workers(synthetic_worker_args("--token-file", token_file)) as (worker,):
        target = WorkerAddress.parse(worker.address)

        async def answer(codes: bytes) -> dict:
            reader, writer = await Dialer(token=TOKEN).open(target)
            request = SynthesisRequest(text="Hello there.", voice="tone-mid", seed=1, resume_codes=codes)
            writer.write(framing.encode_json({"op": "synthesize", "request": framing.request_to_json(request),
                                              "codes": True}))
            try:
                while True:
                    kind, payload = await asyncio.wait_for(framing.read_frame(reader, framing.MAX_STREAM_FRAME), 10)
                    if kind == framing.JSON:
                        return framing.decode_json(payload)
            finally:
                writer.close()

        refused = await answer(b"\0" * (2 * CODEBOOKS + 1))
        assert refused["op"] == "error" and "whole frames" in refused["message"]
        refused = await answer(b"\0" * (2 * CODEBOOKS * 10_000))
        assert refused["op"] == "error" and "more than the text" in refused["message"]
        refused = await answer(b"\0" * (2 * CODEBOOKS))  # whole, few, but not this sentence's
        assert refused["op"] == "error" and "do not continue" in refused["message"]
        first = SyntheticSynthesizer()
        chunks = [c async for c in first.synthesize(SynthesisRequest(text="Hello there.", voice="tone-mid", seed=1))]
        assert (await answer(chunks[0].codes))["op"] == "done"


async def test_a_lone_worker_that_drains_finishes_the_stream_it_could_hand_to_no_one(token_file):
    """With no other worker, the handed-over stream goes back to the draining worker from its codes (asking for
    no hand-over): the sentence ends whole, byte for byte, and the worker exits once it is served."""
    with workers(synthetic_worker_args("--token-file", token_file, speed=2.0)) as (worker,):
        remote = pool(worker.address)
        await remote.start()
        try:
            request = SynthesisRequest(text=TEXT, voice="tone-mid", seed=11, request_id="http-1")  # no session
            stream = remote.synthesize(request)
            audio = bytearray((await anext(stream)).pcm)
            worker.terminate()
            async for chunk in stream:
                audio += chunk.pcm
            assert bytes(audio) == uninterrupted()
            assert remote.handovers == 1 and remote.resumed_from_codes == 1
            assert await asyncio.to_thread(worker.wait, 30) == 0
        finally:
            await remote.stop()


class NoCodes(SyntheticSynthesizer):
    """The synthetic backend as one without codes (as Piper is): no "resume_codes", no codebooks."""

    honours = SyntheticSynthesizer.honours - {"resume_codes"}
    codebooks = 0


async def test_a_worker_without_codes_tells_none_and_refuses_to_continue_from_codes(tmp_path):
    """An in-process worker on a Unix socket whose backend has no codes (its chunks carry some all the same):
    none go over the wire, and a request that continues from codes is refused, not spoken from the start."""
    server = WorkerServer(NoCodes(), str(tmp_path / "w.sock"))
    await server.start()
    remote = RemoteSynthesizer(socket=server.socket_path, connect_timeout_s=10, info_refresh_s=60)
    await remote.start()
    try:
        assert "resume_codes" not in remote.honours and remote.codebooks == 0
        chunks = [c async for c in remote.synthesize(SynthesisRequest(text=TEXT, voice="tone-mid", seed=11))]
        assert not any(c.codes for c in chunks) and b"".join(c.pcm for c in chunks) == uninterrupted()
        with pytest.raises(SynthesisError, match="cannot continue a sentence from codes"):
            async for _ in remote.synthesize(SynthesisRequest(text=TEXT, voice="tone-mid", seed=11,
                                                              resume_codes=b"\0" * 32)):
                pass
    finally:
        await remote.stop()
        await server.close()


def test_a_chunks_codes_go_in_frames_of_whole_frames():
    codes = bytes(range(256)) * 1000  # 8,000 frames of 16 codes
    frames, at = [], 0
    wire = framing.encode_codes(codes, 16)
    while at < len(wire):
        length = int.from_bytes(wire[at:at + 4], "big")
        kind, payload = wire[at + 4:at + 5], wire[at + 5:at + 4 + length]
        assert kind == framing.CODES and len(payload) <= framing.AUDIO_FRAME_BYTES and len(payload) % 32 == 0
        frames.append(payload)
        at += 4 + length
    assert b"".join(frames) == codes and len(frames) > 1
