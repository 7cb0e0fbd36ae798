"""How well Piper's word timestamps match its audio: at each word boundary inside a sentence, where is the
signal's energy dip, and how far is it from the reported boundary?

For each sentence (the first --sentences of bench/data/arctic_en.jsonl, CMU ARCTIC prompts) the Piper
backend synthesizes the text with word timestamps, exactly as the gateway asks for them. Then, for every
pair of consecutive words with audio of their own (a word espeak ran into its neighbour has none), the
check looks for the quietest 10 ms of the audio (RMS in 10 ms windows every 2.5 ms) between the middle of
the first word and the middle of the second, and at most --search-ms beyond the reported boundary on each
side. The reported boundary is the span from the first word's end to the second's start (a pause can lie
between them); the error is 0 when the dip lies inside it, else its distance to the nearer edge.

Connected speech does not always dip between words ("in the" may be one breath), so the same check is run
on a naive alignment, the words spread over the sentence's speech by their number of letters: that is
what the check gives for timings that know nothing of the audio, and the Piper figures are read against it.
The Piper figures are also split by boundary kind: where Piper put a pause (80 ms or more) between the
words, and where the words run together (there the quietest moment is often a stop's closure or a fricative inside a
word, not the boundary: the check's own limit).

    python bench/word_alignment_accuracy.py --sentences 100 --out bench/results/word_alignment_piper.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from pathlib import Path

import numpy as np

from tts_backend.base import SynthesisRequest, WordTiming
from tts_backend.piper import PiperSynthesizer
from tts_backend.piper_words import WordTimer

DATA = Path(__file__).parent / "data" / "arctic_en.jsonl"
WINDOW_S = 0.010
HOP_S = 0.0025
PAUSE_S = 0.080  # a gap this long between two words is a pause (the word-gap phoneme alone is shorter)


def energy_db(pcm: np.ndarray, rate: int) -> np.ndarray:
    """RMS in dB of WINDOW_S windows every HOP_S; frame k is centred at k * HOP_S."""
    window, hop = int(rate * WINDOW_S), int(rate * HOP_S)
    padded = np.pad(pcm.astype(float), (window // 2, window))
    frames = np.lib.stride_tricks.sliding_window_view(padded, window)[::hop]
    return 10 * np.log10(np.mean(frames**2, axis=1) + 1.0)


def boundary_errors(words: list[WordTiming], energy: np.ndarray, rate: int, search_s: float,
                    paused: list[bool] | None = None) -> list[float]:
    """Per boundary between two timed words: seconds from the energy dip to the reported boundary span.
    `paused`, when given, gets whether each boundary has a pause (a gap between the words)."""
    errors = []
    spoken = [w for w in words if w.end > w.start]
    for left, right in zip(spoken, spoken[1:]):
        end, start = left.end / rate, right.start / rate
        low = max((left.start + left.end) / 2 / rate, end - search_s)
        high = min((right.start + right.end) / 2 / rate, start + search_s)
        first, last = int(low / HOP_S), int(high / HOP_S) + 1
        if last <= first:
            continue
        dip = (first + int(np.argmin(energy[first:last]))) * HOP_S
        errors.append(0.0 if end <= dip <= start else min(abs(dip - end), abs(dip - start)))
        if paused is not None:
            paused.append(start - end >= PAUSE_S)
    return errors


def spread_by_letters(words: list[WordTiming]) -> list[WordTiming]:
    """The naive alignment: the speech from the first word's start to the last word's end, shared by letters."""
    spoken = [w for w in words if w.end > w.start]
    first, last = spoken[0].start, spoken[-1].end
    letters = [max(1, sum(c.isalnum() for c in w.word)) for w in spoken]
    total, position, spread = sum(letters), 0, []
    for word, count in zip(spoken, letters):
        start = first + (last - first) * position // total
        position += count
        spread.append(WordTiming(word.word, start, first + (last - first) * position // total))
    return spread


def summary(errors_s: list[float]) -> dict:
    ms = np.array(errors_s) * 1000
    return {"boundaries": len(ms), "median_ms": round(float(np.median(ms)), 1),
            "p95_ms": round(float(np.percentile(ms, 95)), 1), "mean_ms": round(float(np.mean(ms)), 1),
            "within_20_ms": round(float(np.mean(ms <= 20)), 3)}


async def run(args: argparse.Namespace) -> dict:
    sentences = [json.loads(line) for line in DATA.read_text().splitlines()[: args.sentences]]
    backend = PiperSynthesizer(threads=1)
    await backend.start()
    rate = backend.sample_rate
    voice = backend._find(backend.default_voice).piper_voice
    piper_errors, naive_errors, paused, merged, words_total, cost = [], [], [], 0, 0, []
    try:
        for sentence in sentences:
            request = SynthesisRequest(text=sentence["text"], voice=backend.default_voice, word_timestamps=True)
            pcm, words = [], []
            async for chunk in backend.synthesize(request):
                pcm.append(chunk.pcm)
                words.extend(chunk.words)
            # What timestamps add to a sentence's synthesis: planning its words (espeak per word).
            started = time.process_time()
            WordTimer(voice, sentence["text"])
            cost.append(time.process_time() - started)
            audio = np.frombuffer(b"".join(pcm), dtype="<i2")
            energy = energy_db(audio, rate)
            words_total += len(words)
            merged += sum(1 for w in words if w.end == w.start)
            piper_errors += boundary_errors(words, energy, rate, args.search_ms / 1000, paused)
            naive_errors += boundary_errors(spread_by_letters(words), energy, rate, args.search_ms / 1000)
    finally:
        await backend.stop()
    return {
        "command": f"python bench/word_alignment_accuracy.py --sentences {args.sentences} --search-ms {args.search_ms}",
        "machine": f"{platform.machine()}, {len(__import__('os').sched_getaffinity(0))} CPUs ({platform.processor() or 'cpu'})",
        "voice": backend.default_voice,
        "sentences": len(sentences),
        "words": words_total,
        "words_without_own_audio": merged,
        "piper_alignment": summary(piper_errors),
        "piper_at_pauses": summary([e for e, p in zip(piper_errors, paused) if p]),
        "piper_between_connected_words": summary([e for e, p in zip(piper_errors, paused) if not p]),
        "naive_alignment_by_letters": summary(naive_errors),
        "word_planning_cpu_ms_per_sentence": round(float(np.mean(cost)) * 1000, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=100)
    parser.add_argument("--search-ms", type=float, default=150.0, help="how far past the boundary to look for the dip")
    parser.add_argument("--out", help="write the JSON result here too")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
