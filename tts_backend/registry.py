"""Backend names -> Synthesizer instances. Imports are lazy so the gateway never pulls torch unless asked."""

from __future__ import annotations

from typing import Any

from .base import Synthesizer

BACKENDS = ("piper", "synthetic", "qwen3", "remote")


def create_backend(name: str, **options: Any) -> Synthesizer:
    if name == "synthetic":
        from .synthetic import SyntheticSynthesizer

        return SyntheticSynthesizer(**options)
    if name == "piper":
        from .piper import PiperSynthesizer

        return PiperSynthesizer(**options)
    if name == "qwen3":
        from .qwen3_backend import Qwen3Synthesizer

        return Qwen3Synthesizer(**options)
    if name == "remote":
        from .remote.pool import RemoteSynthesizer

        return RemoteSynthesizer(**options)
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
