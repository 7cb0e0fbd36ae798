"""Cloned voices' prompt prefixes prefilled once (engine/voice_kv.py), on the CPU with the tiny Base checkpoint.

An in-context voice's prompt starts with positions that hold the voice alone (the head and the reference
transcript: `Prompt.voice_prefix`); the runner keeps their Talker K/V per voice and prefills only the rest of
a request's prompt. What that must keep: the model's own generation. A split prefill (prefix, then the rest
attending it) is not bitwise one prefill on the CPU: the prefix's queries attend the prefix's keys alone, and
PyTorch's CPU attention rounds differently by the attended length (~1e-7 in fp32 on the tiny model, at the
prefix positions from the second layer on). So the runner checks are within a tolerance, and the sampled codes,
and so the audio, must be the model's own in fp32: alone, batched beside other cloned and x-vector voices,
under a byte bound small enough to evict, and on the shapes the CUDA graphs would see. (In bf16 the tiny
random model's logits tie exactly at places, and the split moves a greedy code there.)
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from tests.qwen3_fixtures import single_torch_thread, tiny_base  # noqa: F401 - fixtures
from tests.test_engine_qwen3 import assert_same_audio, audio_of, started
from tests.test_qwen3_clone_backend import reference
from tests.test_qwen3_clone_parity import REF_TEXT, _clip
from tts_backend.base import SynthesisRequest
from tts_backend.engine.request import RequestState
from tts_backend.engine.runner import Qwen3ModelRunner, Qwen3RunnerConfig
from tts_backend.engine.voice_kv import VoiceKVCache
from tts_backend.qwen3.prompt import VoicePrompt

TEXTS = ["Hello there, this is a cloned voice speaking.", "Quite another sentence, in the same voice."]


@pytest.fixture(scope="module")
def model(tiny_base):
    from tts_backend.qwen3.generate import Qwen3TTS

    return Qwen3TTS.from_pretrained(str(tiny_base), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def voices(model):
    return {"a": model.clone_prompt(torch.from_numpy(_clip(3.21, 1)), REF_TEXT, False),
            "b": model.clone_prompt(torch.from_numpy(_clip(2.0, 4)), "Other reference words, longer ones.", False),
            "x": model.clone_prompt(torch.from_numpy(_clip(2.0, 5)), None, True)}


# ---- what the prefix is ----------------------------------------------------------------------------------
@pytest.mark.parametrize("non_streaming", [True, False])
def test_the_voice_prefix_is_exactly_the_text_free_head_of_the_prompt(model, voices, non_streaming):
    """Two texts in one voice: the prompts' embeddings agree on every prefix position and part at the next."""
    voice = voices["a"]
    prompts = [model.make_prompt(t, voice=voice, non_streaming_mode=non_streaming) for t in TEXTS]
    n = prompts[0].voice_prefix
    assert n == prompts[1].voice_prefix == 8 + len(voice.ref_text_ids)  # the head up to tts_bos, the transcript
    embeds = [model.prompt_embeds(p) for p in prompts]
    assert torch.equal(embeds[0][:n], embeds[1][:n])
    assert not torch.equal(embeds[0][n], embeds[1][n])  # t_1 sits there
    assert prompts[0].voice_prefix_digest() == prompts[1].voice_prefix_digest() is not None


def test_the_digest_names_the_content_not_the_voice(model, voices):
    text = TEXTS[0]
    digest = model.make_prompt(text, voice=voices["a"]).voice_prefix_digest()
    # Another tenant's registration of the same clip: other bytes on the wire, the same content.
    again = VoicePrompt.from_bytes(model.clone_prompt(torch.from_numpy(_clip(3.21, 1)), REF_TEXT, False).to_bytes())
    assert model.make_prompt(text, voice=again).voice_prefix_digest() == digest
    others = [model.make_prompt(text, voice=voices["b"]),
              model.make_prompt(text, voice=voices["a"], language="english"),  # a language tag in the head
              model.make_prompt(text, voice=voices["a"], non_streaming_mode=False),  # the frames under the text
              model.make_prompt(text, voice=VoicePrompt(voices["a"].x_vector + 1e-3, voices["a"].ref_codes,
                                                          voices["a"].ref_text_ids))]
    changed = voices["a"].ref_codes.clone()
    changed[0, 3] = (changed[0, 3] + 1) % model.config.talker.codebook_size
    others.append(model.make_prompt(text, voice=VoicePrompt(voices["a"].x_vector, changed,
                                                             voices["a"].ref_text_ids), non_streaming_mode=False))
    assert len({digest, *(p.voice_prefix_digest() for p in others)}) == len(others) + 1
    # x-vector clones keep no prefix (8 shared positions); a reference transcript longer than the frames stops
    # the prefix before the last position.
    assert model.make_prompt(text, voice=voices["x"]).voice_prefix_digest() is None
    brief = VoicePrompt(voices["a"].x_vector, voices["a"].ref_codes[:3], voices["a"].ref_text_ids)
    prompt = model.make_prompt(text, voice=brief, non_streaming_mode=False)
    assert prompt.voice_prefix == len(prompt) - 1


