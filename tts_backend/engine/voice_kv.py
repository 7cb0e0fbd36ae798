"""The Talker K/V of cloned voices' prompt prefixes, kept on the device per runner (one per replica).

An in-context voice's prompt starts with positions that depend on the voice alone (qwen3/prompt.py,
`Prompt.voice_prefix`): prefilled once, their keys and values for every Talker layer are kept here, and a
later request in that voice copies them into its slot and prefills only the rest of its prompt. Entries are
keyed by a digest of what the prefix holds (`Prompt.voice_prefix_digest`), never by a voice's name, which a
tenant chooses: two tenants' identical clips share an entry, two different clips never meet. The cache is
bounded by bytes and drops the least recently used entry first; an entry larger than the whole bound is not
kept (its requests each prefill the prefix, as without the cache).
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class VoiceKVCache:
    """Prefix digest -> K/V [2, layers, positions, kv heads, head dim], least recently used first."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = 0  # requests whose prefix was copied from an entry instead of prefilled
        self.misses = 0  # prefixes prefilled (and kept, when they fit)
        self.evictions = 0
        self.positions_saved = 0  # prompt positions the hits did not prefill

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> torch.Tensor | None:
        kv = self._entries.get(key)
        if kv is not None:
            self._entries.move_to_end(key)
        return kv

    def put(self, key: bytes, kv: torch.Tensor) -> bool:
        """Keep `kv` under `key`, dropping the least recently used entries until it fits; False (nothing
        kept, nothing dropped) when it alone exceeds the bound."""
        size = kv.numel() * kv.element_size()
        if size > self.max_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.numel() * old.element_size()
        while self._entries and self.bytes + size > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= dropped.numel() * dropped.element_size()
            self.evictions += 1
        self._entries[key] = kv
        self.bytes += size
        return True

    def count_misses(self, prefixes: int) -> None:
        """`prefixes` prefilled by the caller (and offered to `put`)."""
        self.misses += prefixes

    def count_hits(self, requests: int, positions: int) -> None:
        """`requests` whose prefix the caller copied from entries instead of prefilling, `positions` in all."""
        self.hits += requests
        self.positions_saved += positions

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions, "bytes": self.bytes,
                "entries": len(self._entries), "max_bytes": self.max_bytes, "positions_saved": self.positions_saved}
