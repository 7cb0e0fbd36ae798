"""Unit checks of the Qwen3-TTS pieces: prompt layout, static KV cache, sampling pipeline, per-row seeding."""

from __future__ import annotations

import pytest
import torch

from tests.qwen3_fixtures import single_torch_thread, tiny_custom_voice  # noqa: F401
from tts_backend.qwen3.config import Qwen3TTSConfig
from tts_backend.qwen3.generate import Qwen3TTS
from tts_backend.qwen3.prompt import NO_CODEC, PromptError, build_prompt
from tts_backend.qwen3.sampling import SamplingParams, apply_repetition_penalty, sample_talker, warp
from tts_backend.qwen3.testing.checkpoint import model_config


@pytest.fixture(scope="module")
def model(tiny_custom_voice):
    return Qwen3TTS.from_pretrained(tiny_custom_voice, "cpu", torch.float32, load_codec=False)


def _cfg(**kw) -> Qwen3TTSConfig:
    return Qwen3TTSConfig.from_dict(model_config("tiny", **kw))


def test_prompt_layout_matches_spec_example():
    cfg = _cfg()
    t = cfg.talker
    text = [101, 102, 103, 104]
    p = build_prompt(cfg, text, speaker="vivian", language="english", non_streaming_mode=True)
    assert len(p) == len(text) + 11 and p.trailing == []
    assert p.text_track[:3] == [151644, 77091, 198] and p.codec_track[:3] == [NO_CODEC] * 3
    lang = t.codec_language_id["english"]
    assert p.codec_track[3:9] == [t.codec_think_id, t.codec_think_bos_id, lang, t.codec_think_eos_id,
                                  t.spk_id["vivian"], t.codec_pad_id]
    assert p.text_track[3:9] == [cfg.tts_pad_token_id] * 5 + [cfg.tts_bos_token_id]
    assert p.text_track[9:] == text + [cfg.tts_eos_token_id, cfg.tts_pad_token_id]
    assert p.codec_track[9:] == [t.codec_pad_id] * 5 + [t.codec_bos_id]

    s = build_prompt(cfg, text, speaker="vivian", language="english", non_streaming_mode=False)
    assert len(s) == 10 and s.text_track[-1] == 101 and s.codec_track[-1] == t.codec_bos_id
    assert s.trailing == [102, 103, 104, cfg.tts_eos_token_id]


def test_language_and_dialect_rules():
    cfg = _cfg()
    t = cfg.talker
    auto = build_prompt(cfg, [5], speaker="vivian", language="Auto")
    assert auto.codec_track[3:6] == [t.codec_nothink_id, t.codec_think_bos_id, t.codec_think_eos_id]
    for language in ("chinese", "auto"):
        eric = build_prompt(cfg, [5], speaker="Eric", language=language)
        assert t.codec_language_id["sichuan_dialect"] in eric.codec_track
    eric_en = build_prompt(cfg, [5], speaker="eric", language="english")
    assert t.codec_language_id["english"] in eric_en.codec_track
    dylan = build_prompt(cfg, [5], speaker="dylan", language="chinese")
    assert t.codec_language_id["beijing_dialect"] in dylan.codec_track
    with pytest.raises(PromptError, match="unknown speaker"):
        build_prompt(cfg, [5], speaker="nobody", language="english")
    with pytest.raises(PromptError, match="unsupported language"):
        build_prompt(cfg, [5], speaker="vivian", language="klingon")
    with pytest.raises(PromptError, match="empty"):
        build_prompt(cfg, [], speaker="vivian")


def test_instructions_by_model_kind_and_size():
    instruct = [151644, 872, 198, 9, 151645, 198]
    big = build_prompt(_cfg(), [5], speaker="vivian", instruct_ids=instruct)
    assert big.text_track[: len(instruct)] == instruct and big.codec_track[: len(instruct)] == [NO_CODEC] * 6
    small = build_prompt(_cfg(tts_model_size="0b6"), [5], speaker="vivian", instruct_ids=instruct)
    assert small.text_track[:3] == [151644, 77091, 198]  # the 0.6B CustomVoice drops instructions
    design = _cfg(model_type="voice_design")
    vd = build_prompt(design, [5], speaker=None, instruct_ids=instruct)
    assert len(vd) == len(instruct) + 3 + 4 + 3  # auto: 3 tags + codec_pad over the text pads; no speaker row
    with pytest.raises(PromptError):
        build_prompt(design, [5], speaker="vivian")
    with pytest.raises(PromptError):
        build_prompt(_cfg(), [5], speaker=None)


def test_kv_cache_decode_equals_full_forward(model):
    """Prefill + one-position steps against the static cache give the hidden states of one causal pass over the
    whole sequence, in any slot of a shared cache."""
    torch.manual_seed(0)
    D = model.config.talker.hidden_size
    seq = torch.randn(12, D)
    full_cache = model.new_talker_cache(1, 16)
    zero = torch.zeros(1, dtype=torch.long)
    full = model.talker(seq[None], full_cache, zero, torch.arange(12)[None])[0]

    cache = model.new_talker_cache(3, 16)
    cache.k.normal_()  # stale garbage from "previous requests" must never be visible
    cache.v.normal_()
    slot = torch.tensor([2])
    out = [model.prefill(cache, slot, [seq[:7]])]
    for p in range(7, 12):
        out.append(model.decode_step(cache, slot, torch.tensor([p]), seq[p][None]))
    stepped = torch.cat(out)
    torch.testing.assert_close(stepped, full[6:], rtol=1e-5, atol=1e-5)


