"""The rewrite of a sentence's written text into what the backend says, and the map back.

`Rewriter.feed` takes the text so far (the same text, longer each time, for a sentence still being
written) and returns the pieces decided since the last call: text as written, text replaced (an alias, a
spelled code, a `<sub>`), pauses and expressions. It stops at the first position whose rewrite more text
could change (a dictionary entry that may still match there, a tag not closed yet) and goes on from there
next time, so it holds back only as much as the longest rule needs, and a position is decided from the
same characters however the text came: what is said does not depend on where the pieces broke.

`WordMap` records where every spoken character came from and turns the backend's words (spans of the
spoken text) into the client's written words: a replaced piece's words all map to the written words it
replaced, and consecutive spoken words that land in the same written word become one word, timed from the
first one's start to the last one's end.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from tts_backend.base import WordTiming, split_words

from . import markup
from .matcher import UNDECIDED, Matcher

WARNING_CONTEXT_CHARS = 24


@dataclass(frozen=True)
class Piece:
    written: str  # the client's text it stands for (markup removed)
    spoken: str  # what the backend is given for it
    replaced: bool = False  # said differently than written: its spoken words map to it as a whole


@dataclass(frozen=True)
class Pause:
    ms: int


@dataclass(frozen=True)
class Expression:
    value: str


class Rewriter:
    """One sentence's rewrite, fed its text as it grows (see the module doc)."""

    def __init__(self, matcher: Matcher, markup_on: bool) -> None:
        self.matcher = matcher
        self.markup_on = markup_on
        self.pos = 0  # characters of the text decided and returned
        self.warnings: list[str] = []  # markup not honoured, each message once

    def _warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)

    def feed(self, text: str, *, final: bool) -> list[Piece | Pause | Expression]:
        """The pieces of `text` decided since the last call (`final`: the text is whole: all of it)."""
        out: list[Piece | Pause | Expression] = []
        matcher, stop = self.matcher, "<" if self.markup_on else ""
        i = literal = self.pos
        while i < len(text):
            char = text[i]
            if stop and char == "<":
                tag = markup.read_tag(text, i, final=final)
                if tag is markup.UNDECIDED:
                    break
                if tag is None:
                    self._warn(f"malformed markup {text[i:i + WARNING_CONTEXT_CHARS]!r} is read as text")
                    i += 1
                    continue
                if literal < i:
                    out.append(Piece(text[literal:i], text[literal:i]))
                if tag.warning:
                    self._warn(tag.warning)
                if tag.kind == "say":
                    out.append(Piece(tag.written, tag.spoken, replaced=tag.spoken != tag.written))
                elif tag.kind == "pause":
                    out.append(Pause(tag.pause_ms))
                elif tag.kind == "expression":
                    out.append(Expression(tag.expression))
                i = literal = tag.end
                continue
            if matcher and matcher.may_start(char):
                match = matcher.match_at(text, i, final=final, stop=stop)
                if match is UNDECIDED:
                    break
                if match is not None:
                    if literal < i:
                        out.append(Piece(text[literal:i], text[literal:i]))
                    end = i + match.length
                    out.append(Piece(text[i:end], match.rule.say, replaced=True))
                    i = literal = end
                    continue
            i += 1
        if literal < i:
            out.append(Piece(text[literal:i], text[literal:i]))
        self.pos = i
        return out


def rewrite_whole(matcher: Matcher, markup_on: bool, text: str) -> tuple[list[Piece | Pause | Expression], list[str]]:
    """A whole text's pieces and its markup warnings."""
    rewriter = Rewriter(matcher, markup_on)
    return rewriter.feed(text, final=True), rewriter.warnings


def written_of(pieces: list[Piece | Pause | Expression]) -> str:
    return "".join(p.written for p in pieces if isinstance(p, Piece))


@dataclass
class _Group:
    first: int  # written word indices, inclusive
    last: int
    start: int  # samples
    end: int


class WordMap:
    """Spoken text back to written words (see the module doc). Pieces are added in order as decided."""

    def __init__(self) -> None:
        self.written = ""
        self.spoken_chars = 0
        self._starts: list[int] = []  # spoken start of each piece that says something
        self._pieces: list[tuple[int, int, int, int, bool]] = []  # spoken start/end, written start/end, replaced
        self._group: _Group | None = None

    def add(self, piece: Piece) -> None:
        ws = len(self.written)
        self.written += piece.written
        if piece.spoken:
            ss = self.spoken_chars
            self.spoken_chars += len(piece.spoken)
            self._starts.append(ss)
            self._pieces.append((ss, self.spoken_chars, ws, len(self.written), piece.replaced))

    def _written_at(self, position: int, *, end: bool) -> int:
        """The written position of spoken character `position` (`end`: the position after it)."""
        k = max(0, bisect.bisect_right(self._starts, position) - 1)
        ss, _, ws, we, replaced = self._pieces[k]
        if replaced:
            return we if end else ws
        return min(we, ws + position - ss + (1 if end else 0))

    def map(self, spans: list[tuple[int, int, WordTiming]]) -> list[WordTiming]:
        """The backend's words, each with its span of the spoken text, as written words: those whose
        written word is complete (a later spoken word lies beyond it). `finish` gives the last one."""
        done: list[WordTiming] = []
        if not self._pieces:
            return [timing for _, _, timing in spans]
        words = split_words(self.written)
        word_starts, word_ends = [a for _, a, _ in words], [b for _, _, b in words]
        for a, b, timing in spans:
            ws, we = self._written_at(a, end=False), self._written_at(max(a, b - 1), end=True)
            first = min(bisect.bisect_right(word_ends, ws), max(0, len(words) - 1))
            last = max(first, bisect.bisect_left(word_starts, we) - 1)
            group = self._group
            if group is not None and first <= group.last:
                group.last, group.end = max(group.last, last), max(group.end, timing.end)
                continue
            if group is not None:
                done.append(self._word(group, words))
            self._group = _Group(first, last, timing.start, timing.end)
        return done

    def finish(self) -> list[WordTiming]:
        group, self._group = self._group, None
        return [self._word(group, split_words(self.written))] if group is not None else []

    def _word(self, group: _Group, words: list[tuple[str, int, int]]) -> WordTiming:
        if not words:
            return WordTiming(self.written.strip(), group.start, group.end)
        last = min(group.last, len(words) - 1)
        return WordTiming(self.written[words[group.first][1]:words[last][2]], group.start, group.end)
