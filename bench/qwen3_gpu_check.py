"""Qwen3-TTS on a GPU: parity of logits with the reference at full 1.7B size, and per-module time per frame.

  python bench/qwen3_gpu_check.py --size 1.7b --device cuda --workdir /tmp/q3 --out-dir $OUT \
      --ref-python python3 --ref-pythonpath /tmp/site:/tmp/tastub

1. Writes a random checkpoint of the released shapes (tts_backend.qwen3.testing.checkpoint) on local disk.
2. Reference (qwen-tts 0.1.1 + transformers 4.57.3, a separate interpreter/PYTHONPATH) and ours both load it in
   fp32 and decode greedily from the same prompts, dumping the fp32 logits of every talker and code-predictor
   step; relative error = max|ours - ref| / max|ref| over the steps before the first differing code.
3. Ours in bf16 (codec in fp32 as stored, and bf16), batch 1: median time of a talker step, of the 15-step code
   predictor loop, of a codec chunk, eager and as CUDA graphs; and an end-to-end sampled generation.
Writes qwen3_gpu_check.json (+ prints a table). `--size tiny --device cpu` runs the same steps locally.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_backend.qwen3.generate import Qwen3TTS  # noqa: E402
from tts_backend.qwen3.testing.checkpoint import write_checkpoint  # noqa: E402

REF_SCRIPT = ROOT / "tests" / "reference_scripts" / "qwen3_ref_generate.py"
GREEDY = {"do_sample": False, "subtalker_dosample": False}
CASES = [
    dict(name="vivian_en_nonstreaming", texts=["The quick brown fox jumps over the lazy dog, twice."],
         speakers=["vivian"], languages=["english"], instructs=None, non_streaming_mode=True, seed=None),
    dict(name="eric_zh_instruct_streaming", texts=["今天天气很好，我们去公园散步吧。"], speakers=["eric"],
         languages=["chinese"], instructs=["用轻松的语气说"], non_streaming_mode=False, seed=None),
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of fn() (device events on CUDA, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if torch.device(device).type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def as_graph(fn, device):
    """Capture fn as a CUDA graph (its tensors become static); returns a replay function and the outputs."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


# ------------------------------------------------------------------------------------------- parity


def run_reference(args, checkpoint: Path, workdir: Path, max_new: int) -> dict:
    cases = [{**c, "gen": {**GREEDY, "max_new_tokens": max_new}} for c in CASES]
    spec = workdir / "ref_spec.json"
    device = "cuda:0" if args.device == "cuda" else "cpu"
    spec.write_text(json.dumps({"dtype": "float32", "device": device, "threads": os.cpu_count() or 1,
                                "runs": [{"checkpoint": str(checkpoint), "cases": cases}]}))
    out = workdir / "ref_out.pt"
    if args.ref_python:
        env = dict(os.environ)
        if args.ref_pythonpath:
            env["PYTHONPATH"] = args.ref_pythonpath
        result = subprocess.run([args.ref_python, str(REF_SCRIPT), str(spec), str(out)], env=env,
                                capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"reference failed:\n{result.stderr[-6000:]}")
    else:
        sys.path.insert(0, str(ROOT))
        from tests.reference_env import run_reference as run_in_venv

        run_in_venv(REF_SCRIPT, str(spec), str(out))
    return torch.load(out)["runs"][0]


def ours_fp32(checkpoint: Path, device: str, max_new: int) -> dict:
    model = Qwen3TTS.from_pretrained(checkpoint, device, torch.float32, load_codec=False)
    params = model.sampling_params(do_sample=False, subtalker_do_sample=False, max_new_tokens=max_new)
    results = {}
    for c in CASES:
        prompts = [model.make_prompt(t, speaker=s, language=lang, instruct=(c["instructs"] or [None])[i],
                                     non_streaming_mode=c["non_streaming_mode"])
                   for i, (t, s, lang) in enumerate(zip(c["texts"], c["speakers"], c["languages"]))]
        trace: dict = {}
        codes = model.generate_codes(prompts, params, None, trace=trace)
        results[c["name"]] = {"codes": [x.cpu() for x in codes],
                              "talker_logits": torch.stack(trace["talker_logits"]).cpu(),
                              "predictor_logits": torch.stack(trace["predictor_logits"]).cpu()}
    del model
    return results


