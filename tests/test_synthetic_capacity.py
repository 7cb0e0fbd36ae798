"""The synthetic backend's `capacity`: at most N streams produce at once, the rest wait first come first
served for a slot before their first chunk, and a slot comes back however a stream ends (its end, aclose,
cancellation of the task iterating it). Real asyncio, real streams, no mocks."""

from __future__ import annotations

import asyncio

import pytest

from tts_backend.base import SynthesisRequest, UnknownVoiceError
from tts_backend.synthetic import SyntheticSynthesizer

TEXT = "A sentence long enough for several chunks of audio."


def request(text: str = TEXT, seed: int | None = 7) -> SynthesisRequest:
    return SynthesisRequest(text=text, voice="tone-mid", seed=seed)


async def collect(backend: SyntheticSynthesizer, req: SynthesisRequest, log: list | None = None, name: str = "") -> bytes:
    out = bytearray()
    async for chunk in backend.synthesize(req):
        if log is not None and not out:
            log.append(name)
        out += chunk.pcm
    return bytes(out)


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.001)


def test_no_capacity_by_default():
    backend = SyntheticSynthesizer()
    assert backend.capacity() is None
    assert backend.queued() == 0
    assert backend.load() == 0.0


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_capacity_must_be_a_positive_int(bad):
    with pytest.raises(ValueError):
        SyntheticSynthesizer(capacity=bad)


def test_same_audio_with_and_without_capacity():
    async def scenario():
        free = await collect(SyntheticSynthesizer(speed=50.0, chunk_ms=40), request())
        capped = SyntheticSynthesizer(speed=50.0, chunk_ms=40, capacity=1)
        both = await asyncio.gather(collect(capped, request()), collect(capped, request()))
        return free, both

    free, both = asyncio.run(scenario())
    assert free and both == [free, free]
    assert free == SyntheticSynthesizer(chunk_ms=40).render(request()).tobytes()


def test_at_most_capacity_produce_and_the_rest_wait_in_order():
    async def scenario():
        backend = SyntheticSynthesizer(speed=20.0, chunk_ms=40, capacity=2)
        first_chunks: list[str] = []
        peak = {"producing": 0, "queued": 0}

        async def watch():
            while True:
                peak["producing"] = max(peak["producing"], backend._producing)
                peak["queued"] = max(peak["queued"], backend.queued())
                assert backend._producing <= 2
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        tasks = []
        for i in range(5):
            tasks.append(asyncio.create_task(collect(backend, request(), first_chunks, f"s{i}")))
            await asyncio.sleep(0.002)  # start in a known order
        await until(lambda: backend.queued() == 3)
        assert backend.load() == 1.0
        results = await asyncio.gather(*tasks)
        watcher.cancel()
        return backend, first_chunks, peak, results

    backend, first_chunks, peak, results = asyncio.run(scenario())
    assert first_chunks == ["s0", "s1", "s2", "s3", "s4"]  # FIFO
    assert peak == {"producing": 2, "queued": 3}
    assert len(set(results)) == 1
    assert backend._producing == 0 and backend.queued() == 0 and backend.load() == 0.0


def test_a_resumed_stream_waits_before_the_new_ones_after_the_resumed_ones():
    # Its listener is mid-sentence, hearing nothing (a failover or a drain's hand-over): of those waiting for a
    # slot it goes first, after the streams resumed before it; the new ones keep their order behind them.
    async def scenario():
        backend = SyntheticSynthesizer(speed=20.0, chunk_ms=40, capacity=1)
        codes = b""
        async for chunk in backend.synthesize(request()):
            codes = chunk.codes  # the first chunk's codes: a stream cut after it
            break
        resumed = SynthesisRequest(text=TEXT, voice="tone-mid", seed=7, resume_codes=codes)
        first_chunks: list[str] = []
        tasks = []
        for name, req in (("s0", request()), ("n1", request()), ("r1", resumed), ("n2", request()), ("r2", resumed)):
            tasks.append(asyncio.create_task(collect(backend, req, first_chunks, name)))
            await asyncio.sleep(0.002)  # start in a known order
        await until(lambda: backend.queued() == 4)
        await asyncio.gather(*tasks)
        return backend, first_chunks

    backend, first_chunks = asyncio.run(scenario())
    assert first_chunks == ["s0", "r1", "r2", "n1", "n2"]
    assert backend._producing == 0 and backend.queued() == 0 and not backend._waiting_resumed


