"""Cloned voices' prefill on a GPU: the captured embedding prefill against the same prefill run uncaptured.

    python bench/clone_prefill_check.py --model /tmp/ckpt-base --output $OUT/clone_prefill.json

A Base checkpoint's requests carry vectors (the x-vector, the reference frames) that the id-track prefill graphs
cannot hold, so they enter prefill graphs captured on embeddings (engine/runner.py). For an x-vector voice and
in-context voices of 3, 10 and 30 s clips, at batch 1 and 4, this writes the batch's prompts through the
captured graph and through the uncaptured path into other slots, and reports the largest relative difference of
the last hidden states (bf16: the two paths pad the batch to different lengths, so matmul shapes and rounding
differ slightly), whether the first sampled code agrees, and the median time of each path (CUDA events,
embeddings included). Random weights: only the cost and the agreement are meaningful.

Then, per voice at batch 1 and 4 on the captured path, where a request's prefill spends its time (`stages`): each
part of Qwen3ModelRunner.prefill timed alone, the device idle before it (synchronised), as the host's time to
return from it and the time until the device has finished it too, and the captured steps it replayed. Under load
(H100, 20 RPS) an in-context clone's prefill held the engine thread 9.8 ms a call against an x-vector clone's
3.0 ms (bench/results/clones_timestamps_h100.md); this says which part that is. Then the same prefill queued
behind 20 ms of device work with nothing synchronised (`behind_busy_device`): a part whose host time nears 20 ms
waits for the device, as in the engine it would wait for the frame in flight; and the calls that synchronised,
by PyTorch's sync debug mode (`synchronising_calls`).
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
# The parts of Qwen3ModelRunner.prefill that `stages` times, in the order a clone's prefill runs them (the
# codec priming runs inside the first; the prompt's embeddings, the voice prefix copy and the rest's prefill
# inside _prompt_pass).
STAGES = ("_fresh_slots", "_prime_codec", "prompts_embeds", "_voice_prefixes", "_prefill_rest")
# The device work each prefill is queued behind for the second timing (about three frames at 20 RPS): a part
# that waits for the device shows it as host time.
BEHIND_MS = 20.0


def clip(seconds: float) -> torch.Tensor:
    from bench.engine_load import reference_wav

    import io
    import wave

    import numpy as np

    with wave.open(io.BytesIO(reference_wav(seconds))) as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    return torch.from_numpy(pcm.astype(np.float32) / 32768)


def sleep_cycles_per_ms() -> float:
    """The GPU's clock cycles per millisecond, as torch.cuda._sleep spins them (measured: clocks vary)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def synchronising_calls(run) -> list[str]:
    """Where `run()` (one prefill, CUDA) made the host wait for the device: PyTorch's sync debug mode warns at
    each synchronising call, and the warning names the Python line that made it ("file:line: message")."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sorted({f"{Path(w.filename).name}:{w.lineno}: {str(w.message).splitlines()[0][:120]}" for w in caught})


def stage_times(runner, model, run, iters: int, cuda: bool, behind_cycles: int = 0) -> dict:
    """Median per stage of `run()` (one prefill) over `iters` runs: host ms until the stage returned, and ms
    until the device had finished it too, each stage started on an idle device; and the graph keys replayed.

    behind_cycles > 0 (CUDA): each run is queued behind that many GPU clock cycles of device work instead
    (sleep_cycles_per_ms), and nothing is synchronised, so the host times alone say which part waits for the
    device (its host time nears that work's length; in the engine that wait is the frame in flight, on the
    engine thread). done_ms is then the host time."""
    import time

    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in STAGES}
    replayed: set[str] = set()
    busy = cuda and behind_cycles > 0

    def sync() -> None:
        if cuda and not busy:
            torch.cuda.synchronize()

    def timed_stage(name: str, fn):
        def stage(*args, **kwargs):
            sync()
            started = time.perf_counter()
            out = fn(*args, **kwargs)
            host = time.perf_counter() - started
            sync()
            samples[name].append((host * 1000, (time.perf_counter() - started) * 1000))
            return out
        return stage

    def recording_run(key, fn, inputs):
        if key in runner.graphs:
            replayed.add(repr(key))
        return graphs_run(key, fn, inputs)

    owners = {name: model if name == "prompts_embeds" else runner for name in STAGES}
    originals = {name: getattr(owner, name) for name, owner in owners.items()}
    graphs_run = runner.graphs.run
    for name, owner in owners.items():
        setattr(owner, name, timed_stage(name, originals[name]))
    runner.graphs.run = recording_run
    host_ms = []
    try:
        for _ in range(iters):
            if busy:
                torch.cuda.synchronize()
                torch.cuda._sleep(behind_cycles)
            started = time.perf_counter()
            run()
            host_ms.append((time.perf_counter() - started) * 1000)
            if busy:
                torch.cuda.synchronize()
    finally:
        for name, owner in owners.items():
            setattr(owner, name, originals[name])
        runner.graphs.run = graphs_run
    out = {}
    for name, rows in samples.items():
        if rows:
            out[name] = {"host_ms": statistics.median(h for h, _ in rows),
                         "done_ms": statistics.median(d for _, d in rows), "calls_per_prefill": len(rows) / iters}
    return {"stages": out, "replayed": sorted(replayed), "prefill_host_ms": statistics.median(host_ms)}


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
        # The rest lengths these voices' prompts need after their cached prefixes (3 s: 33, 10 s: 120, 30 s: 370),
        # not every default one: each is a graph per batch bucket and attended length.
        voice_kv_rest_buckets=(32, 64, 128, 384), codec_frames=(1,), sampler="stateless", greedy=True))
    voices = {"x_vector": model.clone_prompt(clip(10), None, x_vector_only=True)}
    for seconds in (3, 10, 30):
        voices[f"icl_{seconds}s"] = model.clone_prompt(clip(seconds), "This is the reference recording.",
                                                       x_vector_only=False)
    rows = []
    with torch.inference_mode():
        runner._allocate()
        runner._capture_prefill()
        runner._capture_rest_prefill()
        behind_cycles = int(sleep_cycles_per_ms() * BEHIND_MS) if cuda else 0
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
                stages = stage_times(runner, model, lambda: runner.prefill(captured_reqs), args.iters, cuda)
                behind = stage_times(runner, model, lambda: runner.prefill(captured_reqs), args.iters, cuda,
                                     behind_cycles) if cuda else None
                rows.append({"voice": name, "batch": batch, "positions": len(prompt),
                             "voice_prefix": prompt.voice_prefix, "captured": was_captured,
                             "captured_ms": captured_ms, "uncaptured_ms": eager_ms, "max_rel_diff": rel,
                             "same_first_code": same_c0, **stages,
                             "behind_busy_device": behind and {"device_ms": BEHIND_MS, **behind},
                             "synchronising_calls": synchronising_calls(lambda: runner.prefill(captured_reqs))
                             if cuda else None})
                print(rows[-1], flush=True)
    lines = ["| voice | batch | prompt positions | captured | captured ms | uncaptured ms | max rel diff |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['voice']} | {r['batch']} | {r['positions']} | {r['captured']} | {r['captured_ms']:.2f} | "
                     f"{r['uncaptured_ms']:.2f} | {r['max_rel_diff']:.2e} |")
    lines += ["", "Where the captured path's time goes, ms per prefill (host returned / device done, each part started on "
              "an idle device):", "", "| voice | batch | " + " | ".join(STAGES) + " | replayed |",
              "|---|---|" + "---|" * (len(STAGES) + 1)]
    for r in rows:
        cells = [f"{r['stages'][n]['host_ms']:.2f} / {r['stages'][n]['done_ms']:.2f}" if n in r["stages"] else "-"
                 for n in STAGES]
        lines.append(f"| {r['voice']} | {r['batch']} | " + " | ".join(cells) + f" | {', '.join(r['replayed'])} |")
    if any(r["behind_busy_device"] for r in rows):
        lines += ["", f"Host ms per prefill queued behind {BEHIND_MS:g} ms of device work, nothing synchronised (a part "
                  "near that waits for the device):", "", "| voice | batch | prefill | " + " | ".join(STAGES) + " |",
                  "|---|---|---|" + "---|" * len(STAGES)]
        for r in rows:
            b = r["behind_busy_device"]
            cells = [f"{b['stages'][n]['host_ms']:.2f}" if n in b["stages"] else "-" for n in STAGES]
            lines.append(f"| {r['voice']} | {r['batch']} | {b['prefill_host_ms']:.2f} | " + " | ".join(cells) + " |")
        lines += ["", "Calls that made the host wait for the device (PyTorch's sync debug mode):", ""]
        lines += [f"- {r['voice']} x {r['batch']}: {'; '.join(r['synchronising_calls']) or 'none'}" for r in rows]
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
