"""PyAV, imported when a compressed format or a reference clip first needs it, not when the gateway starts.

PyAV is a declared dependency, but it is 35 MB as a wheel and only mp3/opus/aac/flac output and cloning
from a clip use it: a stripped install (the GPU bench's, which must fit what one device call carries) serves
pcm and wav without it. There a format or clip that needs it fails with `PyAVMissing`, which says so.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class PyAVMissing(RuntimeError):
    """PyAV is not installed, and `what` needs it."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} needs PyAV, which is not installed here (pip install av)")


def pyav(what: str) -> ModuleType:
    """The `av` module; `what` (e.g. "mp3 output") names the feature in the error where it is missing."""
    try:
        return importlib.import_module("av")
    except ImportError:
        raise PyAVMissing(what) from None
