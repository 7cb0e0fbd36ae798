"""A pronunciation dictionary's entries and their bounds.

An entry maps a written form to a spoken one (an alias): `{"text": "Voxgate", "say": "vox gate"}`. By
default it matches in any case and as whole words only (not inside a longer word); `case_sensitive` and
`whole_word` change that. Every bound has its error code: a malformed entry is `pronunciation_invalid`,
a dictionary or a key over its entries or bytes `pronunciation_limit_reached`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..protocol import ErrorCode, PronunciationEntry, ProtocolError

MAX_TEXT_CHARS = 128  # an entry's written form
MAX_SAY_CHARS = 512  # an entry's spoken form
MAX_ENTRIES = 1000  # in one dictionary, and in one session.config's (or request's) inline list
MAX_DICTIONARY_BYTES = 64 * 1024  # one dictionary's entries as compact JSON
MAX_DICTIONARIES_PER_KEY = 32
# All of one key's dictionaries together, and all the rules one session or request uses (inline and named).
MAX_KEY_BYTES = 256 * 1024


@dataclass(frozen=True)
class Rule:
    text: str
    say: str
    case_sensitive: bool = False
    whole_word: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "say": self.say, "case_sensitive": self.case_sensitive,
                "whole_word": self.whole_word}


def _invalid(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.pronunciation_invalid, message)


def limit_reached(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.pronunciation_limit_reached, message)


def rules_of(entries: Iterable[PronunciationEntry], what: str) -> tuple[Rule, ...]:
    """The rules of a list of entries (`what` names the list in errors), checked against every bound of
    one dictionary."""
    rules: list[Rule] = []
    for n, entry in enumerate(entries):
        if n >= MAX_ENTRIES:
            raise limit_reached(f"{what} has more than {MAX_ENTRIES} entries")
        where = f"{what}[{n}]"
        if not entry.text.strip():
            raise _invalid(f"{where}.text is empty")
        if len(entry.text) > MAX_TEXT_CHARS:
            raise _invalid(f"{where}.text has {len(entry.text)} characters; the limit is {MAX_TEXT_CHARS}")
        if not entry.say.strip():
            raise _invalid(f"{where}.say is empty (an entry says something instead of its text)")
        if len(entry.say) > MAX_SAY_CHARS:
            raise _invalid(f"{where}.say has {len(entry.say)} characters; the limit is {MAX_SAY_CHARS}")
        if any(c in "\r\n" for c in entry.text):
            raise _invalid(f"{where}.text spans lines; an entry matches within a line")
        rules.append(Rule(entry.text, " ".join(entry.say.split()), entry.case_sensitive, entry.whole_word))
    size = size_of(rules)
    if size > MAX_DICTIONARY_BYTES:
        raise limit_reached(f"{what} is {size} bytes as JSON; the limit is {MAX_DICTIONARY_BYTES}")
    return tuple(rules)


def size_of(rules: Iterable[Rule]) -> int:
    """The bytes the rules take as compact JSON (what the bounds count)."""
    return len(json.dumps([r.to_json() for r in rules], separators=(",", ":"), ensure_ascii=False).encode())


def rules_from_json(data: list[dict[str, Any]]) -> tuple[Rule, ...]:
    """Rules as `Rule.to_json` wrote them (the store's copy, a session's recorded config)."""
    return tuple(Rule(str(d["text"]), str(d["say"]), bool(d.get("case_sensitive", False)),
                      bool(d.get("whole_word", True))) for d in data)
