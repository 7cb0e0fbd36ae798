"""The worker's side-thread import of the compiler stack: it imports what it names and swallows a failure (the
runner's own import reports it where it is needed)."""

from __future__ import annotations

import sys

from tts_backend.engine import compiler_preimport


def test_imports_the_compiler_and_survives_a_missing_module(monkeypatch):
    monkeypatch.setattr(compiler_preimport, "COMPILER_MODULES", ("tts_backend.no_such_module", "torch._dynamo"))
    thread = compiler_preimport.import_compiler_in_background()
    thread.join(timeout=300)
    assert not thread.is_alive()
    assert "torch._dynamo" in sys.modules
    assert "tts_backend.no_such_module" not in sys.modules
