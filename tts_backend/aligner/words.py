"""Text -> the words the aligner times, and the prompt that asks for their times.

Words are what the reference aligns: the text is split on whitespace, every character that is not a letter, a
digit or an apostrophe is dropped, and each CJK ideograph stands alone (Chinese has no spaces, so every character
is a word). A word that is all punctuation disappears. Japanese and Korean need dictionary word splitters in the
reference (nagisa, soynlp) that Voxgate does not carry, so they are refused.

The prompt is `<|audio_start|>`, one `<|audio_pad|>` per audio-encoder output, `<|audio_end|>`, then each word
followed by two `<timestamp>` tokens: the head's class at the first is the word's start, at the second its end.
"""

from __future__ import annotations

import unicodedata

UNSUPPORTED_LANGUAGES = ("japanese", "korean")

# CJK Unified Ideographs, Extension A, Extensions B-E, Compatibility Ideographs.
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
               (0x2B820, 0x2CEAF), (0xF900, 0xFAFF))


class UnsupportedLanguage(ValueError):
    pass


def is_cjk(ch: str) -> bool:
    code = ord(ch)
    return any(lo <= code <= hi for lo, hi in _CJK_RANGES)


def _kept(ch: str) -> bool:
    return ch == "'" or unicodedata.category(ch)[0] in "LN"


def split_words(text: str, language: str | None = None) -> list[str]:
    if language and language.lower() in UNSUPPORTED_LANGUAGES:
        raise UnsupportedLanguage(f"word alignment for {language} needs a word splitter Voxgate does not ship")
    words: list[str] = []
    for piece in text.split():
        kept = "".join(ch for ch in piece if _kept(ch))
        run = ""
        for ch in kept:
            if is_cjk(ch):
                if run:
                    words.append(run)
                    run = ""
                words.append(ch)
            else:
                run += ch
        if run:
            words.append(run)
    return words


def times_of_spans(spans: list[str], times: list[tuple[str, float, float]]) -> list[tuple[float, float]]:
    """Aligner word times -> (start_s, end_s) of each span of the text (spans in order, together covering every
    word, e.g. the whitespace-separated words a client sees). A span's start is its first aligned word's start,
    its end its last one's end; a span with nothing to align (an underscore, a lone symbol) is the instant where
    the previous span ended."""
    out, used, last_end = [], 0, 0.0
    for span in spans:
        count = len(split_words(span))
        mine = times[used:used + count]
        used += count
        if mine:
            out.append((mine[0][1], mine[-1][2]))
            last_end = mine[-1][2]
        else:
            out.append((last_end, last_end))
    if used != len(times):
        raise ValueError(f"spans cover {used} aligned words of {len(times)}")
    return out


def prompt_text(words: list[str], audio_tokens: int) -> str:
    return ("<|audio_start|>" + "<|audio_pad|>" * audio_tokens + "<|audio_end|>"
            + "".join(f"{w}<timestamp><timestamp>" for w in words))


def repair_monotonic(values: list[float]) -> list[int]:
    """Make a predicted time sequence non-decreasing, keeping its longest non-decreasing subsequence.

    The subsequence is the one a quadratic DP finds, preferring the earliest predecessor and the earliest end
    among equals. A gap of one or two outliers takes its nearer kept neighbour (the left one on a tie); a longer
    gap is filled by linear steps between its kept neighbours (or copies the only one it has). Values are then
    truncated to integers."""
    n = len(values)
    if n == 0:
        return []
    length = [1] * n
    before = [-1] * n
    for i in range(1, n):
        for j in range(i):
            if values[j] <= values[i] and length[j] + 1 > length[i]:
                length[i], before[i] = length[j] + 1, j
    keep = [False] * n
    i = length.index(max(length))
    while i != -1:
        keep[i] = True
        i = before[i]

    out = list(values)
    i = 0
    while i < n:
        if keep[i]:
            i += 1
            continue
        end = i
        while end < n and not keep[end]:
            end += 1
        left = out[i - 1] if i > 0 else None  # out[i - 1] is kept (or the gap starts the sequence)
        right = out[end] if end < n else None
        gap = end - i
        for k in range(i, end):
            if left is None or right is None:
                out[k] = right if left is None else left
            elif gap <= 2:
                out[k] = left if (k - i + 1) <= (end - k) else right
            else:
                out[k] = left + (right - left) / (gap + 1) * (k - i + 1)
        i = end
    return [int(v) for v in out]


def word_times(words: list[str], classes: list[int], segment_ms: float) -> list[tuple[str, float, float]]:
    """Timestamp classes (two per word) -> (word, start_s, end_s), repaired to be monotonic, rounded to 1 ms."""
    if len(classes) != 2 * len(words):
        raise ValueError(f"{len(classes)} timestamp slots for {len(words)} words")
    ms = repair_monotonic([float(c * segment_ms) for c in classes])
    return [(w, round(ms[2 * i] / 1000.0, 3), round(ms[2 * i + 1] / 1000.0, 3)) for i, w in enumerate(words)]
