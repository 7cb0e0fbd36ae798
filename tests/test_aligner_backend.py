"""The forced aligner behind the Qwen3 backend (`-o aligner=PATH`): word timestamps for the engine's speech.

Tiny random TTS and aligner checkpoints on the CPU. The words come in one chunk with no audio after the
sentence's last audio chunk (the aligner needs the whole sentence), never before the first audio; they are
the sentence's words as the gateway defines them, with the aligner's times for this very audio; sentences that
finish together share one aligner pass. Through the real gateway, `timestamp_type: "word"` gives them in
`audio.done`.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
import websockets

from tests.gateway_server import running_gateway
from tests.qwen3_fixtures import single_torch_thread, tiny_custom_voice  # noqa: F401 - fixtures
from tts_backend.aligner import AlignRequest, load_aligner
from tts_backend.aligner.batcher import AlignmentBatcher
from tts_backend.aligner.testing.checkpoint import write_aligner_checkpoint
from tts_backend.aligner.words import times_of_spans
from tts_backend.base import AudioChunk, SynthesisRequest, split_words
from tts_backend.registry import create_backend
from tts_backend.remote import RemoteSynthesizer

OPTIONS = {"max_active": 4, "max_len": 256, "greedy": True, "frame_cap_chars_per_second": 15}
TEXT = "Good morning - this is the engine, speaking 3.5 words!"


@pytest.fixture(scope="module")
def tiny_aligner(tmp_path_factory):
    return write_aligner_checkpoint(tmp_path_factory.mktemp("aligner-tiny-windowed"), "tiny-windowed", seed=2)


@pytest.mark.parametrize("aligner_process", [True, False], ids=["process", "thread"])
async def test_words_follow_the_audio_with_the_aligners_times(tiny_custom_voice, tiny_aligner, aligner_process):
    backend = create_backend("qwen3", model=str(tiny_custom_voice), device="cpu", dtype="float32",
                             aligner=str(tiny_aligner), aligner_process=aligner_process, **OPTIONS)
    assert "word_timestamps" in backend.honours
    await backend.start()
    try:
        batcher = backend.aligner_batcher
        chunks, aligned_before = [], []
        async for chunk in backend.synthesize(SynthesisRequest(text=TEXT, voice="ryan", word_timestamps=True)):
            chunks.append(chunk)
            aligned_before.append(batcher.sentences)
        plain = [c async for c in backend.synthesize(SynthesisRequest(text=TEXT, voice="ryan"))]
    finally:
        await backend.stop()

    *audio_chunks, ended, last = chunks
    assert audio_chunks and all(c.pcm and not c.words for c in audio_chunks)
    assert aligned_before[0] == 0  # the first audio went out before any alignment ran
    # Said before the aligner's wait, which the caller bounds (issue 32), and before it runs.
    assert ended == AudioChunk(b"", audio_ended=True) and aligned_before[-2] == 0
    assert last.pcm == b"" and last.words
    pcm = b"".join(c.pcm for c in audio_chunks)
    assert pcm == b"".join(c.pcm for c in plain) and not any(c.words for c in plain)  # off: no timing work
    assert batcher.sentences == 1

    spans = split_words(TEXT)
    assert [w.word for w in last.words] == [w for w, _, _ in spans] == \
        ["Good", "morning -", "this", "is", "the", "engine,", "speaking", "3.5", "words!"]
    samples = len(pcm) // 2
    times = [t for w in last.words for t in (w.start, w.end)]
    assert times == sorted(times) and 0 <= times[0] and times[-1] <= samples

    # The same times as the aligner gives for this audio, mapped onto the gateway's words.
    aligner = load_aligner(tiny_aligner, "cpu", torch.float32)
    (direct,) = aligner.align([AlignRequest(np.frombuffer(pcm, "<i2"), 24000, TEXT)])
    assert [w for w, _, _ in direct] == ["Good", "morning", "this", "is", "the", "engine", "speaking", "35", "words"]
    expected = [(min(round(s * 24000), samples), min(round(e * 24000), samples))
                for s, e in times_of_spans([w for w, _, _ in spans], direct)]
    assert [(w.start, w.end) for w in last.words] == expected


def _hold_first_pass(aligner) -> tuple[threading.Event, threading.Event]:
    """Make the aligner's first forward pass wait for `release`; `first_started` is set when it begins."""
    release, first_started = threading.Event(), threading.Event()
    real_align = aligner.align

    def gated(batch):
        if not first_started.is_set():
            first_started.set()
            assert release.wait(30)
        return real_align(batch)

    aligner.align = gated
    return release, first_started


