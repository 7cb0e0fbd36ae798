"""The reference implementation (qwen-tts 0.1.1) in a virtual environment of its own.

qwen-tts pins transformers 4.57.3, which must not leak into Voxgate's own environment, so the tests build a
cached virtualenv beside it (system site-packages visible, so it reuses the installed torch) and run the
reference in subprocesses. `import qwen_tts` also imports the 25 Hz tokenizer's torchaudio dependency; a
stub module is enough for the 12 Hz path, which is all we compare against.

The venv lives in $VOXGATE_REF_VENV or ~/.cache/voxgate/qwen-tts-0.1.1; creating it takes about 30 s.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

REFERENCE_REQUIREMENTS = [
    "transformers==4.57.3",
    "accelerate==1.12.0",
    "soundfile",
    "sox",
    "onnxruntime",
    "einops",
    "librosa",
]
_READY_MARK = ".voxgate-ready-1"


def reference_venv_dir() -> Path:
    default = Path.home() / ".cache" / "voxgate" / "qwen-tts-0.1.1"
    return Path(os.environ.get("VOXGATE_REF_VENV", default))


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _build(venv: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--clear", str(venv)], check=True)
    pip = [str(_venv_python(venv)), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, *REFERENCE_REQUIREMENTS], check=True)
    subprocess.run([*pip, "--no-deps", "qwen-tts==0.1.1"], check=True)
    purelib = subprocess.run(
        [str(_venv_python(venv)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    stub = Path(purelib) / "torchaudio"
    (stub / "compliance").mkdir(parents=True, exist_ok=True)
    note = '"""Stub: qwen_tts imports torchaudio for its 25 Hz tokenizer only; the 12 Hz path never calls it."""\n'
    for name in ("__init__.py", "compliance/__init__.py", "compliance/kaldi.py"):
        (stub / name).write_text(note)
    subprocess.run([str(_venv_python(venv)), "-c", "import qwen_tts"], check=True, capture_output=True)
    (venv / _READY_MARK).write_text("ok\n")


def reference_python() -> Path:
    """Path of the reference venv's python, building the venv on first use (safe across processes)."""
    venv = reference_venv_dir()
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / (venv.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / _READY_MARK).exists():
            _build(venv)
    return _venv_python(venv)


def run_reference(script: str | os.PathLike, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a script with the reference python; raises with its stderr when it fails."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["PYTHONWARNINGS"] = "ignore"
    result = subprocess.run(
        [str(reference_python()), str(script), *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env=env,
    )
    if result.returncode != 0:
        raise RuntimeError(f"reference script {script} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


if __name__ == "__main__":
    print(reference_python())
    print(sysconfig.get_paths()["purelib"])
