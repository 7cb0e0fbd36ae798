"""Loopback ports for the processes a bench or test starts on a fixed port (`voxgate serve --port`, a
worker's --listen and --health-port, `voxgate worker --gpus`, which counts its children's ports up from one
base): picked here, bound later by that process.

A port picked by binding port 0 and letting it go comes from the kernel's ephemeral range, the range every
other socket bound to port 0 and every outgoing connection also draws from: on a busy CI machine one took it
before the process bound it, and the process exited with "address already in use" (a `--gpus` child, a test
of bench/engine_load.py). So the ports are picked below that range, at random, each bound here to check it is
free, then let go: nothing the kernel hands out lands there, and two pickers side by side seldom try the same
one. Where a process can bind port 0 itself and tell its port, that is better still.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path


def ephemeral_ports() -> range:
    """The ports the kernel hands out to sockets bound to port 0 and to outgoing connections
    (net.ipv4.ip_local_port_range; Linux's default where it cannot be read)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def consecutive_free_ports(count: int, taken: set[int] | None = None) -> int:
    """The first of `count` consecutive loopback ports below the ephemeral range that are all free now and
    none of `taken` (they are added to it)."""
    below = ephemeral_ports().start
    lowest = 10000 if below - count > 10000 else 1024
    for _ in range(500):
        first = random.randrange(lowest, below - count)
        block = range(first, first + count)
        if taken is not None and taken & set(block):
            continue
        held = []
        try:
            for port in block:
                probe = socket.socket()
                held.append(probe)
                probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for probe in held:
                probe.close()
        if taken is not None:
            taken.update(block)
        return first
    raise RuntimeError(f"no {count} consecutive free loopback ports")


def free_port(taken: set[int] | None = None) -> int:
    """A loopback port below the ephemeral range, free now and not one of `taken` (ports handed out but not
    yet bound; it is added to them)."""
    return consecutive_free_ports(1, taken)
