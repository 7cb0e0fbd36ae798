"""bench/make_checkpoint.py's Base and forced-aligner checkpoints (issue 23): what `bench/h200.sh` builds on the
GPU machine to measure cloned voices and word timestamps. At tiny sizes the folders it writes load through the
real loaders and work (a Base clones a voice, the aligner aligns); at full size the writer's tensor list must be
exactly what our modules load, name for name and shape for shape (checked on the meta device: no 1 GB write)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent


def _make(*args: str) -> None:
    subprocess.run([sys.executable, str(ROOT / "bench" / "make_checkpoint.py"), *args], check=True, timeout=600,
                   capture_output=True)


def test_make_checkpoint_writes_a_base_model_that_clones(tmp_path):
    from tts_backend.qwen3.generate import Qwen3TTS

    _make("--size", "tiny", "--model-type", "base", "--out", str(tmp_path / "base"))
    model = Qwen3TTS.from_pretrained(tmp_path / "base", "cpu", torch.float32, load_codec=False)
    assert model.config.tts_model_type == "base"
    t = np.arange(24000) / 24000
    clip = torch.from_numpy((0.3 * np.sin(2 * np.pi * 150 * t)).astype(np.float32))
    prompt = model.clone_prompt(clip, "Some reference words.", x_vector_only=False)
    assert prompt.ref_codes.shape[0] == 13  # 1 s at 12.5 Hz, the last frame whole


def test_make_checkpoint_writes_an_aligner_that_loads(tmp_path):
    from tts_backend.aligner.loader import load_aligner

    _make("--aligner", "--size", "tiny", "--out", str(tmp_path / "aligner"))
    aligner = load_aligner(tmp_path / "aligner", "cpu", torch.float32)
    assert sum(p.numel() for p in aligner.parameters()) > 0


def test_the_full_size_aligner_layout_is_what_the_model_loads(tmp_path):
    import math

    from tts_backend.aligner.config import AlignerConfig
    from tts_backend.aligner.model import ForcedAligner
    from tts_backend.aligner.testing.checkpoint import aligner_config, aligner_tensor_shapes, write_aligner_checkpoint
    from tts_backend.qwen3.tokenizer import TextTokenizer

    config = aligner_config("0.6b")
    shapes = aligner_tensor_shapes(config)
    tokenizer = TextTokenizer.from_folder(write_aligner_checkpoint(tmp_path / "tokenizer", "tiny"))
    with torch.device("meta"):
        aligner = ForcedAligner(AlignerConfig.from_dict(config), tokenizer)
    state = {name: tuple(t.shape) for name, t in aligner.state_dict().items()}
    assert state == shapes
    # 0.6B of Qwen3 text decoder (tied embedding apart) plus the audio tower: the release's "0.6B" class
    assert 0.85e9 < sum(math.prod(s) for s in shapes.values()) < 1.0e9
