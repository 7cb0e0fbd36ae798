"""Voice cloning with a Base checkpoint, against the reference qwen-tts 0.1.1 on a tiny random Base checkpoint in
the official layout (fp32, CPU).

The reference runs in its own cached virtualenv (tests/reference_env.py) on the same folder and the same clips
(tests/reference_scripts/qwen3_ref_clone.py): its `create_voice_clone_prompt` gives the x-vector and the reference
codes, its `generate_voice_clone` the codes (recorded from the model's generate) and the waveform. Ours must give
the same log-mel, x-vector and codes exactly, and the waveform to fp32 rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.qwen3_fixtures import single_torch_thread, tiny_base, tiny_custom_voice  # noqa: F401
from tests.reference_env import run_reference
from tts_backend.qwen3.generate import Qwen3TTS
from tts_backend.qwen3.loader import CheckpointError
from tts_backend.qwen3.prompt import PromptError, VoicePrompt
from tts_backend.qwen3.speaker_encoder import log_mel_spectrogram

REF_SCRIPT = Path(__file__).parent / "reference_scripts" / "qwen3_ref_clone.py"
GREEDY = {"do_sample": False, "subtalker_dosample": False}
MAX_NEW = 24
REF_TEXT = "This is the reference transcript."
LONG_TEXT = ("A longer target sentence, so that in streaming mode the reference transcript and this text do not fit "
             "beside the few frames of a very short clip and the rest is fed one token per step.")


def _clip(seconds: float, seed: int) -> np.ndarray:
    """A voiced-like test signal: five harmonics of a gliding 100-180 Hz pitch, amplitude-modulated, plus noise."""
    rng = np.random.default_rng(seed)
    n = int(seconds * 24000)
    t = np.arange(n) / 24000
    phase = 2 * np.pi * np.cumsum(140 + 40 * np.sin(2 * np.pi * 0.7 * t)) / 24000
    x = sum(0.3 / k * np.sin(k * phase) for k in range(1, 6)) * (0.6 + 0.4 * np.sin(2 * np.pi * 2.1 * t))
    return (x + 0.02 * rng.standard_normal(n)).astype(np.float32)


# 3.21 s is not a whole number of 1920-sample frames; 12.3 s gives the encoder transformer 308 positions, more than
# the config's sliding_window of 250 that the reference does not apply; 0.45 s is shorter than the texts.
CLIPS = {"short": (3.21, 1), "long": (12.3, 2), "brief": (0.45, 3)}

CASES = [
    dict(name="icl_greedy_streaming", text="Hello there, this is a cloned voice.", language="english", clip="short",
         ref_text=REF_TEXT, x_vector_only_mode=False, non_streaming_mode=False, gen=GREEDY),
    dict(name="icl_greedy_non_streaming", text="Hello there, this is a cloned voice.", language="auto",
         clip="long", ref_text=REF_TEXT, x_vector_only_mode=False, non_streaming_mode=True, gen=GREEDY),
    dict(name="icl_greedy_text_beyond_frames", text=LONG_TEXT, language="english", clip="brief",
         ref_text=REF_TEXT, x_vector_only_mode=False, non_streaming_mode=False, gen=GREEDY),
    dict(name="xvec_greedy_streaming", text="Hello there, this is a cloned voice.", language="auto", clip="short",
         ref_text=None, x_vector_only_mode=True, non_streaming_mode=False, gen=GREEDY),
    dict(name="xvec_greedy_non_streaming", text="今天天气很好，我们去公园散步吧。", language="chinese", clip="long",
         ref_text=None, x_vector_only_mode=True, non_streaming_mode=True, gen=GREEDY),
    dict(name="icl_sampled_non_streaming", text="Sampling with a seed.", language="english", clip="short",
         ref_text="Reference words.", x_vector_only_mode=False, non_streaming_mode=True, seed=7, gen={}),
    dict(name="icl_sampled_streaming", text="Sampling, streaming text.", language="auto", clip="long",
         ref_text="参考音频的文字。", x_vector_only_mode=False, non_streaming_mode=False, seed=11,
         gen={"repetition_penalty": 1.5, "top_p": 0.8, "top_k": 20, "subtalker_top_p": 0.9}),
    dict(name="xvec_sampled_non_streaming", text="Sampling with a seed.", language="chinese", clip="long",
         ref_text=None, x_vector_only_mode=True, non_streaming_mode=True, seed=5, gen={"temperature": 1.3}),
    dict(name="xvec_sampled_streaming", text="Streaming text, sampled.", language="english", clip="brief",
         ref_text=None, x_vector_only_mode=True, non_streaming_mode=False, seed=3, gen={}),
]
for _case in CASES:
    _case.setdefault("seed", None)
    _case["gen"] = {"max_new_tokens": MAX_NEW, **_case["gen"]}


@pytest.fixture(scope="module")
def clips() -> dict[str, np.ndarray]:
    return {name: _clip(seconds, seed) for name, (seconds, seed) in CLIPS.items()}


@pytest.fixture(scope="module")
def reference(tiny_base, clips, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("qwen3-clone-reference")
    paths = {}
    for name, audio in clips.items():
        paths[name] = str(tmp / f"{name}.npy")
        np.save(paths[name], audio)
    spec = {"checkpoint": str(tiny_base), "threads": 1, "clips": paths,
            "ref_texts": sorted({c["ref_text"] for c in CASES if c["ref_text"]}), "cases": CASES}
    (tmp / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
    run_reference(REF_SCRIPT, str(tmp / "spec.json"), str(tmp / "reference.pt"))
    return torch.load(tmp / "reference.pt")


@pytest.fixture(scope="module")
def model(tiny_base) -> Qwen3TTS:
    return Qwen3TTS.from_pretrained(tiny_base, "cpu", torch.float32)


def _params(model: Qwen3TTS, gen: dict):
    return model.sampling_params(
        do_sample=gen.get("do_sample"), subtalker_do_sample=gen.get("subtalker_dosample"),
        temperature=gen.get("temperature"), top_k=gen.get("top_k"), top_p=gen.get("top_p"),
        repetition_penalty=gen.get("repetition_penalty"), subtalker_top_p=gen.get("subtalker_top_p"),
        max_new_tokens=gen["max_new_tokens"])


@pytest.mark.parametrize("clip", sorted(CLIPS))
@pytest.mark.third_party
def test_clone_prompt_matches_create_voice_clone_prompt(model, reference, clips, clip):
    ref = reference["clips"][clip]
    audio = torch.from_numpy(clips[clip])
    assert torch.equal(log_mel_spectrogram(audio[None])[0], ref["mel"])
    voice = model.clone_prompt(audio, REF_TEXT, x_vector_only=False)
    assert torch.equal(voice.x_vector, ref["x_vector"])
    assert voice.ref_codes.shape == ref["ref_code"].shape == (-(-len(audio) // 1920), 4)
    assert torch.equal(voice.ref_codes, ref["ref_code"])
    assert voice.ref_codes[:, 1:].unique().numel() > 3  # the clip exercises more than a few centroids
    xvec_only = model.clone_prompt(audio, None, x_vector_only=True)
    assert xvec_only.ref_codes is None and torch.equal(xvec_only.x_vector, ref["x_vector"])


@pytest.mark.third_party
def test_reference_text_ids_match(model, reference):
    for text, ids in reference["ref_text_ids"].items():
        assert model.tokenizer.ref_text_ids(text) == ids[3:-2]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
@pytest.mark.third_party
def test_generate_voice_clone_codes_match_reference(model, reference, clips, case):
    ref = reference["cases"][case["name"]]
    voice = model.clone_prompt(torch.from_numpy(clips[case["clip"]]), case["ref_text"], case["x_vector_only_mode"])
    # Through the serialized form, as a registry would hand it to another replica.
    voice = VoicePrompt.from_bytes(voice.to_bytes())
    prompt = model.make_prompt(case["text"], language=case["language"], voice=voice,
                               non_streaming_mode=case["non_streaming_mode"])
    if case["name"] == "icl_greedy_text_beyond_frames":
        assert prompt.trailing  # the layout's "text longer than the reference frames" branch
    generator = torch.Generator().manual_seed(case["seed"]) if case["seed"] is not None else None
    codes = model.generate_codes([prompt], _params(model, case["gen"]), generator)[0]
    assert len(codes) > 0
    assert codes.shape == ref["codes"].shape and torch.equal(codes, ref["codes"]), case["name"]
    # The waveform: the reference decodes ref_codes ++ codes and cuts the reference's share; a stream primed with
    # the reference codes gives the same samples, decoded in pieces as the backend does.
    stream = model.codec_stream(voice)
    wav = torch.cat([stream.decode(codes[:7]), stream.decode(codes[7:])])
    assert wav.shape == ref["wav"].shape
    assert float((wav - ref["wav"]).abs().max()) < 1e-5


@pytest.mark.third_party
def test_streaming_utterance_with_a_cloned_voice_matches_reference(model, reference, clips):
    """The backend's path (Utterance, text pushed in pieces) gives the reference's streaming-mode codes."""
    case = next(c for c in CASES if c["name"] == "icl_sampled_streaming")
    voice = model.clone_prompt(torch.from_numpy(clips[case["clip"]]), case["ref_text"], False)
    utterance = model.start_utterance(case["text"], language=case["language"], voice=voice, seed=case["seed"],
                                      params=_params(model, case["gen"]))
    codes = torch.stack(list(utterance.frames()))
    assert torch.equal(codes, reference["cases"][case["name"]]["codes"])


def test_voice_prompt_bytes_round_trip_and_refusals(model, clips):
    voice = model.clone_prompt(torch.from_numpy(clips["brief"]), REF_TEXT, False)
    again = VoicePrompt.from_bytes(voice.to_bytes())
    assert torch.equal(again.x_vector, voice.x_vector) and torch.equal(again.ref_codes, voice.ref_codes)
    assert again.ref_text_ids == voice.ref_text_ids and not again.x_vector_only
    only = VoicePrompt.from_bytes(model.clone_prompt(torch.from_numpy(clips["brief"]), None, True).to_bytes())
    assert only.x_vector_only and only.ref_text_ids is None
    with pytest.raises(PromptError):
        VoicePrompt.from_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(PromptError):
        VoicePrompt.from_bytes(b"not safetensors at all")
    with pytest.raises(PromptError, match="transcript"):
        model.clone_prompt(torch.from_numpy(clips["brief"]), None, x_vector_only=False)
    with pytest.raises(PromptError, match="voice prompt"):
        model.make_prompt("No voice given.")
    wrong = VoicePrompt(torch.zeros(7))
    with pytest.raises(PromptError, match="x-vector"):
        model.make_prompt("Wrong width.", voice=wrong)


def test_custom_voice_checkpoint_cannot_clone(tiny_custom_voice, clips):
    cv = Qwen3TTS.from_pretrained(tiny_custom_voice, "cpu", torch.float32, load_codec=False)
    with pytest.raises(PromptError, match="Base"):
        cv.clone_prompt(torch.from_numpy(clips["brief"]), None, True)


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_strict_loader_names_a_missing_speaker_encoder_or_codec_encoder_tensor(tiny_base, tmp_path):
    broken = _copy_checkpoint(tiny_base, tmp_path / "no-speaker-encoder")
    tensors = load_file(broken / "model.safetensors")
    del tensors["speaker_encoder.asp.conv.weight"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match="speaker_encoder.asp.conv.weight"):
        Qwen3TTS.from_pretrained(broken, "cpu", torch.float32)

    broken = _copy_checkpoint(tiny_base, tmp_path / "no-mimi-codebook")
    codec = broken / "speech_tokenizer" / "model.safetensors"
    tensors = load_file(codec)
    name = "encoder.quantizer.acoustic_residual_vector_quantizer.layers.2.codebook.embed_sum"
    del tensors[name]
    save_file(tensors, codec)
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        Qwen3TTS.from_pretrained(broken, "cpu", torch.float32)


@pytest.mark.parametrize("size,total,speaker_encoder", [("0.6b", 914_643_008, 8_854_336),
                                                        ("1.7b", 1_928_677_440, 12_001_088)])
def test_released_base_layouts_load_tensor_for_tensor(size, total, speaker_encoder):
    """The released Base files (design doc §7.2-§7.4, totals from their published sizes): every tensor of
    model.safetensors and every encoder.* tensor of the speech tokenizer is either loaded into a module of the
    same shape or one of the few named as unused, and the counts add up to the published parameter totals."""
    import math

    from tts_backend.qwen3.codec_encoder import (
        CodecEncoder, CodecEncoderConfig, codec_encoder_name_map, is_unused_encoder_tensor)
    from tts_backend.qwen3.config import Qwen3TTSConfig
    from tts_backend.qwen3.loader import ModelWeights, model_name_map
    from tts_backend.qwen3.testing.checkpoint import model_config, model_tensor_shapes
    from tts_backend.qwen3.testing.codec_checkpoint import speech_tokenizer_config, speech_tokenizer_tensor_shapes

    config = model_config(size, "base")
    shapes = model_tensor_shapes(config)
    assert sum(math.prod(s) for s in shapes.values()) == total
    with torch.device("meta"):
        weights = ModelWeights(Qwen3TTSConfig.from_dict(config))
    state = weights.state_dict()
    names = model_name_map(weights)
    assert set(names) == set(shapes)
    assert all(tuple(state[names[n]].shape) == s for n, s in shapes.items())
    assert sum(p.numel() for p in weights.speaker_encoder.parameters()) == speaker_encoder
    assert len(weights.speaker_encoder.state_dict()) == 76

    tokenizer = speech_tokenizer_config("full")
    encoder_shapes = {n: s for n, s in speech_tokenizer_tensor_shapes(tokenizer).items() if n.startswith("encoder.")}
    assert sum(math.prod(s) for s in encoder_shapes.values()) == 56_234_304
    cfg = CodecEncoderConfig.from_dict(tokenizer)
    with torch.device("meta"):
        encoder = CodecEncoder(cfg)
    encoder_state = encoder.state_dict()
    mapped = codec_encoder_name_map(encoder)
    assert set(mapped) == {n for n in encoder_shapes if not is_unused_encoder_tensor(n, cfg)}
    assert all(tuple(encoder_state[mapped[n]].shape) == encoder_shapes[n] for n in mapped)
    assert len(encoder.quantizer.acoustic_residual_vector_quantizer.layers) == 15  # 16 valid books in all
