"""The test suite's own footprint: the reference venvs run on this environment's torch (nothing downloads
another), and a default `python -m pytest` skips the tests that build third-party venvs (CI runs them)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import venv_cache
from tests.reference_env import ReferenceEnv

REPO = Path(__file__).resolve().parent.parent


def test_a_reference_venv_runs_on_this_environments_torch(tmp_path, monkeypatch):
    # A recipe whose requirements this environment already has: building it downloads nothing (pip finds
    # them satisfied), which is the point. Its probe imports torch, which the base interpreter may lack.
    monkeypatch.setenv("VOXGATE_TEST_REF_VENV", str(tmp_path / "ref"))
    monkeypatch.setattr(venv_cache, "permitted", True, raising=False)  # nothing third-party is fetched here
    env = ReferenceEnv(directory="unused", env_var="VOXGATE_TEST_REF_VENV", requirements=("numpy",),
                       package="httpx", stubs={"reference_stub.py": "STUBBED = True\n"}, module="torch")
    script = tmp_path / "where.py"
    script.write_text("import sys, numpy, torch, reference_stub\n"
                      "print(torch.__file__); print(numpy.__file__); print(sys.prefix)\n")
    torch_file, numpy_file, prefix = env.run(script, timeout=300).stdout.split()
    import numpy
    import torch

    assert Path(torch_file) == Path(torch.__file__), "the reference must run on the torch the tests run on"
    assert Path(numpy_file) == Path(numpy.__file__)
    assert Path(prefix) == tmp_path / "ref"


def test_a_test_without_the_mark_cannot_reach_a_cached_venv(tmp_path):
    assert venv_cache.permitted is False  # set by tests/conftest.py: this test is not marked third_party
    with pytest.raises(venv_cache.UnmarkedThirdPartyTest, match="third_party"):
        venv_cache.cached_venv(tmp_path / "venv", {}, lambda previous: None)
    assert not (tmp_path / "venv").exists()


def test_a_default_run_skips_the_third_party_tests_and_says_how_to_run_them(tmp_path):
    # As a newcomer runs it: no CI variable. The reference venv would be built in an empty folder, were the
    # test not skipped.
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "VOXGATE_THIRD_PARTY")}
    env["VOXGATE_REF_VENV"] = str(tmp_path / "would-be-built")
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_qwen3_codec_reference.py"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        output, _ = run.communicate(timeout=120)
    finally:  # a build it started (pip, on a run that does not skip) goes with it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 0, output[-3000:]
    assert " skipped" in output and " passed" not in output, output[-3000:]
    assert "--third-party" in output
    assert not (tmp_path / "would-be-built").exists()
