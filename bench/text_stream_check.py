"""Text streaming on the GPU (issue 21): text pushed in pieces says exactly what the whole text says, and says
it sooner. For the coordinator's H200 run, with the engine as served (CUDA graphs, fused layers, Triton):

    python bench/text_stream_check.py --model /tmp/ckpt --others 8 --output text_stream.json
    bash bench/h200.sh setup textstream:"--others 8"

Equality. For each of --sentences ARCTIC sentences (bench/data/arctic_en.jsonl), one request (voice, seed,
streaming-text mode) is run three ways:
  alone    the whole text, nothing else in the engine;
  whole    the whole text, beside --others whole-text requests that keep the batches full;
  pieces   the text pushed word by word (the unfinished tail held back, as the gateway does) at --words-per-s
           with random jitter, beside the same others.
The frames each run generates (all 16 codebooks) are read back from the runner's frame ring after every
code-predictor batch, and compared. pieces == whole or pieces == alone is the pass. In bf16 the GPU's
matmuls may round differently for different batch shapes, which changes a sampled code of any request
whose batch company changed, whole or not: where whole != alone too, the report says so
(`batch_shape_variance`), since then text streaming is not what changed the codes.

Timing (a second pass without the read-back, which syncs the device): per sentence, the first audio of the
pieces run from the first word (when the request opened) and from the last word (negative: it spoke
before the text was complete), against the whole run's first audio from its submit; and the engine's
text-wait counters (waits, chunks late by the engine's making vs gaps while waiting for text).

Exit status 1 when a sentence's pieces match neither whole nor alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "data" / "arctic_en.jsonl"


def words_of(text: str) -> list[str]:
    parts = text.split(" ")
    return [parts[0]] + [" " + p for p in parts[1:]]


class FrameSpy:
    """Each request's frames, read back from the runner's ring after every code-predictor batch, by seed."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.frames: dict[int, list[list[int]]] = {}
        self.on = False
        self._code_predict = runner.code_predict
        runner.code_predict = self._recording

    def _recording(self, requests) -> None:
        self._code_predict(requests)
        if not self.on:
            return
        ring = self.runner.config.frame_ring
        for r in requests:
            written = int(self.runner.written[r.slot])
            self.frames.setdefault(r.seed, []).append(self.runner.ring[r.slot, (written - 1) % ring].tolist())


async def whole(backend, text, voice, seed, timing: dict | None = None) -> int:
    from tts_backend.base import SynthesisRequest

    request = SynthesisRequest(text=text, voice=voice, seed=seed, streaming_text=True)
    started = time.perf_counter()
    samples = 0
    async for chunk in backend.synthesize(request):
        if chunk.pcm and timing is not None and "first_audio_s" not in timing:
            timing["first_audio_s"] = time.perf_counter() - started
        samples += len(chunk.pcm) // 2
    return samples


async def pieces(backend, text, voice, seed, words_per_s, jitter, rng, timing: dict | None = None) -> int:
    from tts_backend.base import SynthesisRequest, TextStream

    words = words_of(text)
    stream = TextStream(words[0])
    request = SynthesisRequest(text=words[0], voice=voice, seed=seed, text_stream=stream)
    opened = time.perf_counter()
    pushed = {}

    async def write():
        for word in words[1:]:
            await asyncio.sleep(max(0.0, rng.uniform(1 - jitter, 1 + jitter) / words_per_s))
            stream.push(word)
        pushed["last_word"] = time.perf_counter()
        stream.finish()

    samples = 0
    first = None

    async def read():
        nonlocal samples, first
        async for chunk in backend.synthesize(request):
            if chunk.pcm and first is None:
                first = time.perf_counter()
            samples += len(chunk.pcm) // 2

    await asyncio.gather(write(), read())
    if timing is not None and first is not None:
        timing["first_audio_from_first_word_s"] = first - opened
        timing["first_audio_from_last_word_s"] = first - pushed["last_word"]
    return samples


def first_difference(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]


