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

from dataclasses import dataclass, field

from .rules import Rule

UNDECIDED = object()


def fold(char: str) -> str:
    """A character for case-insensitive matching: lower case where that is one character (the text's
    positions stay the text's)."""
    lower = char.lower()
    return lower if len(lower) == 1 else char


def is_word_char(char: str) -> bool:
    return char.isalnum()


@dataclass(eq=False)
class _Node:
    children: dict[str, "_Node"] = field(default_factory=dict)
    rules: list[Rule] = field(default_factory=list)  # entries that end here, in the order given


@dataclass(frozen=True)
class Match:
    length: int
    rule: Rule


class Matcher:
    def __init__(self, rules: tuple[Rule, ...]) -> None:
        self.rules = rules
        self._root = _Node()
        for rule in rules:
            node = self._root
            for char in rule.text:
                node = node.children.setdefault(fold(char), _Node())
            node.rules.append(rule)

    def __bool__(self) -> bool:
        return bool(self.rules)

    def may_start(self, char: str) -> bool:
        return fold(char) in self._root.children

    def match_at(self, text: str, i: int, *, final: bool, stop: str = "") -> Match | None | object:
        """The entry matching at text[i], None, or UNDECIDED (see the module doc). The walk stops before any
        character of `stop` (markup's "<": a tag there is read as a tag)."""
        before = text[i - 1] if i else ""
        node, j, best = self._root, i, None
        while j < len(text):
            char = text[j]
            if char in stop:
                break
            node = node.children.get(fold(char))
            if node is None:
                break
            j += 1
            for rule in node.rules:
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
            if node.children and not final and j > i:
                return UNDECIDED  # a longer entry may still match
        return best
