"""Checkpoint configs as the reference's own config classes write them: every attribute present, the unset ones
as null. A Base checkpoint saved by qwen-tts has `"_frame_rate": null` in speech_tokenizer/config.json's
encoder_config; the reference derives the rate (sampling rate over the encoder's hop) and loads it, and so must
we, instead of stopping at start-up with "float() argument must be a string or a real number, not 'NoneType'".
A field that is really missing or of the wrong type is an error that names the file and the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.qwen3_fixtures import single_torch_thread, tiny_base  # noqa: F401
from tts_backend.qwen3.codec_encoder import CodecEncoderConfig, CodecEncoderConfigError
from tts_backend.qwen3.config import ConfigError
from tts_backend.qwen3.generate import Qwen3TTS
from tts_backend.qwen3.testing.checkpoint import write_checkpoint

REF_SCRIPT = Path(__file__).parent / "reference_scripts" / "codec_ref_config.py"


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    edit(data)
    path.write_text(json.dumps(data), encoding="utf-8")


def _clip(seconds: float = 1.0) -> torch.Tensor:
    t = np.arange(int(seconds * 24000)) / 24000
    return torch.from_numpy((0.3 * np.sin(2 * np.pi * 150 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 2 * t)))
                            .astype(np.float32))


@pytest.fixture()
def null_base(tmp_path):
    folder = write_checkpoint(tmp_path / "base", "tiny", model_type="base", seed=2)

    def tokenizer(data):
        enc = data["encoder_config"]
        enc["_frame_rate"] = None
        enc["head_dim"] = None
        enc["num_key_value_heads"] = None

    def model(data):
        data["im_start_token_id"] = None
        data["speaker_encoder_config"]["mel_dim"] = None  # the tiny one keeps the released 128

    _edit_json(folder / "speech_tokenizer" / "config.json", tokenizer)
    _edit_json(folder / "config.json", model)
    return folder


def test_a_base_checkpoint_with_null_optional_fields_loads_and_clones_as_with_them(null_base, tiny_base):
    nulls = Qwen3TTS.from_pretrained(null_base, "cpu", torch.float32, load_codec=False)
    written = Qwen3TTS.from_pretrained(tiny_base, "cpu", torch.float32, load_codec=False)
    assert nulls.codec_encoder.cfg.frame_rate == written.codec_encoder.cfg.frame_rate == 12.5
    assert nulls.config.im_start_token_id == written.config.im_start_token_id
    # Same weights (seed 2 both), so the derived config must give the same reference codes and x-vector.
    clip = _clip()
    a = nulls.clone_prompt(clip, "Reference text.", x_vector_only=False)
    b = written.clone_prompt(clip, "Reference text.", x_vector_only=False)
    assert torch.equal(a.ref_codes, b.ref_codes)
    assert torch.equal(a.x_vector, b.x_vector)


@pytest.mark.parametrize("field, value, named", [
    ("sampling_rate", None, "missing key 'sampling_rate'"),
    ("hidden_size", "abc", "hidden_size = 'abc' is not a valid int"),
])
def test_a_bad_encoder_field_is_named_with_its_file(tmp_path, field, value, named):
    folder = write_checkpoint(tmp_path / "base", "tiny", model_type="base", seed=2)
    config = folder / "speech_tokenizer" / "config.json"
    _edit_json(config, lambda d: d["encoder_config"].__setitem__(field, value))
    with pytest.raises(CodecEncoderConfigError) as error:
        CodecEncoderConfig.from_json(config)
    assert str(config) in str(error.value) and named in str(error.value)


def test_a_bad_model_config_field_is_named_with_its_file(tmp_path):
    folder = write_checkpoint(tmp_path / "base", "tiny", model_type="base", seed=2)
    _edit_json(folder / "config.json", lambda d: d.__setitem__("tts_eos_token_id", "x"))
    with pytest.raises(ConfigError) as error:
        Qwen3TTS.from_pretrained(folder, "cpu", torch.float32, load_codec=False)
    assert str(folder / "config.json") in str(error.value) and "tts_eos_token_id" in str(error.value)


@pytest.mark.slow
@pytest.mark.third_party
def test_the_config_the_reference_writes_loads_with_the_rate_it_derives(tmp_path):
    from tests.reference_env import run_reference

    folder = write_checkpoint(tmp_path / "base", "tiny", model_type="base", seed=2)
    saved, derived = tmp_path / "saved", tmp_path / "derived.json"
    run_reference(REF_SCRIPT, folder / "speech_tokenizer" / "config.json", saved, derived)
    written = json.loads((saved / "config.json").read_text(encoding="utf-8"))
    assert written["encoder_config"].get("_frame_rate", None) is None  # what the issue found: null or absent
    reference = json.loads(derived.read_text(encoding="utf-8"))
    ours = CodecEncoderConfig.from_json(saved / "config.json")
    assert ours.frame_rate == reference["frame_rate"]
    assert ours.downsample_kernel == reference["downsample_kernel"]
