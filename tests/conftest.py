"""Suite-wide settings. Area fixtures live in tests/<area>_fixtures.py or helper modules beside the tests."""

import os

import pytest

from tests import venv_cache

# CI sets CI=true: tests that need an external part (Chromium, Redis, a reference venv) must fail there
# rather than skip when the part is missing.
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}

# Tests marked `third_party` build cached virtualenvs of third-party packages under ~/.cache/voxgate (the
# Qwen3 reference implementations, Pipecat, LiveKit Agents, the Kubernetes tools): gigabytes of downloads
# and many minutes on a laptop. A default `python -m pytest` skips them; `--third-party`,
# VOXGATE_THIRD_PARTY=1 or CI=true runs them (docs/testing.md).
THIRD_PARTY_ON = IN_CI or os.environ.get("VOXGATE_THIRD_PARTY", "").lower() in {"1", "true", "yes"}


def pytest_addoption(parser):
    parser.addoption("--third-party", action="store_true", default=False,
                     help="also run the tests marked third_party (cached venvs of third-party packages)")


def pytest_collection_modifyitems(config, items):
    if THIRD_PARTY_ON or config.getoption("--third-party"):
        return
    skip = pytest.mark.skip(reason="builds a venv of third-party packages under ~/.cache/voxgate:"
                                   " run with --third-party (CI does)")
    for item in items:
        if item.get_closest_marker("third_party"):
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    # A test that reaches a cached third-party venv without the mark fails (tests/venv_cache.py), so the
    # default run can never start a download it was meant to skip.
    venv_cache.permitted = item.get_closest_marker("third_party") is not None
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        venv_cache.permitted = None
