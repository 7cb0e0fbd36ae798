"""Cached virtualenvs for tests whose packages must not enter Voxgate's own environment.

Used by tests/reference_env.py (the qwen-tts reference) and tests/adapter_env.py (Pipecat, LiveKit Agents).
A venv records the recipe it was built for in a marker file, so it is built once and reused across runs; a
lock file beside it makes concurrent processes (two test runs, a benchmark) wait for one build.

Building one downloads packages, so in a test run only a test marked `third_party` may use one: tests/conftest.py
sets `permitted` around each test, and a test without the mark that reaches `cached_venv` fails (the default
`python -m pytest` skips the marked tests; see docs/testing.md). Outside pytest (benchmarks) nothing is checked.
"""

from __future__ import annotations

import fcntl
import json
import os
import site
import subprocess
from collections.abc import Callable
from pathlib import Path

_MARKER = ".voxgate-venv.json"

# Set by tests/conftest.py around each test: whether the test is marked `third_party`. None outside pytest.
permitted: bool | None = None


class UnmarkedThirdPartyTest(RuntimeError):
    """A test without the `third_party` mark reached a cached third-party venv."""


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def cached_venv(venv: Path, recipe: dict, build: Callable[[dict], None]) -> Path:
    """`venv`'s python, once it matches `recipe` (any JSON-able description of what belongs in it).

    When the venv was last made for another recipe (or never), `build(previous)` runs first, under the lock;
    `previous` is the recipe the venv was made for ({} if none), so a build may redo only what changed."""
    if permitted is False:
        raise UnmarkedThirdPartyTest(
            f"this test uses the cached venv {venv}, which downloads third-party packages: mark it"
            " @pytest.mark.third_party (run by CI, skipped by a default `python -m pytest`)"
        )
    wanted = json.loads(json.dumps(recipe))  # the form it takes in the marker (tuples become lists)
    venv.parent.mkdir(parents=True, exist_ok=True)
    marker = venv / _MARKER
    with open(venv.parent / (venv.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            previous = json.loads(marker.read_text())
        except (OSError, ValueError):
            previous = {}
        if previous != wanted:
            marker.unlink(missing_ok=True)  # a build that fails half-way leaves no marker behind
            build(previous)
            marker.write_text(json.dumps(wanted))
    return venv_python(venv)


def our_site_dirs() -> list[str]:
    """The site directories this interpreter imports from: the running venv's, not the base interpreter's."""
    ours = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    return [path for path in ours if Path(path).is_dir()]


def see_our_packages(python: Path) -> None:
    """Make the venv of `python` import what this interpreter imports, after its own packages: each of this
    interpreter's site directories is added with site.addsitedir (which also runs their .pth files, as the
    interpreter itself does at start-up). A venv made with `--system-site-packages` would instead see the
    BASE interpreter's packages (a venv of a venv does not chain): from a user's virtualenv, not the torch
    that Voxgate runs on, and pip would then download another one."""
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    lines = [f"import site; site.addsitedir({path!r})" for path in our_site_dirs()]
    (Path(purelib) / "_voxgate_test_parent_site.pth").write_text("\n".join(lines) + "\n")


def pip_install(venv: Path, *args: str) -> None:
    """`pip install` into the venv; raises with pip's output when it fails."""
    cmd = [str(venv_python(venv)), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")


def run_script(
    python: Path, script: str | os.PathLike, *args: str, timeout: float, env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> subprocess.CompletedProcess:
    """Run a script with a venv's python, outside this process's environment (no PYTHONPATH, VIRTUAL_ENV or
    PYTHONHOME) plus `env`; raises with its output when it fails."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    full_env.update(env or {})
    result = subprocess.run(
        [str(python), str(script), *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd,
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"{script} failed ({result.returncode}):\n"
            f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-8000:]}"
        )
    return result
