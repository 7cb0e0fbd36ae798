"""Shared fixtures for the Qwen3-TTS tests: tiny random checkpoints (spec §9.3), written once per session."""

from __future__ import annotations

import pytest

from tts_backend.qwen3.testing.checkpoint import write_checkpoint


@pytest.fixture(scope="session")
def tiny_custom_voice(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen3-tiny-cv"), "tiny", model_type="custom_voice", seed=0)


@pytest.fixture(scope="session")
def tiny_voice_design(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen3-tiny-vd"), "tiny", model_type="voice_design", seed=1)


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    """A Base (voice clone) checkpoint: speaker encoder in model.safetensors, Mimi encoder in the tokenizer."""
    return write_checkpoint(tmp_path_factory.mktemp("qwen3-tiny-base"), "tiny", model_type="base", seed=2)


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread():
    """The tiny model's ops are far too small to gain from intra-op threads; on a busy 2-core CI machine the
    thread hand-offs cost ten times the arithmetic. Restored after the module."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
