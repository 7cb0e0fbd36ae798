"""Tile sizes of the Triton decode kernels (tts_backend/engine/kernels.py) on this GPU.

    python bench/kernel_tune.py --output kernel_tune.json

For the Talker and code-predictor layer shapes of Qwen3-TTS-12Hz-1.7B at several row counts, times each
kernel of a decoder layer with every candidate tile configuration, each launch replayed inside a CUDA graph
(as the engine runs them), and reports the default tiles' time beside the best, plus the weight-read floor
of each matmul at the measured copy bandwidth. Random weights: timing does not depend on values.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

# (name, hidden, intermediate, heads, kv heads, head dim, cache length)
STACKS = [("talker", 2048, 6144, 16, 8, 128, 2048), ("code_predictor", 1024, 3072, 16, 8, 128, 16)]
MATMUL_CANDIDATES = list(itertools.product((16, 32, 64), (128, 256), (4, 8), (3,)))
ATTEND_CANDIDATES = list(itertools.product((16, 32, 64), (2, 4, 8)))


def graph_time(fn, launches: int = 20, repeats: int = 15) -> float:
    """Seconds per call of `fn`, from a CUDA graph of `launches` calls replayed `repeats` times (median)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000 / launches)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,64")
    parser.add_argument("--context", type=int, default=128, help="Talker positions attended")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    from tts_backend.engine import kernels

    dev = torch.device("cuda")
    dt = torch.bfloat16
    bandwidth = 4.2e12
    results = []
    for name, hidden, inner, heads, kv, head_dim, cache_len in STACKS:
        qkv_n = (heads + 2 * kv) * head_dim
        ln = torch.ones(hidden, device=dev, dtype=dt)
        weights = {
            "qkv": torch.randn(qkv_n, hidden, device=dev, dtype=dt) * 0.02,
            "o": torch.randn(hidden, heads * head_dim, device=dev, dtype=dt) * 0.02,
            "gate_up": torch.randn(2 * inner, hidden, device=dev, dtype=dt) * 0.02,
            "down": torch.randn(hidden, inner, device=dev, dtype=dt) * 0.02,
        }
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, hidden, device=dev, dtype=dt)
            attn = torch.randn(rows, heads * head_dim, device=dev, dtype=dt)
            h = torch.randn(rows, inner, device=dev, dtype=dt)
            calls = {
                "qkv": lambda t: kernels.norm_matmul(x, ln, weights["qkv"], 1e-6, tiles=t),
                "o": lambda t: kernels.matmul_residual(attn, weights["o"], x, tiles=t),
                "gate_up": lambda t: kernels.norm_matmul(x, ln, weights["gate_up"], 1e-6, silu_mul=True, tiles=t),
                "down": lambda t: kernels.matmul_residual(h, weights["down"], x, tiles=t),
            }
            for op, call in calls.items():
                w = weights[op]
                n = w.shape[0] // 2 if op == "gate_up" else w.shape[0]
                default = kernels.default_tiles(n, w.shape[1])
                timings = {}
                for tiles in MATMUL_CANDIDATES:
                    try:
                        timings[tiles] = graph_time(lambda: call(tiles))
                    except Exception as exc:  # noqa: BLE001 - a tile that does not fit (shared memory) is skipped
                        print(f"{name} {op} rows {rows} tiles {tiles}: {type(exc).__name__}", flush=True)
                best = min(timings, key=timings.get)
                floor = w.numel() * w.element_size() / bandwidth
                results.append({"stack": name, "op": op, "rows": rows, "default": list(default),
                                "default_us": timings.get(default, float("nan")) * 1e6, "best": list(best),
                                "best_us": timings[best] * 1e6, "floor_us": floor * 1e6})
                print(f"{name:15s} {op:8s} rows {rows:3d}: default {default} {timings.get(default, 0) * 1e6:7.1f} us, "
                      f"best {best} {timings[best] * 1e6:7.1f} us, floor {floor * 1e6:6.1f} us", flush=True)
            # attention at one new position per row
            k_cache = torch.randn(rows, kv, cache_len, head_dim, device=dev, dtype=dt)
            v_cache = torch.randn_like(k_cache)
            qkv = torch.randn(rows, qkv_n, device=dev, dtype=dt)
            norm = torch.ones(head_dim, device=dev, dtype=dt)
            slots = torch.arange(rows, device=dev)
            pos = torch.full((rows,), min(args.context, cache_len - 1), device=dev, dtype=torch.long)
            timings = {}
            for block_p, warps in ATTEND_CANDIDATES:
                timings[(block_p, warps)] = graph_time(lambda: kernels.attend(
                    qkv, norm, norm, k_cache, v_cache, slots, pos, heads, 1e-6, 1e6, block_p=block_p, num_warps=warps))
            best = min(timings, key=timings.get)
            results.append({"stack": name, "op": "attend", "rows": rows, "default": [32, 4],
                            "default_us": timings[(32, 4)] * 1e6, "best": list(best), "best_us": timings[best] * 1e6})
            print(f"{name:15s} attend   rows {rows:3d}: default (32, 4) {timings[(32, 4)] * 1e6:7.1f} us, best {best} "
                  f"{timings[best] * 1e6:7.1f} us", flush=True)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"tool": "bench/kernel_tune.py", "gpu": torch.cuda.get_device_name(dev),
                                           "context": args.context, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
