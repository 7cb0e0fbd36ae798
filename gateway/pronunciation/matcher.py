"""Dictionary entries in a trie over case-folded characters, matched at a position of a text.

At each position the trie is walked as far as the text goes along it: at most MAX_TEXT_CHARS steps, so a
text of n characters costs O(n * MAX_TEXT_CHARS) at worst and about n in practice (most positions leave
the root at once). No client-written expression is ever compiled or run. The longest entry that matches
at a position wins (the first one listed among equally long ones); the caller moves past it, so matches
never overlap, leftmost first.

A text that is still growing (`final` False) may end where a match is not decided yet: inside a longer
entry that may still match, or right after an entry whose whole-word end needs the next character.
`match_at` then answers UNDECIDED, and the caller waits for more text before this position.
"""

from __future__ import annotations

from dataclasses import dataclass

from .rules import Rule

UNDECIDED = object()


def fold(char: str) -> str:
    """A character for case-insensitive matching: lower case where that is one character (the text's
    positions stay the text's)."""
    lower = char.lower()
    return lower if len(lower) == 1 else char


def is_word_char(char: str) -> bool:
    return char.isalnum()


@dataclass(frozen=True)
class Match:
    length: int
    rule: Rule


# The trie as flat tables of ints: node ids, an edge keyed by node * CHARS + the character's code point.
# Ints, not a dict per node: a key's rules at their bound make about 170,000 nodes, and that many dicts take
# twice as long to build and hold the GIL through the garbage collector's passes over them.
CHARS = 0x110000


class Matcher:
    def __init__(self, rules: tuple[Rule, ...]) -> None:
        self.rules = rules
        self._edges: dict[int, int] = {}  # node * CHARS + code point -> node; the root is 0
        self._ends: dict[int, list[Rule]] = {}  # node -> the entries that end there, in the order given
        self._inner: set[int] = set()  # nodes with an edge out
        nodes = 1
        for rule in rules:
            node = 0
            for char in rule.text:
                key = node * CHARS + ord(fold(char))
                child = self._edges.get(key)
                if child is None:
                    child = self._edges[key] = nodes
                    nodes += 1
                    self._inner.add(node)
                node = child
            self._ends.setdefault(node, []).append(rule)

    def __bool__(self) -> bool:
        return bool(self.rules)

    def may_start(self, char: str) -> bool:
        return ord(fold(char)) in self._edges

    def match_at(self, text: str, i: int, *, final: bool, stop: str = "") -> Match | None | object:
        """The entry matching at text[i], None, or UNDECIDED (see the module doc). The walk stops before any
        character of `stop` (markup's "<": a tag there is read as a tag)."""
        before = text[i - 1] if i else ""
        edges, ends = self._edges, self._ends
        node, j, best = 0, i, None
        while j < len(text):
            char = text[j]
            if char in stop:
                break
            node = edges.get(node * CHARS + ord(fold(char)))
            if node is None:
                break
            j += 1
            for rule in ends.get(node, ()):
                if rule.case_sensitive and text[i:j] != rule.text:
                    continue
                if rule.whole_word and is_word_char(rule.text[0]) and is_word_char(before):
                    continue
                if rule.whole_word and is_word_char(rule.text[-1]):
                    if j == len(text):
                        if not final:
                            return UNDECIDED  # the next character says whether the word ends here
                    elif is_word_char(text[j]):
                        continue
                best = Match(j - i, rule)
                break
        else:
            if node in self._inner and not final and j > i:
                return UNDECIDED  # a longer entry may still match
        return best
