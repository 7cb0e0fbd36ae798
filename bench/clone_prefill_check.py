"""Cloned voices' prefill on a GPU: the captured embedding prefill against the same prefill run uncaptured.

    python bench/clone_prefill_check.py --model /tmp/ckpt-base --output $OUT/clone_prefill.json

A Base checkpoint's requests carry vectors (the x-vector, the reference frames) that the id-track prefill graphs
cannot hold, so they enter prefill graphs captured on embeddings (engine/runner.py). For an x-vector voice and
in-context voices of 3, 10 and 30 s clips, at batch 1 and 4, this writes the batch's prompts through the
captured graph and through the uncaptured path into other slots, and reports the largest relative difference of
the last hidden states (bf16: the two paths pad the batch to different lengths, so matmul shapes and rounding
differ slightly), whether the first sampled code agrees, and the median time of each path (CUDA events,
embeddings included). Random weights: only the cost and the agreement are meaningful.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TEXT = "Author of the danger trail, Philip Steels, etc."


def clip(seconds: float) -> torch.Tensor:
    from bench.engine_load import reference_wav

    import io
    import wave

    import numpy as np

    with wave.open(io.BytesIO(reference_wav(seconds))) as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    return torch.from_numpy(pcm.astype(np.float32) / 32768)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (nothing is captured there)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)

    from tts_backend.engine.request import RequestState
    from tts_backend.engine.runner import Qwen3ModelRunner, Qwen3RunnerConfig
    from tts_backend.qwen3.generate import Qwen3TTS

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model = Qwen3TTS.from_pretrained(args.model, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    runner = Qwen3ModelRunner(model, Qwen3RunnerConfig(
        max_slots=16, max_len=512, decode_buckets=(1, 4), attend_buckets=(512,), prefill_batch_buckets=(1, 4),
        prefill_len_buckets=(32,), clone_prefill_len_buckets=(16, 32, 64, 128, 256, 512), codec_batch_buckets=(1,),
        codec_frames=(1,), sampler="stateless", greedy=True))
    voices = {"x_vector": model.clone_prompt(clip(10), None, x_vector_only=True)}
    for seconds in (3, 10, 30):
        voices[f"icl_{seconds}s"] = model.clone_prompt(clip(seconds), "This is the reference recording.",
                                                       x_vector_only=False)
    rows = []
    with torch.inference_mode():
        runner._allocate()
        runner._capture_prefill()
        for name, voice in voices.items():
            prompt = model.make_prompt(TEXT, voice=voice, language="english", non_streaming_mode=False)
            for batch in (1, 4):
                def requests(first_slot: int):
                    out = []
                    for i in range(batch):
                        r = RequestState(request_id=first_slot + i, prompt=prompt, seed=i, max_frames=64,
                                         chunk_schedule=(2,), arrival=0.0, sample_rate=24000, samples_per_frame=1920)
                        r.slot = first_slot + i
                        out.append(r)
                    return out

                def timed(run) -> float:
                    import time

                    times = []
                    for _ in range(args.iters):
                        if not cuda:
                            started = time.perf_counter()
                            run()
                            times.append((time.perf_counter() - started) * 1000)
                            continue
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        run()
                        end.record()
                        torch.cuda.synchronize()
                        times.append(start.elapsed_time(end))
                    return statistics.median(times)

                captured_reqs, eager_reqs = requests(0), requests(8)
                replays = runner.graphs.replays
                captured_ms = timed(lambda: runner.prefill(captured_reqs))
                was_captured = runner.graphs.replays > replays
                runner.graphs.enabled = False
                eager_ms = timed(lambda: runner.prefill(eager_reqs))
                runner.graphs.enabled = True
                a = runner.hidden[0:batch].float()
                b = runner.hidden[8:8 + batch].float()
                rel = float((a - b).abs().max() / b.abs().max())
                same_c0 = bool(torch.equal(runner.c0[0:batch], runner.c0[8:8 + batch]))
                rows.append({"voice": name, "batch": batch, "positions": len(prompt), "captured": was_captured,
                             "captured_ms": captured_ms, "uncaptured_ms": eager_ms, "max_rel_diff": rel,
                             "same_first_code": same_c0})
                print(rows[-1], flush=True)
    lines = ["| voice | batch | prompt positions | captured | captured ms | uncaptured ms | max rel diff |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['voice']} | {r['batch']} | {r['positions']} | {r['captured']} | {r['captured_ms']:.2f} | "
                     f"{r['uncaptured_ms']:.2f} | {r['max_rel_diff']:.2e} |")
    print("\n".join(lines))
    if args.output:
        args.output.write_text(json.dumps({"command": " ".join(["python", "bench/clone_prefill_check.py",
                                                                 *(argv or sys.argv[1:])]),
                                           "gpu": torch.cuda.get_device_name() if cuda else "cpu", "rows": rows}, indent=2) + "\n")
        args.output.with_suffix(".md").write_text("\n".join(lines) + "\n")
    ok = all((r["captured"] or not cuda) and r["max_rel_diff"] < 3e-2 for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
