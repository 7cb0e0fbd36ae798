"""Every write to a session's socket, under one lock.

`SocketWriter` is what a session's parts share to reach the client: the connection loop sends its
answers through it, the speech pipeline its audio. Holding `lock` is what makes a write safe to
interleave with `input.cancel` (a sentence's frames go out only while it is not cancelled, checked under
the lock). It also times each write, so that a client that stopped reading is noticed (`watch`), and
refuses every write once the session was handed over to another replica (drain).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from .data import ClientGone, SlowConsumer

log = logging.getLogger("voxgate.session")


class SocketWriter:
    def __init__(self, websocket: WebSocket) -> None:
        self.ws = websocket
        self.lock = asyncio.Lock()
        self.handed_over = False  # drain: closed with 1012, nothing more is sent
        self._blocked_since: float | None = None  # when the write under way began, if one is

    async def send_text(self, text: str) -> None:
        async with self.lock:
            await self.send_text_locked(text)

    async def send_text_locked(self, text: str) -> None:
        """Send a text frame; the caller holds `lock`. ClientGone when the socket is closed."""
        await self._write(self.ws.send_text, text)

    async def send_bytes_locked(self, data: bytes) -> None:
        """Send a binary frame; the caller holds `lock`. ClientGone when the socket is closed."""
        await self._write(self.ws.send_bytes, data)

    async def _write(self, send, payload) -> None:
        if self.handed_over:
            raise ClientGone()
        self._blocked_since = time.monotonic()
        try:
            await send(payload)
        except (WebSocketDisconnect, RuntimeError, OSError) as exc:
            raise ClientGone() from exc
        finally:
            self._blocked_since = None

    async def close_locked(self, code: int, reason: str = "") -> None:
        """Close the socket if it is open; the caller holds `lock`. A client already gone is no error."""
        if self.ws.application_state == WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):
                await self.ws.close(code, reason=reason)

    async def hand_over_locked(self, code: int, reason: str) -> bool:
        """Send nothing more and close with `code`; the caller holds `lock`. False if already done."""
        if self.handed_over:
            return False
        self.handed_over = True
        await self.close_locked(code, reason)
        return True

    def blocked_for(self) -> float | None:
        """How long the write under way has waited for the socket, or None when none is waiting."""
        since = self._blocked_since
        return None if since is None else time.monotonic() - since

    async def watch(self, limit_s: float) -> None:
        """Raises SlowConsumer once a write has waited `limit_s` for the socket to accept it: the client
        stopped reading, and only its buffers are held. Runs until then (or until cancelled)."""
        while True:
            await asyncio.sleep(min(1.0, limit_s / 4))
            waited = self.blocked_for()
            if waited is not None and waited >= limit_s:
                raise SlowConsumer()

    def abort(self) -> None:
        """Drop the TCP connection under a socket whose peer reads nothing (a close frame could never be
        written); the server's WebSocket protocol puts the means in the scope (gateway/transport.py)."""
        abort = self.ws.scope.get("voxgate.abort")
        if abort is not None:
            abort()
        else:
            log.warning("cannot abort the connection of a slow consumer: the server offers no way")
