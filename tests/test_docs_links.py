"""Every link and repository path in the READMEs and docs/ resolves inside a clone of the repository.

A clone has nothing beside it: a link such as `../shared/protocol.md` works only in the author's checkout.
Checked: Markdown links (inline and reference), HTML src/href, and paths in backticks that start at one of
the repository's top-level folders (`gateway/app.py`) or at `./` or `../`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCUMENTS = sorted([REPO / "README.md", *REPO.glob("clients/*/README.md"), *REPO.glob("docs/*.md")])

INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
HTML_LINK = re.compile(r"""\b(?:href|src)=["']([^"']+)["']""")
TOP_LEVEL = sorted(p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith("."))
CODE_PATH = re.compile(r"`((?:" + "|".join(map(re.escape, TOP_LEVEL)) + r")/[^`\s]*)`")
RELATIVE_CODE_PATH = re.compile(r"`(\.\.?/[^`\s]+)`")  # `../shared/design/protocol.md`


def targets(text: str) -> list[str]:
    """What a Markdown document points at, fenced code blocks excluded (commands, not links)."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    found = [m for pattern in (INLINE_LINK, REFERENCE_LINK, HTML_LINK) for m in pattern.findall(prose)]
    for path in CODE_PATH.findall(prose):
        if not re.search(r"[*{}<>…]|\.\.\.", path):  # a pattern or a placeholder, not one file
            found.append("/" + path)  # from the repository's root
    found += RELATIVE_CODE_PATH.findall(prose)
    return found


def broken(document: Path, text: str | None = None) -> list[str]:
    """The targets of `document` (its `text`, else the file's) that are not in the repository."""
    problems = []
    for target in targets(document.read_text() if text is None else text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue  # a URL (http:, mailto:, ws:) or an anchor in the same page
        path = target.split("#", 1)[0].split("?", 1)[0]
        resolved = (REPO / path.lstrip("/")) if path.startswith("/") else (document.parent / path)
        resolved = resolved.resolve()
        if not resolved.is_relative_to(REPO):
            problems.append(f"{target}: outside the repository")
        elif not resolved.exists():
            problems.append(f"{target}: no such file or folder")
    return problems


@pytest.mark.parametrize("document", DOCUMENTS, ids=[str(d.relative_to(REPO)) for d in DOCUMENTS])
def test_every_link_resolves_inside_the_repository(document):
    assert broken(document) == []


def test_a_link_out_of_the_repository_is_caught():
    """The check itself: links of the kind a clone lacked are reported, the others are not."""
    text = (
        "See [the protocol](../../../shared/protocol.md), [missing](docs/nothing.md), `gateway/nothing.py`,\n"
        "[fine](../../docs/protocol.md), [web](https://example.com/x), [anchor](#usage), `gateway/app.py`.\n"
        "The full specification is `../../../shared/design/protocol.md`.\n"
        "```bash\ncat ../shared/not-a-link.md\n```\n"
    )
    assert broken(REPO / "clients" / "python" / "README.md", text) == [
        "../../../shared/protocol.md: outside the repository",
        "docs/nothing.md: no such file or folder",
        "/gateway/nothing.py: no such file or folder",
        "../../../shared/design/protocol.md: outside the repository",
    ]
