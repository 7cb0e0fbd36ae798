"""Incremental sentence splitting for text that arrives token by token from an LLM.

The segmenter sees text in arbitrary pieces and releases speakable units (sentences, or clauses) the
moment each is certainly complete, never later:

- A sentence boundary can only sit in a run of whitespace after a token that holds a terminator
  (``. ! ? …``), or in whitespace that holds a line break. Whether such a candidate really is a boundary
  depends on what follows ("Dr. Smith" vs "done. Then"), so it is decided exactly when the first
  non-whitespace character after the run arrives, by asking pysbd about the unreleased text up to and
  including that character. The decision never looks further ahead, so the result is the same however
  the text is cut into pieces, and the sentence is spoken as early as it can be known.
- CJK terminators (``。 ！ ？ ｡ ．``) end a sentence at once, without waiting for whitespace. Closing
  brackets or quotes after them start the next unit.
- ``clause`` granularity also splits after ``, ; :`` followed by whitespace, after a dash that stands
  alone (`` - ``, ``--``) or an em/en dash, and after CJK ``，、；：``, once the clause is at least
  ``CLAUSE_MIN_CHARS`` (24) characters long (``CJK_CLAUSE_MIN_CHARS``, 12, for CJK clause marks: each
  CJK character is a syllable or more). Shorter clauses stay with what follows, so the voice is never
  asked to speak two words on their own.
- ``none`` releases text only on ``flush()``.
- ``token`` finds sentences as ``sentence`` does, for a session that synthesizes each sentence from its first
  words on (the session pushes the words of the unit still open, ``stable_chars``, as they arrive). What has
  been pushed must stay the start of the unit, so a unit that grows too long is cut at its last whitespace,
  never back at an earlier clause mark.
- ``first_unit_words`` (N > 0): the first unit is released early where a speaker may pause: after its first
  clause mark (``, ; :`` or a dash) after two words, before a word that starts a phrase ("and", "but",
  "because", "which", ... ``PHRASE_STARTS``) after two, or after N whole words, whichever comes first;
  later units are whole sentences. For a backend that synthesizes only whole units and takes longer the
  longer the unit (Piper on a CPU), the first audio then waits for a few words instead of a whole sentence;
  the words after the cut are spoken as their own unit. ``first_unit_in_sentence`` says whether that cut fell
  inside a phrase or sentence (not at a clause mark), where the unit's trailing silence would be heard
  as a break.
- No unit is longer than ``max_unit_chars`` (``MAX_UNIT_CHARS`` by default; the gateway passes its
  ``max_synthesis_chars``): each unit is one synthesis call, and a backend's cost and memory grow with it.
  Length is counted as spoken (``spoken_length``): a digit counts DIGIT_SPOKEN_CHARS characters, since a
  number is read out as words ("1234567" is 68 characters spoken), so a unit of numbers is as long in audio
  as a unit of words (before, 277 characters of 7-digit numbers made one unit of about 100 s of speech).
  A unit that grows that long without a boundary is cut at its last clause mark, else at its last
  whitespace; flushed text over the limit is cut into pieces after the last sentence end that fits, else
  the last clause mark, else the last whitespace. Only a single word longer than the limit is cut inside.

- ``keeps_together`` (a predicate on the text before a boundary): where it holds, no boundary is taken
  but the forced cut at ``max_unit_chars``. A session with markup passes one (no unit ends inside a tag or
  its content, gateway/pronunciation/markup.py).

Units keep their text exactly; only the whitespace between units is dropped, and whitespace-only units
are never emitted. pysbd only ever sees the unreleased tail (at most ``PYSBD_WINDOW`` characters of it,
ending at the decision point), so cost stays proportional to the text, not to its square.

Cost: each character is examined about once (at most twice, when a forced cut re-examines the rest of an
over-long unit), and examining one costs at most one pysbd call on a bounded window: linear, but up to a
pysbd call per two or three characters for text dense with candidates ("Dr. Dr. ...", "a\na\n..."),
seconds for 100 KB. `push` does all of it at once; `append` + `advance(deadline)` do it in slices, and
`push_in_slices` runs those on an event loop with the loop free between slices.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Literal

import pysbd

Granularity = Literal["sentence", "clause", "none", "token"]
GRANULARITIES: tuple[str, ...] = ("sentence", "clause", "none", "token")

# A token containing one of these may end a sentence; pysbd decides whether it does.
SENTENCE_TERMINATORS = frozenset(".!?…‼⁇⁈⁉")
# These end a sentence on their own, immediately: CJK text has no space after a sentence.
CJK_TERMINATORS = frozenset("。！？｡．")
CLAUSE_MARKS = frozenset(",;:")
CJK_CLAUSE_MARKS = frozenset("，、；：")
DASHES = frozenset("—–")  # em dash, en dash
CLOSING_QUOTES = "\"')]}”’»"
CLAUSE_MIN_CHARS = 24
# first_unit_words: a clause mark ends the first unit early once it has this many words; a word that starts
# a phrase (a conjunction, a relative pronoun) once the unit before it has FIRST_PHRASE_MIN_WORDS. Those are
# where a speaker may pause (bench/first_unit_pause.py measures the pause at the cut).
FIRST_CLAUSE_MIN_WORDS = 2
FIRST_PHRASE_MIN_WORDS = 2
PHRASE_STARTS = frozenset("and but or nor because although though unless until while whereas when where "
                          "whenever wherever which who whom whose if".split())
CJK_CLAUSE_MIN_CHARS = 12
# pysbd's decisions are local (a few words either side, plus quote/bracket pairing within the sentence);
# a sentence longer than this is judged on its last PYSBD_WINDOW characters only.
PYSBD_WINDOW = 200
# The default longest unit: a unit that grows this long without a boundary is cut at its last clause mark,
# else its last whitespace, else right there. It bounds the latency of run-on text, the cost of judging it
# and the size of one synthesis call.
MAX_UNIT_CHARS = 500
# push_in_slices examines text for at most this long before it lets the event loop run again.
SLICE_S = 0.005

_LANGUAGE_NAMES = {
    "english": "en",
    "chinese": "zh",
    "japanese": "ja",
    "german": "de",
    "french": "fr",
    "spanish": "es",
    "italian": "it",
    "russian": "ru",
    "dutch": "nl",
    "polish": "pl",
    "greek": "el",
    "danish": "da",
    "arabic": "ar",
    "hindi": "hi",
}


def pysbd_language(language: str | None) -> str:
    """The pysbd language code for a protocol language name or code; English when pysbd lacks it."""
    if not language:
        return "en"
    key = language.strip().lower()
    key = _LANGUAGE_NAMES.get(key, key.split("-")[0].split("_")[0])
    return key if key in pysbd.languages.LANGUAGE_CODES else "en"


# Characters a digit stands for when spoken: "1234567" reads as "one million two hundred thirty-four
# thousand five hundred sixty-seven" (9.7 a digit), "2024" as "twenty twenty-four" (4.5), a phone number
# digit by digit (about 5 with the pauses). 8 keeps a unit of large numbers within the limit's audio.
DIGIT_SPOKEN_CHARS = 8


def _spoken_weight(char: str) -> int:
    return DIGIT_SPOKEN_CHARS if char.isdigit() else 1


def spoken_length(text: str) -> int:
    """How long `text` is when spoken, in characters of prose: digits count DIGIT_SPOKEN_CHARS each."""
    return len(text) + (DIGIT_SPOKEN_CHARS - 1) * sum(char.isdigit() for char in text)


def _chars_within(text: str, limit: int) -> int:
    """The longest prefix of `text` (in characters) whose spoken length is at most `limit`."""
    spoken = 0
    for index, char in enumerate(text):
        spoken += _spoken_weight(char)
        if spoken > limit:
            return index
    return len(text)


class SentenceSegmenter:
    """Turns a stream of text pieces into speakable units. One instance per utterance (or context)."""

    def __init__(self, granularity: Granularity = "sentence", language: str = "en",
                 max_unit_chars: int = MAX_UNIT_CHARS, first_unit_words: int = 0,
                 keeps_together: Callable[[str], bool] | None = None) -> None:
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, not {granularity!r}")
        if max_unit_chars < 1:
            raise ValueError(f"max_unit_chars must be positive, not {max_unit_chars}")
        if first_unit_words < 0:
            raise ValueError(f"first_unit_words must be 0 (off) or positive, not {first_unit_words}")
        self.granularity = granularity
        self.max_unit_chars = max_unit_chars
        self.first_unit_words = first_unit_words
        # Whether a unit's text would end inside something that must stay whole (markup: a tag and its
        # content, gateway/pronunciation/markup.py); no boundary is taken there but the forced cut.
        self.keeps_together = keeps_together
        self._released_any = False  # a unit was released (first_unit_words applies to the first only)
        self.first_unit_in_sentence = False  # the first unit was cut early, not at a clause mark
        self.language = pysbd_language(language)
        self._pysbd = pysbd.Segmenter(language=self.language, clean=False)
        self._tail = ""  # text not yet released; never starts with whitespace
        self._reset_scan()

    def _reset_scan(self) -> None:
        self._scan = 0  # characters of _tail already examined
        self._spoken = 0  # their spoken length (spoken_length)
        self._token_start = 0  # start of the current (or last) non-whitespace token
        self._has_word_char = False  # a letter or digit among the examined characters
        self._words = 0  # whole words (tokens followed by whitespace) among the examined characters
        # A sentence-boundary candidate waiting for the next non-whitespace character:
        # (start of the whitespace run, start of the token before it), or None.
        self._pending: tuple[int, int] | None = None

    @property
    def buffered_chars(self) -> int:
        return len(self._tail)

    @property
    def buffered_text(self) -> str:
        """Text pushed but not released yet (recorded for session.resume; pushing it into a fresh
        segmenter restores this one)."""
        return self._tail

    def continue_utterance(self) -> None:
        """The utterance has released units before this segmenter (a resumed one): `first_unit_words`, which
        shortens an utterance's first unit only, no longer applies."""
        self._released_any = True

    @property
    def stable_chars(self) -> int:
        """How many characters of `buffered_text` are certainly the start of the next unit, ending with a
        whole word: up to the end of the last word that whitespace follows, among the examined text. A unit
        always ends at or after it (granularity ``token``: see the module doc), so text up to here may be
        given to synthesis before the unit is complete. Costs the length of the last word."""
        tail, i = self._tail, min(self._scan, len(self._tail))
        while i > 0 and not tail[i - 1].isspace():  # back over the word still being written
            i -= 1
        while i > 0 and tail[i - 1].isspace():
            i -= 1
        return i

    @property
    def examined_all(self) -> bool:
        """Every character appended has been examined (`advance` has nothing left to do)."""
        return self.granularity == "none" or self._scan >= len(self._tail)

    def push(self, text: str) -> list[str]:
        """Add text; return the units that are certainly complete now, in order."""
        self.append(text)
        return self.advance()

    def append(self, text: str) -> None:
        """Add text without examining it; `advance` examines it."""
        if not text:
            return
        if not self._tail:
            text = text.lstrip()
        self._tail += text

    def advance(self, deadline: float | None = None) -> list[str]:
        """Examine the text appended and not examined yet; return the units now certainly complete, in
        order. With a `deadline` (a time.perf_counter() value), stop once it has passed, having examined
        at least one character: `examined_all` says whether text is left for the next call. How the work
        is sliced never changes the units."""
        if self.granularity == "none":
            return []
        released: list[str] = []
        tail = self._tail
        i = self._scan
        examined = 0
        while i < len(tail):
            if deadline is not None and examined and time.perf_counter() >= deadline:
                break
            examined += 1
            self._spoken += _spoken_weight(tail[i])
            cut = self._examine(tail, i)
            if cut is None and self._spoken >= self.max_unit_chars:
                cut = _forced_cut(tail[: i + 1], at_clause_marks=self.granularity != "token")
            if cut is None:
                i += 1
                continue
            end, resume = cut
            unit = tail[:end].strip()
            if unit:
                released.append(unit)
                self._released_any = True
            tail = tail[resume:].lstrip()
            self._tail = tail
            self._reset_scan()
            i = 0
        self._tail = tail
        self._scan = i
        return released

    def flush(self) -> list[str]:
        """Release everything buffered: one unit, or several if it is longer than max_unit_chars. The
        utterance may continue afterwards."""
        unit = self._tail.strip()
        self._tail = ""
        self._reset_scan()
        if unit:
            self._released_any = True
        return split_to_fit(unit, self.max_unit_chars) if unit else []

    def end_unit_at(self, chars: int) -> str:
        """End the unit being written after its first `chars` characters (granularity ``token``: the words
        already given to synthesis, which will not grow) and return it; the text after them starts the next
        unit, examined by the next `advance`. The utterance goes on."""
        unit = self._tail[:chars].strip()
        self._tail = self._tail[chars:].lstrip()
        self._reset_scan()
        if unit:
            self._released_any = True
        return unit

    # -- decisions -------------------------------------------------------------------------------------

    def _examine(self, tail: str, i: int) -> tuple[int, int] | None:
        """Look at character i (all earlier ones were examined). Returns (unit end, next unit start) when
        a unit is complete, else None and updates the scan state."""
        char = tail[i]
        prev = tail[i - 1] if i else ""
        if char.isspace():
            if prev and not prev.isspace():
                token = tail[self._token_start : i]
                self._words += 1
                if self.granularity == "clause" and self._clause_ends_with(token, i) and self._may_end(tail, i):
                    return i, i
                if self.first_unit_words and not self._released_any:
                    cut = self._first_unit_cut(token, i)
                    if cut is not None and self._may_end(tail, cut[0]):
                        end, in_sentence = cut
                        self.first_unit_in_sentence = in_sentence
                        return end, end
                if self._pending is None and (char == "\n" or any(c in SENTENCE_TERMINATORS for c in token)):
                    self._pending = (i, self._token_start)
            elif char == "\n" and self._pending is None and self._token_start < i:
                self._pending = (self._whitespace_run_start(tail, i), self._token_start)
            return None

        if self._pending is not None:
            run_start, token_start = self._pending
            self._pending = None
            if (not _is_list_marker(tail, token_start, run_start, i) and self._may_end(tail, run_start)
                    and self._pysbd_splits(tail, token_start, i)):
                return run_start, i
        if not prev or prev.isspace():
            self._token_start = i
        if char.isalnum():
            self._has_word_char = True
        elif char in CJK_TERMINATORS and self._has_word_char and self._may_end(tail, i + 1):
            return i + 1, i + 1
        if self.granularity == "clause":
            if char in CJK_CLAUSE_MARKS and i + 1 >= CJK_CLAUSE_MIN_CHARS and self._may_end(tail, i + 1):
                return i + 1, i + 1
            # An em/en dash inside a word ("now—then") ends a clause once the next word starts.
            if (prev in DASHES and char not in DASHES and i >= CLAUSE_MIN_CHARS and tail[self._token_start] not in DASHES
                    and self._may_end(tail, i)):
                return i, i
        return None

    def _may_end(self, tail: str, end: int) -> bool:
        """Whether a unit may end at `end` (keeps_together: not inside markup)."""
        return self.keeps_together is None or not self.keeps_together(tail[:end])

    def _first_unit_cut(self, token: str, end: int) -> tuple[int, bool] | None:
        """first_unit_words: where the first unit ends early, now that `token` (ending at `end`) is its latest
        whole word: after it at a clause mark, before it when it starts a phrase, after it at the word limit;
        and whether that is inside the sentence (not at a clause mark)."""
        bare = token.rstrip(CLOSING_QUOTES)
        if self._words >= FIRST_CLAUSE_MIN_WORDS and bare and (bare[-1] in CLAUSE_MARKS or bare[-1] in DASHES):
            return end, False
        if self._words - 1 >= FIRST_PHRASE_MIN_WORDS and token.lower() in PHRASE_STARTS:
            return self._token_start, True
        if self._words >= self.first_unit_words:
            return end, True
        return None

    def _clause_ends_with(self, token: str, end: int) -> bool:
        """Whether `token`, followed by whitespace at `end`, closes a clause long enough to speak alone."""
        if end < CLAUSE_MIN_CHARS:
            return False
        token = token.rstrip(CLOSING_QUOTES)
        if token and (token[-1] in CLAUSE_MARKS or token[-1] in DASHES):
            return True
        return token in ("-", "--")

    @staticmethod
    def _whitespace_run_start(tail: str, i: int) -> int:
        while i > 0 and tail[i - 1].isspace():
            i -= 1
        return i

    def _pysbd_splits(self, tail: str, token_start: int, next_start: int) -> bool:
        """Whether pysbd, shown the tail up to and including the first character after the candidate,
        starts a new sentence after the token at token_start (anywhere up to next_start)."""
        window_start = 0
        if next_start > PYSBD_WINDOW:
            window_start = tail.find(" ", next_start - PYSBD_WINDOW, token_start)
            window_start = 0 if window_start < 0 else window_start + 1
        text = tail[window_start : next_start + 1]
        low, high = token_start - window_start, next_start - window_start
        return any(low < start <= high for start in self._sentence_starts(text))

    def _sentence_starts(self, text: str) -> list[int]:
        """Offsets in `text` where pysbd starts its sentences. pysbd's own char_span search can land on an
        earlier copy of a repeated sentence, so its sentences are aligned here in order instead."""
        starts = []
        cursor = 0
        for sentence in self._pysbd.processor(text).process():
            sentence = sentence.strip()
            if not sentence:
                continue
            found = text.find(sentence, cursor)
            if found < 0:  # pysbd rewrote the text; trust only what was aligned so far
                break
            starts.append(found)
            cursor = found + len(sentence)
        return starts


