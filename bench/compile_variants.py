"""How many graph variants the engine's start-up makes TorchInductor compile, on the CPU (issue 22).

On the H200 each compiled variant costs about 8 s of start-up (bench/results/engine_h200.md), so the count
is what decides a cold start. TorchDynamo decides the variants (a new one per shape its guards reject), not
Inductor, so tracing with a backend that compiles nothing gives the same count here in seconds: the runner's
functions go through `torch.compile(..., backend="eager")`, and every step the GPU would capture runs once
at each captured shape, in the order the runner captures them.

    TRITON_INTERPRET=1 python bench/compile_variants.py [--size small] [--json out.json]
    TRITON_INTERPRET=1 python bench/compile_variants.py --option codec_fused_convolutions=true --codec-serving --reasons

Prints, per kind of step, the variants compiled and, with --reasons, why each recompilation happened.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def count_variants(size: str = "small", model_type: str = "custom_voice", config_overrides: dict | None = None,
                   reasons: bool = False, resume_lengths: tuple[int, ...] = (), codec_serving: bool = False) -> dict:
    """{kind: variants compiled while capturing that kind, ..., "total": n, "recompiles": [...]}; with
    `resume_lengths`, also "resume": the variants the uncaptured resume pass (a Talker prefill of two rows,
    a prompt plus delivered frames beside a one-position padding row, each from its own start) traces after
    capture, at those lengths; with `codec_serving`, also "codec_serving": the variants the codec calls a
    server makes after capture trace (`serve_codec`)."""
    from torch._dynamo.utils import counters

    from tts_backend.engine.runner import Qwen3ModelRunner, Qwen3RunnerConfig
    from tts_backend.qwen3.generate import Qwen3TTS
    from tts_backend.qwen3.testing.checkpoint import write_checkpoint

    real_compile = torch.compile
    torch._dynamo.reset()
    counters.clear()
    recompiles: list[str] = []

    class _Recompiles(logging.Handler):
        def emit(self, record):
            recompiles.append(record.getMessage())

    handler = _Recompiles()
    if reasons:
        torch._logging.set_logs(recompiles=True)
        logging.getLogger("torch._dynamo").addHandler(handler)
    torch.compile = lambda fn, **kw: real_compile(fn, **{**kw, "backend": "eager"})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = write_checkpoint(Path(tmp) / "ckpt", size, seed=3, model_type=model_type)
            model = Qwen3TTS.from_pretrained(str(path), device="cpu", dtype=torch.float32)
            # The fused path as CUDA resolves its "auto" options (the codec's fused, channels-last stages too).
            options = dict(sampler="stateless", fused=True, kernels="triton", max_len=512,
                           codec_fused_convolutions=True, codec_channels_last=True)
            options.update(config_overrides or {})
            runner = Qwen3ModelRunner(model, Qwen3RunnerConfig(**options))
            runner.compile = True  # what CUDA does; the CPU default runs the functions uncompiled
            runner.graphs.enabled = True  # so that the runner pads batches to its buckets as it does on CUDA
            counts: dict[str, int] = {}

            def capture(key, fn, example_inputs, warmup=2):
                kind = key[0]
                before = int(counters["stats"]["unique_graphs"])
                with torch.inference_mode():
                    fn(*[t.clone() for t in example_inputs])
                counts[kind] = counts.get(kind, 0) + int(counters["stats"]["unique_graphs"]) - before
                # Known as captured, so that serving calls split and pick shapes as on CUDA; a "replay" runs
                # the step through TorchDynamo again, so a call whose inputs the capture's guards reject shows.
                runner.graphs._steps[key] = _TracedStep(fn)

            runner.graphs.capture = capture
            with torch.inference_mode():
                runner._allocate()
                runner._capture_all()
                if resume_lengths:
                    from tts_backend.qwen3.generate import right_padded

                    before = int(counters["stats"]["unique_graphs"])
                    width = model.talker.codec_head.weight.shape[1]
                    for n in resume_lengths:
                        up = torch.tensor([[n, 1], [0, 0]])
                        runner._prefill_embeds(torch.tensor([0, runner.scratch]),
                                               right_padded([torch.randn(n, width), torch.randn(1, width)]),
                                               up[0], up[1], n)
                    counts["resume"] = int(counters["stats"]["unique_graphs"]) - before
                if codec_serving:
                    before = int(counters["stats"]["unique_graphs"])
                    serve_codec(runner)
                    counts["codec_serving"] = int(counters["stats"]["unique_graphs"]) - before
    finally:
        torch.compile = real_compile
        if reasons:
            logging.getLogger("torch._dynamo").removeHandler(handler)
            torch._logging.set_logs(recompiles=False)
    counts["total"] = int(counters["stats"]["unique_graphs"])
    if reasons:
        counts["recompiles"] = recompiles
    return counts


class _TracedStep:
    """A captured step whose replay calls the step again (on CUDA a replay runs no Python at all)."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def replay(self, inputs) -> None:
        self.fn(*inputs)


def serve_codec(runner) -> None:
    """Every shape of codec call a server makes after start-up: each batch bucket (padded: one request fewer
    than the bucket, padding rows on the scratch slot) at each frame count the scheduler asks for (1 to
    max(codec_frames): captured counts, the others as captured pieces); a resumed request's priming (two
    rows, in its chunk schedule's pieces); a cloned voice's reference priming (64-frame pieces)."""
    import types

    from tts_backend.engine.runner import codec_pieces

    requests = [types.SimpleNamespace(slot=slot) for slot in range(runner.config.max_slots)]
    counts, groups = runner.config.codec_frames, runner.model.num_code_groups
    generator = torch.Generator().manual_seed(0)

    def codes(frames: int) -> torch.Tensor:
        return torch.randint(0, runner.codebook_size, (frames, groups), generator=generator)

    with torch.inference_mode():
        for bucket in runner.codec_buckets:
            for frames in range(1, max(counts) + 1):
                runner.codec_wait(runner.codec_launch(requests[: max(1, bucket - 1)], frames))
        for frames in (5, 7, 2 * max(counts) + 3):
            runner._prime_codec_frames(1, codes(frames), codec_pieces(frames, counts))
        runner._prime_codec(2, codes(100))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--model-type", default="custom_voice")
    parser.add_argument("--reasons", action="store_true")
    parser.add_argument("--codec-serving", action="store_true",
                        help="also count what the codec calls after start-up trace (serve_codec)")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=JSON",
                        help="a Qwen3RunnerConfig field, e.g. codec_fused_convolutions=true (repeatable)")
    parser.add_argument("--json")
    args = parser.parse_args()
    # JSON lists become tuples: the config's bucket fields are tuples (codec_frames is concatenated with one).
    overrides = {name: tuple(v) if isinstance(v := json.loads(value), list) else v
                 for name, value in (o.split("=", 1) for o in args.option)}
    result = count_variants(args.size, args.model_type, config_overrides=overrides, reasons=args.reasons,
                            codec_serving=args.codec_serving)
    for line in result.pop("recompiles", []):
        print(line)
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
