"""The speech pipeline on its own (gateway/session/pipeline.py): a queue of sentences and utterance ends in,
frames on a socket out, each frame recorded in the store first. Driven without a server: the synthetic
backend, the memory store, and a socket stand-in that keeps what is written to it."""

from __future__ import annotations

import asyncio
import contextlib

from gateway.metrics import GatewayMetrics
from gateway.session.data import SessionEnd, SessionInfo, UtteranceEnd
from gateway.session.pipeline import SpeechPipeline
from gateway.session.writer import SocketWriter
from gateway.settings import GatewaySettings
from gateway.store.base import SentenceRecord, SessionChanges
from gateway.store.memory import MemorySessionStore
from tests.session_parts import RATE, VOICE, RecordingSocket, resolved_config, sentence, utterance
from tts_backend.synthetic import SyntheticSynthesizer

SESSION = "s-pipeline"
OWNER = "owner-1"


class Parts:
    def __init__(self, backend=None, **settings) -> None:
        self.socket = RecordingSocket()
        self.writer = SocketWriter(self.socket)
        self.store = MemorySessionStore()
        self.info = SessionInfo(owner=OWNER, session_id=SESSION)
        self.backend = backend or SyntheticSynthesizer(sample_rate=RATE)
        self.metrics = GatewayMetrics()
        self.pipeline = SpeechPipeline(self.writer, self.store, self.info, backend=self.backend,
                                       settings=GatewaySettings(**settings), metrics=self.metrics)
        self.config = resolved_config()
        self.sender: asyncio.Task | None = None

    async def released(self, *jobs) -> None:
        """Record the sentences as the connection loop does before it queues them."""
        if not await self.store.get(SESSION):
            await self.store.create(SESSION, self.config.snapshot(), owner=OWNER)
        records = [SentenceRecord(j.index, j.text, j.utterance.context_id, utterance=j.utterance.number) for j in jobs]
        await self.store.apply(SESSION, SessionChanges(sentences=records), owner=OWNER)
        self.info.sentences_released = max(j.index for j in jobs) + 1

    def start(self) -> None:
        self.sender = asyncio.create_task(self.pipeline.send_loop())

    async def stop(self) -> None:
        if self.sender is not None and not self.sender.done():
            self.sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.sender
        await self.pipeline.close()


def spoken(backend: SyntheticSynthesizer, text: str) -> bytes:
    """The PCM the synthetic backend makes of `text`, as the pipeline should send it (pcm at the backend's rate)."""
    from tts_backend.base import SynthesisRequest

    return backend.render(SynthesisRequest(text=text, voice=VOICE)).tobytes()


async def test_sentences_go_out_in_order_each_framed_and_recorded_before_it_is_sent():
    parts = Parts()
    first, second = utterance(1), utterance(2)
    jobs = [sentence(0, "The first sentence.", first, parts.config), sentence(1, "And a second one.", second, parts.config)]
    first.sentences = second.sentences = 1
    await parts.released(*jobs)
    for job in jobs:  # as the connection loop counts released text
        parts.pipeline.count_text(job, len(job.text))
    parts.pipeline.enqueue(jobs[0], UtteranceEnd(first, after=1), jobs[1], SessionEnd(after=2))
    assert parts.pipeline.pending_chars == sum(len(j.text) for j in jobs) and parts.pipeline.ends_queued == 1
    parts.start()
    await asyncio.wait_for(parts.sender, 10)  # ends after the session end

    kinds = [m["type"] for m in parts.socket.messages()]
    assert kinds == ["audio.start", "audio.done", "session.done", "audio.start", "audio.done", "session.done"]
    # No context ids: an utterance's end is session.done, counting the sentences released so far.
    assert parts.socket.messages("session.done")[-1]["total_sentences"] == 2
    starts = [i for i, (kind, m) in enumerate(parts.socket.frames) if kind == "text" and m["type"] == "audio.start"]
    done = [i for i, (kind, m) in enumerate(parts.socket.frames) if kind == "text" and m["type"] == "audio.done"]
    for job, start, end in zip(jobs, starts, done):
        audio = b"".join(data for kind, data in parts.socket.frames[start + 1 : end] if kind == "bytes")
        assert audio == spoken(parts.backend, job.text)
        assert parts.socket.frames[end][1]["total_bytes"] == len(audio)
    frame_limit = RATE * GatewaySettings().max_frame_ms // 1000 * 2
    assert all(len(data) <= frame_limit for kind, data in parts.socket.frames if kind == "bytes")
    assert parts.socket.closed_with == 1000
    assert await parts.store.get(SESSION) is None  # a session that ended is no longer kept
    assert parts.pipeline.pending_chars == 0 and parts.pipeline.ends_queued == 0 and not parts.pipeline.busy


async def test_every_frame_is_in_the_store_before_the_socket_has_it():
    parts = Parts()
    job = sentence(0, "Recorded first, sent second.", utterance(), parts.config)
    await parts.released(job)
    parts.socket.reading_audio.clear()  # the client takes no audio: the first frame waits to be written
    parts.pipeline.enqueue(job)
    parts.start()
    record = await parts.store.get(SESSION)
    for _ in range(200):
        if record.sentences[0].bytes_sent:
            break
        await asyncio.sleep(0.01)
    assert record.sentences[0].bytes_sent > 0 and parts.socket.audio() == b""
    replayed = b"".join(p.data for p in await parts.store.replay(SESSION, 0, 0))
    parts.socket.reading_audio.set()
    for _ in range(500):
        if parts.socket.messages("audio.done"):
            break
        await asyncio.sleep(0.01)
    assert parts.socket.audio().startswith(replayed)
    assert b"".join(p.data for p in await parts.store.replay(SESSION, 0, 0)) == parts.socket.audio()
    assert record.sentences[0].state == "done"
    await parts.stop()