def test_a_waiting_stream_gets_no_chunk_until_a_slot_frees():
    async def scenario():
        backend = SyntheticSynthesizer(speed=1.0, chunk_ms=40, capacity=1)
        holder = backend.synthesize(request())
        await anext(holder)  # holds the only slot, paused between chunks
        second = backend.synthesize(request("Another one."))
        waiter = asyncio.create_task(anext(second))
        await until(lambda: backend.queued() == 1)
        await asyncio.sleep(0.2)
        still_waiting = not waiter.done()
        await holder.aclose()  # the slot passes to the waiter
        chunk = await asyncio.wait_for(waiter, 2)
        holding = backend._producing  # the second stream, suspended at its first yield, holds it
        await second.aclose()
        return backend, still_waiting, chunk, holding

    backend, still_waiting, chunk, holding = asyncio.run(scenario())
    assert still_waiting
    assert chunk.pcm
    assert holding == 1
    assert backend._producing == 0


def test_aclose_frees_the_slot():
    async def scenario():
        backend = SyntheticSynthesizer(speed=1.0, chunk_ms=40, capacity=1)
        stream = backend.synthesize(request())
        await anext(stream)
        held = backend.load()
        await stream.aclose()
        return backend, held

    backend, held = asyncio.run(scenario())
    assert held == 1.0
    assert backend._producing == 0 and backend.load() == 0.0


def test_cancelling_a_producing_stream_frees_the_slot():
    async def scenario():
        backend = SyntheticSynthesizer(speed=0.5, chunk_ms=40, capacity=1)  # slow: cancelled mid-stream
        task = asyncio.create_task(collect(backend, request()))
        await until(lambda: backend.load() == 1.0)
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        freed = (backend._producing, backend.queued())
        # The slot is usable again at once: a short stream gets its first chunk without waiting.
        again = backend.synthesize(request("Next."))
        first = await asyncio.wait_for(anext(again), 1)
        await again.aclose()
        return backend, freed, first

    backend, freed, first = asyncio.run(scenario())
    assert freed == (0, 0)
    assert first.pcm
    assert backend._producing == 0 and backend.queued() == 0


def test_cancelling_a_waiting_stream_leaves_the_queue_and_the_order():
    async def scenario():
        backend = SyntheticSynthesizer(speed=1.0, chunk_ms=40, capacity=1)
        holder = backend.synthesize(request())
        await anext(holder)
        order: list[str] = []
        a = asyncio.create_task(collect(backend, request("Waiter a."), order, "a"))
        await until(lambda: backend.queued() == 1)
        b = asyncio.create_task(collect(backend, request("Waiter b."), order, "b"))
        await until(lambda: backend.queued() == 2)
        a.cancel()
        with pytest.raises(asyncio.CancelledError):
            await a
        queued_after_cancel = backend.queued()
        await holder.aclose()
        await asyncio.wait_for(b, 5)
        return backend, order, queued_after_cancel

    backend, order, queued_after_cancel = asyncio.run(scenario())
    assert queued_after_cancel == 1
    assert order == ["b"]
    assert backend._producing == 0 and backend.queued() == 0


def test_cancelled_just_as_the_slot_is_handed_over_passes_it_on():
    """The holder ends and hands its slot to the first waiter in the same loop step as that waiter's task
    is cancelled: the slot must go to the next waiter, not vanish."""

    async def scenario():
        backend = SyntheticSynthesizer(speed=1.0, chunk_ms=40, capacity=1)
        holder = backend.synthesize(request())
        await anext(holder)
        a = asyncio.create_task(collect(backend, request("Waiter a.")))
        await until(lambda: backend.queued() == 1)
        b = asyncio.create_task(collect(backend, request("Waiter b.")))
        await until(lambda: backend.queued() == 2)
        await holder.aclose()  # a's future is resolved; a has not run yet
        a.cancel()
        with pytest.raises(asyncio.CancelledError):
            await a
        pcm = await asyncio.wait_for(b, 5)
        return backend, pcm

    backend, pcm = asyncio.run(scenario())
    assert pcm
    assert backend._producing == 0 and backend.queued() == 0


def test_unknown_voice_fails_without_taking_a_slot():
    async def scenario():
        backend = SyntheticSynthesizer(capacity=1)
        with pytest.raises(UnknownVoiceError):
            await collect(backend, SynthesisRequest(text=TEXT, voice="nobody"))
        return backend

    backend = asyncio.run(scenario())
    assert backend._producing == 0


def test_many_streams_ending_every_way_leak_nothing():
    async def scenario():
        backend = SyntheticSynthesizer(speed=10.0, chunk_ms=40, capacity=3)
        tasks = [asyncio.create_task(collect(backend, request(f"Stream number {i} says a few words.")))
                 for i in range(12)]
        streams = [backend.synthesize(request()) for _ in range(3)]

        async def close_after_one(stream):
            await anext(stream)
            await stream.aclose()

        closers = [asyncio.create_task(close_after_one(s)) for s in streams]
        await asyncio.sleep(0.05)
        for task in tasks[::3]:
            task.cancel()
        await asyncio.gather(*tasks, *closers, return_exceptions=True)
        return backend

    backend = asyncio.run(scenario())
    assert backend._producing == 0 and backend.queued() == 0 and backend.load() == 0.0
