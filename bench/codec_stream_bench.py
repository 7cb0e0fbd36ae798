"""Micro-benchmark of the 12 Hz codec decoder's stateful streaming: time per decode_chunk call.

For each config (tiny: the CPU test config; full: the released Qwen3-TTS-Tokenizer-12Hz shapes), device, batch
size and chunk size (frames per call), the stream is first advanced past the 72-frame attention window so the
K/V history is full, then `--iters` calls are timed. Weights are random (timing does not depend on values).

    python bench/codec_stream_bench.py                          # tiny+full, CPU (+ CUDA when available)
    python bench/codec_stream_bench.py --sizes full --devices cuda --batches 1 8 32 --json out.json

Reported per row: ms per call, ms per frame, and the real-time factor (audio produced / compute time;
> 1 means faster than real time). On CUDA, calls are synchronised before the clock is read.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from tts_backend.qwen3.codec import CodecDecoder, CodecDecoderConfig
from tts_backend.qwen3.testing.codec_checkpoint import speech_tokenizer_config

FRAME_SECONDS = 0.08  # 1920 samples at 24 kHz


def build(size: str, device: str) -> CodecDecoder:
    torch.manual_seed(0)
    decoder = CodecDecoder(CodecDecoderConfig.from_dict(speech_tokenizer_config(size)))
    return decoder.to(device).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_chunks(decoder: CodecDecoder, device: str, batch: int, frames: int, iters: int, warm_frames: int) -> list[float]:
    c = decoder.config
    state = decoder.init_state(batch)
    generator = torch.Generator().manual_seed(frames)
    total = warm_frames + iters * frames
    codes = torch.randint(0, c.codebook_size, (batch, c.num_quantizers, total), generator=generator).to(device)
    with torch.inference_mode():
        start = 0
        while start < warm_frames:  # fill the window (and warm up kernels for this shape)
            step = min(frames, warm_frames - start)
            decoder.decode_chunk(codes[:, :, start:start + step], state)
            start += step
        times = []
        for _ in range(iters):
            sync(device)
            t0 = time.perf_counter()
            decoder.decode_chunk(codes[:, :, start:start + frames], state)
            sync(device)
            times.append(time.perf_counter() - t0)
            start += frames
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "full"], choices=["tiny", "full"])
    parser.add_argument("--devices", nargs="+", default=None, help="default: cpu, plus cuda when available")
    parser.add_argument("--batches", nargs="+", type=int, default=[1])
    parser.add_argument("--chunks", nargs="+", type=int, default=[2, 4, 8, 12])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warm-frames", type=int, default=80)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])

    hardware = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
    }
    rows = []
    print(f"hardware: {hardware}")
    print("| size | device | batch | frames/call | ms/call (median) | ms/call (min) | ms/frame | real-time factor |")
    print("|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        for device in devices:
            decoder = build(size, device)
            for batch in args.batches:
                for frames in args.chunks:
                    times = time_chunks(decoder, device, batch, frames, args.iters, args.warm_frames)
                    median = statistics.median(times)
                    row = {
                        "size": size, "device": device, "batch": batch, "frames_per_call": frames,
                        "ms_per_call_median": round(median * 1e3, 3), "ms_per_call_min": round(min(times) * 1e3, 3),
                        "ms_per_frame": round(median * 1e3 / frames, 3),
                        "real_time_factor": round(batch * frames * FRAME_SECONDS / median, 2),
                    }
                    rows.append(row)
                    print(f"| {size} | {device} | {batch} | {frames} | {row['ms_per_call_median']} | "
                          f"{row['ms_per_call_min']} | {row['ms_per_frame']} | {row['real_time_factor']} |", flush=True)
            del decoder
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"hardware": hardware, "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
