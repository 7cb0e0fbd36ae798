"""Build a full-size Qwen3-TTS checkpoint with random weights in the official layout, for GPU benchmarks.

    python bench/make_checkpoint.py --size 1.7b --out /tmp/qwen3-1.7b-random [--device cuda]

Writes config.json, generation_config.json, model.safetensors (bf16, the real tensor names and shapes of
Qwen3-TTS-12Hz-1.7B-CustomVoice), the text tokenizer files and speech_tokenizer/ (the 12 Hz codec, fp32),
through the model's own checkpoint writer (tts_backend/qwen3/testing/checkpoint.py). Random weights give
the real compute cost; their audio is noise and EOS does not come naturally (see bench/README.md).

Offline machines: the tokenizer files come from a cache (VOXGATE_CACHE, default ~/.cache/voxgate) that a
connected machine fills once (`python -c "from tts_backend.qwen3.testing.checkpoint import
qwen_tokenizer_files as f; print(f())"`); carry that folder along.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1.7b", choices=["tiny", "0.6b", "1.7b"])
    parser.add_argument("--model-type", default="custom_voice", choices=["custom_voice", "voice_design"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where random tensors are drawn (cuda is much faster)")
    args = parser.parse_args(argv)

    from tts_backend.qwen3.testing.checkpoint import write_checkpoint

    started = time.perf_counter()
    folder = write_checkpoint(args.out, args.size, model_type=args.model_type, seed=args.seed, device=args.device)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    print(f"wrote {folder}: {len(files)} files, {total / 1e9:.2f} GB in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
