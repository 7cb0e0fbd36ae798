"""The loader refuses a checkpoint that is wrong in any way, with an error naming the tensor and the file."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.qwen3_fixtures import single_torch_thread, tiny_custom_voice  # noqa: F401
from tts_backend.qwen3.config import ConfigError
from tts_backend.qwen3.generate import Qwen3TTS
from tts_backend.qwen3.loader import CheckpointError, load_tensors_strict

VICTIM = "talker.model.layers.1.self_attn.k_proj.weight"
PREDICTOR_VICTIM = "talker.code_predictor.lm_head.2.weight"


@pytest.fixture()
def broken_copy(tiny_custom_voice, tmp_path):
    """A fresh copy of the tiny checkpoint and a function that rewrites its model.safetensors."""
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_custom_voice, folder)

    def rewrite(edit):
        path = folder / "model.safetensors"
        tensors = load_file(str(path))
        edit(tensors)
        save_file(tensors, str(path))
        return folder

    return folder, rewrite


def _load(folder):
    return Qwen3TTS.from_pretrained(folder, "cpu", torch.float32, load_codec=False)


def test_intact_checkpoint_loads_every_tensor_as_stored(tiny_custom_voice):
    model = Qwen3TTS.from_pretrained(tiny_custom_voice, "cpu", torch.bfloat16)
    stored = load_file(str(tiny_custom_voice / "model.safetensors"))
    assert torch.equal(model.talker.model.layers[1].self_attn.k_proj.weight, stored[VICTIM])
    assert torch.equal(model.code_predictor.lm_head[2].weight, stored[PREDICTOR_VICTIM])
    assert torch.equal(model.code_predictor.small_to_mtp_projection.bias,
                       stored["talker.code_predictor.small_to_mtp_projection.bias"])
    assert model.talker.codec_head.weight.dtype == torch.bfloat16
    assert next(model.codec.parameters()).dtype == torch.float32  # codec as stored


def test_missing_tensor(broken_copy):
    folder, rewrite = broken_copy
    rewrite(lambda t: t.pop(VICTIM))
    with pytest.raises(CheckpointError) as err:
        _load(folder)
    assert VICTIM in str(err.value) and "missing" in str(err.value)
    assert str(folder / "model.safetensors") in str(err.value)


def test_unexpected_tensor(broken_copy):
    folder, rewrite = broken_copy
    rewrite(lambda t: t.__setitem__("talker.model.layers.9.mlp.gate_proj.weight", torch.zeros(4, 4, dtype=torch.bfloat16)))
    with pytest.raises(CheckpointError) as err:
        _load(folder)
    assert "talker.model.layers.9.mlp.gate_proj.weight" in str(err.value) and "unexpected" in str(err.value)
    assert str(folder / "model.safetensors") in str(err.value)


def test_wrong_shape(broken_copy):
    folder, rewrite = broken_copy
    rewrite(lambda t: t.__setitem__(PREDICTOR_VICTIM, t[PREDICTOR_VICTIM][:, :-1].contiguous()))
    with pytest.raises(CheckpointError) as err:
        _load(folder)
    message = str(err.value)
    assert PREDICTOR_VICTIM in message and "shape [64, 23]" in message and "expected [64, 24]" in message
    assert str(folder / "model.safetensors") in message


def test_non_float_dtype(broken_copy):
    folder, rewrite = broken_copy
    rewrite(lambda t: t.__setitem__(VICTIM, t[VICTIM].to(torch.int32)))
    with pytest.raises(CheckpointError) as err:
        _load(folder)
    message = str(err.value)
    assert VICTIM in message and "torch.int32" in message and "expected one of torch.bfloat16" in message
    assert str(folder / "model.safetensors") in message


@pytest.mark.parametrize("stored", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_a_checkpoint_stored_in_any_float_width_loads_cast(tiny_custom_voice, tmp_path, stored):
    """A fine-tune saved in fp32 or an fp16 export serves: both files rewritten in `stored`, every tensor
    arrives as its stored value cast to the module's dtype (Talker bf16, codec fp32)."""
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_custom_voice, folder)
    files = {part: folder / part / "model.safetensors" for part in ("", "speech_tokenizer")}
    for path in files.values():
        save_file({name: t.to(stored) if t.is_floating_point() else t for name, t in load_file(str(path)).items()},
                  str(path))
    model = Qwen3TTS.from_pretrained(folder, "cpu", torch.bfloat16)
    talker_file, codec_file = (load_file(str(path)) for path in files.values())
    assert talker_file[VICTIM].dtype == stored
    assert torch.equal(model.talker.model.layers[1].self_attn.k_proj.weight, talker_file[VICTIM].to(torch.bfloat16))
    assert torch.equal(model.code_predictor.lm_head[2].weight, talker_file[PREDICTOR_VICTIM].to(torch.bfloat16))
    codec_state = model.codec.state_dict()
    matched = 0
    for name, stored_tensor in codec_file.items():
        if name.startswith("decoder.") and name.removeprefix("decoder.") in codec_state:
            loaded = codec_state[name.removeprefix("decoder.")]
            assert loaded.dtype == torch.float32
            assert torch.equal(loaded, stored_tensor.to(torch.float32)), name
            matched += 1
    assert matched > 10  # the codec's weights were compared, not skipped by a name mismatch


def test_missing_speech_tokenizer(broken_copy):
    folder, _ = broken_copy
    shutil.rmtree(folder / "speech_tokenizer")
    with pytest.raises(CheckpointError) as err:
        Qwen3TTS.from_pretrained(folder, "cpu", torch.float32)
    assert "speech_tokenizer" in str(err.value) and str(folder) in str(err.value)


def test_missing_speech_tokenizer_weights(broken_copy):
    folder, _ = broken_copy
    (folder / "speech_tokenizer" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError) as err:
        Qwen3TTS.from_pretrained(folder, "cpu", torch.float32)
    assert str(folder / "speech_tokenizer" / "model.safetensors") in str(err.value)


def test_missing_tokenizer_file(broken_copy):
    folder, _ = broken_copy
    (folder / "merges.txt").unlink()
    with pytest.raises(CheckpointError) as err:
        _load(folder)
    assert str(folder / "merges.txt") in str(err.value)


def test_inconsistent_config_is_refused(broken_copy):
    folder, _ = broken_copy
    config = json.loads((folder / "config.json").read_text())
    config["talker_config"]["vocab_size"] = 2000
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="vocab_size"):
        _load(folder)


def test_load_tensors_strict_reports_every_problem_at_once():
    module = torch.nn.Linear(3, 2)
    tensors = {"w": torch.zeros(2, 4), "extra": torch.zeros(1)}
    with pytest.raises(CheckpointError) as err:
        load_tensors_strict(module, tensors, "mem.safetensors", {"w": "weight", "b": "bias"},
                            stored_dtypes=(torch.float32,))
    message = str(err.value)
    for fragment in ("missing tensor 'b'", "unexpected tensor 'extra'", "tensor 'w' has shape [2, 4]",
                     "mem.safetensors"):
        assert fragment in message
