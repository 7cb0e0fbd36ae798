"""Word timings from Piper's phoneme alignments (issue 16).

Piper (1.8, with its voice patched to output each phoneme id's duration) says how many samples each
phoneme of a sentence lasts. What it does not say is which written word a phoneme belongs to: espeak-ng
expands what it reads ("$3.50" is spoken as "dollar three point five zero", "10:30" as "ten thirty") and
may run words together ("e.g." becomes "for example", one phoneme word). So the mapping is planned from
the phonemes alone, before synthesis:

1. The text's phonemes (what Piper synthesizes, per espeak sentence) split on the word-gap phoneme " "
   into spoken words; a group of punctuation only (a pause) is no word.
2. Each written word (`split_words`: whitespace tokens, punctuation kept) is phonemized alone, which
   gives how many spoken words, and how many sounds, it is expected to make.
3. The written words take the spoken words in order, each as many as it makes alone. Where context
   changes the count (espeak runs "in the" together as one spoken word "ɪnðə"), a small dynamic
   programme finds the in-order assignment whose sounds per word depart least from the expected ones,
   so the merged word goes to one of its written words and the words after it stay right.
4. A written word that got no spoken word (its sounds run into a neighbour's) takes its share of that
   spoken word: as many of its sounds as it makes alone, so no word has zero length ("in" and "the" of
   "ɪnðə" get "ɪn" and "ðə").

A written word spans from the start of its first spoken word's first sound to the end of its last sound:
stress marks belong to the word, punctuation phonemes (the pause after a comma) do not, and neither does
the silence Piper puts before the first phoneme. Times are exact sample positions of Piper's own output:
its durations sum to the audio's length.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

from .base import WordTiming, split_words

_GAP = " "
_MARKS = frozenset("ˈˌːˑ")  # stress and length: part of a sound, not one


def _is_pause(phoneme: str) -> bool:
    return all(unicodedata.category(c).startswith("P") or c.isspace() for c in phoneme)


def _spoken_groups(phonemes: list[str]) -> list[list[int]]:
    """Indices into `phonemes` of each spoken word: runs between gaps, without their pauses."""
    groups: list[list[int]] = []
    current: list[int] = []
    for i, phoneme in enumerate(phonemes):
        if phoneme == _GAP:
            if current:
                groups.append(current)
            current = []
        elif not _is_pause(phoneme):
            current.append(i)
    if current:
        groups.append(current)
    return groups


def _sounds(phonemes: list[str], indices: list[int]) -> int:
    """How many sounds a spoken word has: its phonemes but stress and length marks."""
    return sum(1 for i in indices if phonemes[i] not in _MARKS)


def assign(expected: list[tuple[int, int]], available: list[int]) -> list[int]:
    """How many spoken words each written word takes, in order. `expected`: per written word, the spoken
    words and sounds it makes alone; `available`: the sounds of each spoken word of the text. When the
    counts agree each takes its own count; else the in-order assignment whose sounds per written word
    depart least from the expected ones (a merged "in the" goes whole to one of its two words, instead of
    shifting every later word by one); ties go to the earlier word."""
    if sum(count for count, _ in expected) == len(available):
        return [count for count, _ in expected]
    n, m = len(expected), len(available)
    prefix = [0]
    for sounds in available:
        prefix.append(prefix[-1] + sounds)
    inf = float("inf")
    best = [[inf] * (m + 1) for _ in range(n + 1)]  # best[i][j]: first i words took the first j spoken words
    choice = [[0] * (m + 1) for _ in range(n + 1)]
    best[0][0] = 0
    for i in range(1, n + 1):
        count, sounds = expected[i - 1]
        for j in range(m + 1):
            for k in range(min(j, count + 4) + 1):  # a word takes at most 4 more spoken words than alone
                cost = best[i - 1][j - k] + abs(prefix[j] - prefix[j - k] - sounds) + 0.1 * abs(k - count)
                if cost < best[i][j]:
                    best[i][j], choice[i][j] = cost, k
    counts, j = [], m
    for i in range(n, 0, -1):
        counts.append(choice[i][j])
        j -= choice[i][j]
    return counts[::-1]


@dataclass
class _Planned:
    word: str
    sentence: int  # espeak sentence of its first spoken word
    groups: list[tuple[int, list[int]]]  # (espeak sentence, phoneme indices) of each spoken word


class WordTimer:
    """Plans a text's words over its phonemes, then times them as Piper's sentences (chunks) come.

    voice: a piper.PiperVoice. `feed` takes each synthesized sentence's phoneme alignments (or None if
    Piper could not align it: its words are then spread over its audio by phoneme count) and returns the
    words complete once that sentence is in."""

    def __init__(self, voice, text: str) -> None:
        self._sentences = [p for p in voice.phonemize(text) if p]  # as PiperVoice.synthesize iterates them
        groups = [(s, g) for s, phonemes in enumerate(self._sentences) for g in _spoken_groups(phonemes)]
        written = split_words(text)
        expected = []
        for word, _, _ in written:
            alone = [(p, g) for p in voice.phonemize(word) for g in _spoken_groups(p)]
            expected.append((len(alone), sum(_sounds(p, g) for p, g in alone)))
        available = [_sounds(self._sentences[s], g) for s, g in groups]
        self._planned: list[_Planned] = []
        taken = 0
        for (word, _, _), count in zip(written, assign(expected, available)):
            mine = groups[taken : taken + count]
            self._planned.append(_Planned(word, mine[0][0] if mine else -1, mine))
            taken += count
        self._share_merged([sounds for _, sounds in expected])
        self._bounds: list[list[tuple[int, int]]] = []  # per sentence fed: each phoneme's [start, end)
        self._offset = 0  # samples of the sentences fed so far
        self._told = 0
        self._last_end = 0

    def _share_merged(self, expected_sounds: list[int]) -> None:
        """A written word that got no spoken word of its own was run together with a neighbour ("in the" as
        "ɪnðə"): it takes its share of that spoken word, as many of its sounds as it makes alone (the
        neighbour keeps at least one), from the neighbour that got more sounds than it makes alone (the one
        before it on a tie). A word that finds none keeps zero length where it would have been."""
        planned = self._planned
        for i, word in enumerate(planned):
            if word.groups or expected_sounds[i] == 0:
                continue
            surplus = {}
            for j, side in ((i - 1, -1), (i + 1, 0)):
                if 0 <= j < len(planned) and planned[j].groups:
                    sentence, indices = planned[j].groups[side]
                    sounds = _sounds(self._sentences[sentence], indices)
                    mine = sum(_sounds(self._sentences[s], g) for s, g in planned[j].groups)
                    if sounds > 1:
                        surplus[j] = mine - expected_sounds[j]
            if not surplus:
                continue
            donor = max(surplus, key=lambda j: (surplus[j], -j))
            side = -1 if donor < i else 0
            sentence, indices = planned[donor].groups[side]
            phonemes = self._sentences[sentence]
            total = _sounds(phonemes, indices)
            take = max(1, min(expected_sounds[i], total - 1))
            keep = total - take if donor < i else take  # sounds before the cut
            cut, counted = 0, 0
            while counted < keep or (cut < len(indices) and phonemes[indices[cut]] in _MARKS
                                     and phonemes[indices[cut]] not in "ˈˌ"):
                counted += phonemes[indices[cut]] not in _MARKS
                cut += 1
            head, tail = indices[:cut], indices[cut:]
            if donor < i:
                planned[donor].groups[side] = (sentence, head)
                word.groups = [(sentence, tail)]
            else:
                planned[donor].groups[side] = (sentence, tail)
                word.groups = [(sentence, head)]
            word.sentence = sentence

    def feed(self, phonemes: list[str], durations: list[int] | None, num_samples: int) -> tuple[WordTiming, ...]:
        """One synthesized sentence: its phonemes, each phoneme's samples (BOS first, EOS last, as Piper's
        alignments list them; None: unknown), and its audio's length."""
        if durations is None or len(durations) != len(phonemes) + 2:
            # Spread over the audio by phoneme count, after no leading silence.
            per = num_samples / max(1, len(phonemes))
            durations = [0] + [round((i + 1) * per) - round(i * per) for i in range(len(phonemes))] + [0]
        position = self._offset + durations[0]
        bounds = []
        for duration in durations[1:-1]:
            bounds.append((position, position + duration))
            position += duration
        self._bounds.append(bounds)
        self._offset += num_samples
        return self._complete()

    def _complete(self) -> tuple[WordTiming, ...]:
        fed = len(self._bounds)
        words = []
        while self._told < len(self._planned):
            planned = self._planned[self._told]
            if any(sentence >= fed for sentence, _ in planned.groups):
                break
            if planned.groups:
                first_sentence, first = planned.groups[0]
                last_sentence, last = planned.groups[-1]
                start = self._bounds[first_sentence][first[0]][0]
                end = self._bounds[last_sentence][last[-1]][1]
            else:  # no sound of its own: at the boundary where it would have been
                start = end = self._last_end
            words.append(WordTiming(planned.word, start, end))
            self._last_end = end
            self._told += 1
        return tuple(words)

    def rest(self) -> tuple[WordTiming, ...]:
        """Words never completed (Piper made fewer sentences than planned): at the end of the audio."""
        words = []
        for planned in self._planned[self._told :]:
            words.append(WordTiming(planned.word, self._offset, self._offset))
        self._told = len(self._planned)
        return tuple(words)
