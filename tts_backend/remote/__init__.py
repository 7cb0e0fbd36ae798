"""Synthesis in other processes: `voxgate worker` (worker.py) serving a backend over a Unix socket or TCP,
the framed protocol between it and a gateway (framing.py), and the gateway's `remote` backend (pool.py),
which spreads sessions over a pool of workers."""

from .pool import RemoteSynthesizer

__all__ = ["RemoteSynthesizer"]
