"""Counter-based Gumbel noise: seeded sampling that is batch-independent and CUDA-graph safe."""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors (every product stays below 2**63, so no overflow)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [B, vocab] for (seed, draw counter) per row.

    Integer arithmetic only until the last step, so a (seed, counter) gives the same noise on any device
    and in any batch; argmax(scores + noise) is a draw from softmax(scores). This is what makes seeded
    sampling reproducible inside CUDA graphs, where per-request torch generators cannot be used.
    """
    vocab_ids = torch.arange(vocab, device=seeds.device, dtype=torch.long)
    key = _hash32((seeds & _MASK32) ^ 0x3C6EF372)
    ctr = _hash32((counters * 0x9E37 + key) & _MASK32)  # [B]
    x = _hash32(((ctr[:, None] ^ vocab_ids[None]) * 0x2C1B3C6D + key[:, None]) & _MASK32)  # [B, V]
    u = ((x >> 8).float() + 0.5) * (1.0 / 16777216.0)  # (0, 1)
    return -torch.log(-torch.log(u))
