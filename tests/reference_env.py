"""The reference implementations (qwen-tts 0.1.1, qwen-asr 0.0.6) in virtual environments of their own.

qwen-tts pins transformers 4.57.3, which must not leak into Voxgate's own environment, so the tests build a
cached virtualenv beside it (system site-packages visible, so it reuses the installed torch) and run the
reference in subprocesses. `import qwen_tts` also imports the 25 Hz tokenizer's torchaudio dependency; a
stub module is enough for the 12 Hz path, which is all we compare against.

The venv lives in $VOXGATE_REF_VENV or ~/.cache/voxgate/qwen-tts-0.1.1; creating it takes about 30 s.

qwen-asr (the forced aligner's reference) pins transformers 4.57.6, so it gets a second venv,
$VOXGATE_ASR_REF_VENV or ~/.cache/voxgate/qwen-asr-0.0.6. Its module-level `import nagisa` (Japanese word
splitting, a compiled DyNet extension) is stubbed: the tests align the languages split on spaces and CJK characters.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.venv_cache import cached_venv, pip_install, run_script, venv_python

REFERENCE_REQUIREMENTS = [
    "transformers==4.57.3",
    "accelerate==1.12.0",
    "soundfile",
    "sox",
    "onnxruntime",
    "einops",
    "librosa",
]
REFERENCE_PACKAGE = "qwen-tts==0.1.1"  # installed without its dependencies (it would replace torch)
# Bump when the build recipe changes, so cached venvs of an older recipe are rebuilt.
_RECIPE = 1


def reference_venv_dir() -> Path:
    default = Path.home() / ".cache" / "voxgate" / "qwen-tts-0.1.1"
    return Path(os.environ.get("VOXGATE_REF_VENV", default))


def _build_venv(venv: Path, requirements: list[str], package: str, stubs: dict[str, str], module: str) -> None:
    """A venv that sees the system site-packages (torch), with `requirements`, `package` without its
    dependencies, and stub files (path under site-packages -> text) for imports the compared path never uses."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--clear", str(venv)], check=True)
    pip_install(venv, *requirements)
    pip_install(venv, "--no-deps", package)
    purelib = subprocess.run(
        [str(venv_python(venv)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    for name, text in stubs.items():
        (Path(purelib) / name).parent.mkdir(parents=True, exist_ok=True)
        (Path(purelib) / name).write_text(text)
    subprocess.run([str(venv_python(venv)), "-c", f"import {module}"], check=True, capture_output=True)


_TORCHAUDIO_STUB = '"""Stub: qwen_tts imports torchaudio for its 25 Hz tokenizer only; the 12 Hz path never calls it."""\n'


def _build(venv: Path) -> None:
    stubs = {name: _TORCHAUDIO_STUB for name in
             ("torchaudio/__init__.py", "torchaudio/compliance/__init__.py", "torchaudio/compliance/kaldi.py")}
    _build_venv(venv, REFERENCE_REQUIREMENTS, REFERENCE_PACKAGE, stubs, "qwen_tts")


def reference_python() -> Path:
    """Path of the reference venv's python, building the venv on first use (safe across processes)."""
    venv = reference_venv_dir()
    recipe = {"recipe": _RECIPE, "python": sys.version_info[:2],
              "requirements": [*REFERENCE_REQUIREMENTS, REFERENCE_PACKAGE]}
    return cached_venv(venv, recipe, lambda previous: _build(venv))


def run_reference(script: str | os.PathLike, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a script with the reference python; raises with its output when it fails."""
    return run_script(reference_python(), script, *args, timeout=timeout, env={"PYTHONWARNINGS": "ignore"})


ASR_REFERENCE_REQUIREMENTS = ["transformers==4.57.6", "accelerate==1.12.0", "soundfile", "librosa"]
ASR_REFERENCE_PACKAGE = "qwen-asr==0.0.6"  # without its dependencies (gradio, flask, sox... are not needed)
_ASR_RECIPE = 1


def asr_reference_venv_dir() -> Path:
    default = Path.home() / ".cache" / "voxgate" / "qwen-asr-0.0.6"
    return Path(os.environ.get("VOXGATE_ASR_REF_VENV", default))


def _build_asr(venv: Path) -> None:
    stub = '"""Stub: qwen_asr imports nagisa for Japanese word splitting only, which the tests do not use."""\n'
    _build_venv(venv, ASR_REFERENCE_REQUIREMENTS, ASR_REFERENCE_PACKAGE, {"nagisa.py": stub}, "qwen_asr")


def asr_reference_python() -> Path:
    """Path of the qwen-asr venv's python, building the venv on first use (safe across processes)."""
    venv = asr_reference_venv_dir()
    recipe = {"recipe": _ASR_RECIPE, "python": sys.version_info[:2],
              "requirements": [*ASR_REFERENCE_REQUIREMENTS, ASR_REFERENCE_PACKAGE]}
    return cached_venv(venv, recipe, lambda previous: _build_asr(venv))


def run_asr_reference(script: str | os.PathLike, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a script with the qwen-asr reference python; raises with its output when it fails."""
    return run_script(asr_reference_python(), script, *args, timeout=timeout, env={"PYTHONWARNINGS": "ignore"})


if __name__ == "__main__":
    print(reference_python())
    print(sysconfig.get_paths()["purelib"])
