"""session.resume in the middle of a sentence goes on from the sentence's codes (issue 33), against real
gateways (synthetic backend, named as such: deterministic, one frame of codes a chunk): a replica SIGKILLed
at a random point of a sentence, resumed on another through Redis and through a Redis Cluster; a socket
dropped and resumed on the same gateway with the memory store. The store holds the open sentence's codes
(and only its); the new synthesis continues from them rather than making the sentence again; the audio is
the uninterrupted run's, byte for byte."""

from __future__ import annotations

import random

import httpx
import websockets

from gateway.store.memory import MemorySessionStore
from gateway.store.redis import RedisSessionStore
from tests.gateway_server import running_gateway
from tests.redis_fixtures import redis_cluster, redis_prefix, redis_target  # noqa: F401 (fixtures)
from tests.resume_fixtures import (
    PACED,
    Listener,
    gateways,
    receive_into_sentence,
    resume,
    start_session,
    uninterrupted_pcm,
)
from tts_backend.base import SynthesisRequest
from tts_backend.synthetic import CODEBOOKS, SyntheticSynthesizer

TEXT = (
    "The first sentence is spoken without any trouble at all. "
    "The second sentence is where the replica will be lost, somewhere in its middle. "
    "And the third one closes the turn."
)
RESUMED = "voxgate_sentences_resumed_from_codes_total"


def resumed_from_codes(metrics_url: str) -> float:
    text = httpx.get(metrics_url, timeout=5).text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(RESUMED + " "))


async def test_a_replica_killed_at_a_random_point_of_a_sentence_goes_on_from_its_codes(redis_target, redis_prefix):  # noqa: F811
    cut = random.Random().randrange(1, 40) * 1920  # bytes of sentence 1 the client has before the kill
    print(f"killing the replica after {cut} bytes of sentence 1")
    with gateways(redis_target.url, redis_prefix, 2, *PACED, *redis_target.flags) as (a, b):
        reference = await uninterrupted_pcm(b.ws_url, TEXT)
        listener = Listener()
        ws = await websockets.connect(a.ws_url, max_size=None)
        await start_session(ws, listener, TEXT)
        await receive_into_sentence(ws, listener, 1, min_bytes=cut)
        a.kill()
        await listener.receive_until_closed(ws)
        store = RedisSessionStore(redis_target.url, key_prefix=redis_prefix, cluster=redis_target.cluster)
        await store.start()
        try:
            record = await store.get(listener.session_id)
        finally:
            await store.stop()
        # What the store keeps: the codes of the open sentence only, whole frames, resuming at a byte it has.
        open_ones = [s for s in record.sentences.values() if s.state not in ("done", "cancelled", "failed")]
        assert all(not s.codes for s in record.sentences.values() if s not in open_ones)
        speaking = [s for s in open_ones if s.bytes_sent]
        assert speaking, "the kill came between sentences"
        sentence = speaking[0]
        assert sentence.codes and len(sentence.codes) % (2 * CODEBOOKS) == 0
        assert 0 < sentence.codes_at <= sentence.bytes_sent
        ws = await resume(b.ws_url, listener)
        done = await listener.receive(ws, "session.done")
        await ws.close()
        assert resumed_from_codes(b.url + "/metrics") == 1
    assert done["total_sentences"] == 3
    assert listener.pcm() == reference


class RecordingSynthetic(SyntheticSynthesizer):
    """The synthetic backend, keeping every request it is given (to see what a resume asked for)."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.requests: list[SynthesisRequest] = []

    def synthesize(self, request: SynthesisRequest):
        self.requests.append(request)
        return super().synthesize(request)


async def test_a_dropped_socket_resumes_from_the_codes_in_the_memory_store():
    backend = RecordingSynthetic(speed=8.0, chunk_ms=40)
    store = MemorySessionStore()
    with running_gateway(backend, store=store) as gateway:
        reference = await uninterrupted_pcm(gateway.ws_url, TEXT)
        listener = Listener()
        ws = await websockets.connect(gateway.ws_url, max_size=None)
        await start_session(ws, listener, TEXT)
        await receive_into_sentence(ws, listener, 1, min_bytes=10 * 1920)
        await ws.close()  # the network fails mid-sentence; the gateway keeps the session
        had = len(listener.audio[1])
        backend.requests.clear()
        ws = await resume(gateway.ws_url, listener)
        done = await listener.receive(ws, "session.done")
        await ws.close()
    assert done["total_sentences"] == 3 and listener.pcm() == reference
    resumed = [r for r in backend.requests if r.resume_codes]
    assert len(resumed) == 1 and resumed[0].text.startswith("The second sentence")
    # It went on from the codes the client's audio had (or a little less): not the whole sentence again.
    frames = len(resumed[0].resume_codes) // (2 * CODEBOOKS)
    assert frames >= 1 and frames * 40 * 24 * 2 <= had + 40 * 24 * 2 * 8
    record = await store.get(listener.session_id)  # (gone, or kept with no codes: every sentence ended)
    assert record is None or not [s.codes for s in record.sentences.values() if s.codes]