async def run(args) -> dict:
    from tts_backend.qwen3_backend import Qwen3Synthesizer

    prompts = [json.loads(line)["text"] for line in args.prompts.read_text(encoding="utf-8").splitlines() if line]
    rng = random.Random(args.seed)
    chosen = rng.sample(prompts, args.sentences + args.others)
    sentences, company = chosen[: args.sentences], chosen[args.sentences:]
    options = dict(model=str(args.model), device=args.device, max_active=args.max_active, max_len=args.max_len,
                   frame_cap_chars_per_second=args.frame_cap_chars_per_second, trim_leading_silence=False)
    if args.dtype:
        options["dtype"] = args.dtype
    if args.runner_options:
        options["runner_options"] = args.runner_options
    backend = Qwen3Synthesizer(**options)
    await backend.start()
    try:
        voice = backend.default_voice
        engine = backend.engine
        spy = FrameSpy(engine.runner)
        report = {"fast_path": engine.runner.fast_path(), "sampler": engine.runner.sampler,
                  "device": str(engine.runner.device), "others": args.others, "words_per_s": args.words_per_s,
                  "sentences": []}

        def others(base_seed):
            return [whole(backend, t, voice, base_seed + i) for i, t in enumerate(company)]

        failed = 0
        for n, text in enumerate(sentences):
            seed = 1000 + n
            spy.on = True
            spy.frames.clear()
            await whole(backend, text, voice, seed)
            alone = spy.frames.pop(seed)
            spy.frames.clear()
            await asyncio.gather(whole(backend, text, voice, seed), *others(5000))
            batched = spy.frames.pop(seed)
            spy.frames.clear()
            await asyncio.gather(pieces(backend, text, voice, seed, args.words_per_s, args.jitter, rng),
                                 *others(6000))
            streamed = spy.frames.pop(seed)
            spy.on = False
            entry = {
                "text": text, "frames": len(alone),
                "pieces_equal_whole": streamed == batched, "pieces_equal_alone": streamed == alone,
                "whole_equal_alone": batched == alone,
                "first_difference": {"pieces_whole": first_difference(streamed, batched),
                                     "pieces_alone": first_difference(streamed, alone),
                                     "whole_alone": first_difference(batched, alone)},
            }
            entry["pass"] = entry["pieces_equal_whole"] or entry["pieces_equal_alone"]
            entry["batch_shape_variance"] = not entry["whole_equal_alone"]
            failed += not entry["pass"]
            report["sentences"].append(entry)
            print(f"[{n}] frames={len(alone)} pieces==whole={entry['pieces_equal_whole']} "
                  f"pieces==alone={entry['pieces_equal_alone']} whole==alone={entry['whole_equal_alone']}", flush=True)

        before = engine.stats_snapshot()
        timings = []
        for n, text in enumerate(sentences):
            t_pieces, t_whole = {}, {}
            await asyncio.gather(pieces(backend, text, voice, 2000 + n, args.words_per_s, args.jitter, rng, t_pieces),
                                 *others(7000))
            await asyncio.gather(whole(backend, text, voice, 2000 + n, t_whole), *others(8000))
            timings.append({"pieces": t_pieces, "whole": t_whole})
        after = engine.stats_snapshot()
        from_first = [t["pieces"]["first_audio_from_first_word_s"] * 1000 for t in timings if t["pieces"]]
        from_last = [t["pieces"]["first_audio_from_last_word_s"] * 1000 for t in timings if t["pieces"]]
        whole_first = [t["whole"]["first_audio_s"] * 1000 for t in timings if t["whole"]]
        report["timing_ms"] = {
            "pieces_first_audio_from_first_word": {"median": statistics.median(from_first), "p95": p95(from_first)},
            "pieces_first_audio_from_last_word": {"median": statistics.median(from_last), "p95": p95(from_last)},
            "whole_first_audio_from_submit": {"median": statistics.median(whole_first), "p95": p95(whole_first)},
            "per_sentence": timings,
        }
        report["engine_text"] = {key: after["text"][key] - before["text"][key] for key in ("waits", "wait_s", "gaps",
                                                                                          "gap_s")}
        report["engine_late_chunks"] = after["late_chunks"] - before["late_chunks"]
        report["failed"] = failed
        return report
    finally:
        await backend.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path, help="Qwen3-TTS checkpoint folder")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--dtype", default=None, help="model dtype (default: the backend's, bfloat16)")
    parser.add_argument("--sentences", type=int, default=6)
    parser.add_argument("--others", type=int, default=8, help="whole-text requests beside each run")
    parser.add_argument("--words-per-s", type=float, default=40.0)
    parser.add_argument("--jitter", type=float, default=0.5, help="each word's interval varies by this fraction")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-active", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--frame-cap-chars-per-second", type=float, default=15.0,
                        help="random weights never sample EOS: cap each request at its text's length at this rate")
    parser.add_argument("--runner-options", type=json.loads, default=None, help="JSON, e.g. '{\"kernels\": \"inductor\"}'")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--output", type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = asyncio.run(run(args))
    text = json.dumps(report, indent=2)
    if args.output:
        args.output.write_text(text + "\n", encoding="utf-8")
    timing = report["timing_ms"]
    print(f"fast path: {report['fast_path']}")
    print(f"first audio, pieces, from the first word: median {timing['pieces_first_audio_from_first_word']['median']:.1f}"
          f" ms, p95 {timing['pieces_first_audio_from_first_word']['p95']:.1f} ms; from the last word: median "
          f"{timing['pieces_first_audio_from_last_word']['median']:.1f} ms; whole from submit: median "
          f"{timing['whole_first_audio_from_submit']['median']:.1f} ms")
    print(f"engine: text waits {report['engine_text']}, chunks late by the engine {report['engine_late_chunks']}")
    print("PASS" if not report["failed"] else f"FAIL: {report['failed']} sentence(s) said something else in pieces")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
