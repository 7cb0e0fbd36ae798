"""Parity of our Qwen3-ForcedAligner (tts_backend/aligner) with the reference qwen-asr 0.0.6, on tiny random
checkpoints in the released layout (fp32, CPU).

The reference runs in its own cached virtualenv (tests/reference_env.py) over the same checkpoint folders and the
same 16 kHz clips (tests/reference_scripts/aligner_ref_align.py). Per case, batched as the reference batches:
the log-mel features, the prompt token ids, the timestamp class at every `<timestamp>` slot (identical), the
head's logits there (to fp32 rounding) and the final word times after the monotonic repair (identical). The word
splitting and the repair are also compared on inputs of their own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.qwen3_fixtures import single_torch_thread  # noqa: F401
from tests.reference_env import run_asr_reference
from tts_backend.aligner import AlignRequest, load_aligner
from tts_backend.aligner.features import log_mel
from tts_backend.aligner.testing.checkpoint import write_aligner_checkpoint
from tts_backend.aligner.words import repair_monotonic, split_words
from tts_backend.qwen3.loader import CheckpointError

REF_SCRIPT = Path(__file__).parent / "reference_scripts" / "aligner_ref_align.py"


def _clip(seconds: float, seed: int) -> np.ndarray:
    """Speech-like test signal: a gliding tone with syllable-rate bursts of noise, silent gaps, peak ~0.5."""
    n = int(round(seconds * 16000))
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16000
    envelope = np.clip(np.sin(2 * np.pi * (2.5 + seed % 3) * t), 0, None) ** 2
    tone = np.sin(2 * np.pi * (140 + 60 * np.sin(t * (1 + seed))) * t)
    return (0.5 * envelope * (0.7 * tone + 0.3 * rng.standard_normal(n))).astype(np.float32)


# Lengths cover: one chunk (< 1 s), an exact chunk boundary (16000 samples = 100 frames), sample counts that are
# not a multiple of the hop (the batch padding rule), several chunks, and (windowed config) several windows.
CLIPS = {"short": (0.45, 1), "one_second": (1.0, 2), "odd": (2.3731, 3), "long": (3.61, 4), "mid": (1.7777, 5)}
CASES = [
    dict(name="single_en", clips=["odd"], texts=["Hello world, this is a parity test of the aligner."],
         languages=["English"]),
    dict(name="single_zh", clips=["mid"], texts=["今天天气很好，我们去公园散步吧。"], languages=["Chinese"]),
    dict(name="batch3_mixed", clips=["short", "long", "one_second"],
         texts=["Hi there!", "It's 3.14 o'clock -- we'll meet at 221B Baker St., OK? Ünïcödé café.",
                "Hello 世界, mixed 中文 and English."],
         languages=["English", "English", "Chinese"]),
    dict(name="batch2_de", clips=["mid", "odd"], texts=["Guten Morgen, wie geht's?", "Zweite Zeile, etwas länger."],
         languages=["German", "German"]),
]
WORD_TEXTS = [
    ("Hello world, this is a parity test.", "English"),
    ("It's 3:45pm -- we'll meet at 221B Baker St.   OK?\n\nNew paragraph\twith tab.", "English"),
    ("今天天气很好，我们去公园散步吧。北京的秋天最美！", "Chinese"),
    ("Ünïcödé café naïve résumé — “quotes” … 😀👍🏽 don't", "French"),
    ("abc中文def 123", "Chinese"),
    ("... --- !!!", "English"),
]
REPAIR = [
    [5.0], [80.0, 160.0, 240.0], [80.0, 4000.0, 160.0, 240.0], [80.0, 160.0, 0.0, 400.0],
    [80.0, 160.0, 240.0, 320.0, 0.0, 0.0, 0.0, 800.0, 880.0, 960.0, 1040.0], [500.0, 80.0, 160.0],
    [400.0, 400.0, 80.0, 80.0, 80.0, 720.0], [960.0, 880.0, 800.0, 720.0, 640.0], [0.0, 0.0, 0.0],
    [160.0, 80.0, 240.0, 80.0, 320.0, 400.0, 0.0, 0.0, 0.0, 0.0, 480.0, 80.0],
]


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, tuple[np.ndarray, Path]]:
    folder = tmp_path_factory.mktemp("aligner-clips")
    out = {}
    for name, (seconds, seed) in CLIPS.items():
        audio = _clip(seconds, seed)
        np.save(folder / f"{name}.npy", audio)
        out[name] = (audio, folder / f"{name}.npy")
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return {size: write_aligner_checkpoint(tmp_path_factory.mktemp(f"aligner-{size}"), size, seed=seed)
            for size, seed in (("tiny", 0), ("tiny-windowed", 1))}


@pytest.fixture(scope="module")
def reference(checkpoints, clips, tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("aligner-reference")
    results = {}
    for size, folder in checkpoints.items():
        spec = {"checkpoint": str(folder), "windowed": size == "tiny-windowed", "words": WORD_TEXTS,
                "repair": REPAIR,
                "cases": [dict(name=c["name"], texts=c["texts"], languages=c["languages"],
                               audio=[str(clips[k][1]) for k in c["clips"]]) for c in CASES]}
        (tmp / f"{size}.json").write_text(json.dumps(spec), encoding="utf-8")
        run_asr_reference(REF_SCRIPT, str(tmp / f"{size}.json"), str(tmp / f"{size}.pt"))
        results[size] = torch.load(tmp / f"{size}.pt")
    return results


@pytest.fixture(scope="module")
def aligners(checkpoints):
    return {size: load_aligner(folder, "cpu", torch.float32) for size, folder in checkpoints.items()}


@pytest.mark.parametrize("size", ["tiny", "tiny-windowed"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
@pytest.mark.third_party
def test_timestamp_classes_and_word_times_match_reference(aligners, reference, clips, size, case):
    aligner, ref = aligners[size], reference[size][case["name"]]
    audio = [clips[k][0] for k in case["clips"]]
    words = [split_words(t, lang) for t, lang in zip(case["texts"], case["languages"])]

    for clip, ref_features in zip(audio, ref["features"]):
        features = log_mel(clip, 128)
        assert features.shape == ref_features.shape
        assert float((features - ref_features).abs().max()) < 1e-5

    classes = aligner.timestamp_classes(audio, words)
    assert classes == ref["classes"]
    assert sum(len(c) for c in classes) > 0

    # The logits behind the classes agree to fp32 rounding, so equal classes are not luck of a wide margin only.
    trace_rows = [row for row in ref["logits"] if row.numel()]
    ours = _slot_logits(aligner, audio, words)
    for mine, theirs in zip([r for r in ours if r.numel()], trace_rows):
        assert float((mine - theirs).abs().max() / theirs.abs().max()) < 1e-4

    requests = [AlignRequest(a, 16000, t, lang) for a, t, lang in zip(audio, case["texts"], case["languages"])]
    got = aligner.align(requests)
    assert got == [[tuple(item) for item in row] for row in ref["items"]]
    for row in got:
        starts_ends = [t for _, s, e in row for t in (s, e)]
        assert starts_ends == sorted(starts_ends)


def _slot_logits(aligner, audio, words) -> list[torch.Tensor]:
    """The head's logits at each row's timestamp slots, captured on the way through the aligner's padded pass."""
    captured = {}
    handle = aligner.thinker.lm_head.register_forward_hook(lambda m, i, o: captured.setdefault("logits", o))
    try:
        batch = aligner.prepare(audio, words)
        aligner.run(batch)
    finally:
        handle.remove()
    return [captured["logits"][b, slots] for b, slots in enumerate(batch.slots)]


