"""Text pushed while the Qwen3 engine speaks (issue 21), on the CPU with a tiny random checkpoint.

The property that matters: what is said never changes, only when. For a seed, a text that arrives in
pieces gives exactly the codes (and so the audio) of the same text sent whole in streaming-text mode.
"""

from __future__ import annotations

import asyncio
import random
import threading

import numpy as np
import pytest

from tests.qwen3_fixtures import tiny_base, tiny_custom_voice  # noqa: F401 - session fixtures
from tts_backend.base import SynthesisRequest, TextStream
from tts_backend.registry import create_backend

TEXT = "Hello world, this is a small test of the engine."


async def started(path, **options):
    backend = create_backend("qwen3", model=str(path), device="cpu", max_active=4, max_len=256, **options)
    await backend.start()
    return backend


async def audio_of(backend, request) -> np.ndarray:
    return np.frombuffer(b"".join([c.pcm async for c in backend.synthesize(request)]), "<i2")


def reference_audio(model, text, voice, seed, max_new_tokens, streaming_text) -> np.ndarray:
    codes = model.synthesize_codes(text, speaker=voice, seed=seed, max_new_tokens=max_new_tokens,
                                   non_streaming_mode=not streaming_text)
    wav = model.codec.decode(codes.T[None].contiguous())[0].float().numpy()
    return (np.clip(wav, -1, 1) * 32767).round().astype(np.int16)


def same_audio(got: np.ndarray, want: np.ndarray) -> bool:
    return len(got) == len(want) > 0 and int(np.abs(got.astype(np.int32) - want).max()) <= 1


@pytest.mark.parametrize("server_default", [False, True])
async def test_the_text_mode_is_chosen_per_request(tiny_custom_voice, server_default):
    backend = await started(tiny_custom_voice, streaming_text=server_default, trim_leading_silence=False)
    try:
        assert "text_mode" in backend.honours
        for choice in (None, True, False):
            request = SynthesisRequest(text=TEXT, voice="ryan", seed=3, max_new_tokens=20, streaming_text=choice)
            got = await audio_of(backend, request)
            mode = server_default if choice is None else choice
            assert same_audio(got, reference_audio(backend.model, TEXT, "ryan", 3, 20, mode))
            assert not same_audio(got, reference_audio(backend.model, TEXT, "ryan", 3, 20, not mode))
    finally:
        await backend.stop()


SENTENCES = [
    "Hello world, this is a small test of the engine.",
    "It's $3.50 - or so they said... then the rain came.",
    "One more sentence, spoken beside the others.",
]


def record_codes(backend) -> dict:
    """A spy on the real runner: after each code-predictor batch, each request's new frame (its 16 codes,
    read back from the frame ring), by the request's seed."""
    runner = backend.engine.runner
    code_predict = runner.code_predict
    frames: dict = {}

    def recording(requests):
        code_predict(requests)
        ring = runner.config.frame_ring
        for r in requests:
            written = int(runner.written[r.slot])
            frames.setdefault(r.seed, []).append(runner.ring[r.slot, (written - 1) % ring].tolist())

    runner.code_predict = recording
    return frames


def random_pieces(text: str, rng) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(2, 10)))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


async def pushed_in_pieces(backend, text, seed, rng, max_new_tokens) -> tuple[np.ndarray, int]:
    """Audio of `text` pushed in random pieces (cut anywhere, words too) after random delays; and how much
    audio had come before finish()."""
    pieces = random_pieces(text, rng)
    stream = TextStream(pieces[0])
    request = SynthesisRequest(text=pieces[0], voice="ryan", seed=seed, max_new_tokens=max_new_tokens,
                               text_stream=stream)
    audio = bytearray()
    before_finish = []

    async def write():
        for i, piece in enumerate(pieces[1:]):
            if i == len(pieces) - 2:
                # Before the last piece, at the least, the engine runs out of text: wait until it says so.
                for _ in range(12000):
                    if backend.engine.stats_snapshot()["text"]["waiting"]:
                        break
                    await asyncio.sleep(0.005)
                else:
                    raise AssertionError("the engine never waited for text")
            else:
                await asyncio.sleep(rng.choice([0, 0, 0.002, 0.01, 0.05]))
            stream.push(piece)
        await asyncio.sleep(rng.choice([0, 0.02]))
        before_finish.append(len(audio))
        stream.finish()

    async def read():
        async for chunk in backend.synthesize(request):
            audio.extend(chunk.pcm)

    await asyncio.gather(write(), read())
    return np.frombuffer(bytes(audio), "<i2"), before_finish[0]