def test_the_cache_is_bounded_by_bytes_and_drops_the_least_recently_used():
    cache = VoiceKVCache(max_bytes=100)
    entry = torch.zeros(10, dtype=torch.float32)  # 40 bytes
    assert cache.put(b"a", entry) and cache.put(b"b", entry.clone())
    assert cache.get(b"a") is entry  # now the most recently used
    assert cache.put(b"c", entry.clone())
    assert cache.get(b"b") is None and cache.get(b"a") is entry and cache.evictions == 1
    assert not cache.put(b"big", torch.zeros(26))  # 104 bytes: never kept, nothing dropped for it
    assert len(cache) == 2 and cache.bytes == 80 and cache.evictions == 1


# ---- the runner: split prefill against one prefill ------------------------------------------------------
class EagerGraphs:
    """Stands in for GraphSet on the CPU: a 'capture' runs the step once and remembers its key, a 'replay'
    runs it on the inputs. The runner then pads and buckets every step as it does for CUDA graphs, so the
    shapes a captured prefill sees are checked here."""

    enabled = True

    def __init__(self) -> None:
        self.keys: set = set()
        self.replayed: list = []
        self.uncaptured: dict[str, int] = {}

    def ran_uncaptured(self, kind: str) -> None:
        self.uncaptured[kind] = self.uncaptured.get(kind, 0) + 1

    def __contains__(self, key) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def capture(self, key, fn, example_inputs, warmup: int = 2) -> None:
        fn(*example_inputs)
        self.keys.add(key)

    def discard(self, kind: str) -> None:
        self.keys = {k for k in self.keys if k[0] != kind}

    @staticmethod
    def failing_on(kind: str, capture):
        def failing(key, fn, example_inputs, warmup: int = 2):
            if key[0] == kind:
                raise RuntimeError("simulated compiler failure")
            capture(key, fn, example_inputs, warmup)

        return failing

    @staticmethod
    def skipping(kinds: tuple[str, ...], capture):
        def skipped(key, fn, example_inputs, warmup: int = 2):
            if key[0] not in kinds:
                capture(key, fn, example_inputs, warmup)

        return skipped

    def run(self, key, fn, inputs) -> None:
        if key in self.keys:
            self.replayed.append(key)
        else:
            self.ran_uncaptured(key[0])
        fn(*inputs)


def _requests(prompts) -> list[RequestState]:
    return [RequestState(request_id=i, prompt=p, seed=7 + i, max_frames=20, chunk_schedule=(2, 4), arrival=0.0,
                         sample_rate=24000, samples_per_frame=1920, slot=i) for i, p in enumerate(prompts)]


def _prefilled(model, prompts, voice_kv_bytes, graphs="eager", fused=False):
    """[(logits [B, V], c0 [B], pos [B])] after each of two prefills of `prompts` in one runner (the first
    fills the voice cache, the second reads it), and the runner. graphs: "eager"; "bucketed" (EagerGraphs);
    "square": bucketed, with the capture of the rest-of-prompt shapes failing (runner._capture_all's
    fallback), so the rest runs on the whole prompt's square bucket."""
    runner = Qwen3ModelRunner(model, Qwen3RunnerConfig(max_slots=4, max_len=256, sampler="stateless",
                                                       fused=fused, voice_kv_bytes=voice_kv_bytes,
                                                       clone_prefill_len_buckets=(16, 32, 64, 128, 256)))
    with torch.inference_mode():
        runner._allocate()
        if graphs != "eager":
            runner.graphs = EagerGraphs()
            if graphs == "square":
                runner.graphs.capture = EagerGraphs.failing_on("prefill_rest", runner.graphs.capture)
            if graphs == "none":  # no clone prefill shape captured at all
                runner.graphs.capture = EagerGraphs.skipping(("prefill_rest", "prefill_embeds"), runner.graphs.capture)
            runner._capture_all()
        out = []
        for _ in range(2):
            requests = _requests(prompts)
            runner.prefill(requests)
            B = len(prompts)
            out.append((model.talker.logits(runner.hidden[:B]).float(), runner.c0[:B].clone(),
                        runner.pos[:B].clone()))
    return out, runner


