"""The first unit of an utterance on Piper (issue 31): how long the pause at its cut is, and how much sooner
its first audio comes, against the sentence spoken whole.

With `split_granularity: "token"` on a backend that synthesizes whole units (Piper), an utterance's first
sentence is cut early (gateway/session/segmenter.py, `first_unit_words`), so its first audio waits for a few
words' synthesis instead of the whole sentence's; the words after the cut are their own unit. Where the cut
falls mid-phrase, the listener hears a pause a speaker would not make.

For each of --sentences ARCTIC sentences (bench/data/arctic_en.jsonl) that the rule cuts, with the bundled
Piper voice (deterministic):
  join pause    the silence around the cut when the two units' audio is played back to back, as the
                gateway sends it (the first unit's trailing silence dropped where the checkout does;
                10 ms frames under -40 dBFS; the run of them that holds the join);
  whole pause   the silence at the same word boundary in the sentence spoken whole (located by Piper's
                word timings);
  first audio   the first unit's synthesis time against the whole sentence's (best of --repeats, on this
                machine as loaded; first audio of a Piper unit is its whole synthesis).

    python bench/first_unit_pause.py --sentences 60 --out bench/results/first_unit_pause.json

The rule measured is the checkout's (--first-unit-words changes its word limit); run it on two checkouts to
compare rules. On the shared 2-core VM (load 3-5), 80 sentences:

    cut after four words, units as made         join 190 ms, whole 10 ms: 170 ms more (p90 221);
                                                first audio at 0.45 of the whole sentence's synthesis
    a clause mark or a phrase word first, the   join 70 ms, whole 20 ms: 40 ms more (p90 80);
    trailing silence dropped inside a sentence  first audio at 0.49 of the whole sentence's synthesis
    (cutting after ten words instead: 20 ms more, but first audio at 0.87: most of the gain gone)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.session.connection import FIRST_UNIT_WORDS  # noqa: E402
from gateway.session.segmenter import CLAUSE_MARKS, CLOSING_QUOTES, DASHES, SentenceSegmenter  # noqa: E402
from tts_backend.base import SynthesisRequest, split_words  # noqa: E402
from tts_backend.piper import PiperSynthesizer  # noqa: E402

try:  # the checkout's way of joining a cut sentence (older ones have none)
    from gateway.audio.silence import TrailingSilence  # noqa: E402
except ImportError:
    TrailingSilence = None

DATA = Path(__file__).resolve().parent / "data" / "arctic_en.jsonl"
# Words that start a phrase, for the report's cut kinds (the same list as the segmenter's, which older
# checkouts lack).
PHRASE_STARTS_EN = frozenset("and but or nor because although though unless until while whereas when where "
                             "whenever wherever which who whom whose if".split())
FRAME_S = 0.010
SILENCE = 32768 * 10 ** (-40 / 20)  # -40 dBFS, RMS of a frame


def first_cut(text: str, words: int = FIRST_UNIT_WORDS) -> tuple[str, str, bool] | None:
    """The first unit, the rest, and whether the gateway drops the first unit's trailing silence, as a session
    on Piper splits the utterance's first sentence (None when the sentence stays whole)."""
    segmenter = SentenceSegmenter("sentence", first_unit_words=words)
    units = segmenter.push(text) + segmenter.flush()
    if len(units) < 2:
        return None
    return units[0], " ".join(units[1:]), getattr(segmenter, "first_unit_in_sentence", False)


def as_sent(pcm: np.ndarray, rate: int, trim: bool) -> np.ndarray:
    """The first unit's audio as the gateway sends it."""
    if not trim or TrailingSilence is None:
        return pcm
    trailing = TrailingSilence(rate)
    sent = trailing.feed(pcm.tobytes()) + trailing.end()
    return np.frombuffer(sent, dtype=np.int16)


def cut_kind(head: str, rest: str) -> str:
    """Where the cut fell: after a clause mark, before a word that starts a phrase, or mid-phrase."""
    if head.rstrip(CLOSING_QUOTES)[-1:] in CLAUSE_MARKS | DASHES:
        return "clause"
    return "phrase" if rest.split()[0].lower() in PHRASE_STARTS_EN else "mid-phrase"


def silent_run(pcm: np.ndarray, rate: int, at: int) -> float:
    """Seconds of the run of silent frames that holds sample `at` (0 when its frame is not silent)."""
    frame = max(1, int(rate * FRAME_S))

    def silent(start: int) -> bool:
        piece = pcm[max(0, start): start + frame].astype(np.float64)
        return piece.size > 0 and float(np.sqrt(np.mean(piece * piece))) < SILENCE

    start = at - frame // 2
    if not silent(start):
        return 0.0
    left = right = start
    while left - frame >= 0 and silent(left - frame):
        left -= frame
    while right + frame < len(pcm) and silent(right + frame):
        right += frame
    return (right + frame - left) / rate


