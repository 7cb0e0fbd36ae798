"""Start-up cost of loading a Qwen3-TTS checkpoint folder, phase by phase (issue 29's start-up target).

    python bench/startup_load.py --model /tmp/ckpt --device cuda --runner --output $OUT/startup_load.json
    python bench/startup_load.py --model /tmp/startup-ckpt --device cpu --runner --max-slots 4 --max-len 256

In one fresh process, as a `voxgate worker` starts: importing torch and the model code, initialising the device
(CUDA context), `Qwen3TTS.from_pretrained` (its own phases: config, model_weights, codec_decoder, codec_encoder,
tokenizer, identity; each ends with its copies on the device finished), and with --runner the engine runner's
"allocated the slots and fused the weights" phase (Qwen3ModelRunner._allocate, nothing compiled or captured)
with its imports of the compiler stack timed first, apart. Where the file's pages sit (page cache or disk) is
the machine's state: run it twice for a warm-cache number. --profile adds the functions with the most own time.
Writes JSON naming the device (`gpu` as torch reports it, or cpu) and the checkpoint's size.
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

_TORCH_IMPORTED = time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a Qwen3-TTS checkpoint folder")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--runner", action="store_true", help="also time the runner's allocation phase")
    parser.add_argument("--max-slots", type=int, default=64, help="the runner's KV slots (the worker's default)")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="report the N functions with the "
                        "most own time in from_pretrained (cProfile; it slows Python-heavy phases)")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)

    seconds = {"import_torch": _TORCH_IMPORTED - _STARTED}
    mark = time.perf_counter()
    from tts_backend.qwen3.generate import Qwen3TTS

    seconds["import_model_code"] = time.perf_counter() - mark
    device = torch.device(args.device)
    mark = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)
        torch.cuda.synchronize(device)
    seconds["device_init"] = time.perf_counter() - mark

    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    mark = time.perf_counter()
    model = Qwen3TTS.from_pretrained(args.model, device=device, dtype=getattr(torch, args.dtype))
    seconds["from_pretrained"] = time.perf_counter() - mark
    if profiler is not None:
        profiler.disable()
    phases = {f"from_pretrained.{name}": s for name, s in model.load_seconds.items()}

    if args.runner:
        seconds.update(time_runner_allocation(model, args.max_slots, args.max_len))
    seconds["total"] = time.perf_counter() - _STARTED

    files = sorted(p for p in args.model.rglob("*.safetensors"))
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "host": {"cpus": _cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "model": str(args.model),
        "weights_bytes": {str(p.relative_to(args.model)): p.stat().st_size for p in files},
        "dtype": args.dtype,
        "seconds": {name: round(s, 3) for name, s in {**seconds, **phases}.items()},
    }
    if profiler is not None:
        report["profile"] = _top_functions(profiler, args.profile)
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    return 0


def time_runner_allocation(model, max_slots: int, max_len: int) -> dict[str, float]:
    """The runner's allocation as the worker's start-up runs it (fused path, stateless sampler), without the
    compile or graph capture that follow it; the compiler stack's imports timed on their own first."""
    from tts_backend.engine.runner import Qwen3ModelRunner, Qwen3RunnerConfig

    cuda = model.device.type == "cuda"
    mark = time.perf_counter()
    import torch._dynamo  # noqa: F401  (what the runner's torch.compile wrappers pull in)
    if cuda:
        import torch._inductor.compile_fx  # noqa: F401
        from tts_backend.engine.fused import triton_kernels

        triton_kernels()
    out = {"runner.import_compiler": time.perf_counter() - mark}
    mark = time.perf_counter()
    runner = Qwen3ModelRunner(model, Qwen3RunnerConfig(
        max_slots=max_slots, max_len=max_len, sampler="stateless", fused=True, cuda_graphs=False))
    runner._allocate()
    if cuda:
        torch.cuda.synchronize(model.device)
    out["runner.allocate"] = time.perf_counter() - mark
    return out


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _top_functions(profiler, count: int) -> list[dict]:
    import pstats

    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:count]
    return [{"function": f"{path}:{line}({name})", "calls": calls, "own_s": round(own, 3), "cumulative_s": round(cum, 3)}
            for (path, line, name), (_, calls, own, cum, _) in rows]


if __name__ == "__main__":
    raise SystemExit(main())
