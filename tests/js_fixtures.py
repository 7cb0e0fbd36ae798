"""Shared helpers of the JavaScript client and web demo tests: find Node, the npm packages and Chromium.

Locally a missing part skips the test with the command that provides it; in CI (tests.conftest.IN_CI)
it fails, because .ci/run installs all of them.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import IN_CI

REPO = Path(__file__).resolve().parent.parent
JS_CLIENT_DIR = REPO / "clients" / "js"
CHROMIUM = Path("/usr/bin/chromium")


def missing(what: str, how: str) -> None:
    message = f"{what} is missing ({how})"
    if IN_CI:
        pytest.fail(message + "; CI must provide it (.ci/run installs it)", pytrace=False)
    pytest.skip(message)


def require_node() -> str:
    node = shutil.which("node")
    if node is None:
        missing("node (Node.js 20)", "apt-get install -y nodejs npm")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    if int(version.lstrip("v").split(".")[0]) < 20:
        missing(f"Node.js 20 or newer (found {version})", "install Node.js 20")
    return node


def require_npm_packages() -> None:
    """Install clients/js's locked npm packages on first use, so `python -m pytest` alone runs these tests."""
    packages = ("ws", "playwright-core")

    def absent() -> list[str]:
        return [p for p in packages if not (JS_CLIENT_DIR / "node_modules" / p / "package.json").exists()]

    if absent() and shutil.which("npm"):
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"], cwd=JS_CLIENT_DIR, capture_output=True, timeout=300
        )
    for package in absent():
        missing(f"npm package {package} in clients/js", "cd clients/js && npm ci")


def require_chromium() -> Path:
    if not CHROMIUM.exists():
        missing("Debian's Chromium at /usr/bin/chromium", "apt-get install -y chromium")
    return CHROMIUM


def run_node_json(script: Path, *args: str, timeout: float = 90.0, node_options: list[str] = ()) -> dict:
    """Run a Node script that prints one JSON object on stdout; fail the test with its stderr otherwise."""
    node = require_node()
    completed = subprocess.run(
        [node, *node_options, str(script), *args], capture_output=True, text=True, timeout=timeout, cwd=JS_CLIENT_DIR
    )
    if completed.returncode != 0:
        pytest.fail(f"{script.name} exited with {completed.returncode}:\n{completed.stderr[-4000:]}", pytrace=False)
    try:
        return json.loads(completed.stdout)
    except ValueError:
        pytest.fail(f"{script.name} printed no JSON:\n{completed.stdout[-2000:]}\n{completed.stderr[-2000:]}", pytrace=False)


@contextlib.contextmanager
def static_site(folder: Path) -> Iterator[str]:
    """`folder`'s files served on a loopback port of their own: a page of another origin than the gateway's,
    as a user hosts one. Yields the site's base URL (http://127.0.0.1:PORT)."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *args: None  # type: ignore[method-assign]
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, name="static-site", daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
            thread.join(5)
