"""Nari Labs' benchmark harness (nari-labs/benchmarks, `tts_bench`) in a cached virtualenv of its own.

The harness is not on PyPI (PyPI's `tts-bench` is another project), so its source comes from GitHub as the
archive of one pinned commit, checked against a digest of its files before use, and kept in
~/.cache/voxgate/nari-benchmarks-<commit>. Where GitHub cannot be reached, $VOXGATE_NARI_BENCH_SRC names a
copy already on disk: that archive (unpacked into the cache once) or an unpacked copy or checkout of it. Its dependencies, pinned as its uv.lock pins them, come
from PyPI into a venv of their own ($VOXGATE_NARI_BENCH_VENV, default ~/.cache/voxgate/nari-bench).

It declares Python >= 3.12 but its source runs on 3.11 (not 3.10: asyncio.timeout, datetime.UTC), so it is not installed: it runs from its source
folder (`python -m tts_bench`, with that folder on PYTHONPATH), unmodified.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from tests.venv_cache import cached_venv, pip_install

COMMIT = "a2d65e16fa121d9dbd80dfbb0cf1007563f96509"
ARCHIVE_URL = f"https://github.com/nari-labs/benchmarks/archive/{COMMIT}.tar.gz"
# sha256 over "path\0sha256(content)\n" of every file under tts_bench/src/ at COMMIT, sorted by path: the
# same whatever the archive's compression or a checkout's line endings would do to the bytes around them.
SOURCE_DIGEST = "1afc7b74e0fa1c507e27900aaaa5a6ca538a1ae963039e94176aaca61b1d8c91"
# Its uv.lock's pins, but numpy's (2.5.1 needs Python 3.12): 2.2.6, within its numpy>=2.2.
REQUIREMENTS = ("aiohttp==3.14.3", "click==8.4.2", "jiwer==4.0.0", "numpy==2.2.6", "pydantic==2.13.4",
                "whisper-normalizer==0.1.15")
_CACHE = Path.home() / ".cache" / "voxgate"


class HarnessUnavailable(RuntimeError):
    """Neither a local copy nor the pinned archive could be had (no network to GitHub, say)."""


def source_digest(root: Path) -> str:
    digest = hashlib.sha256()
    src = root / "tts_bench" / "src"
    for path in sorted(p for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(f"{path.relative_to(root).as_posix()}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\n"
                      .encode())
    return digest.hexdigest()


def _checked(root: Path) -> Path:
    found = source_digest(root)
    if found != SOURCE_DIGEST:
        raise RuntimeError(f"{root}: the harness source is not commit {COMMIT} (digest {found})")
    return root


def _unpack(data: bytes, into: Path) -> Path:
    """The archive's single top folder, unpacked under `into`."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        archive.extractall(into, filter="data")
    (top,) = [p for p in into.iterdir() if p.is_dir()]
    return top


def source_dir() -> Path:
    """The harness's repository folder at COMMIT (its code is in tts_bench/src)."""
    given = Path(os.environ.get("VOXGATE_NARI_BENCH_SRC", ""))
    if given.is_dir() and given != Path():
        return _checked(given)
    cached = _CACHE / f"nari-benchmarks-{COMMIT}"
    if cached.is_dir():
        return _checked(cached)
    if given.is_file():
        data = given.read_bytes()
    else:
        try:
            with urllib.request.urlopen(ARCHIVE_URL, timeout=60) as response:
                data = response.read()
        except OSError as exc:
            raise HarnessUnavailable(
                f"Nari's harness: {ARCHIVE_URL} could not be fetched ({exc}); set VOXGATE_NARI_BENCH_SRC to that"
                " archive (kept in the cache then) or to an unpacked copy of it") from exc
    _CACHE.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="nari-bench-", dir=_CACHE))
    try:
        _checked(_unpack(data, staging)).rename(cached)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return cached


def harness_python() -> Path:
    """The venv's python with the harness's dependencies, built on first use (safe across processes)."""
    venv = Path(os.environ.get("VOXGATE_NARI_BENCH_VENV", _CACHE / "nari-bench"))

    def build(previous: dict) -> None:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pip_install(venv, *REQUIREMENTS)

    return cached_venv(venv, {"python": sys.version_info[:2], "requirements": REQUIREMENTS}, build)


def run_harness(*args: str, timeout: float, cwd: Path) -> subprocess.CompletedProcess:
    """`bench ARGS` (the harness's command) from its unmodified source, in its venv."""
    python, src = harness_python(), source_dir() / "tts_bench" / "src"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PYTHONPATH=str(src), PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
    return subprocess.run([str(python), "-m", "tts_bench", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)