async def synthesize(backend: PiperSynthesizer, text: str, *, words: bool = False):
    """(pcm as int16, word timings, seconds to the first chunk)."""
    started = time.perf_counter()
    first = None
    pcm, timings = bytearray(), []
    async for chunk in backend.synthesize(SynthesisRequest(text=text, voice=backend.default_voice,
                                                           word_timestamps=words)):
        if first is None and chunk.pcm:
            first = time.perf_counter() - started
        pcm += chunk.pcm
        timings += chunk.words
    return np.frombuffer(bytes(pcm), dtype=np.int16), timings, first or 0.0


async def measure(texts: list[str], repeats: int, words: int = FIRST_UNIT_WORDS) -> dict:
    backend = PiperSynthesizer()
    await backend.start()
    rate = backend.sample_rate
    rows = []
    try:
        for text in texts:
            cut = first_cut(text, words)
            if cut is None:
                rows.append({"text": text, "cut": None})
                continue
            head, rest, trim = cut
            head_pcm = as_sent((await synthesize(backend, head))[0], rate, trim)
            rest_pcm, _, _ = await synthesize(backend, rest)
            joined = np.concatenate([head_pcm, rest_pcm])
            whole_pcm, timings, _ = await synthesize(backend, text, words=True)
            k = len(split_words(head))  # the first word of the rest
            boundary = None
            if 0 < k < len(timings):
                boundary = (timings[k - 1].end + timings[k].start) // 2  # samples
            head_s = min([(await synthesize(backend, head))[2] for _ in range(repeats)])
            whole_s = min([(await synthesize(backend, text))[2] for _ in range(repeats)])
            rows.append({
                "text": text, "cut": head, "head_words": k, "kind": cut_kind(head, rest),
                "join_pause_ms": round(1000 * silent_run(joined, rate, len(head_pcm)), 1),
                "whole_pause_ms": None if boundary is None else round(1000 * silent_run(whole_pcm, rate, boundary), 1),
                "first_audio_ms": round(1000 * head_s, 1), "whole_first_audio_ms": round(1000 * whole_s, 1),
            })
    finally:
        await backend.stop()
    cut_rows = [r for r in rows if r["cut"] is not None]

    def median(key: str) -> float | None:
        values = [r[key] for r in cut_rows if r.get(key) is not None]
        return round(statistics.median(values), 1) if values else None

    extra = [r["join_pause_ms"] - r["whole_pause_ms"] for r in cut_rows if r["whole_pause_ms"] is not None]
    gain = [r["whole_first_audio_ms"] - r["first_audio_ms"] for r in cut_rows]
    # First audio against the whole sentence's synthesis, in the same run (1 for a sentence not cut): what
    # the load of the machine changes least.
    share = [r["first_audio_ms"] / r["whole_first_audio_ms"] if r["cut"] else 1.0 for r in rows]
    kinds = {}
    for kind in ("clause", "phrase", "mid-phrase"):
        of_kind = [r for r in cut_rows if r["kind"] == kind and r["whole_pause_ms"] is not None]
        if of_kind:
            kinds[kind] = {"cuts": len(of_kind), "median_join_pause_ms": statistics.median(
                r["join_pause_ms"] for r in of_kind), "median_whole_pause_ms": statistics.median(
                r["whole_pause_ms"] for r in of_kind)}
    return {
        "rule": f"first_unit_words={words}", "sentences": len(rows), "cut": len(cut_rows),
        "median_join_pause_ms": median("join_pause_ms"), "median_whole_pause_ms": median("whole_pause_ms"),
        "median_extra_pause_ms": round(statistics.median(extra), 1) if extra else None,
        "p90_extra_pause_ms": round(float(np.percentile(extra, 90)), 1) if extra else None,
        "median_first_audio_gain_ms": round(statistics.median(gain), 1) if gain else None,
        "median_first_audio_share_of_whole": round(statistics.median(share), 2) if share else None,
        "median_head_words": statistics.median(r["head_words"] for r in cut_rows) if cut_rows else None,
        "by_kind": kinds,
        "cpus": len(os.sched_getaffinity(0)), "load_1min": round(os.getloadavg()[0], 2),
        "rows": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sentences", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--first-unit-words", type=int, default=FIRST_UNIT_WORDS,
                        help="the word limit of the first unit (default: the gateway's)")
    parser.add_argument("--out")
    args = parser.parse_args()
    texts = [json.loads(line)["text"] for line in DATA.read_text().splitlines()][: args.sentences]
    report = asyncio.run(measure(texts, args.repeats, args.first_unit_words))
    summary = {k: v for k, v in report.items() if k != "rows"}
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
