"""Cached virtualenvs with the voice-agent frameworks the adapters are pinned to (issue 8).

Pipecat and LiveKit Agents each pull a large dependency tree (their own numpy, pydantic, aiohttp, ...)
that must not leak into the gateway's environment, so every framework gets a venv of its own, without
system site-packages. Inside it: the pinned framework from PyPI, then `clients/python` (voxgate-client)
and the adapter itself installed editable from this checkout. Test scripts run there as subprocesses
against a gateway the pytest process serves on loopback.

A venv lives in $VOXGATE_ADAPTER_VENVS/<name> (default ~/.cache/voxgate/adapter-<name>). Building one
takes about 100 s on a 2-core machine; it is rebuilt only when the pins change. A checkout
in another folder (CI clones afresh) only re-points the two editable installs, which takes seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from tests.venv_cache import cached_venv, pip_install, run_script, venv_python

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Framework:
    name: str  # also the adapter's folder under clients/
    requirements: tuple[str, ...]  # pinned framework, from PyPI
    probe: str  # an import that must work once the venv is ready


FRAMEWORKS = {
    "pipecat": Framework("pipecat", ("pipecat-ai==1.14.0",), "import pipecat, voxgate_pipecat"),
    "livekit": Framework(
        "livekit", ("livekit-agents==1.8.9", "livekit-plugins-baseten==1.8.9"),
        "import livekit.agents, livekit.plugins.baseten, voxgate_livekit",
    ),
}
# Bump when the build recipe changes, so cached venvs of an older recipe are rebuilt.
_RECIPE = 1


def venv_dir(name: str) -> Path:
    root = os.environ.get("VOXGATE_ADAPTER_VENVS")
    return Path(root) / name if root else Path.home() / ".cache" / "voxgate" / f"adapter-{name}"


def _pins_key(framework: Framework) -> str:
    return hashlib.sha256(json.dumps([_RECIPE, sys.version_info[:2], framework.requirements]).encode()).hexdigest()


def _install_checkout(venv: Path, framework: Framework) -> None:
    """Editable installs of the client library and the adapter from this checkout (deps come with the
    framework or were installed by the full build; --no-build-isolation reuses the venv's setuptools)."""
    pip_install(
        venv, "--no-deps", "--no-build-isolation",
        "-e", str(REPO_ROOT / "clients" / "python"),
        "-e", str(REPO_ROOT / "clients" / framework.name),
    )


def _build(venv: Path, framework: Framework) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip_install(venv, "setuptools>=68", "wheel")
    # One resolve: the pinned framework and the two checkouts with their own dependencies.
    pip_install(
        venv, "--no-build-isolation",
        "-e", str(REPO_ROOT / "clients" / "python"),
        "-e", str(REPO_ROOT / "clients" / framework.name),
        *framework.requirements,
    )


def prepare_all() -> None:
    """Build every framework venv at once (in parallel: pip mostly waits on the network), so a test run
    that uses both pays for the slower build only."""
    errors: list[BaseException] = []

    def build(name: str) -> None:
        try:
            adapter_python(name)
        except BaseException as exc:  # reported by the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=build, args=(name,)) for name in FRAMEWORKS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def adapter_python(name: str) -> Path:
    """The python of framework `name`'s venv, built or re-pointed on first use (safe across processes)."""
    framework = FRAMEWORKS[name]
    venv = venv_dir(name)
    pins = _pins_key(framework)

    def build(previous: dict) -> None:
        if previous.get("pins") == pins:
            _install_checkout(venv, framework)  # the same venv, used from another checkout
        else:
            _build(venv, framework)
        subprocess.run([str(venv_python(venv)), "-c", framework.probe], check=True, capture_output=True)

    return cached_venv(venv, {"pins": pins, "checkout": str(REPO_ROOT)}, build)


def run_in_adapter_env(name: str, script: str | os.PathLike, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run a script with the framework's python; raises with its output when it fails."""
    return run_script(adapter_python(name), script, *args, timeout=timeout, env={"PYTHONUNBUFFERED": "1"},
                      cwd=REPO_ROOT)


if __name__ == "__main__":
    for framework_name in sys.argv[1:] or FRAMEWORKS:
        print(framework_name, adapter_python(framework_name))