@pytest.mark.parametrize("graphs", ["eager", "bucketed", "square", "none"])
@pytest.mark.parametrize("fused", [False, True], ids=["modules", "fused"])
def test_a_cached_prefix_prefills_what_the_whole_prompt_does(model, voices, graphs, fused):
    """Two in-context voices (one in each text mode, one twice) beside an x-vector one: the first prefill
    misses, the second hits; both give the logits of one whole prefill within fp32 rounding, the same codes
    and the same positions."""
    prompts = [model.make_prompt(TEXTS[0], voice=voices["a"]),
               model.make_prompt(TEXTS[1], voice=voices["b"], non_streaming_mode=False),
               model.make_prompt(TEXTS[1], voice=voices["x"]),
               model.make_prompt(TEXTS[1], voice=voices["a"])]
    whole, _ = _prefilled(model, prompts, 0, fused=fused)
    split, runner = _prefilled(model, prompts, 1 << 20, graphs=graphs, fused=fused)
    for (want_logits, want_c0, want_pos), (got_logits, got_c0, got_pos) in zip(whole, split):
        torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(got_c0, want_c0) and torch.equal(got_pos, want_pos)
        assert got_pos.tolist() == [len(p) for p in prompts]
    stats = runner.voice_kv_stats()
    prefix_a, prefix_b = prompts[0].voice_prefix, prompts[1].voice_prefix
    # First prefill: a and b prefilled (a's second request copies a's new entry); second: all three copied.
    assert stats["misses"] == 2 and stats["hits"] == 1 + 3
    assert stats["positions_saved"] == prefix_a + 2 * prefix_a + prefix_b
    per_position = 2 * model.config.talker.num_hidden_layers * model.config.talker.num_key_value_heads * \
        model.config.talker.head_dim * 4
    assert stats["entries"] == 2 and stats["bytes"] == (prefix_a + prefix_b) * per_position
    prefills = {k for k in runner.graphs.replayed if k[0].startswith("prefill")} if graphs != "eager" else None
    if graphs == "bucketed":
        # The rest of each prompt ran on a captured bucket narrower than the positions it attends.
        (key,) = prefills
        kind, b, rest, attend = key
        assert kind == "prefill_rest" and b == 4 and rest < attend
        assert rest >= max(len(p) - p.voice_prefix for p in prompts) and attend >= max(len(p) for p in prompts)
    elif graphs == "square":
        (key,) = prefills
        assert key[:2] == ("prefill_embeds", 4) and key[2] >= max(len(p) for p in prompts)
    # Where no captured prefill fits, each of the two prefills ran uncaptured, and the runner says so (the
    # engine's /metrics, voxgate_engine_uncaptured_passes_total); where one did, nothing did.
    if graphs == "none":
        assert not prefills and runner.uncaptured_passes() == {"prefill_rest": 2}
    elif graphs != "eager":
        assert "prefill_rest" not in runner.uncaptured_passes()
    else:
        assert runner.uncaptured_passes() is None  # no graphs on the CPU: nothing to fall back from


# ---- the engine: the model's own audio ------------------------------------------------------------------
def model_audio(model, request: SynthesisRequest):
    """The model's own greedy generation of a request in its voice and text mode, decoded after the reference
    frames as the reference does, as int16."""
    voice = VoicePrompt.from_bytes(request.voice_prompt, model.identity)
    codes = model.synthesize_codes(request.text, voice=voice, seed=request.seed, do_sample=False,
                                   subtalker_do_sample=False, max_new_tokens=request.max_new_tokens,
                                   non_streaming_mode=not request.streaming_text)
    wav = model.codec_stream(voice).decode(codes).numpy()
    return (np.clip(wav, -1, 1) * 32767).round().astype(np.int16)