async def test_sentences_finishing_together_share_one_aligner_pass(tiny_aligner):
    aligner = load_aligner(tiny_aligner, "cpu", torch.float32)
    rng = np.random.default_rng(0)
    requests = [AlignRequest((0.2 * rng.standard_normal(n)).astype(np.float32), 16000, text) for n, text in
                ((21000, "first sentence here"), (30500, "second one"), (9000, "third"))]
    alone = [aligner.align([r])[0] for r in requests]

    # Hold the first pass until the other two sentences are queued, as when sentences finish during a pass.
    release, first_started = _hold_first_pass(aligner)
    batcher = AlignmentBatcher(aligner, max_batch=8)
    try:
        first = asyncio.create_task(batcher.align(requests[0]))
        assert await asyncio.to_thread(first_started.wait, 30)
        rest = [asyncio.create_task(batcher.align(r)) for r in requests[1:]]
        await asyncio.sleep(0)  # both are queued (put() happens before their first await)
        release.set()
        results = [await first] + [await t for t in rest]
    finally:
        await asyncio.to_thread(batcher.close)
    assert results == alone
    assert (batcher.batches, batcher.sentences) == (2, 3)


async def test_words_come_through_a_worker_process(tiny_custom_voice, tiny_aligner, tmp_path):
    """`voxgate worker --backend qwen3 -o aligner=PATH`: the gateway's side of the socket gets the same words."""
    socket_path = str(tmp_path / "aligner.sock")
    args = [f"--option={k}={json.dumps(v)}" for k, v in OPTIONS.items()]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tts_backend.remote.worker", "--socket", socket_path, "--backend", "qwen3", "--model",
         str(tiny_custom_voice), "--device", "cpu", "--option", f"aligner={tiny_aligner}", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    request = SynthesisRequest(text=TEXT, voice="ryan", word_timestamps=True)
    try:
        remote = RemoteSynthesizer(socket=socket_path, connect_timeout_s=120)
        await remote.start()
        try:
            assert "word_timestamps" in remote.honours
            remote_chunks = [c async for c in remote.synthesize(request)]
        finally:
            await remote.stop()
    finally:
        proc.terminate()
        proc.wait(20)
    local = create_backend("qwen3", model=str(tiny_custom_voice), device="cpu", aligner=str(tiny_aligner), **OPTIONS)
    await local.start()
    try:
        local_chunks = [c async for c in local.synthesize(request)]
    finally:
        await local.stop()
    remote_words = [w for c in remote_chunks for w in c.words]
    assert remote_words and remote_words == [w for c in local_chunks for w in c.words]
    got, want = (np.frombuffer(b"".join(c.pcm for c in chunks), "<i2").astype(np.int32)
                 for chunks in (remote_chunks, local_chunks))
    # Same codes; the codec's fp32 rounding may move a sample by one step between the two processes.
    assert len(got) == len(want) > 0 and np.abs(got - want).max() <= 1


