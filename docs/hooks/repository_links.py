"""MkDocs hook: links from a page to the repository's files outside docs/ (`../docker/compose.yaml`).

On GitHub such a link opens the file; the site has no copy of it, and MkDocs would report it as a link to
a page that does not exist. So in the site each one becomes the file's path in code (`docker/compose.yaml`),
after its target is checked: a link to a file the repository lacks is a warning, which `--strict` makes
an error, as it does for broken links between pages.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.repository_links")

LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.MULTILINE | re.DOTALL)


def on_page_markdown(markdown, page, config, files):
    docs = Path(os.path.abspath(config["docs_dir"]))
    repository = docs.parent

    def rewrite(match: re.Match) -> str:
        text, target = match.groups()
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith(("#", "/")):
            return match.group(0)
        path = target.split("#", 1)[0]
        resolved = Path(os.path.normpath(docs / posixpath.dirname(page.file.src_uri) / path))
        if resolved.is_relative_to(docs):
            return match.group(0)  # a page or asset of the site: MkDocs checks it
        if not resolved.is_relative_to(repository):
            log.warning("Doc file '%s' links to '%s', outside the repository", page.file.src_uri, target)
            return match.group(0)
        if not resolved.exists():
            log.warning("Doc file '%s' links to '%s', which is not a file of the repository",
                        page.file.src_uri, target)
        shown = resolved.relative_to(repository).as_posix() + ("/" if resolved.is_dir() else "")
        # `base/worker.yaml` linking to ../deploy/kubernetes/base/worker.yaml: the path in full says it all
        if re.fullmatch(r"`[^`]+`", text) and shown.endswith(text.strip("`").lstrip("./")):
            return f"`{shown}`"
        return f"{text} (`{shown}`)"

    pieces, last = [], 0
    for fence in FENCE.finditer(markdown):
        pieces.append(LINK.sub(rewrite, markdown[last:fence.start()]))
        pieces.append(fence.group(0))
        last = fence.end()
    pieces.append(LINK.sub(rewrite, markdown[last:]))
    return "".join(pieces)