async def test_synthesis_waits_while_the_sender_is_behind():
    """Back-pressure: with a client that reads nothing, the audio made and not sent stays within about twice
    max_queued_audio_s, however long the sentences are."""
    parts = Parts(max_queued_audio_s=0.5, lookahead_sentences=1)
    one = utterance()
    long_text = "A long sentence that the synthetic voice takes many seconds to say, on and on. " * 3
    jobs = [sentence(i, long_text, one, parts.config) for i in range(3)]
    await parts.released(*jobs)
    parts.socket.reading.clear()
    parts.pipeline.enqueue(*jobs)
    parts.start()
    bound = 0.5 * 2 * RATE
    await asyncio.sleep(0.5)  # the synthetic backend makes audio far faster than that
    assert 0 < parts.pipeline.queued_audio <= 2 * bound
    assert len(spoken(parts.backend, long_text)) > 4 * bound  # without the bound it would all be queued
    assert jobs[2].task is None  # beyond the look-ahead: not started
    await parts.stop()


async def test_a_cut_context_sends_not_one_more_byte():
    """input.cancel's part: with the writer's lock held (the sender between frames), `cut` stops the
    context's sentence being sent and drops its queued sentences and utterance end; the other context goes on.
    A chunk of a second goes out in frames of 100 ms: the cut falls between two frames of one chunk."""
    parts = Parts(backend=SyntheticSynthesizer(sample_rate=RATE, chunk_ms=1000), max_frame_ms=100)
    a, b = utterance(1, "a"), utterance(2, "b")
    parts.info.uses_contexts = True
    long_text = "A sentence long enough to be sent in many frames, one after another. " * 2
    jobs = [sentence(0, long_text, a, parts.config), sentence(1, "More of context a.", a, parts.config),
            sentence(2, "Context b speaks.", b, parts.config)]
    a.sentences, b.sentences = 2, 1
    await parts.released(*jobs)
    for job in jobs:
        parts.pipeline.count_text(job, len(job.text))
    parts.pipeline.enqueue(jobs[0], jobs[1], UtteranceEnd(a, after=2), jobs[2], UtteranceEnd(b, after=3))
    parts.start()
    while not parts.socket.audio():
        parts.socket.frame_written.clear()
        await parts.socket.frame_written.wait()
    async with parts.writer.lock:
        cut = parts.pipeline.cut("a")
        sent_of_a = len(parts.socket.audio())
    assert cut.interrupted is jobs[0] and cut.stopped == jobs[:2]
    assert [end.utterance for end in cut.dropped_ends] == [a] and set(cut.utterances) == {1}
    assert parts.pipeline.ends_queued == 1 and parts.pipeline.pending_chars == len(jobs[2].text)
    parts.pipeline.refill()
    for _ in range(500):
        if parts.socket.messages("utterance.done"):
            break
        await asyncio.sleep(0.01)
    b_start = next(i for i, (k, m) in enumerate(parts.socket.frames) if k == "text" and m.get("sentence_index") == 2)
    before_b = b"".join(d for k, d in parts.socket.frames[:b_start] if k == "bytes")
    assert len(before_b) == sent_of_a < len(spoken(parts.backend, long_text))  # nothing of a after the cut
    assert [m["context_id"] for m in parts.socket.messages("utterance.done")] == ["b"]
    assert [m["sentence_index"] for m in parts.socket.messages("audio.start")] == [0, 2]
    await parts.stop()


async def test_a_stopped_pipeline_starts_no_synthesis():
    class CountingSynthesizer(SyntheticSynthesizer):
        calls = 0

        def synthesize(self, request):
            CountingSynthesizer.calls += 1
            return super().synthesize(request)

    parts = Parts(backend=CountingSynthesizer(sample_rate=RATE))
    job = sentence(0, "Never spoken.", utterance(), parts.config)
    await parts.released(job)
    parts.pipeline.stop()
    parts.pipeline.enqueue(job)
    await asyncio.sleep(0.05)
    assert CountingSynthesizer.calls == 0 and job.task is None


async def test_a_failed_synthesis_is_reported_in_order_and_recorded():
    class FailingSynthesizer(SyntheticSynthesizer):
        async def synthesize(self, request):
            raise RuntimeError("the voice broke")
            yield  # an async generator, as backends are

    parts = Parts(backend=FailingSynthesizer(sample_rate=RATE))
    job = sentence(0, "This one fails.", utterance(), parts.config)
    await parts.released(job)
    parts.pipeline.enqueue(job)
    parts.start()
    for _ in range(500):
        if parts.socket.messages("audio.done"):
            break
        await asyncio.sleep(0.01)
    kinds = [(m["type"], m.get("code")) for m in parts.socket.messages()]
    assert kinds == [("audio.start", None), ("error", "synthesis_failed"), ("audio.done", None)]
    assert parts.socket.messages("audio.done")[0]["error"] is True
    for _ in range(100):
        if (await parts.store.get(SESSION)).sentences[0].state == "failed":
            break
        await asyncio.sleep(0.01)
    assert (await parts.store.get(SESSION)).sentences[0].state == "failed"
    await parts.stop()
