"""Resume from codes (issue 33) in the GPU engine, on the CPU: the chunks' codes are the frames generated, in
order, never ahead of their audio (the leading-silence trimmer holds audio; the codes wait with it), and a
request resumed from the codes of the chunks delivered so far yields exactly the uninterrupted run's audio
after them, byte for byte: at every cut, in both text modes, alone and beside other requests.

The engine loop is checked with the scripted runner (codes are frame indices there); the Qwen3 runner with
the tiny random checkpoint. Why byte for byte holds on the CPU: the stateless sampler draws step i's noise
from (seed, i) alone, the runner's stepwise teacher forcing takes the uninterrupted request's own decode
steps (Qwen3RunnerConfig.resume_prefill), and the codec is primed and goes on in the calls that request made.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from tests.engine_fixtures import Script, ScriptedRunnerTestDouble
from tests.qwen3_fixtures import single_torch_thread, tiny_base, tiny_custom_voice  # noqa: F401 - fixtures
from tests.test_aligner_backend import tiny_aligner  # noqa: F401 - fixture
from tests.test_qwen3_clone_parity import REF_TEXT, _clip
from tts_backend.base import ReferenceAudio, SynthesisError, SynthesisRequest, TextStream
from tts_backend.engine.engine import Engine, EngineConfig
from tts_backend.engine.request import RequestState, quick_start_schedule, schedule_pieces
from tts_backend.engine.scheduler import SchedulerConfig
from tts_backend.registry import create_backend

SPF = 1920
TEXT = "Hello world, this is a small test of the engine."
OTHERS = ["Another sentence beside it.", "A third one, longer than the others are, to keep the batch full."]


# ---- the engine loop (scripted runner) ---------------------------------------------------------------------
async def scripted_chunks(frames: int, silent: int, schedule=(2, 4, 8, 12)) -> list[tuple[bytes, bytes]]:
    runner = ScriptedRunnerTestDouble(max_slots=2)
    engine = Engine(runner, EngineConfig(scheduler=SchedulerConfig(max_active=2), chunk_schedule=schedule))
    engine.start_inline()
    stream = engine.submit(Script(frames, silent), seed=1, max_frames=1000)
    while engine.step() is not None:
        pass
    return [chunk async for chunk in stream.chunks()]


@pytest.mark.parametrize("frames, silent", [(10, 0), (10, 3), (20, 7), (6, 6)])
async def test_codes_ride_with_audio_and_never_ahead_of_it(frames, silent):
    chunks = await scripted_chunks(frames, silent)
    codes = b"".join(c for _, c in chunks)
    assert np.frombuffer(codes, "<u2").tolist() == list(range(frames))  # every frame once, in order
    total = sum(len(p) // 2 for p, _ in chunks)
    trimmed = frames * SPF - total  # leading silence the trimmer dropped
    assert trimmed >= 0 and (silent == 0) == (trimmed == 0)
    shipped = framed = 0
    for i, (pcm, frame_codes) in enumerate(chunks):
        assert pcm or i == len(chunks) - 1  # codes alone only at the end
        shipped += len(pcm) // 2
        framed += len(frame_codes) // 2
        # The audio of every frame named so far has shipped (less what was trimmed, all before the onset).
        assert framed * SPF - trimmed <= shipped or (not pcm and framed == frames)


async def test_an_all_silent_stream_ships_its_held_tail_with_every_code():
    chunks = await scripted_chunks(6, 6)
    assert np.frombuffer(b"".join(c for _, c in chunks), "<u2").tolist() == list(range(6))
    assert chunks[-1][0]  # the flushed quiet tail carries the codes held with it


async def scripted_run(frames: int, resume_frames: int = 0, schedule=(2, 4, 8, 12), continues: bool = True,
                       quick_start_below: int = 0):
    runner = ScriptedRunnerTestDouble(max_slots=2)
    runner.resume_continues_schedule = continues
    engine = Engine(runner, EngineConfig(scheduler=SchedulerConfig(max_active=2), chunk_schedule=schedule,
                                         quick_start_below=quick_start_below))
    engine.start_inline()
    stream = engine.submit(Script(frames), seed=1, max_frames=1000, resume=resume_frames or None,
                           resume_frames=resume_frames)
    while engine.step() is not None:
        pass
    chunks = [chunk async for chunk in stream.chunks()]
    return chunks, [c[2] for c in runner.calls if c[0] == "codec"], runner


@pytest.mark.parametrize("quick", [0, 16], ids=["plain-start", "quick-start"])
@pytest.mark.parametrize("continues", [True, False], ids=["schedule-goes-on", "schedule-restarts"])
@pytest.mark.parametrize("k", [1, 2, 5, 6, 14, 30])
async def test_the_engine_resumes_where_the_uninterrupted_stream_was(k, continues, quick):
    # The scripted runner's audio and codes follow frames_decoded: a resumed request that starts its counters
    # where the uninterrupted one had them yields exactly its audio and codes after frame k. Its codec calls go
    # on with the chunk schedule where that run's were, or (a GPU runner) start again at the smallest chunk.
    whole, calls, _ = await scripted_run(40, quick_start_below=quick)
    rest, rest_calls, runner = await scripted_run(40, k, continues=continues, quick_start_below=quick)
    schedule = quick_start_schedule((2, 4, 8, 12)) if quick else (2, 4, 8, 12)
    pcm, codes = joined(whole, 0), joined(whole, 1)
    assert joined(rest, 0) == pcm[k * SPF * 2:]
    assert np.frombuffer(joined(rest, 1), "<u2").tolist() == list(range(k, 40))
    assert calls == schedule_pieces(schedule, 40)
    if not continues:
        assert rest_calls == schedule_pieces(schedule, 40 - k)
    elif schedule_pieces(schedule, k) == calls[: len(schedule_pieces(schedule, k))]:  # k ends a call
        assert rest_calls == calls[len(schedule_pieces(schedule, k)):]
    assert runner.talker_steps[1] == 40 - k  # steps k+1..40 (the last samples EOS); step k ran in the prefill
    assert len(codes) == 2 * 40


async def test_a_request_resumed_at_its_end_ends_with_nothing():
    chunks, calls, runner = await scripted_run(12, 12)
    assert chunks == [] and calls == [] and runner.released == [1]


def test_schedule_pieces_are_the_calls_a_schedule_makes():
    assert schedule_pieces((2, 4, 8, 12), 0) == []
    assert schedule_pieces((2, 4, 8, 12), 5) == [2, 3]
    assert schedule_pieces((2, 4, 8, 12), 50) == [2, 4, 8, 12, 12, 12]
    assert schedule_pieces((4,), 9) == [4, 4, 1]


# ---- the Qwen3 engine ------------------------------------------------------------------------------------
async def started(path, **options):
    options.setdefault("sampler", "stateless")
    backend = create_backend("qwen3", model=str(path), device="cpu", max_active=4, max_len=256, **options)
    await backend.start()
    return backend


async def chunks_of(backend, request) -> list[tuple[bytes, bytes]]:
    return [(c.pcm, c.codes) async for c in backend.synthesize(request)]


def joined(chunks, part: int) -> bytes:
    return b"".join(c[part] for c in chunks)


def pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.int32)


def request(**fields) -> SynthesisRequest:
    return SynthesisRequest(**{"text": TEXT, "voice": "ryan", "seed": 3, "max_new_tokens": 40, **fields})


async def test_greedy_chunks_carry_the_models_own_frames(tiny_custom_voice):
    # Greedy decoding draws nothing, so the reference sampler resumes too: the codes are the model's own
    # generate loop's, frame for frame.
    backend = await started(tiny_custom_voice, sampler="reference", greedy=True)
    try:
        assert "resume_codes" in backend.honours
        codebooks = backend.codebooks
        assert codebooks == backend.model.num_code_groups and backend.frame_rate == 12.5
        chunks = await chunks_of(backend, request())
        codes = np.frombuffer(joined(chunks, 1), "<u2").reshape(-1, codebooks)
        want = backend.model.synthesize_codes(TEXT, speaker="ryan", seed=3, max_new_tokens=40, do_sample=False,
                                              subtalker_do_sample=False)
        assert codes.tolist() == want.tolist()
        assert all(len(c) % (2 * codebooks) == 0 for _, c in chunks)
    finally:
        await backend.stop()


async def test_sampled_chunks_codes_decode_to_their_audio(tiny_custom_voice):
    backend = await started(tiny_custom_voice, trim_leading_silence=False)
    try:
        chunks = await chunks_of(backend, request())
        for pcm, codes in chunks:  # each chunk: the audio of exactly its frames
            assert len(pcm) // 2 == len(codes) // (2 * backend.codebooks) * SPF
        codes = np.frombuffer(joined(chunks, 1), "<u2").reshape(-1, backend.codebooks).astype(np.int64)
        wav = backend.model.codec.decode(torch.from_numpy(codes).T[None].contiguous())[0].float().numpy()
        want = (np.clip(wav, -1, 1) * 32767).round().astype(np.int32)
        got = np.frombuffer(joined(chunks, 0), "<i2").astype(np.int32)
        assert len(got) == len(want) and np.abs(got - want).max() <= 1  # chunked vs whole decode: fp32 rounding
    finally:
        await backend.stop()


@pytest.mark.parametrize("streaming_text", [False, True])
@pytest.mark.parametrize("trim", [False, True])
async def test_every_cut_resumes_byte_exact_alone(tiny_custom_voice, streaming_text, trim):
    backend = await started(tiny_custom_voice, trim_leading_silence=trim)
    try:
        whole = await chunks_of(backend, request(streaming_text=streaming_text))
        assert len(whole) >= 4
        for cut in range(len(whole) + 1):  # 0 (nothing delivered), 1 (the first, small chunk) ... all
            codes = joined(whole[:cut], 1)
            rest = await chunks_of(backend, request(streaming_text=streaming_text, resume_codes=codes))
            assert joined(rest, 0) == joined(whole[cut:], 0), cut
            assert joined(rest, 1) == joined(whole[cut:], 1), cut  # only the new frames' codes
    finally:
        await backend.stop()


class CodecCalls:
    """Each codec call a request's stream was in, by seed: (frames, streams in the call) (the runner's
    codec_launch, spied)."""

    def __init__(self, runner) -> None:
        self.calls: dict[int, list[tuple[int, int]]] = {}
        launch = runner.codec_launch

        def recording(requests, frames):
            for r in requests:
                self.calls.setdefault(r.seed, []).append((frames, len(requests)))
            return launch(requests, frames)

        runner.codec_launch = recording


async def test_a_resumed_request_beside_others_makes_the_same_frames_and_audio(tiny_custom_voice):
    """Beside other requests the resumed request's frames are the uninterrupted run's, exactly. Its audio is too,
    byte for byte, wherever its codec calls are the uninterrupted run's. The company may change them: the
    scheduler decodes a stream's pending frames in bulk, and other streams share its calls; a codec call's
    frames and rows move its output in the last bits on the CPU, so then the samples are within one step of
    rounding."""
    backend = await started(tiny_custom_voice, trim_leading_silence=False)
    spy = CodecCalls(backend.engine.runner)
    try:
        others = [request(text=text, seed=10 + i) for i, text in enumerate(OTHERS)]
        alone = [await chunks_of(backend, r) for r in others]
        exact = 0
        for streaming_text in (False, True):
            spy.calls.clear()
            whole = await chunks_of(backend, request(streaming_text=streaming_text))
            calls = spy.calls.pop(3)
            for cut in (1, 2, len(whole) - 1):
                resumed = request(streaming_text=streaming_text, resume_codes=joined(whole[:cut], 1))
                spy.calls.clear()
                results = await asyncio.gather(chunks_of(backend, resumed), *(chunks_of(backend, r) for r in others))
                assert joined(results[0], 1) == joined(whole[cut:], 1), (streaming_text, cut)
                frames = len(joined(whole[:cut], 1)) // (2 * backend.codebooks)
                if [f for f, _ in calls[:cut]] == schedule_pieces((2, 4, 8, 12), frames) and \
                        spy.calls[3] == calls[cut:]:
                    assert joined(results[0], 0) == joined(whole[cut:], 0), (streaming_text, cut)
                    exact += 1
                else:
                    assert np.abs(pcm16(joined(results[0], 0)) - pcm16(joined(whole[cut:], 0))).max() <= 1
                # The others make the same frames as alone, and their audio is as close.
                assert [joined(r, 1) for r in results[1:]] == [joined(a, 1) for a in alone]
                for got, want in zip(results[1:], alone):
                    assert np.abs(pcm16(joined(got, 0)) - pcm16(joined(want, 0))).max() <= 1
        print(f"{exact} of 6 resumed beside others in the uninterrupted run's codec calls, byte for byte")
        stats = backend.engine.stats
        assert stats.items["PREFILL"] > stats.batches["PREFILL"]  # resumed prefills shared batches with others
    finally:
        await backend.stop()


async def test_cloned_voices_resume_byte_exact(tiny_base):
    # An in-context voice's codec state starts primed with its reference clip; the delivered frames continue
    # that priming. An x-vector voice has none.
    backend = await started(tiny_base, trim_leading_silence=False)
    try:
        icl = await backend.clone_voice(ReferenceAudio(_clip(3.21, 1).astype("<f4").tobytes(), REF_TEXT))
        xvec = await backend.clone_voice(ReferenceAudio(_clip(2.0, 4).astype("<f4").tobytes()), x_vector_only=True)
        for prompt in (icl, xvec):
            for streaming_text in (False, True):
                ask = dict(voice="cloned", voice_prompt=prompt, streaming_text=streaming_text)
                whole = await chunks_of(backend, request(**ask))
                for cut in (1, 3, len(whole) - 1):
                    rest = await chunks_of(backend, request(**ask, resume_codes=joined(whole[:cut], 1)))
                    assert joined(rest, 0) == joined(whole[cut:], 0), (prompt is icl, streaming_text, cut)
    finally:
        await backend.stop()


async def test_the_gpus_path_resumes_with_the_same_frames(tiny_custom_voice):
    # The fused layers (eager here), the batched teacher-forcing pass and a chunk schedule that starts again, as
    # on a GPU: the same frames after every cut; the samples within one step of rounding (the pass's logits are
    # not bitwise the steps', and the codec's calls are not the uninterrupted run's).
    backend = await started(tiny_custom_voice, trim_leading_silence=False,
                            runner_options={"fused": True, "kernels": "inductor", "resume_prefill": "batched"})
    runner = backend.engine.runner
    runner.resume_continues_schedule = False  # as on CUDA: the codec primed in 64-frame calls, the schedule anew
    try:
        assert runner.fused and runner.resume_batched
        for streaming_text in (False, True):
            whole = await chunks_of(backend, request(streaming_text=streaming_text))
            for cut in range(1, len(whole)):
                rest = await chunks_of(backend, request(streaming_text=streaming_text,
                                                        resume_codes=joined(whole[:cut], 1)))
                assert joined(rest, 1) == joined(whole[cut:], 1), (streaming_text, cut)
                assert np.abs(pcm16(joined(rest, 0)) - pcm16(joined(whole[cut:], 0))).max() <= 1
    finally:
        await backend.stop()


def bounded_priming_audio(runner, codes: np.ndarray, first: int, k: int, calls: list[int]) -> bytes:
    """What a resume with its codec primed from frame `first` on (resume_codec_context) should sound like after
    frame k: a fresh codec state (no reference priming), frames first..k-1 through it in one call with the
    audio dropped, then the later frames in the resumed stream's own codec calls (`calls`, frames each)."""
    codec = runner.codec_module
    frames = torch.from_numpy(codes.astype(np.int64)).T[None]  # [1, G, F]
    state = codec.init_state(1)
    codec.decode_chunk(frames[..., first:k].contiguous(), state)
    pieces, at = [], k
    for n in calls:
        pieces.append(codec.decode_chunk(frames[..., at: at + n].contiguous(), state)[0])
        at += n
    wav = torch.cat(pieces).float().numpy()
    return (np.clip(wav, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


@pytest.mark.parametrize("voice", ["named", "in-context clone"])
async def test_a_resume_deep_into_a_sentence_primes_the_codec_with_its_last_frames_only(tiny_custom_voice, tiny_base,
                                                                                        voice):
    # resume_codec_context 4: a cut after k > 4 frames rebuilds the codec's left context from the last 4 alone,
    # from a fresh state (an in-context voice's reference priming skipped), and the audio after the cut is what
    # that state decodes; the frames are the uninterrupted run's whatever the priming. A cut within 4 frames
    # primes them all, after the reference: the uninterrupted run's audio, byte for byte.
    path = tiny_custom_voice if voice == "named" else tiny_base
    backend = await started(path, trim_leading_silence=False, runner_options={"resume_codec_context": 4})
    runner = backend.engine.runner
    spy = CodecCalls(runner)
    try:
        ask = {}
        if voice != "named":
            prompt = await backend.clone_voice(ReferenceAudio(_clip(3.21, 1).astype("<f4").tobytes(), REF_TEXT))
            ask = dict(voice="cloned", voice_prompt=prompt)
        whole = await chunks_of(backend, request(**ask))
        codes = np.frombuffer(joined(whole, 1), "<u2").reshape(-1, backend.codebooks)
        bounded = 0
        for cut in range(1, len(whole)):
            k = len(joined(whole[:cut], 1)) // (2 * backend.codebooks)
            spy.calls.clear()
            rest = await chunks_of(backend, request(**ask, resume_codes=joined(whole[:cut], 1)))
            assert joined(rest, 1) == joined(whole[cut:], 1), cut
            if k <= 4:
                assert joined(rest, 0) == joined(whole[cut:], 0), cut
                continue
            bounded += 1
            want = bounded_priming_audio(runner, codes, k - 4, k, [f for f, _ in spy.calls[3]])
            assert np.abs(pcm16(joined(rest, 0)) - pcm16(want)).max() <= 1, cut
            # The test tells the priming apart: the whole context's audio is another.
            assert np.abs(pcm16(want) - pcm16(joined(whole[cut:], 0))).max() > 1, cut
        assert bounded >= 2
    finally:
        await backend.stop()


async def test_resume_codec_context_takes_a_number_of_frames_null_or_auto(tiny_custom_voice):
    for bad in (0, -3, 2.5, True, "all"):
        with pytest.raises(ValueError, match="resume_codec_context"):
            await started(tiny_custom_voice, runner_options={"resume_codec_context": bad})


async def test_resumes_beyond_the_resume_graphs_rows_go_in_groups_with_the_same_frames(tiny_custom_voice):
    # The batched pass on the resume graphs' padded inputs (eager here, the inputs a GPU replays): rows padded
    # on the scratch slot, positions right-padded, and more resumes than the graphs' rows in passes of that
    # many, each with its own EOS flags. Every resumed request makes the uninterrupted run's frames. The three
    # resumes reach the engine while its thread is held in another request's prefill, so that they are waiting
    # together when it next schedules, as a failover's are: one pass of three, in groups of two and one.
    import threading

    from tests.worker_fixtures import wait_for_async

    backend = await started(tiny_custom_voice, trim_leading_silence=False,
                            runner_options={"fused": True, "kernels": "inductor", "resume_prefill": "batched",
                                            "resume_graph_shapes": [[2, 128]]})
    runner = backend.engine.runner
    runner.resume_continues_schedule = False
    passes, groups = [], []
    resume_pass, run, prefill = runner._resume_pass, runner.graphs.run, runner.prefill
    held, go = threading.Event(), threading.Event()

    def recording_pass(requests, embeds, starts):
        passes.append(len(requests))
        return resume_pass(requests, embeds, starts)

    def recording_run(key, fn, inputs):
        if isinstance(key, tuple) and key[0] == "resume":
            groups.append(key)
        return run(key, fn, inputs)

    def holding_prefill(requests):
        if not held.is_set():
            held.set()
            go.wait(60)
        return prefill(requests)

    runner._resume_pass, runner.graphs.run = recording_pass, recording_run
    try:
        assert runner.resume_shapes == {2: (128,)}
        texts = [TEXT, *OTHERS]
        wholes = [await chunks_of(backend, request(text=t, seed=20 + i)) for i, t in enumerate(texts)]
        runner.prefill = holding_prefill
        for cut in (1, 2):
            passes.clear()
            groups.clear()
            held.clear()
            go.clear()
            blocker = asyncio.create_task(chunks_of(backend, request(text="Hold on.", seed=99)))
            assert await asyncio.to_thread(held.wait, 60)
            resumed = [asyncio.create_task(chunks_of(backend, request(
                text=t, seed=20 + i, resume_codes=joined(w[:cut], 1)))) for i, (t, w) in enumerate(zip(texts, wholes))]
            await wait_for_async(lambda: backend.engine.stats_snapshot()["streams"] == 1 + len(texts), 30,
                                 "the resumes in the engine")
            go.set()
            await blocker
            for got, whole in zip([await t for t in resumed], wholes):
                assert joined(got, 1) == joined(whole[cut:], 1), cut
                assert np.abs(pcm16(joined(got, 0)) - pcm16(joined(whole[cut:], 0))).max() <= 1
            assert passes == [3] and groups == [("resume", 2, 128)] * 2, (passes, groups)
    finally:
        go.set()
        await backend.stop()


async def test_a_cut_inside_a_chunk_goes_on_with_the_same_frames(tiny_custom_voice):
    # A caller may hold codes that end inside one of the uninterrupted run's codec calls (a pool that had part
    # of a chunk keeps whole frames only). The frames after the cut are the same; the codec then decodes them
    # in other calls than the uninterrupted run did, which moves samples by at most one step of rounding.
    backend = await started(tiny_custom_voice, trim_leading_silence=False)
    try:
        whole = await chunks_of(backend, request())
        frame = 2 * backend.codebooks
        codes, pcm = joined(whole, 1), joined(whole, 0)
        for k in (1, 3, 5, 9):
            rest = await chunks_of(backend, request(resume_codes=codes[: k * frame]))
            assert joined(rest, 1) == codes[k * frame:], k
            got = np.frombuffer(joined(rest, 0), "<i2").astype(np.int32)
            want = np.frombuffer(pcm[k * SPF * 2:], "<i2").astype(np.int32)
            assert len(got) == len(want) and np.abs(got - want).max() <= 1, k
    finally:
        await backend.stop()


async def test_a_text_stream_resumes_with_the_same_frames(tiny_custom_voice):
    backend = await started(tiny_custom_voice, trim_leading_silence=False)
    words = TEXT.split(" ")

    async def spoken(resume_codes: bytes = b"") -> list:
        stream = TextStream(words[0])

        async def push() -> None:
            for word in words[1:]:
                await asyncio.sleep(0.002)
                stream.push(" " + word)
            stream.finish()

        pusher = asyncio.ensure_future(push())
        try:
            return await chunks_of(backend, request(text=stream.text, text_stream=stream, resume_codes=resume_codes))
        finally:
            await pusher

    try:
        whole = await spoken()
        assert joined(whole, 1) == joined(await chunks_of(backend, request(streaming_text=True)), 1)
        for cut in (1, 2, len(whole) // 2):
            rest = await spoken(joined(whole[:cut], 1))
            # The same frames. The codec calls of a text stream follow when its text comes (a stream that waits
            # for text has its frames so far decoded), so its audio may differ by one step of rounding.
            assert joined(rest, 1) == joined(whole[cut:], 1), cut
            assert np.abs(pcm16(joined(rest, 0)) - pcm16(joined(whole[cut:], 0))).max() <= 1, cut
    finally:
        await backend.stop()


async def test_resume_codes_that_cannot_continue_the_request_are_refused(tiny_custom_voice):
    backend = await started(tiny_custom_voice, trim_leading_silence=False)
    try:
        frame = 2 * backend.codebooks
        whole = await chunks_of(backend, request(max_new_tokens=10))
        codes = joined(whole, 1)
        bad = {
            "not whole frames": codes[: frame + 1],
            "a code past the codebook": b"\xff\xff" * backend.codebooks,
            "more frames than the request makes": codes + codes[:frame],
            "more than the text can produce": b"\0" * (backend.max_code_bytes(len(TEXT)) + frame),
        }
        for what, resume in bad.items():
            with pytest.raises(SynthesisError, match="resume codes"):
                await chunks_of(backend, request(max_new_tokens=10, resume_codes=resume))
        # All its frames delivered: nothing follows them.
        assert await chunks_of(backend, request(max_new_tokens=10, resume_codes=codes)) == []
    finally:
        await backend.stop()


async def test_the_reference_sampler_tells_no_codes_and_refuses_to_resume(tiny_custom_voice):
    backend = await started(tiny_custom_voice, sampler="reference")
    try:
        assert "resume_codes" not in backend.honours and backend.codebooks == 0
        chunks = await chunks_of(backend, request())
        assert chunks and all(codes == b"" for _, codes in chunks)
        with pytest.raises(SynthesisError, match="cannot continue"):
            await chunks_of(backend, request(resume_codes=b"\0" * 8))
    finally:
        await backend.stop()


# ---- batched teacher forcing against stepwise ------------------------------------------------------------
@pytest.mark.parametrize("streaming_text", [False, True])
def test_batched_teacher_forcing_matches_the_stepwise_pass(tiny_custom_voice, streaming_text):
    """The GPU's one-pass teacher forcing computes what the CPU's stepwise pass computes, up to floating-point
    order: the next frame's logits within a tolerance, its sampled code and every counter equal."""
    from tts_backend.engine.runner import Qwen3ModelRunner, Qwen3RunnerConfig
    from tts_backend.qwen3.generate import Qwen3TTS

    model = Qwen3TTS.from_pretrained(str(tiny_custom_voice), device="cpu", dtype=torch.float32)
    prompt = model.make_prompt(TEXT, speaker="ryan", language="auto", instruct=None,
                               non_streaming_mode=not streaming_text)
    codes = model.synthesize_codes(TEXT, speaker="ryan", seed=5, max_new_tokens=30, do_sample=False,
                                   subtalker_do_sample=False, non_streaming_mode=not streaming_text)
    k = 9
    states = {}
    # "fused": the GPU's layers (engine/fused.py, eager on the CPU), whose one-row pass is padded to two.
    for mode, fused in (("stepwise", False), ("batched", False), ("fused", True)):
        runner = Qwen3ModelRunner(model, Qwen3RunnerConfig(max_slots=2, max_len=128, sampler="stateless",
                                                           fused=fused, kernels="inductor",
                                                           resume_prefill="stepwise" if mode == "stepwise"
                                                           else "batched"))
        runner.prepare()
        r = RequestState(request_id=1, prompt=prompt, seed=5, max_frames=40, chunk_schedule=(2, 4, 8, 12),
                         arrival=0.0, sample_rate=24000, samples_per_frame=SPF, slot=1,
                         resume=codes[:k].to(torch.int64))
        eos = runner.prefill([r])
        with torch.inference_mode():
            logits = model.talker.logits(runner.hidden[1:2]).float()
        states[mode] = (eos, logits, int(runner.c0[1]), [int(b[1]) for b in (
            runner.generated, runner.draws, runner.pos, runner.trail_pos, runner.written, runner.decoded)],
            runner.presence[1].clone(), runner.pos_host[1])
    eos_s, logits_s, c0_s, counters_s, presence_s, pos_s = states["stepwise"]
    assert counters_s[:4] == [k + 1, (k + 1) * 1 + k * (model.num_code_groups - 1), len(prompt) + k, k]
    for mode in ("batched", "fused"):
        eos_b, logits_b, c0_b, counters_b, presence_b, pos_b = states[mode]
        assert eos_s == eos_b == [False]
        assert torch.allclose(logits_s, logits_b, atol=1e-4, rtol=1e-4), mode
        assert c0_s == c0_b, mode
        assert counters_s == counters_b and pos_s == pos_b == len(prompt) + k, mode
        assert torch.equal(presence_s, presence_b), mode


# ---- word timings -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("trim", [False, True])
async def test_a_resumed_sentences_words_keep_its_time_base(tiny_custom_voice, tiny_aligner, trim):
    # The aligner hears the whole sentence: the delivered frames' audio (decoded again from their codes, trimmed
    # as the engine trims) before the resumed audio, so the words are the uninterrupted run's, in its samples.
    backend = create_backend("qwen3", model=str(tiny_custom_voice), device="cpu", dtype="float32",
                             aligner=str(tiny_aligner), aligner_process=False, max_active=4, max_len=256,
                             greedy=True, frame_cap_chars_per_second=15, trim_leading_silence=trim)
    await backend.start()
    try:
        ask = dict(text=TEXT, voice="ryan", seed=3, word_timestamps=True)
        whole = [c async for c in backend.synthesize(SynthesisRequest(**ask))]
        words = [w for c in whole for w in c.words]
        audio = [c for c in whole if c.pcm]
        assert words and len(audio) >= 3
        for cut in (1, len(audio) - 1):
            codes = b"".join(c.codes for c in audio[:cut])
            rest = [c async for c in backend.synthesize(SynthesisRequest(**ask, resume_codes=codes))]
            assert b"".join(c.pcm for c in rest) == b"".join(c.pcm for c in audio[cut:])
            assert [w for c in rest for w in c.words] == words, cut
    finally:
        await backend.stop()


def test_the_priming_of_a_failovers_resumes_takes_few_calls_and_gives_each_slot_its_frames_in_order():
    # _prime_codec_captured (CUDA only) primes every resumed request's codec state in these calls: each slot's
    # frames exactly once and in order (so its state is what its own priming would leave), slots with as many
    # frames left decoded together, no call wider than the largest captured codec batch.
    import random

    from tts_backend.engine.runner import priming_calls

    failover = [(3, 27), (5, 27), (7, 15), (9, 7), (11, 7), (13, 2), (15, 2), (17, 2)]  # the H100 kill run's 8
    calls = priming_calls(failover, most=12, widest=16)
    assert calls == [(0, 12, [3, 5, 7]), (0, 7, [9, 11]), (0, 2, [13, 15, 17]),
                     (12, 12, [3, 5]), (12, 3, [7]), (24, 3, [3, 5])]  # 6 calls, against 13 one request at a time
    rng = random.Random(0)
    for _ in range(200):
        frames = [(slot, rng.randint(1, 80)) for slot in rng.sample(range(64), rng.randint(1, 40))]
        most, widest = rng.choice([4, 8, 12]), rng.choice([1, 2, 4, 16])
        calls = priming_calls(frames, most, widest)
        covered = {slot: 0 for slot, _ in frames}
        for start, n, slots in calls:
            assert 1 <= n <= most and 1 <= len(slots) <= widest
            for slot in slots:
                assert covered[slot] == start  # in order, nothing skipped or decoded twice
                covered[slot] += n
        assert covered == dict(frames)
    assert priming_calls([], 12, 16) == []


def test_the_primings_ring_writes_put_each_call_s_frames_where_one_write_per_slot_did():
    # _prime_codec_captured (CUDA only) writes each call's frames into the slots' frame rings with one indexed
    # write; the same rings, call after call, as the write per slot and call it replaced, ring wrap included.
    import random

    from tts_backend.engine.runner import priming_calls, priming_ring_writes

    rng = random.Random(1)
    for _ in range(50):
        ring, groups = rng.choice([16, 48, 64]), 16
        frames = [(slot, rng.randint(1, 90)) for slot in rng.sample(range(12), rng.randint(1, 8))]
        codes = {slot: torch.randint(0, 2048, (k, groups)) for slot, k in frames}
        offsets, at = {}, 0
        for slot, k in frames:
            offsets[slot], at = at, at + k
        # The request's frame each slot's priming starts at (resume_codec_context: its last frames only).
        firsts = {slot: rng.choice([0, rng.randint(0, 200)]) for slot, _ in frames}
        stacked = torch.cat([codes[slot] for slot, _ in frames])
        calls = priming_calls(frames, rng.choice([4, 12]), rng.choice([2, 16]))
        writes = priming_ring_writes(calls, offsets, ring, firsts)
        assert writes.shape == (3, sum(n * len(slots) for _, n, slots in calls))
        one, each = torch.zeros(13, ring, groups, dtype=torch.long), torch.zeros(13, ring, groups, dtype=torch.long)
        column = 0
        for start, n, slots in calls:
            w = writes[:, column: column + n * len(slots)]
            column += n * len(slots)
            one[w[0], w[1]] = stacked[w[2]]
            for slot in slots:
                each[slot, (firsts[slot] + start + torch.arange(n)) % ring] = codes[slot][start: start + n]
            assert torch.equal(one, each)
    assert priming_ring_writes([], {}, 64).shape == (3, 0)
    assert torch.equal(priming_ring_writes([(0, 2, [5])], {5: 0}, 64),
                       priming_ring_writes([(0, 2, [5])], {5: 0}, 64, {5: 0}))
