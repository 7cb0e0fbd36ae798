"""README.md is a landing page, and it and each page of docs/ read as one document: no section twice, no
block of text pasted twice."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCUMENTS = [README, *sorted((REPO / "docs").glob("*.md"))]
IDS = [str(d.relative_to(REPO)) for d in DOCUMENTS]

# The reference lives in docs/; README keeps the commands, what Voxgate is, the picture, one exchange, links.
README_MAX_LINES = 150
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


def test_the_readme_is_a_landing_page():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    # .ci/run reads README's first bash block as the two commands a newcomer pastes: keep its shape.
    first_block = re.search(r"^```bash\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL).group(1)
    commands = [line.split("  #", 1)[0].strip() for line in first_block.splitlines()]
    assert len(commands) == 2 and all(re.fullmatch(r"pip install .+ && .+", c) for c in commands), commands
    assert "(docs/web_demo.png)" in text and "(docs/index.md)" in text


@pytest.mark.parametrize("document", DOCUMENTS, ids=IDS)
def test_no_heading_appears_twice(document) -> None:
    headings = Counter(line for _, line in prose_lines(document.read_text()) if re.match(r"#{1,3} ", line))
    assert [h for h, n in headings.items() if n > 1] == []


@pytest.mark.parametrize("document", DOCUMENTS, ids=IDS)
def test_no_block_of_prose_appears_twice(document) -> None:
    lines = prose_lines(document.read_text())
    seen: dict[tuple[str, ...], int] = {}
    repeated = []
    for i in range(len(lines) - BLOCK_LINES + 1):
        block = tuple(text for _, text in lines[i:i + BLOCK_LINES])
        first = seen.setdefault(block, lines[i][0])
        if first != lines[i][0]:
            repeated.append((first, lines[i][0], block[0][:60]))
    assert repeated == [], f"(first line, repeated at line, text): {repeated[:5]}"
