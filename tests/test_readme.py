"""README.md reads as one document: no section twice, no block of text pasted twice."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"

# Table rows and fenced code may repeat on purpose (a command shown in two places); prose may not.
BLOCK_LINES = 4


def prose_lines(text: str) -> list[tuple[int, str]]:
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or not line.strip() or line.startswith("|"):
            continue
        out.append((number, line.rstrip()))
    return out


def test_no_heading_appears_twice() -> None:
    headings = Counter(line for line in README.read_text().splitlines() if line.startswith("## "))
    assert [h for h, n in headings.items() if n > 1] == []


def test_no_block_of_prose_appears_twice() -> None:
    lines = prose_lines(README.read_text())
    seen: dict[tuple[str, ...], int] = {}
    repeated = []
    for i in range(len(lines) - BLOCK_LINES + 1):
        block = tuple(text for _, text in lines[i:i + BLOCK_LINES])
        first = seen.setdefault(block, lines[i][0])
        if first != lines[i][0]:
            repeated.append((first, lines[i][0], block[0][:60]))
    assert repeated == [], f"(first line, repeated at line, text): {repeated[:5]}"
