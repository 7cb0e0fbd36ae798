"""The reference implementations (qwen-tts 0.1.1, qwen-asr 0.0.6) in virtual environments of their own.

qwen-tts pins transformers 4.57.3, which must not leak into Voxgate's own environment, so the tests build a
cached virtualenv beside it and run the reference in subprocesses. That venv imports its own packages
first, then those of the environment running the tests (a .pth file, `see_our_packages`): the reference runs
on the very torch Voxgate runs on, and nothing downloads another (`--system-site-packages` would show the
base interpreter's packages instead, not a virtualenv's). `import qwen_tts` also imports the 25 Hz
tokenizer's torchaudio dependency; a stub module is enough for the 12 Hz path, which is all we compare against.

The venv lives in $VOXGATE_REF_VENV or ~/.cache/voxgate/qwen-tts-0.1.1 (about 150 MB: transformers and a
few audio packages); creating it takes about a minute. Tests that use it are marked `third_party`.

qwen-asr (the forced aligner's reference) pins transformers 4.57.6, so it gets a second venv,
$VOXGATE_ASR_REF_VENV or ~/.cache/voxgate/qwen-asr-0.0.6. Its module-level `import nagisa` (Japanese word
splitting, a compiled DyNet extension) is stubbed: the tests align the languages split on spaces and CJK characters.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from tests.venv_cache import cached_venv, our_site_dirs, pip_install, run_script, see_our_packages, venv_python


@dataclass(frozen=True)
class ReferenceEnv:
    """One reference package in a cached venv of its own: built on first use (safe across processes), rebuilt
    when its requirements or `recipe` change."""

    directory: str  # under ~/.cache/voxgate, unless `env_var` names another folder
    env_var: str
    requirements: tuple[str, ...]
    package: str  # installed without its dependencies (they would replace torch, or are not needed)
    stubs: dict[str, str]  # path under site-packages -> text, for imports the compared path never uses
    module: str  # imported once built, to prove the venv works
    recipe: int = 2  # bump when the build recipe changes, so cached venvs of an older recipe are rebuilt

    def venv_dir(self) -> Path:
        return Path(os.environ.get(self.env_var, Path.home() / ".cache" / "voxgate" / self.directory))

    def python(self) -> Path:
        venv = self.venv_dir()
        wanted = {"recipe": self.recipe, "python": sys.version_info[:2], "on": our_site_dirs(),
                  "requirements": [*self.requirements, self.package]}
        return cached_venv(venv, wanted, lambda previous: self._build(venv))

    def run(self, script: str | os.PathLike, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """Run a script with this reference's python; raises with its output when it fails."""
        return run_script(self.python(), script, *args, timeout=timeout, env={"PYTHONWARNINGS": "ignore"})

    def _build(self, venv: Path) -> None:
        """A venv that sees this environment's packages (torch) after its own, with the requirements (what
        this environment already has, torch above all, is not installed again), the package without its
        dependencies, and the stub files."""
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        see_our_packages(venv_python(venv))
        if self.requirements:
            pip_install(venv, *self.requirements)
        pip_install(venv, "--no-deps", self.package)
        purelib = subprocess.run(
            [str(venv_python(venv)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
        for name, text in self.stubs.items():
            (Path(purelib) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(purelib) / name).write_text(text)
        subprocess.run([str(venv_python(venv)), "-c", f"import {self.module}"], check=True, capture_output=True)


_TORCHAUDIO_STUB = '"""Stub: qwen_tts imports torchaudio for its 25 Hz tokenizer only; the 12 Hz path never calls it."""\n'
QWEN_TTS = ReferenceEnv(
    directory="qwen-tts-0.1.1",
    env_var="VOXGATE_REF_VENV",
    requirements=("transformers==4.57.3", "accelerate==1.12.0", "soundfile", "sox", "onnxruntime", "einops",
                  "librosa"),
    package="qwen-tts==0.1.1",
    stubs={name: _TORCHAUDIO_STUB for name in
           ("torchaudio/__init__.py", "torchaudio/compliance/__init__.py", "torchaudio/compliance/kaldi.py")},
    module="qwen_tts",
)
QWEN_ASR = ReferenceEnv(
    directory="qwen-asr-0.0.6",
    env_var="VOXGATE_ASR_REF_VENV",
    requirements=("transformers==4.57.6", "accelerate==1.12.0", "soundfile", "librosa"),
    package="qwen-asr==0.0.6",
    stubs={"nagisa.py": '"""Stub: qwen_asr imports nagisa for Japanese word splitting only, which the tests do'
                        ' not use."""\n'},
    module="qwen_asr",
)
run_reference = QWEN_TTS.run
run_asr_reference = QWEN_ASR.run


if __name__ == "__main__":
    print(QWEN_TTS.python())
    print(sysconfig.get_paths()["purelib"])
