"""Per-frame step time of the engine on the GPU, against the weight-read floor.

    python bench/engine_step.py --model /tmp/qwen3-1.7b-random --batches 1,8,32,64 --output step.json

A frame step is one Talker decode step plus the whole 15-step code-predictor loop (sampling and embedding
lookups included), each replayed as the CUDA graph the engine captures. Timed with CUDA events over many
replays after warm-up; the median of several repeats is reported. Also: the first-chunk path pieces
(prefill, 2-frame codec decode) and eager (no graph) frame time at batch 1 for contrast.

Floor: the bytes of weights one frame must read at batch 1 (Talker layers + final norm + codec head once;
the code predictor's layers, input projection and one lm-head for each of its 15 steps, since 157 MB does
not stay in the 60 MB L2) over the device-to-device copy bandwidth measured here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


def copy_bandwidth(device, nbytes: int = 4 << 30) -> float:
    """Bytes read plus written per second by a large device-to-device copy."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def weight_bytes_per_frame(model) -> dict[str, int]:
    def nbytes(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    talker = model.talker
    talker_bytes = nbytes(talker.model.layers) + nbytes(talker.model.norm) + nbytes(talker.codec_head)
    cp = model.code_predictor
    per_step = nbytes(cp.model.layers) + nbytes(cp.model.norm) + nbytes(cp.small_to_mtp_projection) + nbytes(cp.lm_head[0])
    steps = model.num_code_groups - 1
    return {"talker": talker_bytes, "code_predictor_per_step": per_step, "code_predictor": per_step * steps,
            "frame": talker_bytes + per_step * steps}


def time_replays(fn, iters: int, repeats: int = 5) -> float:
    """Median over repeats of the mean seconds per call of `fn` (GPU time between events)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    results = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        results.append(start.elapsed_time(end) / 1000 / iters)
    return statistics.median(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--context", type=int, default=64, help="Talker positions already in each slot")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--kernels", default="auto", choices=["auto", "triton", "inductor"],
                        help="decode layers of the fused path (Qwen3RunnerConfig.kernels)")
    parser.add_argument("--prefill-batches", default="2,4,8", help="cost table: prefill batch sizes (no 1: a shape of its own to compile)")
    parser.add_argument("--prefill-lengths", default="32,64", help="cost table: prefill prompt positions")
    parser.add_argument("--codec-batches", default="2,4,8,16", help="cost table: codec batch sizes")
    parser.add_argument("--codec-frames", default="2,4,8,12", help="cost table: frames per codec call")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    for name in ("prefill_batches", "prefill_lengths", "codec_batches", "codec_frames"):
        setattr(args, name, [int(x) for x in getattr(args, name).split(",")])

    from tts_backend.qwen3.generate import Qwen3TTS

    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    t0 = time.perf_counter()
    model = Qwen3TTS.from_pretrained(args.model, device=device, dtype=torch.bfloat16)
    load_s = time.perf_counter() - t0
    attend = 128
    bandwidth = copy_bandwidth(device)
    floor = weight_bytes_per_frame(model)
    fused_error = None
    try:
        report = measure(args, model, batches, attend, bandwidth, floor, fused="auto")
    except Exception as exc:  # noqa: BLE001 - the fast path failed to build: measure the plain modules instead
        import traceback

        traceback.print_exc()
        fused_error = repr(exc)[:500]
        torch._dynamo.reset()
        report = measure(args, model, batches, attend, bandwidth, floor, fused=False)
    report.update({
        "command": " ".join(["python", "bench/engine_step.py", *(argv or sys.argv[1:])]),
        "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "model": args.model,
        "load_s": load_s, "fused_error": fused_error,
    })
    rows = report["rows"]
    lines = ["| batch | frame ms | Talker ms | code predictor ms | floor ms | gap | frames/s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['frame_ms']:.2f} | {r['talker_ms']:.2f} | {r['code_predictor_ms']:.2f} | "
                     f"{r['floor_ms']:.2f} | {r['gap']:.2f}x | {r['frames_per_s']:.0f} |")
    lines.append("")
    lines.append(f"fused {report['fused']}, compiled {report['compiled']}, decode kernels {report['kernels']}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
                 f"weights per frame {floor['frame'] / 1e9:.2f} GB; eager frame at batch 1 "
                 f"{report['eager_frame_batch1_ms']:.1f} ms; prefill (2x32) {report['prefill_batch2_32pos_ms']:.2f} ms; "
                 + "; ".join(f"{k} {v:.2f}" for k, v in report.items() if k.startswith("codec_")))
    table = "\n".join(lines)
    print(table)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
        args.output.with_suffix(".md").write_text(f"## Engine frame step ({report['gpu']})\n\n{table}\n")
    return 0


def measure(args, model, batches, attend, bandwidth, floor, fused) -> dict:
    from tts_backend.engine.runner import Qwen3ModelRunner, Qwen3RunnerConfig

    device = model.device
    max_b = max(batches)
    runner = Qwen3ModelRunner(model, Qwen3RunnerConfig(
        max_slots=max_b, max_len=512, decode_buckets=tuple(batches), attend_buckets=(attend,),
        prefill_batch_buckets=tuple(args.prefill_batches), prefill_len_buckets=tuple(args.prefill_lengths),
        codec_batch_buckets=tuple(args.codec_batches), codec_frames=tuple(args.codec_frames),
        sampler="stateless", fused=fused, kernels=args.kernels if fused else "inductor",
    ))
    with torch.inference_mode():
        runner._allocate()
        if runner.triton:
            runner._check_kernels()  # as serving does: the kernels serve only if they agree on this device
        graphs = runner.graphs
        rows: list[dict] = []
        for b in batches:
            slots = torch.arange(b, device=device)
            runner.seeds[:b] = torch.arange(b, device=device)
            graphs.capture(("decode", b, attend), lambda s: runner._decode_fn(s, attend), [slots])
            graphs.capture(("cp", b), runner._cp_fn, [slots])
            dec = graphs._steps[("decode", b, attend)]
            cp = graphs._steps[("cp", b)]
            dec.static_inputs[0].copy_(slots)
            cp.static_inputs[0].copy_(slots)

            def reset_positions():
                runner.pos[:b] = args.context

            def frame():
                dec.graph.replay()
                cp.graph.replay()

            reset_positions()
            talker_s = time_replays(dec.graph.replay, args.iters)
            reset_positions()
            cp_s = time_replays(cp.graph.replay, args.iters)
            reset_positions()
            frame_s = time_replays(frame, args.iters)
            floor_s = (floor["talker"] + floor["code_predictor"]) / bandwidth
            rows.append({"batch": b, "talker_ms": talker_s * 1e3, "code_predictor_ms": cp_s * 1e3,
                         "frame_ms": frame_s * 1e3, "floor_ms": floor_s * 1e3, "gap": frame_s / floor_s,
                         "frames_per_s": b / frame_s})
            print(f"batch {b}: frame {frame_s * 1e3:.2f} ms (talker {talker_s * 1e3:.2f}, code predictor "
                  f"{cp_s * 1e3:.2f}), floor {floor_s * 1e3:.2f} ms, gap {frame_s / floor_s:.2f}x", flush=True)
            if args.output:  # keep what is measured even if the run is cut short
                args.output.parent.mkdir(parents=True, exist_ok=True)
                args.output.with_suffix(".partial.json").write_text(json.dumps(
                    {"fused": runner.fused, "compiled": runner.compile, "bandwidth_TBps": bandwidth / 1e12,
                     "rows": rows}, indent=2) + "\n")

        # The compiled fast path against the model's own modules on the same inputs and caches.
        check = {}
        if runner.fused:
            gen = torch.Generator(device=device).manual_seed(0)
            slots = torch.arange(8, device=device)
            pos = torch.full((8, 1), args.context, device=device, dtype=torch.long)
            x = torch.randn(8, 1, model.talker.cfg.hidden_size, generator=gen, device=device).to(torch.bfloat16)
            if runner.triton:
                fast = runner.fused_talker.decode(x[:, 0], runner.kv, slots, pos[:, 0])[:, None].float()
            else:
                fast = runner.fused_talker.forward(x, runner.kv, slots, pos, attend).float()
            plain = model.talker(x, runner.kv, slots, pos, attend).float()
            check["talker_hidden"] = ((fast - plain).norm() / plain.norm()).item()
            cp = model.code_predictor
            cp_rows = torch.arange(8, device=device)
            x2 = torch.randn(8, 2, model.talker.cfg.hidden_size, generator=gen, device=device).to(torch.bfloat16)
            pos2 = torch.arange(2, device=device)[None].expand(8, 2)
            projected = cp.small_to_mtp_projection(x2)
            if runner.triton:  # one position per pass; compare the second
                stack = runner.fused_cp.stack
                stack.decode(projected[:, 0].contiguous(), runner.cp_cache, cp_rows, pos2[:, 0].contiguous())
                fast = stack.decode(projected[:, 1].contiguous(), runner.cp_cache, cp_rows,
                                    pos2[:, 1].contiguous())[:, None].float()
            else:
                fast = runner.fused_cp.stack.forward(projected, runner.cp_cache, cp_rows, pos2,
                                                     runner.cp_cache.max_len).float()
            plain = cp.model.run_layers(cp.small_to_mtp_projection(x2), runner.cp_cache, cp_rows, pos2,
                                        attend_len=runner.cp_cache.max_len).float()
            if runner.triton:
                plain = plain[:, 1:]
            check["code_predictor_hidden"] = ((fast - plain).norm() / plain.norm()).item()
            print(f"fast path vs modules, relative error: {check}", flush=True)

        # Eager frame at batch 1, for contrast with the captured one.
        slots = torch.zeros(1, dtype=torch.long, device=device)
        runner.pos[:1] = args.context

        def eager_frame():
            runner._decode_fn(slots, attend)
            runner._cp_fn(slots)

        eager_s = time_replays(eager_frame, 5, repeats=3)

        # The first-chunk path and the simulator's cost table (bench/engine_sim.py): prefill per (batch, prompt
        # length) and codec per (batch, frames), each replayed as the graph the engine captures.
        sc = runner.scratch
        prefill_ms = {}
        for b in args.prefill_batches:
            for n in args.prefill_lengths:
                inputs = [torch.arange(b, dtype=torch.long, device=device), torch.zeros(b, n, dtype=torch.long, device=device),
                          torch.full((b, n), -1, dtype=torch.long, device=device),
                          torch.full((b,), max(1, n - 4), dtype=torch.long, device=device)]
                graphs.capture(("prefill", b, n), runner._prefill_fn, inputs)
                prefill_ms[f"{b}x{n}"] = time_replays(graphs._steps[("prefill", b, n)].graph.replay, args.iters) * 1e3
        prefill_s = prefill_ms.get("2x32", min(prefill_ms.values())) / 1e3
        codec_ms = {}
        for b in args.codec_batches:
            for f in args.codec_frames:
                s = torch.full((b,), sc, dtype=torch.long, device=device)
                graphs.capture(("codec", f, b), lambda x, f=f, b=b: runner._codec_fn(x, f, runner.codec_static[b]), [s])
                codec_ms[f"{b}x{f}"] = time_replays(graphs._steps[("codec", f, b)].graph.replay, 10) * 1e3
        codec_rows = {f"codec_{f}frames_batch{b}_ms": codec_ms[f"{b}x{f}"] for b, f in ((2, 2), (16, 12))
                      if f"{b}x{f}" in codec_ms}
        cost_table = {
            "frame_ms": {str(r["batch"]): r["frame_ms"] for r in rows},
            "talker_ms": {str(r["batch"]): r["talker_ms"] for r in rows},
            "code_predictor_ms": {str(r["batch"]): r["code_predictor_ms"] for r in rows},
            "prefill_ms": prefill_ms,  # "BATCHxPOSITIONS"
            "codec_ms": codec_ms,  # "BATCHxFRAMES"
        }
    return {
        "tool": "bench/engine_step.py",
        "copy_bandwidth_TBps": bandwidth / 1e12,
        "weight_bytes": floor,
        "context_positions": args.context,
        "attend_bucket": attend,
        "rows": rows,
        "eager_frame_batch1_ms": eager_s * 1e3,
        "prefill_batch2_32pos_ms": prefill_s * 1e3,
        **codec_rows,
        "cost_table": cost_table,
        "gpu_memory_GiB": torch.cuda.max_memory_allocated(device) / 2**30,
        "fused": runner.fused,
        "compiled": runner.compile,
        "kernels": "triton" if runner.triton else ("inductor" if runner.fused else "modules"),
        "capture_and_compile_s": runner.graphs.capture_seconds,
        "fused_vs_modules_relative_error": check,
        "start_up_kernel_check": runner.kernel_check,
    }


if __name__ == "__main__":
    raise SystemExit(main())
