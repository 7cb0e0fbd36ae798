"""The start-up reader (tts_backend/qwen3/safetensors_file.py): what it loads is the file's content byte for byte,
through every path (direct read, chunked staging with and without a cast, CUDA), and a damaged file is refused
with an error that names it. safetensors' own load_file is the independent reference."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.qwen3_fixtures import single_torch_thread, tiny_base  # noqa: F401
from tts_backend.qwen3 import safetensors_file
from tts_backend.qwen3.generate import Qwen3TTS
from tts_backend.qwen3.loader import CheckpointError, SafetensorsFile, build_empty


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_every_loaded_tensor_is_the_files_bytes(tiny_base):
    """A Base checkpoint (talker, predictor, speaker encoder, codec decoder and encoder) loaded in the dtypes it
    is stored in: every module tensor holds exactly the stored bytes."""
    model = Qwen3TTS.from_pretrained(tiny_base, "cpu", torch.bfloat16)
    stored = load_file(str(tiny_base / "model.safetensors"))
    modules = {"talker.code_predictor.": model.code_predictor, "talker.": model.talker,
               "speaker_encoder.": model.speaker_encoder}
    compared = 0
    for name, tensor in stored.items():
        prefix = next(p for p in modules if name.startswith(p))
        loaded = modules[prefix].state_dict()[name.removeprefix(prefix)]
        assert loaded.dtype == tensor.dtype and _bytes(loaded) == _bytes(tensor), name
        compared += 1
    assert compared == len(stored) > 50
    codec_file = load_file(str(tiny_base / "speech_tokenizer" / "model.safetensors"))
    for module, prefix in ((model.codec, "decoder."), (model.codec_encoder, "encoder.")):
        state = module.state_dict()
        matched = [n for n in codec_file if n.startswith(prefix) and n.removeprefix(prefix) in state]
        assert len(matched) > 10
        for name in matched:
            assert _bytes(state[name.removeprefix(prefix)]) == _bytes(codec_file[name]), name


def _write(tmp_path, tensors):
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path))
    return path


def test_chunked_staging_casts_and_lays_out_like_copy(tmp_path, monkeypatch):
    """Staging buffers far smaller than a tensor (many chunks per tensor) into a cast destination and a
    non-contiguous one give what copy_ of the stored tensor gives."""
    monkeypatch.setattr(safetensors_file, "STAGING_BYTES", 96)
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(37, 11, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
               "c": torch.randn(9, 8, generator=g), "empty": torch.zeros(0, 3)}
    path = _write(tmp_path, tensors)
    cast = torch.empty(37, 11, dtype=torch.bfloat16)
    same = torch.empty(5, dtype=torch.bfloat16)
    strided = torch.empty(8, 9).t()
    empty = torch.empty(0, 3)
    SafetensorsFile(path).copy_into([("c", strided), ("a", cast), ("b", same), ("empty", empty)])
    assert torch.equal(cast, tensors["a"].to(torch.bfloat16))
    assert _bytes(same) == _bytes(tensors["b"])
    assert torch.equal(strided, tensors["c"])
    assert SafetensorsFile(path).tensor("a").equal(tensors["a"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_destinations_get_the_stored_values(tmp_path, monkeypatch):
    """Through the two pinned buffers, each reused many times (a small staging size), with and without a cast."""
    monkeypatch.setattr(safetensors_file, "STAGING_BYTES", 4096)
    g = torch.Generator().manual_seed(1)
    tensors = {f"w{i}": torch.randn(64, 33 + i, generator=g) for i in range(6)}
    path = _write(tmp_path, tensors)
    dests = {name: torch.empty(t.shape, device="cuda", dtype=torch.bfloat16 if i % 2 else torch.float32)
             for i, (name, t) in enumerate(tensors.items())}
    SafetensorsFile(path).copy_into(list(dests.items()))
    for name, dest in dests.items():
        assert torch.equal(dest.cpu(), tensors[name].to(dest.dtype)), name


@pytest.fixture()
def model_file(tiny_base, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_base, folder)
    return folder, folder / "model.safetensors"


def test_truncated_weights_are_refused_naming_the_file(model_file):
    folder, path = model_file
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated download") as err:
        Qwen3TTS.from_pretrained(folder, "cpu", torch.bfloat16, load_codec=False)
    assert str(path) in str(err.value)


def test_trailing_bytes_after_the_tensors_are_refused(model_file):
    folder, path = model_file
    path.write_bytes(path.read_bytes() + b"\0" * 64)
    with pytest.raises(CheckpointError, match="data section holds") as err:
        Qwen3TTS.from_pretrained(folder, "cpu", torch.bfloat16, load_codec=False)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("damage", ["header_cut", "header_garbage", "offsets_off_shape"])
def test_corrupt_header_is_refused_naming_the_file(model_file, damage):
    folder, path = model_file
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[:8], "little")
    if damage == "header_cut":
        data = data[: 8 + length // 2]
    elif damage == "header_garbage":
        data[8:12] = b"\xff\xfe{["
    else:
        # One tensor's shape claims one more row than its bytes hold (same header length: a digit swapped).
        header = data[8:8 + length].decode()
        name = "talker.model.layers.1.self_attn.k_proj.weight"
        at = header.index('"shape":[', header.index(name)) + len('"shape":[')
        digit = header[at]
        data[8 + at:8 + at + 1] = str((int(digit) % 9) + 1 if digit != "9" else 8).encode()
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as err:
        Qwen3TTS.from_pretrained(folder, "cpu", torch.bfloat16, load_codec=False)
    assert str(path) in str(err.value)


def test_build_empty_restores_the_initialisers_even_when_the_build_fails():
    before = torch.nn.init.normal_

    def failing():
        torch.nn.Embedding(4, 2)
        raise RuntimeError("build failed")

    with pytest.raises(RuntimeError, match="build failed"):
        build_empty(failing, "cpu")
    assert torch.nn.init.normal_ is before
    built = build_empty(lambda: torch.nn.Linear(3, 2), "cpu", torch.bfloat16)
    assert built.weight.device.type == "cpu" and built.weight.dtype == torch.bfloat16
    assert built.weight.is_contiguous() and torch.nn.init.normal_ is before