async def test_cached_voices_speak_the_models_own_audio_alone_batched_and_evicted(tiny_base):
    """Greedy requests in two in-context voices (both text modes) and an x-vector voice, one at a time and all
    at once, under a bound that holds one voice's prefix: each speaks what the model generates in its voice,
    entries are evicted and made again, and the counters reach the backend's metrics."""
    # fp32: in bf16 the split prefill's last-bit differences flip the tiny random model's greedy codes, whose
    # logits tie exactly there (seen: a residual codebook at frame 2 of a streaming-mode voice).
    backend = await started(tiny_base, dtype="float32", greedy=True, sampler="stateless", trim_leading_silence=False,
                            runner_options={"voice_kv_bytes": 4096})
    try:
        runner = backend.engine.runner
        a = await backend.clone_voice(reference(_clip(3.21, 1), REF_TEXT), x_vector_only=False)
        b = await backend.clone_voice(reference(_clip(2.0, 4), "Other reference words."), x_vector_only=False)
        x = await backend.clone_voice(reference(_clip(2.0, 5)), x_vector_only=True)
        requests = [SynthesisRequest(text=TEXTS[0], voice="cloned", seed=1, max_new_tokens=16, voice_prompt=a),
                    SynthesisRequest(text=TEXTS[1], voice="cloned", seed=2, max_new_tokens=16, voice_prompt=b,
                                     streaming_text=True),
                    SynthesisRequest(text=TEXTS[1], voice="cloned", seed=3, max_new_tokens=16, voice_prompt=a,
                                     streaming_text=True),
                    SynthesisRequest(text=TEXTS[0], voice="cloned", seed=4, max_new_tokens=16, voice_prompt=x),
                    SynthesisRequest(text=TEXTS[1], voice="cloned", seed=5, max_new_tokens=16, voice_prompt=a)]
        before = runner.voice_kv_stats()
        alone = [await audio_of(backend, r) for r in requests]
        together = await asyncio.gather(*(audio_of(backend, r) for r in requests))
        stats = runner.voice_kv_stats()
        for request, got, got_batched in zip(requests, alone, together):
            want = model_audio(backend.model, request)
            assert len(got) == len(want) > 0
            assert_same_audio(got, want)
            assert_same_audio(got_batched, want)
        # Alone, a's non-streaming prefix is made, then b's and a's streaming ones each evict the one before;
        # the last request finds a's non-streaming prefix evicted, as the batch does.
        assert stats["evictions"] - before["evictions"] >= 4
        assert stats["hits"] > before["hits"] and stats["bytes"] <= 4096 and stats["entries"] == 1
        families = {f.name: f for f in await backend.metrics()}
        assert dict(families["engine_voice_kv_requests"].samples) == {("hit",): stats["hits"],
                                                                       ("miss",): stats["misses"]}
        assert families["engine_voice_kv_evictions"].samples == (((), float(stats["evictions"])),)
        assert families["engine_voice_kv_bytes"].samples == (((), float(stats["bytes"])),)
    finally:
        await backend.stop()


async def test_sampled_requests_make_the_same_codes_with_the_cache_as_without(tiny_base):
    """Seeded sampling (the stateless sampler), fp32, a batch of in-context voices in both text modes beside an
    x-vector one: with the voice cache (the prefixes made by the first round, copied in the second) the codes
    and so the audio are those of an engine that prefills every prompt whole."""
    results = {}
    for voice_kv_bytes in (0, 1 << 20):
        backend = await started(tiny_base, dtype="float32", sampler="stateless", trim_leading_silence=False,
                                runner_options={"voice_kv_bytes": voice_kv_bytes})
        try:
            a = await backend.clone_voice(reference(_clip(3.21, 1), REF_TEXT), x_vector_only=False)
            b = await backend.clone_voice(reference(_clip(2.0, 4), "Other reference words."), x_vector_only=False)
            x = await backend.clone_voice(reference(_clip(2.0, 5)), x_vector_only=True)
            requests = [SynthesisRequest(text=TEXTS[i % 2], voice="cloned", seed=20 + i, max_new_tokens=20,
                                         voice_prompt=voice, streaming_text=bool(i % 2))
                        for i, voice in enumerate((a, b, x, a))]
            results[voice_kv_bytes] = [await asyncio.gather(*(audio_of(backend, r) for r in requests))
                                       for _ in range(2)]
            stats = backend.engine.runner.voice_kv_stats()
        finally:
            await backend.stop()
    assert stats["hits"] >= 3  # the second round copied every in-context prefix
    for whole, cached in zip(results[0], results[1 << 20]):
        for want, got in zip(whole, cached):
            assert len(got) == len(want) > 0 and np.array_equal(got, want)


