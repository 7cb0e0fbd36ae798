"""The documentation site builds with `mkdocs build --strict`: every page in the nav, every link between
pages and every anchor resolves, and every link from a page to a repository file outside docs/ names a
file that exists (docs/hooks/repository_links.py). CI runs this as part of the suite."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_the_site_builds_strictly(tmp_path):
    result = build(REPO / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()
    for page in sorted((REPO / "docs").glob("*.md")):
        assert (tmp_path / "site" / page.stem / "index.html").is_file() or page.stem == "index", page.name
    # A link to a repository file outside docs/ is shown as its path, not left as a dead link.
    deploy = (tmp_path / "site" / "deploy" / "index.html").read_text()
    assert "<code>deploy/kubernetes/overlays/fleet/keda.yaml</code>" in deploy and "../deploy/kubernetes" not in deploy


def test_a_broken_link_fails_the_build(tmp_path):
    """The check itself: a copy of the docs with a dead page link, a missing anchor and a link to a
    repository file that does not exist does not build, and the error names each."""
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "docs", copy / "docs")
    shutil.copy(REPO / "mkdocs.yml", copy / "mkdocs.yml")
    for folder in ("deploy", "docker", "bench", "clients"):  # what the pages link to outside docs/
        (copy / folder).symlink_to(REPO / folder)
    page = copy / "docs" / "features.md"
    page.write_text(page.read_text() + "\n[a](nothing.md), [b](protocol.md#no-such-part), [c](../docker/nothing.yaml)\n")
    result = build(copy / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    warnings = [line for line in result.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 3, warnings
    for target in ("'nothing.md'", "'#no-such-part'", "'../docker/nothing.yaml'"):
        assert sum(target in warning for warning in warnings) == 1, (target, warnings)