async def test_a_sentence_that_fails_does_not_fail_its_batch(tiny_aligner):
    aligner = load_aligner(tiny_aligner, "cpu", torch.float32)
    good = AlignRequest((0.2 * np.random.default_rng(1).standard_normal(20000)).astype(np.float32), 16000, "good one")
    bad = AlignRequest(np.zeros((2, 100), np.float32), 16000, "stereo is refused")
    (alone,) = aligner.align([good])
    release, first_started = _hold_first_pass(aligner)
    batcher = AlignmentBatcher(aligner, max_batch=8)
    try:
        first = asyncio.create_task(batcher.align(good))
        assert await asyncio.to_thread(first_started.wait, 30)
        failing, fine = asyncio.create_task(batcher.align(bad)), asyncio.create_task(batcher.align(good))
        await asyncio.sleep(0)
        release.set()
        assert await first == alone and await fine == alone
        with pytest.raises(ValueError, match="mono"):
            await failing
    finally:
        await asyncio.to_thread(batcher.close)


async def test_timestamp_type_word_through_the_gateway(tiny_custom_voice, tiny_aligner):
    options = {**OPTIONS, "aligner": str(tiny_aligner)}
    with running_gateway("qwen3", model=str(tiny_custom_voice), device="cpu", backend_options=options,
                         ready_timeout_s=180) as server:
        async with websockets.connect(server.ws_url) as ws:
            await ws.send(json.dumps({"type": "session.config", "voice": "ryan", "timestamp_type": "word",
                                      "response_format": "pcm", "sample_rate": 24000}))
            await ws.send(json.dumps({"type": "input.text", "text": "One sentence here. And a second, longer one!"}))
            await ws.send(json.dumps({"type": "input.done"}))
            messages, audio, current = [], {}, None
            while True:
                message = await ws.recv()
                if isinstance(message, bytes):
                    audio[current] += message
                    continue
                message = json.loads(message)
                messages.append(message)
                if message["type"] == "audio.start":
                    current = message["sentence_index"]
                    audio[current] = b""
                if message["type"] in ("session.done", "error"):
                    break
    assert messages[-1]["type"] == "session.done", messages[-1]
    started = next(m for m in messages if m["type"] == "session.started")
    assert started["sample_rate"] == 24000 and started["format"] == "pcm" and not started.get("warnings")
    dones = [m for m in messages if m["type"] == "audio.done"]
    starts = {m["sentence_index"]: m["sentence_text"] for m in messages if m["type"] == "audio.start"}
    assert len(dones) == 2
    for done in dones:
        alignment = done["timestamp_info"]["word_alignment"]
        text = starts[done["sentence_index"]]
        assert alignment["words"] == [w for w, _, _ in split_words(text)]
        seconds = len(audio[done["sentence_index"]]) / 2 / 24000
        times = [t for pair in zip(alignment["word_start_times_seconds"], alignment["word_end_times_seconds"])
                 for t in pair]
        assert times == sorted(times) and 0 <= times[0] and times[-1] <= seconds + 1e-6


async def test_a_pass_waits_its_gather_time_for_more_sentences(tiny_aligner):
    # With gather_s, a sentence queued after the pass took its first one still joins that pass (here it fills
    # the batch, so the pass goes at once); without, the first went alone (the test above's two passes).
    aligner = load_aligner(tiny_aligner, "cpu", torch.float32)
    rng = np.random.default_rng(2)
    requests = [AlignRequest((0.2 * rng.standard_normal(n)).astype(np.float32), 16000, text)
                for n, text in ((21000, "first sentence here"), (9000, "second"))]
    alone = [aligner.align([r])[0] for r in requests]
    batcher = AlignmentBatcher(aligner, max_batch=2, gather_s=60.0)
    try:
        first = asyncio.create_task(batcher.align(requests[0]))
        await asyncio.sleep(0.2)  # the thread has taken it and waits for company
        assert not first.done()
        second = asyncio.create_task(batcher.align(requests[1]))
        results = [await first, await second]
    finally:
        await asyncio.to_thread(batcher.close)
    assert results == alone
    assert (batcher.batches, batcher.sentences) == (1, 2)
    with pytest.raises(ValueError, match="gather_s"):
        AlignmentBatcher(aligner, gather_s=-1)