@pytest.mark.third_party
def test_prompt_ids_match_reference(aligners, reference, clips):
    """Our tokenizer over our prompt gives the reference processor's input ids (placeholders, words, slots)."""
    from tts_backend.aligner.features import encoder_tokens
    from tts_backend.aligner.words import prompt_text

    aligner = aligners["tiny"]
    case = next(c for c in CASES if c["name"] == "batch3_mixed")
    frames = [log_mel(clips[k][0], 128).shape[1] for k in case["clips"]]
    for text, lang, n, ref_ids in zip(case["texts"], case["languages"], frames,
                                      reference["tiny"][case["name"]]["input_ids"]):
        prompt = prompt_text(split_words(text, lang), encoder_tokens(n, aligner.cfg.audio.chunk_frames))
        assert aligner.tokenizer.encode(prompt) == ref_ids


@pytest.mark.third_party
def test_word_split_matches_reference(reference):
    for text, lang in WORD_TEXTS:
        assert split_words(text, lang) == reference["tiny"]["words"][text], text


@pytest.mark.third_party
def test_monotonic_repair_matches_reference(reference):
    for seq, ref in zip(REPAIR, reference["tiny"]["repair"]):
        assert repair_monotonic(seq) == ref, seq


def test_loader_refuses_a_checkpoint_that_does_not_match(checkpoints, tmp_path):
    """The one strict loader: a missing, extra or mis-shaped tensor is an error naming it."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(checkpoints["tiny"] / "model.safetensors"))
    broken = {
        "missing": {k: v for k, v in tensors.items() if k != "thinker.lm_head.weight"},
        "extra": {**tensors, "thinker.audio_tower.conv1.weight": torch.zeros(2)},
        "shape": {**tensors, "thinker.model.norm.weight": torch.zeros(7, dtype=torch.bfloat16)},
    }
    expected = {"missing": "missing tensor 'thinker.lm_head.weight'",
                "extra": "unexpected tensor 'thinker.audio_tower.conv1.weight'",
                "shape": "tensor 'thinker.model.norm.weight' has shape [7]"}
    for kind, content in broken.items():
        folder = tmp_path / kind
        shutil.copytree(checkpoints["tiny"], folder)
        save_file(content, str(folder / "model.safetensors"))
        with pytest.raises(CheckpointError, match=re.escape(expected[kind])):
            load_aligner(folder, "cpu", torch.float32)


def test_a_sentence_is_timed_the_same_alone_and_in_any_batch(aligners, clips):
    """A sentence's times do not depend on the sentences that share its batch (the server batches unrelated
    sessions): each row of a batch equals the sentence aligned alone, in either order."""
    requests = [AlignRequest(clips[k][0], 16000, text, "English") for k, text in
                (("long", "The longest clip of the batch."), ("short", "Short one."), ("odd", "A third, odd length."))]
    for size, aligner in aligners.items():
        alone = [aligner.align([r])[0] for r in requests]
        assert aligner.align(requests) == alone, size
        assert aligner.align(requests[::-1]) == alone[::-1], size


def test_a_sentence_without_words_gives_no_times(aligners, clips):
    """Punctuation only: nothing to time (the reference's repair fails on an empty sequence); the other sentence
    of the batch is still aligned."""
    got = aligners["tiny"].align([AlignRequest(clips["mid"][0], 16000, "...!?", "English"),
                                  AlignRequest(clips["odd"][0], 16000, "Two words.", "English")])
    assert got[0] == [] and [w for w, _, _ in got[1]] == ["Two", "words"]
    assert aligners["tiny"].align([AlignRequest(clips["mid"][0], 16000, "— …", "English")]) == [[]]
    # Audio shorter than one analysis window: the words are all at 0, and the batch still aligns the rest.
    got = aligners["tiny"].align([AlignRequest(clips["mid"][0][:150], 16000, "Too short.", "English"),
                                  AlignRequest(np.zeros(0, np.int16), 24000, "Empty.", "English"),
                                  AlignRequest(clips["odd"][0], 16000, "Two words.", "English")])
    assert got[:2] == [[("Too", 0.0, 0.0), ("short", 0.0, 0.0)], [("Empty", 0.0, 0.0)]]
    assert [w for w, _, _ in got[2]] == ["Two", "words"]


def test_resampled_audio_and_int16_align(aligners, clips):
    """Audio at the TTS rate (24 kHz int16) goes through the same path: resampled to 16 kHz, scaled to [-1, 1]."""
    import soxr

    audio = clips["odd"][0]
    at_24k = soxr.resample(audio, 16000, 24000, quality="HQ")
    pcm = np.clip(at_24k * 32768, -32768, 32767).astype(np.int16)
    got = aligners["tiny"].align([AlignRequest(pcm, 24000, "Resampled audio still aligns.", "English")])
    assert [w for w, _, _ in got[0]] == ["Resampled", "audio", "still", "aligns"]
    assert all(0 <= s <= e for _, s, e in got[0])


def test_padding_to_any_bucket_leaves_the_times_alone(aligners, clips):
    """The padded passes (rows, audio chunks and prompt positions rounded up to fixed buckets, as the captured
    graphs take them on a GPU) give each sentence the times it gets at the tightest fit and at much larger
    padding, for clips of one chunk (whose convolutions must not see the padding), several chunks and windows."""
    from tts_backend.aligner.model import Buckets

    requests = [AlignRequest(clips[k][0], 16000, text, "English") for k, text in
                (("short", "Short one."), ("long", "The longest clip of the batch, with more words."),
                 ("one_second", "Exactly a second."), ("odd", "A third, odd length."))]
    for size, aligner in aligners.items():
        default = aligner.buckets
        try:
            results = {}
            for name, buckets in (("tight", Buckets(rows=(1,), chunks=(1,), lengths=(1,))),
                                  ("default", default),
                                  ("wide", Buckets(rows=(16,), chunks=(12,), lengths=(512,)))):
                aligner.buckets = buckets
                results[name] = (aligner.align(requests), [aligner.align([r])[0] for r in requests])
            assert results["default"][0] == results["default"][1], size
            assert results["tight"] == results["default"] == results["wide"], size
            assert all(row for row in results["default"][0])
        finally:
            aligner.buckets = default


def test_prompt_ids_are_the_prompt_text_encoded(aligners):
    """The prompt's ids are built from its parts (each word encoded once): the same as encoding prompt_text."""
    from tts_backend.aligner.words import prompt_text

    aligner = aligners["tiny"]
    for text, lang in WORD_TEXTS:
        words = split_words(text, lang)
        for audio_tokens in (1, 13, 40):
            assert aligner.prompt_ids(words, audio_tokens) == aligner.tokenizer.encode(prompt_text(words, audio_tokens))
