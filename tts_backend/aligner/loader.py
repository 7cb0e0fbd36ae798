"""Qwen3-ForcedAligner checkpoint folder -> ForcedAligner, through the one strict loader.

The folder is the released layout: config.json, model.safetensors (`thinker.audio_tower.*`, `thinker.model.*`,
`thinker.lm_head.weight`; bf16 in the release) and the tokenizer files (vocab.json, merges.txt,
tokenizer_config.json with `<|audio_start|>`, `<|audio_end|>`, `<|audio_pad|>` and `<timestamp>`). Every tensor
must be there with its exact shape, and nothing else may be (tts_backend.qwen3.loader.load_tensors_strict).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tts_backend.qwen3.loader import MODEL_FILE, CheckpointError, SafetensorsFile, load_tensors_strict
from tts_backend.qwen3.tokenizer import TextTokenizer

from .config import AlignerConfig
from .encoder import sinusoid_positions
from .model import ForcedAligner

REQUIRED_FILES = ("config.json", MODEL_FILE, "vocab.json", "merges.txt", "tokenizer_config.json")


def load_aligner(
    folder: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16
) -> ForcedAligner:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"aligner checkpoint folder {folder} does not exist")
    for name in REQUIRED_FILES:
        if not (folder / name).is_file():
            raise CheckpointError(f"missing file {folder / name} (the forced aligner checkpoint)")
    cfg = AlignerConfig.from_json(folder / "config.json")
    tokenizer = TextTokenizer.from_folder(folder)
    for token, want in (("<|audio_pad|>", cfg.audio_token_id), ("<timestamp>", cfg.timestamp_token_id),
                        ("<|audio_start|>", cfg.audio_start_token_id), ("<|audio_end|>", cfg.audio_end_token_id)):
        if tokenizer.token_id(token) != want:
            raise CheckpointError(f"{folder / 'tokenizer_config.json'}: {token} has id {tokenizer.token_id(token)},"
                                  f" config.json says {want}")
    with torch.device("meta"):
        aligner = ForcedAligner(cfg, tokenizer)
    aligner = aligner.to_empty(device=device).to(dtype)
    # The position table is not in the file and to_empty left it uninitialised: rebuild it (fp32, like the
    # reference's; it is cast where it is added).
    aligner.thinker.audio_tower.positional_embedding = sinusoid_positions(
        cfg.audio.max_source_positions, cfg.audio.d_model).to(device)
    path = folder / MODEL_FILE
    names = {name: name for name in aligner.state_dict()}
    load_tensors_strict(aligner, SafetensorsFile(path), path, names)
    return aligner.eval()
