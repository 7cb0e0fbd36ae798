"""The reference implementation (qwen-tts 0.1.1, Hugging Face Transformers) at concurrency 1, for comparison.

    python bench/engine_reference.py --model /tmp/qwen3-1.7b-random --requests 10 --output ref.json

Runs `Qwen3TTSModel.generate_custom_voice` one request at a time on ARCTIC prompts (seeded order), each capped
at the frames its text takes at 15 characters per second like the engine benchmark (random weights never
end on their own). The reference does not stream: its time to first audio is the time to the whole clip.
Reports per-request wall time, audio seconds and RTF (wall / audio). Needs an environment with qwen-tts
0.1.1 and transformers 4.57.3 (tests/reference_env.py builds one; on the GPU machine carry the wheels).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent / "data" / "arctic_en.jsonl"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--speaker", default="ryan")
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chars-per-second", type=float, default=15.0)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)

    import torch
    from qwen_tts import Qwen3TTSModel

    prompts = [json.loads(line)["text"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    rng = random.Random(f"voxgate-prompts-{args.seed}")
    texts = [prompts[rng.randrange(len(prompts))] for _ in range(args.warmup + args.requests)]
    started = time.perf_counter()
    wrapper = Qwen3TTSModel.from_pretrained(args.model, dtype=getattr(torch, args.dtype), device_map=args.device)
    load_s = time.perf_counter() - started

    rows = []
    for i, text in enumerate(texts):
        frames = max(2, math.ceil(len(text.strip()) / args.chars_per_second * 12.5))
        torch.manual_seed(args.seed + i)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        wavs, sample_rate = wrapper.generate_custom_voice(
            text=text, speaker=args.speaker, language="English", max_new_tokens=frames + 1)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        audio_s = len(wavs[0]) / sample_rate
        if i >= args.warmup:
            rows.append({"chars": len(text), "frame_cap": frames, "wall_s": wall, "audio_s": audio_s,
                         "rtf": wall / audio_s if audio_s else None})
            print(f"request {i - args.warmup}: {len(text)} chars, {audio_s:.2f} s audio in {wall * 1000:.0f} ms", flush=True)

    def q(values, p):
        ordered = sorted(values)
        return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)] if ordered else None

    walls = [r["wall_s"] for r in rows]
    rtfs = [r["rtf"] for r in rows if r["rtf"] is not None]
    report = {
        "tool": "bench/engine_reference.py", "command": " ".join(["python", "bench/engine_reference.py", *(argv or sys.argv[1:])]),
        "implementation": "qwen-tts 0.1.1 generate_custom_voice (non-streaming: first audio = whole clip)",
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "load_s": load_s, "requests": rows,
        "ttfa_s": {"p50": q(walls, 50), "p95": q(walls, 95)},
        "rtf": {"p50": q(rtfs, 50), "mean": statistics.fmean(rtfs) if rtfs else None},
    }
    print(f"reference at concurrency 1: time to audio p50 {report['ttfa_s']['p50'] * 1000:.0f} ms, "
          f"p95 {report['ttfa_s']['p95'] * 1000:.0f} ms; RTF p50 {report['rtf']['p50']:.3f}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