def _forced_cut(unit: str, at_clause_marks: bool = True) -> tuple[int, int]:
    """Where to cut an over-long unit: after its last clause mark (with `at_clause_marks`), else at its last
    whitespace."""
    last_space = -1
    for k in range(len(unit) - 1, 0, -1):
        if unit[k].isspace() and not unit[k - 1].isspace():
            if not at_clause_marks:
                return k, k
            if unit[k - 1] in CLAUSE_MARKS:
                return k, k
            if last_space < 0:
                last_space = k
    if last_space > 0:
        return last_space, last_space
    return len(unit), len(unit)


_CLOSERS = re.escape(CLOSING_QUOTES)
# Where a piece of flushed text may end: after a sentence's end, after a clause mark, after a word.
_SENTENCE_END = re.compile(f"[{re.escape(''.join(sorted(SENTENCE_TERMINATORS)))}][{_CLOSERS}]*(?=\\s)"
                           f"|[{''.join(sorted(CJK_TERMINATORS))}][{_CLOSERS}]*")
_CLAUSE_END = re.compile(f"[{re.escape(''.join(sorted(CLAUSE_MARKS | DASHES)))}][{_CLOSERS}]*(?=\\s)"
                         f"|[{''.join(sorted(CJK_CLAUSE_MARKS))}]")
