"""Graceful drain on SIGTERM (issue 5).

uvicorn's own shutdown closes every WebSocket at once (close code 1012) and only then runs the app's
shutdown, which would cut utterances mid-sentence. `voxgate serve` therefore runs `DrainingServer`: the
first SIGTERM starts `drain()` while uvicorn keeps serving - /ready turns false, new WebSockets are
refused with `overloaded` (close 1013, retryable), open utterances finish - and only when every session
is gone, or `drain_timeout_s` has passed and the rest were told to resume elsewhere (close 1012 with the
session id as the reason; their state is in the store), does uvicorn shut down. A second SIGTERM or a
SIGINT (Ctrl-C) exits at once, the way uvicorn always does.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from .http.static import web_root

log = logging.getLogger("voxgate")

CLOSE_GRACE_S = 5.0  # after handing sessions over, how long their sockets may take to close


async def drain(gateway, timeout_s: float, poll_s: float = 0.05) -> None:
    """Stop taking sessions, let open utterances finish for up to `timeout_s`, then hand the rest over.
    Each session is handed over as soon as it sits between utterances, so clients move early."""
    gateway.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    handing: dict[object, asyncio.Task] = {}
    log.info("draining %d session(s) for up to %g s", len(gateway.sessions), timeout_s)
    while gateway.sessions and loop.time() < deadline + CLOSE_GRACE_S:
        expired = loop.time() >= deadline
        for session in list(gateway.sessions):
            if session not in handing and (expired or session.between_utterances):
                handing[session] = asyncio.create_task(session.hand_over(), name="hand-over")
        await asyncio.sleep(poll_s)
    if handing:  # a hand-over stuck on a socket that accepts nothing must not hold the exit
        await asyncio.wait(handing.values(), timeout=CLOSE_GRACE_S)
    log.info("drain finished: %d session(s) handed over, %d left", len(handing), len(gateway.sessions))


def startup_line(host: str, port: int, backend: str) -> str:
    """Where a person points a browser: the page's URL first (a wildcard host is reached on loopback here)."""
    local = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, f"[{host}]" if ":" in host else host)
    base = f"http://{local}:{port}"
    page = f"open {base}/ for the web demo" if web_root() is not None else "no web demo in this install"
    return (f"Voxgate is up: {page}; WebSocket ws://{local}:{port}/v1/audio/speech/stream; "
            f"OpenAI-style HTTP {base}/v1; backend {backend} (ready when {base}/ready answers 200)")


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM drains the gateway before uvicorn's shutdown starts, and a backend
    that fails to start stops the server (`voxgate serve` then exits non-zero).

    The signal handler only sets a flag, which a task started with the server polls - the way uvicorn
    itself polls `should_exit` - so nothing is scheduled from inside a signal handler."""

    POLL_S = 0.05

    def __init__(self, config: uvicorn.Config, gateway, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.drain_timeout_s = drain_timeout_s
        self._drain_requested = False

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            port = sockets[0].getsockname()[1] if sockets else self.config.port
            log.info("%s", startup_line(self.config.host, port, self.gateway.settings.backend))

    async def serve(self, sockets=None) -> None:
        watcher = asyncio.create_task(self._drain_when_asked(), name="drain-on-sigterm")
        try:
            await super().serve(sockets)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self._drain_requested and not self.should_exit:
            self._drain_requested = True
            return
        super().handle_exit(sig, frame)

    async def _drain_when_asked(self) -> None:
        while not self._drain_requested:
            if self.gateway.failure is not None:  # nothing to drain: no session was ever admitted
                self.should_exit = True
                return
            await asyncio.sleep(self.POLL_S)
        try:
            await drain(self.gateway, self.drain_timeout_s)
        finally:
            self.should_exit = True