def compare(ours: dict, ref: dict, groups: int) -> dict:
    report = {}
    for name, o in ours.items():
        r = ref["cases"][name]
        a, b = o["codes"][0], r["codes"][0]
        n = min(len(a), len(b))
        differing = (a[:n] != b[:n]).any(1).nonzero()
        same_frames = int(differing[0]) if len(differing) else n
        # Steps with identical inputs: talker step k consumes frames < k; predictor draws of frames <= same_frames.
        t_steps = min(same_frames + 1, len(o["talker_logits"]), len(r["talker_logits"]))
        p_steps = min((same_frames + 1) * (groups - 1), len(o["predictor_logits"]), len(r["predictor_logits"]))
        tl, rl = o["talker_logits"][:t_steps], r["talker_logits"][:t_steps]
        pl, rp = o["predictor_logits"][:p_steps], r["predictor_logits"][:p_steps]
        report[name] = {
            "frames_ours": len(a), "frames_ref": len(b), "identical_frames": same_frames,
            "codes_identical": bool(len(a) == len(b) and same_frames == n),
            "talker_steps_compared": t_steps, "predictor_steps_compared": p_steps,
            "talker_logits_rel_err": float((tl - rl).abs().max() / rl.abs().max()),
            "predictor_logits_rel_err": float((pl - rp).abs().max() / rp.abs().max()),
            "first_step_talker_rel_err": float((tl[0] - rl[0]).abs().max() / rl[0].abs().max()),
        }
    return report


# ------------------------------------------------------------------------------------------- timing


