"""README's command 2 fetches one Triton: the dev extra names the Triton that the pinned torch requires
(it named `triton>=3.6`, so pip fetched the newest Triton, then torch's pin: 286 MB twice)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import IN_CI

PYPROJECT = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()


def requirement(name: str) -> str:
    (spec,) = re.findall(rf'^\s*"({name}[^";]*)(?:;[^"]*)?",', PYPROJECT, flags=re.MULTILINE)
    return spec


def torch_requirements(version: str) -> list[str]:
    """Requires-Dist of PyPI's Linux x86_64 wheel of torch `version` for this Python, read from the simple
    index's metadata file (PEP 658), as pip reads it."""
    index = httpx.get("https://pypi.org/simple/torch/", headers={"Accept": "application/vnd.pypi.simple.v1+json"},
                      timeout=30, follow_redirects=True)
    index.raise_for_status()
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    (wheel,) = [f for f in index.json()["files"]
                if re.fullmatch(rf"torch-{re.escape(version)}-{tag}-{tag}-manylinux[\w.]*x86_64\.whl", f["filename"])]
    metadata = httpx.get(wheel["url"] + ".metadata", timeout=30, follow_redirects=True)
    metadata.raise_for_status()
    return re.findall(r"^Requires-Dist: (.+)$", metadata.text, flags=re.MULTILINE)


def test_the_dev_extras_triton_is_the_one_the_pinned_torch_requires():
    torch_version = requirement("torch").removeprefix("torch==")
    assert re.fullmatch(r"\d+\.\d+\.\d+", torch_version), "torch is pinned to one version"
    try:
        requires = torch_requirements(torch_version)
    except httpx.HTTPError as exc:  # a laptop offline
        if IN_CI:
            raise
        pytest.skip(f"PyPI cannot be reached: {exc}")
    (pinned,) = [re.sub(r"\s", "", r.split(";")[0]) for r in requires if re.match(r"triton\b", r)]
    assert requirement("triton") == pinned, f"torch {torch_version} requires {pinned}"
