"""Qwen3-ForcedAligner-0.6B in plain PyTorch: word start/end times for a sentence's audio and text.

config (config.json), features (log-mel), encoder (audio tower), decoder (Qwen3 decoder), words (word split,
prompt, monotonic repair, class -> seconds), model (ForcedAligner.align), loader (strict checkpoint loading).
"""

from .loader import load_aligner
from .model import AlignRequest, ForcedAligner

__all__ = ["AlignRequest", "ForcedAligner", "load_aligner"]