def test_batched_prefill_and_decode_equal_single_rows(model):
    torch.manual_seed(1)
    D = model.config.talker.hidden_size
    a, b = torch.randn(5, D), torch.randn(9, D)
    cache = model.new_talker_cache(2, 16)
    slots = torch.tensor([1, 0])
    h = model.prefill(cache, slots, [a, b])
    x = torch.randn(2, D)
    h2 = model.decode_step(cache, slots, torch.tensor([5, 9]), x)
    for row, seq in enumerate((a, b)):
        single = model.new_talker_cache(1, 16)
        zero = torch.zeros(1, dtype=torch.long)
        hs = model.prefill(single, zero, [seq])
        hs2 = model.decode_step(single, zero, torch.tensor([seq.shape[0]]), x[row][None])
        torch.testing.assert_close(h[row], hs[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h2[row], hs2[0], rtol=1e-5, atol=1e-5)


def test_talker_sampling_pipeline_rules(model):
    cfg = model.config.talker
    eos = cfg.codec_eos_token_id
    logits = torch.zeros(1, cfg.vocab_size)
    logits[0, eos] = 100.0
    logits[0, cfg.codec_pad_id] = 90.0  # special ids are never produced
    greedy = SamplingParams().greedy()
    assert int(sample_talker(logits, None, 0, greedy, eos, model.suppress_mask, None)) < cfg.codebook_size
    assert int(sample_talker(logits, None, 1, greedy, eos, model.suppress_mask, None)) < cfg.codebook_size
    assert int(sample_talker(logits, None, 2, greedy, eos, model.suppress_mask, None)) == eos  # min_new_tokens 2

    scores = torch.tensor([[2.0, -2.0, 1.0]])
    penalised = apply_repetition_penalty(scores, torch.tensor([[0, 1, 1]]), 2.0)
    assert penalised.tolist() == [[1.0, -4.0, 1.0]]
    kept = warp(torch.tensor([[1.0, 5.0, 3.0, 4.0]]), 1.0, 2, 1.0)
    assert torch.isfinite(kept).tolist() == [[False, True, False, True]]
    nucleus = warp(torch.tensor([[0.0, 10.0, 9.0, -5.0]]), 1.0, 0, 0.5)
    assert torch.isfinite(nucleus).tolist() == [[False, True, False, False]]


def test_per_row_generators_make_rows_independent(model):
    """With one generator per row (what a serving engine uses), a request's codes do not depend on its
    neighbours in the batch."""
    params = model.sampling_params(max_new_tokens=12)
    p1 = model.make_prompt("First request.", speaker="vivian", language="english")
    p2 = model.make_prompt("Another, longer request in the same batch.", speaker="ryan", language="english")
    alone = model.generate_codes([p1], params, [torch.Generator().manual_seed(42)])[0]
    together = model.generate_codes([p1, p2], params, [torch.Generator().manual_seed(42),
                                                        torch.Generator().manual_seed(7)])[0]
    assert alone.shape[0] > 0
    assert torch.equal(alone, together)


def test_codes_are_valid_for_the_codec(model):
    codes = model.synthesize_codes("Check the value ranges.", speaker="aiden", language="english", seed=3,
                                   max_new_tokens=16)
    assert codes.shape[1] == model.num_code_groups
    assert int(codes.min()) >= 0 and int(codes.max()) < model.config.talker.codebook_size


def test_streamed_audio_equals_whole_decode(tiny_custom_voice):
    """Frames of a streaming utterance decoded chunk by chunk as they come equal one decode of all frames."""
    full = Qwen3TTS.from_pretrained(tiny_custom_voice, "cpu", torch.float32)
    utterance = full.start_utterance("Streaming audio out.", speaker="vivian", language="english", seed=9,
                                     params=full.sampling_params(max_new_tokens=14))
    stream = full.codec_stream()
    frames, chunks, pending = [], [], []
    for frame in utterance.frames():
        frames.append(frame)
        pending.append(frame)
        if len(pending) == 3:
            chunks.append(stream.decode(torch.stack(pending)))
            pending = []
    chunks.append(stream.decode(torch.stack(pending)) if pending else torch.zeros(0))
    streamed = torch.cat(chunks)
    whole = full.decode_codes(torch.stack(frames))
    assert streamed.shape == (len(frames) * 1920,)
    torch.testing.assert_close(streamed, whole, rtol=0, atol=1e-5)
    assert float(whole.abs().max()) > 0


@pytest.mark.parametrize("size,params", [("1.7b", 1_916_676_352), ("0.6b", 905_788_672)])
def test_full_size_layout_matches_released_parameter_counts(size, params):
    """The writer's tensor list for the released shapes, and our modules built on the meta device, agree with each
    other name for name and shape for shape, and with the released parameter totals (spec §7.4)."""
    import math

    from tts_backend.qwen3.loader import ModelWeights, model_name_map
    from tts_backend.qwen3.testing.checkpoint import model_tensor_shapes

    config = model_config(size)
    shapes = model_tensor_shapes(config)
    assert sum(math.prod(s) for s in shapes.values()) == params
    with torch.device("meta"):
        weights = ModelWeights(Qwen3TTSConfig.from_dict(config))
    names = model_name_map(weights)
    state = weights.state_dict()
    assert set(names) == set(shapes)
    assert all(tuple(state[names[k]].shape) == shape for k, shape in shapes.items())
