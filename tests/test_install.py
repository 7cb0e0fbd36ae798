"""A non-editable install (`pip install .`) serves the web demo and the JavaScript client it loads.

The wheel is built from this checkout, installed without dependencies into a fresh virtual environment
that sees this interpreter's packages (so the dependencies come from here), and `voxgate serve` runs from
that environment in a folder outside the repository: the page and every file it references must come
from the wheel.

"This interpreter's packages" are those of whatever environment runs the tests: the base interpreter's
as CI once ran them, or a virtualenv's, as README's command 2 installs them. A venv made with
`system_site_packages=True` would see only the BASE interpreter's packages (a venv of a venv does not
chain), so the new venv is pointed at this interpreter's site directories by a .pth file instead
(tests/venv_cache.py's `see_our_packages`, which the reference venvs use too).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import venv
from pathlib import Path
from urllib.parse import urljoin

import httpx
import pytest

from tests.gateway_server import free_port, wait_until_ready
from tests.venv_cache import see_our_packages

REPO = Path(__file__).resolve().parent.parent

# What a page or module can reference: <script src>, <link href>, ES imports, and `new URL("…", import.meta.url)`
# (the AudioWorklet module)
REFERENCE = re.compile(
    r"""(?:\bsrc=|\bhref=|\bfrom\s+|\bimport\s*\(\s*|\bnew\s+URL\(\s*)["']([^"':]+?\.(?:js|css|html))["']"""
)


def referenced_files(url: str, client: httpx.Client, seen: dict[str, str]) -> None:
    """GET `url` and, recursively, every local file it references; `seen` maps each URL to its body."""
    if url in seen:
        return
    response = client.get(url)
    assert response.status_code == 200, f"{url}: {response.status_code}"
    seen[url] = response.text
    for reference in REFERENCE.findall(response.text):
        referenced_files(urljoin(url, reference), client, seen)


@pytest.mark.slow
def test_a_wheel_install_serves_the_web_demo_and_its_javascript(tmp_path):
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("voxgate-*.whl")

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    see_our_packages(python)
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        capture_output=True, text=True, timeout=300, env=environ,
    )
    assert install.returncode == 0, install.stderr

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    where = subprocess.run([str(python), "-c", "import gateway; print(gateway.__file__)"],
                           cwd=outside, env=environ, capture_output=True, text=True, check=True)
    assert Path(where.stdout.strip()).is_relative_to(env_dir), "the wheel's gateway must be the one imported"

    port = free_port()
    process = subprocess.Popen(
        [str(env_dir / "bin" / "voxgate"), "serve", "--backend", "synthetic", "--port", str(port)],
        cwd=outside, env=dict(environ, VOXGATE_LOG_LEVEL="warning"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, 60, lambda: None if process.poll() is None else process.stdout.read().decode())
        seen: dict[str, str] = {}
        with httpx.Client(timeout=10) as client:
            referenced_files(url + "/", client, seen)
        assert "<html" in seen[url + "/"].lower()
        served = {u.removeprefix(url) for u in seen}
        expected_js = {f"/clients/js/{p.name}" for p in (REPO / "clients" / "js").glob("*.js")}
        assert expected_js <= served, f"not reached from the page: {expected_js - served}"
        for path in served - {"/"}:
            source = REPO / ("web_demo" + path if not path.startswith("/clients/") else path.lstrip("/"))
            assert seen[url + path] == source.read_text(), f"{path} differs from {source}"
    finally:
        process.terminate()
        process.wait(10)