@torch.inference_mode()
def timings(checkpoint: Path, device: str, context: int, gen_frames: int) -> dict:
    model = Qwen3TTS.from_pretrained(checkpoint, device, torch.bfloat16)
    is_cuda = torch.device(device).type == "cuda"
    D = model.config.talker.hidden_size
    G = model.num_code_groups
    out: dict = {"context_positions": context}
    max_len = context + 64
    cache = model.new_talker_cache(1, max_len)
    pcache = model.new_predictor_cache(1)
    slots = torch.zeros(1, dtype=torch.long, device=device)
    prompt = model.make_prompt("Timing the talker step at a realistic context length. " * 4, speaker=None
                               if model.config.tts_model_type != "custom_voice" else "vivian", language="english")
    embeds = model.prompt_embeds(prompt)
    filler = torch.randn(context - embeds.shape[0], D, device=device, dtype=embeds.dtype) * 0.5
    hidden = model.prefill(cache, slots, [torch.cat((embeds, filler))])
    pos = torch.tensor([context], device=device)
    x = torch.randn(1, D, device=device, dtype=model.dtype)
    c0 = torch.tensor([17], device=device)

    def talker_step():
        return model.talker.logits(model.decode_step(cache, slots, pos, x, attend_len=max_len)).float()

    def predictor_greedy():
        return model.residual_codes(pcache, slots, hidden, c0, lambda l: l.argmax(-1))

    params = model.sampling_params()
    gen = torch.Generator(device=device).manual_seed(0)
    from tts_backend.qwen3.sampling import sample_residual

    def predictor_sampled():
        return model.residual_codes(pcache, slots, hidden, c0, lambda l: sample_residual(l, params, gen))

    out["talker_step_ms_eager"] = timed(talker_step, device)
    out["predictor_15_steps_ms_eager_greedy"] = timed(predictor_greedy, device)
    out["predictor_15_steps_ms_eager_sampled"] = timed(predictor_sampled, device)
    if is_cuda:
        replay, _ = as_graph(talker_step, device)
        out["talker_step_ms_cuda_graph"] = timed(replay, device, iters=100)
        replay, _ = as_graph(predictor_greedy, device)
        out["predictor_15_steps_ms_cuda_graph_greedy"] = timed(replay, device, iters=100)

    codec = model.codec
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        codec.to(dtype)
        for chunk in (1, 4, 12):
            codes = torch.randint(0, model.config.talker.codebook_size, (1, G, chunk), device=device)
            state = codec.init_state(1)
            # Mid-stream: 200 frames of history already decoded, state carried (positions and conv tails).
            with torch.inference_mode():
                codec.decode_chunk(torch.randint(0, model.config.talker.codebook_size, (1, G, 200), device=device),
                                   state)
            snapshot = state.clone()

            def codec_chunk():
                state.index_copy_(torch.tensor([0], device=device), snapshot)
                return codec.decode_chunk(codes, state)

            ms = timed(codec_chunk, device)
            out[f"codec_{label}_chunk{chunk}_ms"] = ms
            out[f"codec_{label}_chunk{chunk}_ms_per_frame"] = ms / chunk
    codec.to(torch.float32)

    # End to end: sampled generation, batch 1, eager, generation_config defaults.
    p = model.make_prompt("End to end generation speed at batch one, with the published sampling settings.",
                          speaker="vivian" if model.config.tts_model_type == "custom_voice" else None,
                          language="english")
    run_params = model.sampling_params(max_new_tokens=gen_frames + 1, min_new_tokens=gen_frames + 1)
    sync(device)
    t0 = time.perf_counter()
    codes = model.generate_codes([p], run_params, torch.Generator(device=device).manual_seed(1))[0]
    sync(device)
    elapsed = time.perf_counter() - t0
    out["e2e_eager_frames"] = int(codes.shape[0])
    out["e2e_eager_ms_per_frame"] = elapsed * 1e3 / max(1, codes.shape[0])
    out["e2e_eager_realtime_factor"] = (codes.shape[0] * 0.08) / elapsed
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1.7b", choices=["tiny", "0.6b", "1.7b"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workdir", default="/tmp/qwen3_gpu_check")
    ap.add_argument("--out-dir", default=".")
    ap.add_argument("--ref-python", default="", help="interpreter with qwen-tts 0.1.1; default: tests' venv")
    ap.add_argument("--ref-pythonpath", default="")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--gen-frames", type=int, default=100)
    ap.add_argument("--skip-parity", action="store_true")
    args = ap.parse_args()

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = workdir / f"ckpt-{args.size}"
    result: dict = {"size": args.size, "device": args.device, "torch": torch.__version__}
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name(0)
    if not (checkpoint / "model.safetensors").is_file():
        log(f"writing random {args.size} checkpoint to {checkpoint}")
        t0 = time.perf_counter()
        write_checkpoint(checkpoint, args.size, seed=0, device=args.device)
        result["checkpoint_write_s"] = round(time.perf_counter() - t0, 1)
    if not args.skip_parity:
        try:
            log("reference (qwen-tts 0.1.1, fp32)")
            t0 = time.perf_counter()
            ref = run_reference(args, checkpoint, workdir, args.max_new_tokens)
            result["reference_s"] = round(time.perf_counter() - t0, 1)
            log("ours (fp32)")
            ours = ours_fp32(checkpoint, args.device, args.max_new_tokens)
            groups = ours[CASES[0]["name"]]["codes"][0].shape[1]
            result["parity_fp32"] = compare(ours, ref, groups)
            log(json.dumps(result["parity_fp32"], indent=1))
        except Exception as exc:  # keep the timing half of a scarce device run
            result["parity_error"] = repr(exc)[-4000:]
            log(f"parity failed: {exc!r}"[-4000:])
        if args.device == "cuda":
            torch.cuda.empty_cache()
    log("timing (bf16, batch 1)")
    result["timing_bf16_batch1"] = timings(checkpoint, args.device, args.context, args.gen_frames)
    out = Path(args.out_dir) / "qwen3_gpu_check.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
