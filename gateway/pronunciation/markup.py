"""The markup subset a session opts into with `text_markup: "ssml"` (docs/protocol.md, "Pronunciation"):

- `<spell>AB-12</spell>`, `<say-as interpret-as="characters|spell-out|digits|telephone">…</say-as>`: letters
  and digits one by one, each group of them a phrase ("A B, 1 2");
- `<sub alias="vox gate">Voxgate</sub>`: the alias is said, the content is what was written;
- `<break time="300ms"/>` (or `strength="weak"`...): that much silence in the audio;
- `<speak>` around it all is taken and dropped;
- LiveKit's expressions (`<expression value="warm"/>`, `<expr value="warm"/>`): the words after it are
  spoken with that instruction where the backend honours instructions, else dropped with a warning.

A tag is read at one position (`read_tag`): its whole extent is known, or it is UNDECIDED (a text still
growing may complete it), or it is malformed (None), which the caller reads as plain text with a warning.
Every tag and its content are bounded (MAX_TAG_CHARS, MAX_CONTENT_CHARS), so reading one costs a bounded
scan.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_TAG_CHARS = 256
MAX_CONTENT_CHARS = 256
MAX_BREAK_MS = 10_000
BREAK_STRENGTHS = {"none": 0, "x-weak": 100, "weak": 250, "medium": 400, "strong": 700, "x-strong": 1000}
SPELLED = {"characters": "characters", "spell-out": "characters", "verbatim": "characters", "digits": "digits",
           "telephone": "telephone"}
EXPRESSION_TAGS = ("expression", "expr")

_TAG = re.compile(r"<(/?)([A-Za-z][\w.:-]*)((?:\s+[A-Za-z_:][\w.:-]*\s*=\s*(?:\"[^\"<>]*\"|'[^'<>]*'))*)\s*(/?)>")
_ATTR = re.compile(r"([A-Za-z_:][\w.:-]*)\s*=\s*(?:\"([^\"<>]*)\"|'([^'<>]*)')")
_TIME = re.compile(r"\s*(\d{1,6}(?:\.\d{1,3})?)\s*(ms|s)\s*", re.IGNORECASE)
_ALNUM_RUN = re.compile(r"[^\W_]+")

UNDECIDED = object()


@dataclass(frozen=True)
class Tag:
    """A tag read at a position: `end` is past it (and past its content and closing tag, for a container)."""

    end: int
    kind: str  # "say" (content said as `spoken`), "pause", "expression", "drop" (a tag with no effect)
    written: str = ""  # the client's text it stands for (a container's content)
    spoken: str = ""
    pause_ms: int = 0
    expression: str = ""
    warning: str | None = None  # set for a tag taken but not honoured as written (an unknown one)


def spell(text: str, kind: str = "characters") -> str:
    """Letters and digits one by one, runs of them separated as phrases: "AB-12" -> "A B, 1 2"; a
    telephone number's "+" is said."""
    groups = [" ".join(c.upper() if c.isalpha() else c for c in run) for run in _ALNUM_RUN.findall(text)]
    spoken = ", ".join(groups)
    if kind == "telephone" and text.lstrip().startswith("+"):
        spoken = "plus " + spoken
    return spoken or text


def _attrs(raw: str) -> dict[str, str]:
    return {m.group(1).lower(): m.group(2) if m.group(2) is not None else m.group(3) for m in _ATTR.finditer(raw)}


def _pause_ms(attrs: dict[str, str]) -> int | None:
    if "time" in attrs:
        match = _TIME.fullmatch(attrs["time"])
        if match is None:
            return None
        value = float(match.group(1)) * (1 if match.group(2).lower() == "ms" else 1000)
        return int(min(value, MAX_BREAK_MS))
    return BREAK_STRENGTHS.get(attrs.get("strength", "medium").lower())


_TAG_START = re.compile(r"</?[A-Za-z]")
_NOT_CONTAINERS = ("speak", "break", *EXPRESSION_TAGS)


def ends_inside_markup(text: str) -> bool:
    """Whether `text` ends inside a tag or inside a container's content (a sentence must not end there: its
    markup would be cut in two). Looks at the end of the text only, as far as a tag and its content reach."""
    window = text[-(MAX_TAG_CHARS + MAX_CONTENT_CHARS + 16):]
    lt, gt = window.rfind("<"), window.rfind(">")
    if lt < 0:
        return False
    if lt > gt:  # a tag being written: "<sub alias='Dr. Who" (not "a < b": no tag starts so)
        return _TAG_START.match(window, lt) is not None and len(window) - lt < MAX_TAG_CHARS
    tag = _TAG.fullmatch(window, lt, gt + 1)
    return (tag is not None and not tag.group(1) and not tag.group(4)
            and tag.group(2).lower() not in _NOT_CONTAINERS and len(window) - gt - 1 < MAX_CONTENT_CHARS)


def read_tag(text: str, i: int, *, final: bool) -> Tag | None | object:
    """The tag at text[i] ("<"): a Tag, None (malformed: read "<" as text) or UNDECIDED."""
    close = text.find(">", i, i + MAX_TAG_CHARS)
    if close < 0:
        return UNDECIDED if not final and len(text) < i + MAX_TAG_CHARS and text.find("<", i + 1) < 0 else None
    match = _TAG.fullmatch(text, i, close + 1)
    if match is None:
        return None
    closing, name, raw_attrs, empty = match.group(1), match.group(2).lower(), match.group(3), match.group(4)
    end = close + 1
    attrs = _attrs(raw_attrs)
    if name == "speak":
        return Tag(end, "drop")
    if closing:
        return None  # a closing tag without its opening one
    if name == "break":
        ms = _pause_ms(attrs)
        return Tag(end, "pause", pause_ms=ms) if ms is not None else None
    if name in EXPRESSION_TAGS:
        value = attrs.get("value") or attrs.get("emotion") or attrs.get("type") or ""
        return Tag(end, "expression", expression=value.strip()) if value.strip() else None
    if empty:
        return Tag(end, "drop", warning=f"<{name}/> is not in the markup subset; dropped")
    # A container: its content runs to the matching closing tag, with no tag inside.
    closing_tag = f"</{name}>"
    window = end + MAX_CONTENT_CHARS + len(closing_tag)
    stop = text.find(closing_tag, end, window)
    if stop < 0:
        if final or len(text) >= window:
            return None
        nested = text.find("<", end)
        # Undecided while the text may still close it: no tag inside, or only the closing tag's start.
        return UNDECIDED if nested < 0 or closing_tag.startswith(text[nested:]) else None
    if text.find("<", end, stop) >= 0:
        return None
    content = text[end:stop]
    after = stop + len(closing_tag)
    if name == "spell":
        return Tag(after, "say", written=content, spoken=spell(content))
    if name == "say-as":
        kind = SPELLED.get(attrs.get("interpret-as", "").lower())
        if kind is None:
            return Tag(after, "say", written=content, spoken=content,
                       warning=f"say-as interpret-as={attrs.get('interpret-as', '')!r} is not in the markup"
                               " subset; read as written")
        return Tag(after, "say", written=content, spoken=spell(content, kind))
    if name == "sub":
        alias = " ".join(attrs.get("alias", "").split())
        return Tag(after, "say", written=content, spoken=alias) if alias else None
    return Tag(after, "say", written=content, spoken=content,
               warning=f"<{name}> is not in the markup subset; its text is read as written")