@pytest.mark.parametrize("streaming_text", [False, True])
async def test_a_cloned_voice_resumes_from_its_codes_byte_exact(tiny_base, streaming_text):
    """Resume from codes (issue 33) with the voice prefix cached: the resumed request's prompt pass copies the
    prefix as the uninterrupted one's did, so it goes on with the same bytes."""
    backend = await started(tiny_base, sampler="stateless", trim_leading_silence=False)
    try:
        voice = await backend.clone_voice(reference(_clip(3.21, 1), REF_TEXT), x_vector_only=False)

        def request(resume_codes=None):
            return SynthesisRequest(text=TEXTS[0], voice="cloned", seed=9, max_new_tokens=24, voice_prompt=voice,
                                    streaming_text=streaming_text, resume_codes=resume_codes)

        whole = [(c.pcm, c.codes) async for c in backend.synthesize(request())]
        for cut in (1, len(whole) - 1):
            rest = [c.pcm async for c in backend.synthesize(request(b"".join(c for _, c in whole[:cut])))]
            assert b"".join(rest) == b"".join(p for p, _ in whole[cut:]), cut
        assert backend.engine.runner.voice_kv_stats()["hits"] >= 2
    finally:
        await backend.stop()


def test_voice_kv_bytes_is_checked(model):
    with pytest.raises(ValueError, match="voice_kv_bytes"):
        Qwen3ModelRunner(model, Qwen3RunnerConfig(voice_kv_bytes=-1))
    assert Qwen3ModelRunner(model, Qwen3RunnerConfig(voice_kv_bytes=0)).voice_kv_stats() is None
    assert Qwen3ModelRunner(model, Qwen3RunnerConfig()).voice_kv_stats()["max_bytes"] == 32 << 20  # CPU default


# ---- through a real gateway: two registrations of one clip share the prefix ------------------------------
async def test_two_voices_from_one_clip_share_one_prefix_behind_a_gateway(tiny_base):
    """voice.add of the same clip under two names (bench/engine_load.py's registrations), a session in each:
    the second copies the prefix the first prefilled, and /metrics shows it as bench/engine_load.py reads it."""
    import json

    import websockets

    from bench.engine_load import engine_breakdown, register_clones, scrape_counters
    from tests.gateway_server import receive_until, running_gateway

    options = {"max_active": 2, "max_len": 512, "greedy": True, "frame_cap_chars_per_second": 15}
    with running_gateway("qwen3", model=str(tiny_base), device="cpu", backend_options=options,
                         ready_timeout_s=120) as server:
        names = [entry["name"] for entry in register_clones(server.url, "icl", [3.0])]
        assert names == ["bench-icl-3s", "bench-icl-3s-again"]
        before = scrape_counters(server.url)
        for name in names:
            async with websockets.connect(server.ws_url) as ws:
                await ws.send(json.dumps({"type": "session.config", "voice": name, "stream_audio": True}))
                await ws.send(json.dumps({"type": "input.text", "text": TEXTS[0]}))
                await ws.send(json.dumps({"type": "input.done"}))
                messages = await receive_until(ws, "session.done", timeout=120)
            assert any(isinstance(m, dict) and m["type"] == "audio.done" for m in messages)
        after = scrape_counters(server.url)
    breakdown = engine_breakdown(before, after)
    kv = breakdown["voice_kv"]
    assert breakdown["uncaptured"] is None  # the CPU captures no graphs, so it has none to fall back from
    assert kv["misses"] == 1 and kv["hits"] == 1 and kv["evictions"] == 0
    assert kv["positions_saved"] == kv["positions_saved_per_hit"] > 8  # the head and the bench's transcript