@pytest.mark.parametrize("case", range(4))
async def test_text_in_random_pieces_says_exactly_what_the_whole_text_says(tiny_custom_voice, case):
    """Batched with other requests, the text cut at random places and pushed after random delays: the
    codes are exactly those of the whole text in streaming-text mode, for the seed (sampled, not greedy).
    In fp32: in bf16 the CPU's matmuls round differently for different batch shapes, which can flip a
    sampled code of any request, whole or not, whose batch company changed (the pieces' timing changes it);
    that is not what this test is about."""
    rng = random.Random(case)
    backend = await started(tiny_custom_voice, trim_leading_silence=False, dtype="float32")
    try:
        frames = record_codes(backend)
        n = 24 + 4 * case
        sentences = [SENTENCES[(case + i) % 3] for i in range(3)]
        streamed = sentences[0]
        got = await asyncio.gather(
            pushed_in_pieces(backend, streamed, 100, rng, n),
            *(audio_of(backend, SynthesisRequest(text=t, voice="aiden", seed=200 + i, max_new_tokens=n))
              for i, t in enumerate(sentences[1:])))
        pieces_audio, before_finish = got[0]
        assert before_finish > 0  # it spoke before the text was finished
        pieces_codes = frames.pop(100)
        frames.clear()
        whole = SynthesisRequest(text=streamed, voice="ryan", seed=100, max_new_tokens=n, streaming_text=True)
        whole_audio, *_ = await asyncio.gather(
            audio_of(backend, whole),
            *(audio_of(backend, SynthesisRequest(text=t, voice="vivian", seed=300 + i, max_new_tokens=n + 3))
              for i, t in enumerate(sentences[1:])))
        assert pieces_codes == frames[100]  # what is said: the same, frame for frame
        assert len(pieces_codes) > 3
        # The audio: the same codes through the codec, chunked where each run's timing cut it (fp32 rounding
        # moves a sample by at most one step between chunkings, as for any batched request).
        assert len(pieces_audio) == len(whole_audio) == len(pieces_codes) * 1920
        assert int(np.abs(pieces_audio.astype(np.int32) - whole_audio).max()) <= 1
        want = reference_audio(backend.model, streamed, "ryan", 100, n, streaming_text=True)
        assert int(np.abs(whole_audio.astype(np.int32) - want).max()) <= 1
        assert backend.engine.stats.text_waits > 0  # it did wait for text on the way
    finally:
        await backend.stop()


