"""The Qwen3 engine end to end on the CPU with a tiny random checkpoint, through the gateway interface.

Checks that the batched engine (scheduler + model runner + stateful codec) produces exactly what the
model's own single-request generation produces for the same seed, that the stateless sampler is
reproducible, and that cancellation and the worker process work with the real model.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.qwen3_fixtures import tiny_custom_voice  # noqa: F401 - session fixture
from tts_backend.base import SynthesisError, SynthesisRequest, UnknownVoiceError
from tts_backend.registry import create_backend
from tts_backend.remote import RemoteSynthesizer

TEXT = "Hello world, this is a small test of the engine."


async def started(path, **options):
    backend = create_backend("qwen3", model=str(path), device="cpu", max_active=4, max_len=256, **options)
    await backend.start()
    return backend


async def audio_of(backend, request) -> np.ndarray:
    pcm = b"".join([c.pcm async for c in backend.synthesize(request)])
    return np.frombuffer(pcm, "<i2")


def reference_audio(model, request, greedy=False) -> tuple[torch.Tensor, np.ndarray]:
    """What the model's own generate loop + whole-sequence codec decode give for a request."""
    overrides = {"max_new_tokens": request.max_new_tokens}
    if greedy:
        overrides.update(do_sample=False, subtalker_do_sample=False)
    codes = model.synthesize_codes(request.text, speaker=request.voice, seed=request.seed, **overrides)
    wav = model.codec.decode(codes.T[None].contiguous())[0].float().numpy()
    return codes, (np.clip(wav, -1, 1) * 32767).round().astype(np.int16)


def assert_same_audio(got: np.ndarray, want: np.ndarray) -> None:
    # Leading silence trimming may drop samples before the onset; what is shipped is the reference's tail.
    assert 0 < len(got) <= len(want)
    tail = want[len(want) - len(got):]
    assert np.abs(got.astype(np.int32) - tail.astype(np.int32)).max() <= 1  # chunked vs whole decode: fp32 rounding


@pytest.mark.parametrize("greedy", [False, True])
async def test_engine_equals_single_request_generation(tiny_custom_voice, greedy):
    backend = await started(tiny_custom_voice, greedy=greedy, trim_leading_silence=False)
    try:
        assert backend.engine.runner.sampler == "reference"
        for seed in (1, 7):
            request = SynthesisRequest(text=TEXT, voice="ryan", seed=seed, max_new_tokens=30)
            got = await audio_of(backend, request)
            codes, want = reference_audio(backend.model, request, greedy)
            assert len(got) == codes.shape[0] * 1920
            assert_same_audio(got, want)
    finally:
        await backend.stop()


async def test_concurrent_requests_each_match_their_own_generation(tiny_custom_voice):
    # Greedy, so that bf16 rounding differences between batched and single-row matmuls cannot flip a sampled
    # token; what this checks is that batching never mixes up rows, slots, caches or codec states.
    backend = await started(tiny_custom_voice, greedy=True, trim_leading_silence=False)
    try:
        requests = [SynthesisRequest(text=TEXT[: 20 + 7 * i], voice=v, seed=10 + i, max_new_tokens=18 + 5 * i)
                    for i, v in enumerate(["ryan", "vivian", "aiden"])]
        results = await asyncio.gather(*(audio_of(backend, r) for r in requests))
        stats = backend.engine.stats
        assert stats.items["FRAME"] > stats.batches["FRAME"]  # some frames held several requests
        for request, got in zip(requests, results):
            assert_same_audio(got, reference_audio(backend.model, request, greedy=True)[1])
    finally:
        await backend.stop()


async def test_stateless_sampler_is_reproducible_and_seed_dependent(tiny_custom_voice):
    backend = await started(tiny_custom_voice, sampler="stateless")
    try:
        request = SynthesisRequest(text=TEXT, voice="serena", seed=3, max_new_tokens=25)
        first, again = await asyncio.gather(audio_of(backend, request), audio_of(backend, request))
        alone = await audio_of(backend, request)
        other = await audio_of(backend, SynthesisRequest(text=TEXT, voice="serena", seed=4, max_new_tokens=25))
        # Same seed: the same codes, batched together or alone (the codec's fp32 rounding may move a sample
        # by one step between batch shapes).
        for audio in (again, alone):
            assert len(audio) == len(first) > 0
            assert np.abs(audio.astype(np.int32) - first).max() <= 1
        n = min(len(first), len(other))
        assert np.abs(other[:n].astype(np.int32) - first[:n]).max() > 1000
    finally:
        await backend.stop()


