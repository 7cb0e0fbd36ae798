"""A worker's connections that have not finished the handshake (framing.py), and which of them to drop when
there are too many.

A peer that has proved nothing costs the worker a descriptor and a little memory, so their number is
bounded: at most `cap` in all and `per_source` from one IP address. Past a bound, one is dropped, so that new
peers are never refused outright. Which one matters, because a gateway shares those places with whoever opens
connections to the worker, from another host or from its own address: a gateway sends its hello the moment
it connects and its proof one round trip later, while an idle peer sends nothing. So the one dropped is the
oldest that has sent no hello yet ("silent"), and only where there is none the oldest that has ("greeted");
never the newcomer itself while another can go. Idle connections, however fast they come, then only ever
replace each other: a gateway's connection is at risk only in the moment before its hello is read (a few
turns of the event loop, in which far fewer than `per_source` connections are accepted), and a peer that
sends hellos and stops there holds a place for the handshake's deadline at most, oldest first, while a
gateway's stays for a round trip.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable


class PendingHandshakes:
    """Connections (any hashable: the worker uses their StreamWriter) mid-handshake, by source address."""

    def __init__(self, cap: int, per_source: int) -> None:
        self.cap = cap
        self.per_source = per_source
        self._silent: collections.OrderedDict[Hashable, str] = collections.OrderedDict()  # oldest first
        self._greeted: collections.OrderedDict[Hashable, str] = collections.OrderedDict()
        self._by_source: dict[str, tuple[collections.OrderedDict, collections.OrderedDict]] = {}

    def __len__(self) -> int:
        return len(self._silent) + len(self._greeted)

    def add(self, connection: Hashable, source: str) -> list[Hashable]:
        """A new connection from `source`; the connections to drop to keep within the bounds."""
        self._silent[connection] = source
        silent, greeted = self._by_source.setdefault(source, (collections.OrderedDict(), collections.OrderedDict()))
        silent[connection] = None
        dropped = []
        if len(silent) + len(greeted) > self.per_source:
            dropped.append(self._drop(self._oldest(silent, greeted, connection)))
        while len(self) > self.cap:
            dropped.append(self._drop(self._oldest(self._silent, self._greeted, connection)))
        return dropped

    def greet(self, connection: Hashable) -> None:
        """The connection's hello has come (and been answered)."""
        source = self._silent.pop(connection, None)
        if source is None:
            return
        self._greeted[connection] = source
        silent, greeted = self._by_source[source]
        del silent[connection]
        greeted[connection] = None

    def remove(self, connection: Hashable) -> None:
        """The connection finished the handshake, failed it, or was dropped (again: nothing happens)."""
        source = self._silent.pop(connection, None) or self._greeted.pop(connection, None)
        if source is None:
            return
        silent, greeted = self._by_source[source]
        silent.pop(connection, None)
        greeted.pop(connection, None)
        if not silent and not greeted:
            del self._by_source[source]

    @staticmethod
    def _oldest(silent: collections.OrderedDict, greeted: collections.OrderedDict, newcomer: Hashable) -> Hashable:
        first_silent = next(iter(silent), None)
        if first_silent is not None and first_silent is not newcomer:
            return first_silent
        return next(iter(greeted), newcomer)

    def _drop(self, connection: Hashable) -> Hashable:
        self.remove(connection)
        return connection
