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

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Framework:
    name: str  # also the adapter's folder under clients/
    requirements: tuple[str, ...]  # pinned framework, from PyPI
    probe: str  # an import that must work once the venv is ready


FRAMEWORKS = {
    "pipecat": Framework("pipecat", ("pipecat-ai==1.14.0",), "import pipecat, voxgate_pipecat"),
    "livekit": Framework("livekit", ("livekit-agents==1.8.9",), "import livekit.agents, voxgate_livekit"),
}
# Bump when the build recipe changes, so cached venvs of an older recipe are rebuilt.
_RECIPE = 1


def venv_dir(name: str) -> Path:
    root = os.environ.get("VOXGATE_ADAPTER_VENVS")
    return Path(root) / name if root else Path.home() / ".cache" / "voxgate" / f"adapter-{name}"


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _pins_key(framework: Framework) -> str:
    return hashlib.sha256(json.dumps([_RECIPE, sys.version_info[:2], framework.requirements]).encode()).hexdigest()


def _pip(venv: Path, *args: str) -> None:
    cmd = [str(_python(venv)), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")


def _install_checkout(venv: Path, framework: Framework) -> None:
    """Editable installs of the client library and the adapter from this checkout (deps come with the
    framework or were installed by the full build; --no-build-isolation reuses the venv's setuptools)."""
    _pip(
        venv, "--no-deps", "--no-build-isolation",
        "-e", str(REPO_ROOT / "clients" / "python"),
        "-e", str(REPO_ROOT / "clients" / framework.name),
    )


def _build(venv: Path, framework: Framework) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    _pip(venv, "setuptools>=68", "wheel")
    # One resolve: the pinned framework and the two checkouts with their own dependencies.
    _pip(
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
    venv.parent.mkdir(parents=True, exist_ok=True)
    marker = venv / ".voxgate-adapter-ready"
    wanted = {"pins": _pins_key(framework), "checkout": str(REPO_ROOT)}
    with open(venv.parent / (venv.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            ready = json.loads(marker.read_text())
        except (OSError, ValueError):
            ready = {}
        if ready != wanted:
            marker.unlink(missing_ok=True)
            if ready.get("pins") != wanted["pins"]:
                _build(venv, framework)
            else:
                _install_checkout(venv, framework)
            subprocess.run([str(_python(venv)), "-c", framework.probe], check=True, capture_output=True)
            marker.write_text(json.dumps(wanted))
    return _python(venv)


def run_in_adapter_env(name: str, script: str | os.PathLike, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run a script with the framework's python; raises with its output when it fails."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PYTHONUNBUFFERED"] = "1"
    result = subprocess.run(
        [str(adapter_python(name)), str(script), *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=str(REPO_ROOT),
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"{name} script {script} failed ({result.returncode}):\n"
            f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-8000:]}"
        )
    return result


if __name__ == "__main__":
    for framework_name in sys.argv[1:] or FRAMEWORKS:
        print(framework_name, adapter_python(framework_name))
