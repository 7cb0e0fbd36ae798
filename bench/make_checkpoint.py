"""Build a full-size Qwen3-TTS checkpoint with random weights in the official layout, for GPU benchmarks.

    python bench/make_checkpoint.py --size 1.7b --out /tmp/qwen3-1.7b-random [--device cuda]
    python bench/make_checkpoint.py --size 1.7b --model-type base --out /tmp/qwen3-1.7b-base-random
    python bench/make_checkpoint.py --aligner --size 0.6b --out /tmp/qwen3-aligner-random

Writes config.json, generation_config.json, model.safetensors (bf16, the real tensor names and shapes of
Qwen3-TTS-12Hz-1.7B-CustomVoice, or of -Base with its speaker encoder), the text tokenizer files and
speech_tokenizer/ (the 12 Hz codec, fp32, with the encoder a Base model clones with), through the model's own
checkpoint writer (tts_backend/qwen3/testing/checkpoint.py). With --aligner: Qwen3-ForcedAligner-0.6B's
folder (tts_backend/aligner/testing/checkpoint.py), for word timestamps (`-o aligner=DIR`). Random weights give
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
    parser.add_argument("--size", default="1.7b", choices=["tiny", "0.6b", "1.7b"],
                        help="the TTS model's size; with --aligner, tiny or 0.6b (the released aligner)")
    parser.add_argument("--model-type", default="custom_voice", choices=["custom_voice", "voice_design", "base"])
    parser.add_argument("--aligner", action="store_true", help="write a forced-aligner checkpoint instead")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where random tensors are drawn (cuda is much faster)")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    if args.aligner:
        from tts_backend.aligner.testing.checkpoint import write_aligner_checkpoint

        if args.size == "1.7b":
            parser.error("the forced aligner is released at 0.6b only")
        folder = write_aligner_checkpoint(args.out, args.size, seed=args.seed)
    else:
        from tts_backend.qwen3.testing.checkpoint import write_checkpoint

        folder = write_checkpoint(args.out, args.size, model_type=args.model_type, seed=args.seed,
                                  device=args.device)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    print(f"wrote {folder}: {len(files)} files, {total / 1e9:.2f} GB in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
