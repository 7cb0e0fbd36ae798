"""Admission limits: how many sessions may be open, in total and per API key.

One `Admission` per app instance. Issue 7 adds rates (requests and characters per key) and overload
shedding here; sessions acquire a slot for their whole life and give it back when they end.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from collections.abc import Iterator

from .auth import Principal
from .protocol import CloseCode, ErrorCode, ProtocolError
from .settings import GatewaySettings


class Admission:
    def __init__(self, settings: GatewaySettings) -> None:
        self.max_sessions = settings.max_sessions
        self.max_sessions_per_key = settings.max_sessions_per_key
        self.open_sessions = 0
        self._per_key: Counter[str | None] = Counter()

    @contextmanager
    def session(self, principal: Principal) -> Iterator[None]:
        """Hold a session slot. Raises ProtocolError(too_many_sessions) when none is free."""
        if self.max_sessions and self.open_sessions >= self.max_sessions:
            raise ProtocolError(
                ErrorCode.too_many_sessions,
                f"the gateway is serving its maximum of {self.max_sessions} sessions; try again later",
                close=CloseCode.try_again_later,
            )
        if self.max_sessions_per_key and self._per_key[principal.key_id] >= self.max_sessions_per_key:
            raise ProtocolError(
                ErrorCode.too_many_sessions,
                f"this API key already has {self.max_sessions_per_key} open sessions",
                close=CloseCode.try_again_later,
            )
        self.open_sessions += 1
        self._per_key[principal.key_id] += 1
        try:
            yield
        finally:
            self.open_sessions -= 1
            self._per_key[principal.key_id] -= 1