async def test_cancel_frees_the_slot_and_errors_are_clear(tiny_custom_voice):
    backend = await started(tiny_custom_voice)
    try:
        with pytest.raises(UnknownVoiceError):
            async for _ in backend.synthesize(SynthesisRequest(text="x", voice="nobody")):
                pass
        with pytest.raises(SynthesisError, match="text too long"):
            async for _ in backend.synthesize(SynthesisRequest(text="word " * 400, voice="ryan")):
                pass
        with pytest.raises(SynthesisError, match="chunk schedule"):
            async for _ in backend.synthesize(SynthesisRequest(text="x", voice="ryan", chunk_schedule=(0,))):
                pass
        # A per-request schedule is honoured: 3-frame chunks, whatever the default.
        sizes = [len(c.pcm) // 2 async for c in backend.synthesize(
            SynthesisRequest(text=TEXT, voice="ryan", seed=5, max_new_tokens=11, chunk_schedule=(3,)))]
        assert len(sizes) == 4 and sizes[1:3] == [3 * 1920] * 2 and sizes[3] == 1920  # 10 frames: 3 + 3 + 3 + 1
        stream = backend.synthesize(SynthesisRequest(text=TEXT * 4, voice="ryan", seed=1, max_new_tokens=200))
        await stream.__anext__()
        await stream.aclose()
        for _ in range(200):
            if backend.engine.scheduler.active == 0:
                break
            await asyncio.sleep(0.01)
        assert backend.engine.scheduler.active == 0
        assert backend.engine.stats.cancelled == 1
        audio = await audio_of(backend, SynthesisRequest(text="Still here.", voice="ryan", seed=2, max_new_tokens=10))
        assert len(audio) > 0
    finally:
        await backend.stop()


async def test_ready_only_after_the_warm_up_request(tiny_custom_voice):
    """The start-up warm-up runs through synthesize() while `ready` (the gateway's /ready) still says no."""
    backend = create_backend("qwen3", model=str(tiny_custom_voice), device="cpu", max_active=4, max_len=256)
    seen = []

    async def watch():
        while True:
            seen.append((backend.ready, backend.engine is not None and backend.engine.ready))
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    try:
        await backend.start()
    finally:
        watcher.cancel()
    try:
        assert backend.ready and backend.engine.stats.completed == 1
        assert any(engine_up for _, engine_up in seen), "the watcher never looked while the engine was up"
        assert not any(ready for ready, _ in seen), "ready before start() returned"
    finally:
        await backend.stop()


async def test_warm_up_resumes_requests_from_its_codes_when_asked(tiny_custom_voice, caplog):
    """`warmup_resumes`: after the warm-up request, that many requests resumed from its codes run before ready
    (a failover's survivor meets the resume path's first launches otherwise); "auto" is none on the CPU. The
    stateless sampler: the reference one cannot resume."""
    import re

    with caplog.at_level(logging.INFO, logger="tts_backend"):
        backend = create_backend("qwen3", model=str(tiny_custom_voice), device="cpu", max_active=4, max_len=256,
                                 sampler="stateless", warmup_resumes=3)
        await backend.start()
    try:
        assert backend.ready and backend.engine.stats.completed == 4
        resumed = [int(m.group(1)) for r in caplog.records
                   if (m := re.match(r"resumed (\d+) requests", r.getMessage()))]
        assert sum(resumed) == 3
        # The engine's line before each resume call says how long the call's resumes were gathered.
        gathered = [int(m.group(1)) for r in caplog.records
                    if (m := re.match(r"resuming (\d+) requests: they arrived over [\d.]+ ms, the first [\d.]+ ms "
                                      r"before their prefill", r.getMessage()))]
        assert gathered == [int(m.group(1)) for r in caplog.records
                            if (m := re.match(r"resumed (\d+) requests", r.getMessage()))]
        shipped = [r for r in caplog.records if re.match(r"resumed request \d+ shipped its first chunk [\d.]+ ms "
                                                         r"after its arrival", r.getMessage())]
        assert len(shipped) == 3  # one line per resumed request
        assert any("3 warm-up requests resumed" in r.getMessage() for r in caplog.records)
    finally:
        await backend.stop()
    with pytest.raises(SynthesisError, match="warmup_resumes"):
        create_backend("qwen3", model=str(tiny_custom_voice), device="cpu", warmup_resumes=-1)