async def test_a_qwen3_worker_takes_text_over_its_socket(tiny_custom_voice, tmp_path):
    """Pieces pushed through a real worker process (text frames on the stream's connection) say what the
    whole text says in streaming-text mode in this process."""
    import subprocess
    import sys

    from tts_backend.remote import RemoteSynthesizer

    socket_path = str(tmp_path / "qwen3.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tts_backend.remote.worker", "--socket", socket_path, "--backend", "qwen3",
         "--model", str(tiny_custom_voice), "--device", "cpu", "--option", "max_active=2",
         "--option", "max_len=256", "--option", "dtype=float32", "--option", "trim_leading_silence=false"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        remote = RemoteSynthesizer(socket=socket_path, connect_timeout_s=120)
        await remote.start()
        try:
            assert {"text_streaming", "text_mode"} <= remote.honours
            rng = random.Random(9)
            got, before_finish = await pushed_in_pieces_to(remote, SENTENCES[1], 21, rng, 26)
        finally:
            await remote.stop()
    finally:
        proc.terminate()
        proc.wait(20)
    local = await started(tiny_custom_voice, trim_leading_silence=False, dtype="float32")
    try:
        want = await audio_of(local, SynthesisRequest(text=SENTENCES[1], voice="ryan", seed=21, max_new_tokens=26,
                                                      streaming_text=True))
    finally:
        await local.stop()
    assert len(got) == len(want) > 0
    assert int(np.abs(got.astype(np.int32) - want).max()) <= 1
    assert before_finish > 0


async def pushed_in_pieces_to(backend, text, seed, rng, max_new_tokens) -> tuple[np.ndarray, int]:
    """As pushed_in_pieces, for any backend: the middle piece waits for the first audio."""
    pieces = random_pieces(text, rng)
    stream = TextStream(pieces[0])
    request = SynthesisRequest(text=pieces[0], voice="ryan", seed=seed, max_new_tokens=max_new_tokens,
                               text_stream=stream)
    audio = bytearray()
    heard = asyncio.Event()
    before_finish = []

    async def write():
        for i, piece in enumerate(pieces[1:]):
            if i == len(pieces) // 2:
                await asyncio.wait_for(heard.wait(), 60)  # audio before the text is complete
            await asyncio.sleep(rng.choice([0, 0.005, 0.03]))
            stream.push(piece)
        before_finish.append(len(audio))
        stream.finish()

    async def read():
        async for chunk in backend.synthesize(request):
            audio.extend(chunk.pcm)
            if audio:
                heard.set()

    await asyncio.gather(write(), read())
    return np.frombuffer(bytes(audio), "<i2"), before_finish[0]


LONG = ("A cloned voice reads this long sentence so that its text runs past the reference clip's frames, "
        "which the in-context prompt fills with the transcript first and then with the new words, one per frame, "
        "while the rest is still being written by a slow language model somewhere far away.")


@pytest.mark.parametrize("mode", ["icl", "x_vector", "icl_short"])
async def test_cloned_voices_take_text_in_pieces_too(tiny_base, mode):  # noqa: F811 - fixture
    """An in-context clone's prefill holds the reference transcript and as much of the text as its reference
    frames take: the request waits (holding no slot) until that much has come, or the text ends; what follows
    is pushed. Either way it says exactly what the whole text says."""
    from tests.test_qwen3_clone_parity import REF_TEXT, _clip
    from tts_backend.base import ReferenceAudio

    backend = await started(tiny_base, trim_leading_silence=False, dtype="float32")
    try:
        clip = ReferenceAudio(_clip(3.21, 1).astype("<f4").tobytes(), REF_TEXT)
        prompt = await backend.clone_voice(clip, x_vector_only=mode == "x_vector")
        text = LONG if mode != "icl_short" else "Short, and done before the prefill is full."
        frames = record_codes(backend)
        runner = backend.engine.runner
        push_texts = runner.push_texts
        pushed_after_prefill = []

        def recording(pushes):
            pushed_after_prefill.extend(request.slot is not None and request.phase.name not in (
                "WAITING", "NEED_PREFILL") for request, _ in pushes)
            return push_texts(pushes)

        runner.push_texts = recording
        rng = random.Random(len(mode))
        pieces = random_pieces(text, rng)
        stream = TextStream(pieces[0])
        request = SynthesisRequest(text=pieces[0], voice="cloned", seed=8, max_new_tokens=24, voice_prompt=prompt,
                                   text_stream=stream)

        async def write():
            for piece in pieces[1:]:
                await asyncio.sleep(rng.choice([0, 0.01, 0.05]))
                stream.push(piece)
            stream.finish()

        got, _ = await asyncio.gather(audio_of(backend, request), write())
        streamed = frames.pop(8)
        want = await audio_of(backend, SynthesisRequest(text=text, voice="cloned", seed=8, max_new_tokens=24,
                                                        voice_prompt=prompt, streaming_text=True))
        assert streamed == frames.pop(8) and len(streamed) > 3
        assert len(got) == len(want) and int(np.abs(got.astype(np.int32) - want).max()) <= 1
        if mode == "icl_short":  # all of it fits the prefill: it waited for the end and went in whole
            assert not pushed_after_prefill
        else:  # text came after the prefill had run: it was decoding while the text was written
            assert any(pushed_after_prefill)
    finally:
        await backend.stop()


def test_text_in_pieces_on_the_triton_kernels(tmp_path):
    """The GPU fast path's code (fused layers, the Triton decode kernels in Triton's interpreter, the
    stateless sampler) takes pushed text into the same trailing buffer its decode steps read: pieces, beside
    another request, give the whole text's codes exactly."""
    pytest.importorskip("triton")
    from tests.test_engine_kernels import run_interpreted

    result = run_interpreted(f"""
        import asyncio, json, random
        import torch
        from tests.test_engine_text_stream import pushed_in_pieces, record_codes
        from tts_backend.base import SynthesisRequest
        from tts_backend.qwen3.testing.checkpoint import write_checkpoint
        from tts_backend.registry import create_backend
        torch.set_num_threads(1)
        path = write_checkpoint({str(tmp_path)!r} + "/small", "small", seed=3)

        async def main():
            backend = create_backend("qwen3", model=str(path), device="cpu", dtype="float32", max_active=4,
                                     max_len=256, sampler="stateless", trim_leading_silence=False,
                                     runner_options={{"fused": True, "kernels": "triton"}})
            await backend.start()
            try:
                frames = record_codes(backend)
                # Few frames: Triton's interpreter is slow; the piece boundaries fall in the first words.
                text = "Hello world, this is it."
                other = SynthesisRequest(text="One more.", voice="aiden", seed=50, max_new_tokens=8)
                async def speak(request):
                    return b"".join([c.pcm async for c in backend.synthesize(request)])
                await asyncio.gather(pushed_in_pieces(backend, text, 40, random.Random(1), 8),
                                     speak(other))
                streamed = frames.pop(40)
                frames.clear()
                whole = SynthesisRequest(text=text, voice="ryan", seed=40, max_new_tokens=8,
                                         streaming_text=True)
                await asyncio.gather(speak(whole), speak(other))
                print(json.dumps({{"triton": backend.engine.runner.triton, "equal": streamed == frames[40],
                                   "frames": len(streamed), "waits": backend.engine.stats.text_waits}}))
            finally:
                await backend.stop()
        asyncio.run(main())
    """, timeout=900)
    assert result["triton"] is True
    assert result["equal"] and result["frames"] >= 5, result
    assert result["waits"] > 0


async def test_token_sessions_through_the_gateway_on_the_qwen3_engine(tiny_custom_voice):
    """The whole chain on the real engine: a WebSocket client streams words with split_granularity "token";
    every sentence starts at its first words and says what the same sentence says sent whole in
    streaming-text mode (sentence splitting with non_streaming_mode false)."""
    import json

    import websockets

    from tests.gateway_server import audio_by_sentence, receive_until, running_gateway
    from tts_backend.qwen3_backend import Qwen3Synthesizer

    backend = Qwen3Synthesizer(model=str(tiny_custom_voice), device="cpu", dtype="float32", max_active=4,
                               max_len=256, trim_leading_silence=False, frame_cap_chars_per_second=40)
    text = "Hello world, this is the engine. It speaks while the words come in. Done"
    words = [w + " " for w in text.split(" ")[:-1]] + [text.split(" ")[-1]]

    # The words that end the two long sentences: in token mode each is held back until the engine has that
    # sentence, so that it is opened before its text is complete however slowly this machine runs the gateway.
    sentence_ends = [i for i, w in enumerate(words) if w.rstrip().endswith(".")]
    submits = threading.Semaphore(0)

    async def speak(url, wait_for_submits=False, **config):
        async with websockets.connect(url, max_size=None) as ws:
            await ws.send(json.dumps({"type": "session.config", "stream_audio": True, "voice": "ryan", "seed": 4,
                                      "response_format": "pcm", **config}))
            started = json.loads(await ws.recv())
            for i, word in enumerate(words):
                if wait_for_submits and i in sentence_ends:
                    assert await asyncio.to_thread(submits.acquire, timeout=60), "the sentence was not opened"
                await ws.send(json.dumps({"type": "input.text", "text": word}))
                await asyncio.sleep(0.02)
            await ws.send(json.dumps({"type": "input.done"}))
            return started, await receive_until(ws, "session.done")

    with running_gateway(backend) as server:
        engine_push, engine_submit = backend.engine.push_text, backend.engine.submit
        pushes = []
        backend.engine.push_text = lambda *args, **kw: (pushes.append(args[0]), engine_push(*args, **kw))[1]

        def submit(*args, **kw):
            stream = engine_submit(*args, **kw)
            submits.release()
            return stream

        backend.engine.submit = submit
        token_started, token = await speak(server.ws_url, wait_for_submits=True, split_granularity="token")
        # The two long sentences were opened before their text was complete ("Done" comes with input.done).
        assert len(set(pushes)) >= 2
        sentence_started, sentence = await speak(server.ws_url, split_granularity="sentence", non_streaming_mode=False)
    assert "warnings" not in token_started and "warnings" not in sentence_started, (token_started, sentence_started)
    got, want = audio_by_sentence(token), audio_by_sentence(sentence)
    assert sorted(got) == sorted(want) == [0, 1, 2]
    for index in want:
        a, b = np.frombuffer(got[index], "<i2"), np.frombuffer(want[index], "<i2")
        assert len(a) == len(b) > 0 and int(np.abs(a.astype(np.int32) - b).max()) <= 1, index
    assert backend.engine.stats.completed >= 7  # the warm-up and both sessions' sentences
