"""Where a codec call's device time goes, and what precision and convolution settings buy (issue 29).

On the H100 a codec call costs about 2 ms plus 78 us per stream-frame (bench/results/engine_step_h100.json:
2 x 2 frames 2.3 ms, 16 x 12 frames 16.9 ms), and the codec limits capacity. This times one full-size codec
decoder call, captured in a CUDA graph as the runner replays it, per variant:

- `fp32`: the codec before its convolution stages were fused (fp32 weights, TF32 matmuls and convolutions,
  compiled SnakeBeta and pre-transformer layers, the RVQ as one gather);
- `fp32_bench`: the same with cuDNN's benchmark mode (it times the convolution algorithms per shape);
- `bf16`: weights and state in bfloat16 (with benchmark mode), and its deviation from `fp32` on the same codes
  (the SNR of the bf16 output against the fp32 one, in dB; random weights, so a bound on the arithmetic only);
- `fp32_fused`, `bf16_fused`: the same with the convolution stages fused (engine/fused.py
  `_route_codec_convolutions`: conv biases, SnakeBetas, history updates and residual adds inside compiled
  functions and GEMMs; the runner's with codec_fused_convolutions, off by default); fp32_fused's SNR against `fp32`
  shows the fused math is the same math (rounding only);
- `bf16_fused_nlc`: the fused stages on channels-last activations (engine/codec_channels_last.py: NHWC
  convolutions on [B, T, C] views, SnakeBetas and history windows along whole rows; the runner's with
  codec_channels_last, off by default), and `bf16_fused_nlc_heuristic` beside it as `bf16_fused_heuristic` is
  beside `bf16_fused`;

and the top kernels of one `fp32` call, one `bf16_fused` call and one `bf16_fused_nlc` call by device time
(torch.profiler), to show what is left to cut.

    python bench/codec_profile.py --output /tmp/codec_profile.json          # CUDA only
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tts_backend.qwen3.codec import CodecDecoder, CodecDecoderConfig  # noqa: E402
from tts_backend.qwen3.testing.codec_checkpoint import speech_tokenizer_config  # noqa: E402

SHAPES = ((1, 2), (2, 2), (4, 2), (8, 12), (16, 12), (32, 12), (64, 12), (16, 4), (32, 4))
# name -> (weights and state dtype, cuDNN benchmark mode, fused convolution stages, channels-last stages)
VARIANTS = {
    "fp32": (torch.float32, False, False, False),
    "fp32_bench": (torch.float32, True, False, False),
    "bf16": (torch.bfloat16, True, False, False),
    "fp32_fused": (torch.float32, True, True, False),
    "bf16_fused": (torch.bfloat16, True, True, False),
    # As the runner captures it unless codec_cudnn_benchmark is on: cuDNN's heuristics pick the kernels.
    "bf16_fused_heuristic": (torch.bfloat16, False, True, False),
    "bf16_fused_nlc": (torch.bfloat16, True, True, True),
    "bf16_fused_nlc_heuristic": (torch.bfloat16, False, True, True),
}
# Variants whose kernels are profiled (report key profile_<name>) besides fp32's.
PROFILED = ("bf16_fused", "bf16_fused_nlc")


def build(dtype: torch.dtype, compile: bool, convolutions: bool = False, device: str = "cuda",
          size: str = "full", channels_last: bool = False) -> CodecDecoder:
    """A random codec of the released shapes (same weights for every variant: seed 0) on its fast path."""
    from tts_backend.engine.codec_fast import fuse_codec_activations

    torch.manual_seed(0)
    codec = CodecDecoder(CodecDecoderConfig.from_dict(speech_tokenizer_config(size))).to(device, dtype).eval()
    fuse_codec_activations(codec, compile, convolutions=convolutions, channels_last=channels_last)
    return codec


def codes_for(codec: CodecDecoder, batch: int, frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    c = codec.config
    codes = torch.randint(0, c.codebook_size, (batch, c.num_quantizers, frames), generator=g)
    return codes.to(codec.quantizer.rvq_first.output_proj.weight.device)


def warm_state(codec: CodecDecoder, batch: int) -> object:
    """A state past the attention window (what a playing stream's calls see)."""
    state = codec.init_state(batch)
    with torch.inference_mode():
        for i in range(8):
            codec.decode_chunk(codes_for(codec, batch, 12, 100 + i), state)
    return state


def time_graph(codec: CodecDecoder, batch: int, frames: int, iters: int) -> float:
    state = warm_state(codec, batch)
    codes = codes_for(codec, batch, frames, 7)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode(), torch.cuda.stream(stream):
        for _ in range(2):
            codec.decode_chunk(codes, state)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        codec.decode_chunk(codes, state)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def snr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    noise = (reference.float() - other.float()).pow(2).mean().item()
    signal = reference.float().pow(2).mean().item()
    return float("inf") if noise == 0 else 10 * torch.log10(torch.tensor(signal / noise)).item()


def deviation(fp32: CodecDecoder, other: CodecDecoder, batch: int = 4, chunks: int = 12) -> float:
    """The other codec's output against fp32's over `chunks` consecutive 4-frame calls from a fresh state."""
    a, b = fp32.init_state(batch), other.init_state(batch)
    outs_a, outs_b = [], []
    with torch.inference_mode():
        for i in range(chunks):
            codes = codes_for(fp32, batch, 4, 200 + i)
            outs_a.append(fp32.decode_chunk(codes, a))
            outs_b.append(other.decode_chunk(codes, b))
    return snr_db(torch.cat(outs_a, 1), torch.cat(outs_b, 1))


def top_kernels(codec: CodecDecoder, batch: int, frames: int, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    state = warm_state(codec, batch)
    codes = codes_for(codec, batch, frames, 9)
    with torch.inference_mode():
        codec.decode_chunk(codes, state)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            codec.decode_chunk(codes, state)
            torch.cuda.synchronize()
    rows = []
    total_us, kernels = 0.0, 0
    for e in prof.key_averages():
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        if us <= 0:
            continue
        total_us += us
        kernels += e.count
        rows.append({"name": e.key[:120], "count": e.count, "us": round(us, 1)})
    rows.sort(key=lambda r: -r["us"])
    return {"batch": batch, "frames": frames, "device_us": round(total_us, 1), "kernels": kernels, "top": rows[:top]}


def print_profile(name: str, profile: list[dict]) -> None:
    for p in profile:
        print(f"\n{name} {p['batch']} x {p['frames']}: {p['device_us'] / 1000:.2f} ms device, "
              f"{p['kernels']} kernels")
        for r in p["top"]:
            print(f"  {r['us']:9.1f} us  x{r['count']:<4} {r['name']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma separated, of {', '.join(VARIANTS)} (fp32 is always built: the SNR reference)")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    chosen = args.variants.split(",")
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}")
    if not torch.cuda.is_available():
        print("codec_profile needs CUDA")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "variants": {}}
    fp32 = build(torch.float32, True)
    report["profile"] = [top_kernels(fp32, b, f, args.top) for b, f in ((2, 2), (16, 12))]
    print_profile("fp32", report["profile"])
    for name in chosen:
        dtype, bench, convolutions, channels_last = VARIANTS[name]
        torch.backends.cudnn.benchmark = bench
        codec = fp32 if name == "fp32" else build(dtype, True, convolutions, channels_last=channels_last)
        if name in PROFILED:
            key = f"profile_{name}"
            try:
                report[key] = [top_kernels(codec, b, f, args.top) for b, f in ((2, 2), (16, 12))]
                print_profile(name, report[key])
            except Exception as exc:  # noqa: BLE001 - reported, the timings still run
                report[key] = f"failed: {type(exc).__name__}: {exc}"[:500]
                print(report[key], flush=True)
        rows = {}
        for b, f in SHAPES:
            try:
                rows[f"{b}x{f}"] = round(time_graph(codec, b, f, args.iters), 3)
            except Exception as exc:  # noqa: BLE001 - reported, the other shapes still run
                rows[f"{b}x{f}"] = f"failed: {type(exc).__name__}: {exc}"[:200]
            print(f"{name} {b}x{f}: {rows[f'{b}x{f}']} ms", flush=True)
        entry = {"ms": rows}
        if name != "fp32":
            entry["snr_db_vs_fp32"] = round(deviation(fp32, codec), 1)
            print(f"{name}: SNR against fp32 {entry['snr_db_vs_fp32']} dB")
            del codec
        report["variants"][name] = entry
    args.output.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