async def test_a_failed_warm_up_resume_does_not_stop_the_start(tiny_custom_voice, monkeypatch, caplog):
    """What the warm-up resumes save is a failover's pause: when they fail the backend serves without them."""
    from tts_backend.qwen3_backend import Qwen3Synthesizer

    async def failing(self, warm, codes, count):
        raise SynthesisError("the resume pass failed")

    monkeypatch.setattr(Qwen3Synthesizer, "_warm_up_resumes", failing)
    backend = create_backend("qwen3", model=str(tiny_custom_voice), device="cpu", max_active=4, max_len=256,
                             sampler="stateless", warmup_resumes=2)
    with caplog.at_level(logging.ERROR, logger="tts_backend"):
        await backend.start()
    try:
        assert backend.ready and any("warm-up resumes failed" in r.getMessage() for r in caplog.records)
        got = await audio_of(backend, SynthesisRequest(text=TEXT, voice="ryan", seed=3, max_new_tokens=6))
        assert len(got) > 0
    finally:
        await backend.stop()


async def test_worker_process_serves_the_qwen3_engine(tiny_custom_voice, tmp_path):
    socket_path = str(tmp_path / "qwen3.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tts_backend.remote.worker", "--socket", socket_path, "--backend", "qwen3",
         "--model", str(tiny_custom_voice), "--device", "cpu", "--option", "max_active=2",
         "--option", "max_len=256"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        remote = RemoteSynthesizer(socket=socket_path, connect_timeout_s=120)
        await remote.start()
        try:
            assert "ryan" in {v.id for v in remote.voices()}
            request = SynthesisRequest(text=TEXT, voice="ryan", seed=11, max_new_tokens=16)
            got = await audio_of(remote, request)
            local = await started(tiny_custom_voice)
            try:
                want = await audio_of(local, request)
            finally:
                await local.stop()
            assert np.array_equal(got, want)
            # The worker's engine counters reach the gateway's side of the socket (for its /metrics).
            metrics = {m.name: m for m in await remote.metrics()}
            assert metrics["worker_streams"].samples == (((), 0.0),)
            completed = dict(metrics["engine_requests"].samples)[("completed",)]
            assert completed == 2  # the warm-up request and this one
            assert dict(metrics["engine_batches"].samples)[("frame",)] >= 15
        finally:
            await remote.stop()
    finally:
        proc.terminate()
        proc.wait(20)


async def test_fused_fast_path_equals_the_model_modules(tiny_custom_voice):
    """engine/fused.py (the GPU fast path; eager here) computes what the qwen3 modules compute."""
    results = {}
    for fused in (False, True):
        backend = await started(tiny_custom_voice, sampler="stateless", trim_leading_silence=False,
                                runner_options={"fused": fused})
        try:
            assert backend.engine.runner.fused is fused
            requests = [SynthesisRequest(text=TEXT[: 20 + 9 * i], voice="ryan", seed=i, max_new_tokens=24)
                        for i in range(3)]
            results[fused] = await asyncio.gather(*(audio_of(backend, r) for r in requests))
        finally:
            await backend.stop()
    for plain, fast in zip(results[False], results[True]):
        assert len(plain) == len(fast) > 0
        assert np.abs(plain.astype(np.int32) - fast).max() <= 1


def test_a_stage_whose_fast_path_fails_to_capture_falls_back_alone(tiny_custom_voice):
    """If compiling the prefill (or the codec activations) fails at capture time, only that stage goes back to
    the model's own modules; the Talker decode and code-predictor fast path stay."""
    from tts_backend.engine.runner import Qwen3ModelRunner, Qwen3RunnerConfig
    from tts_backend.qwen3.generate import Qwen3TTS

    model = Qwen3TTS.from_pretrained(str(tiny_custom_voice), device="cpu")
    runner = Qwen3ModelRunner(model, Qwen3RunnerConfig(max_slots=2, max_len=128, sampler="stateless", fused=True,
                                                       prefill_len_buckets=(16,), codec_frames=(2,)))
    captured = []

    def capture(key, fn, example_inputs, warmup=2):
        if key[0] == "prefill" and runner.fused_prefill:
            raise RuntimeError("simulated compiler failure")
        with torch.inference_mode():
            fn(*example_inputs)  # run the step once, as a capture's warm-up would
        captured.append(key)

    with torch.inference_mode():
        runner._allocate()
    runner.graphs.capture = capture
    runner._capture_all()
    assert runner.fused and not runner.fused_prefill
    kinds = {k[0] for k in captured}
    assert kinds == {"decode", "cp", "codec", "prefill"}


def test_a_codec_that_fails_to_compile_keeps_its_compiler_free_fast_path(tiny_custom_voice):
    """A codec capture that fails with the compiled functions drops them (SnakeBeta, pre-transformer layers)
    but keeps the RVQ gather tables, which need no compiler."""
    from tts_backend.engine.runner import Qwen3ModelRunner, Qwen3RunnerConfig
    from tts_backend.qwen3.codec import SnakeBeta
    from tts_backend.qwen3.generate import Qwen3TTS

    model = Qwen3TTS.from_pretrained(str(tiny_custom_voice), device="cpu")
    runner = Qwen3ModelRunner(model, Qwen3RunnerConfig(max_slots=2, max_len=128, sampler="stateless", fused=True,
                                                       prefill_len_buckets=(16,), codec_frames=(2,)))
    with torch.inference_mode():
        runner._allocate()
    snake = next(m for m in runner.codec_module.modules() if isinstance(m, SnakeBeta))
    snake.forward = lambda x: x  # stands in for a compiled activation
    failures = []

    def capture(key, fn, example_inputs, warmup=2):
        if key[0] == "codec" and not failures:
            failures.append(key)
            raise RuntimeError("simulated compiler failure")
        with torch.inference_mode():
            fn(*example_inputs)

    runner.graphs.capture = capture
    runner._capture_all()
    assert failures and "forward" not in snake.__dict__
    assert "forward" in runner.codec_module.quantizer.__dict__


def test_scheduler_options_reach_the_engine_and_a_misspelt_one_fails_at_start(tiny_custom_voice):
    """`-o scheduler_options=...` (the policy what-ifs bench/engine_sim.py explores, confirmed on the GPU with
    bench/engine_profile.py --scheduler-options): each one set on the engine's scheduler, the rest as the runner
    makes them; an unknown or non-numeric one is refused before anything loads."""
    from tts_backend.qwen3_backend import Qwen3Synthesizer

    def backend(**options):
        return Qwen3Synthesizer(model=str(tiny_custom_voice), device="cpu", dtype="float32", max_active=2,
                                max_len=128, warmup=False, scheduler_options=options)

    with pytest.raises(SynthesisError, match="'prefill_gathr_s' is not one of"):
        backend(prefill_gathr_s=0.02)
    with pytest.raises(SynthesisError, match="'max_active' is not one of"):
        backend(max_active=8)  # the slots follow the runner's
    with pytest.raises(SynthesisError, match="must be a number"):
        backend(prefill_gather_s="soon")
    with pytest.raises(SynthesisError, match="must be a number"):
        backend(prefill_gather_s=True)
    with pytest.raises(SynthesisError, match="must be true or false"):
        backend(admit_mid_frame=0)
    tuned = backend(prefill_gather_s=0.02, prefill_gather_streams=8, admit_mid_frame=False)
    tuned._load_model()
    tuned._build()
    config = tuned.engine.scheduler.config
    assert (config.prefill_gather_s, config.prefill_gather_streams, config.max_active) == (0.02, 8, 2)
    assert config.admit_mid_frame is False
    default = backend()
    default._load_model()
    default._build()
    assert default.engine.scheduler.config.prefill_gather_s != 0.02