_WORD_END = re.compile(r"\S(?=\s)")


def split_to_fit(text: str, limit: int) -> list[str]:
    """`text` (stripped) in pieces of at most `limit` characters as spoken (spoken_length), in order,
    whitespace between them dropped: each cut after the last sentence end that fits, else the last clause
    mark, else the last word; only a word longer than `limit` is cut inside. Linear in the text."""
    pieces = []
    while (fit := _chars_within(text, limit)) < len(text):
        window = text[: fit + 1]  # whitespace just past the limit lets a piece end exactly at it
        end = max(1, fit)
        for boundary in (_SENTENCE_END, _CLAUSE_END, _WORD_END):
            ends = [m.end() for m in boundary.finditer(window) if m.end() <= fit]
            if ends:
                end = ends[-1]
                break
        pieces.append(text[:end].rstrip())
        text = text[end:].lstrip()
    if text:
        pieces.append(text)
    return pieces


def _is_list_marker(tail: str, token_start: int, token_end: int, next_start: int) -> bool:
    """Whether the token is list numbering ("1.", "2)") inside a sentence rather than a sentence end:
    a bare small number that opens the unit, follows a colon, comma, semicolon or line break, or is
    followed by a lowercase word. pysbd, shown only the next character, would split "Steps: 1. mix"."""
    token = tail[token_start:token_end]
    if not _LIST_MARKER.fullmatch(token):
        return False
    if token_start == 0 or tail[next_start].islower():
        return True
    before = tail[:token_start]
    return before.rstrip()[-1:] in (":", ",", ";") or "\n" in before[len(before.rstrip()) :]


_LIST_MARKER = re.compile(r"\d{1,2}[.)]")


async def push_in_slices(segmenter: SentenceSegmenter, text: str) -> list[str]:
    """`segmenter.push(text)` on an event loop: examined in slices of about SLICE_S, letting the loop run
    between them, so text that is slow to split (a large input dense with abbreviations) never stalls
    other sessions. Gives the same units as push; the caller must not touch the segmenter meanwhile."""
    segmenter.append(text)
    released = segmenter.advance(time.perf_counter() + SLICE_S)
    while not segmenter.examined_all:
        await asyncio.sleep(0)
        released += segmenter.advance(time.perf_counter() + SLICE_S)
    return released
