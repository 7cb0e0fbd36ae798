"""Graceful drain on SIGTERM or Ctrl-C (SIGINT) (issue 5).

uvicorn's own shutdown closes every WebSocket at once (close code 1012) and only then runs the app's
shutdown, which would cut utterances mid-sentence. `voxgate serve` therefore runs `DrainingServer`: the
first SIGTERM or SIGINT starts `drain()` while uvicorn keeps serving - /ready turns false, new WebSockets are
refused with `overloaded` (close 1013, retryable), open utterances finish - and only when every session
is gone, or `drain_timeout_s` has passed and the rest were told to resume elsewhere (close 1012 with the
session id as the reason; their state is in the store), does uvicorn shut down, and the process exits 0.
A second signal, of either kind, stops at once: open connections are closed without waiting, and the
process exits with 128 + the signal's number (130 for Ctrl-C), without a traceback.
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
            f"OpenAI-style HTTP {base}/v1; starting backend {backend} (a 'ready' line follows once it serves)")


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM or SIGINT drains the gateway before uvicorn's shutdown starts, a
    second one stops at once (`stopped_at_once_by` is then that signal), and a backend that fails to start
    stops the server (`voxgate serve` then exits non-zero).

    The signal handler only sets flags, which a task started with the server polls - the way uvicorn
    itself polls `should_exit` - so nothing is scheduled or logged from inside a signal handler. No signal
    is handed back to uvicorn, which would raise it again once the server has stopped: SIGINT's default
    handler then prints a KeyboardInterrupt traceback."""

    POLL_S = 0.05

    def __init__(self, config: uvicorn.Config, gateway, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.drain_timeout_s = drain_timeout_s
        self._drain_requested = False
        self.stopped_at_once_by: int | None = None
        self._cut_off = 0  # sessions open when the second signal came

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
            if self.stopped_at_once_by is not None:
                log.warning("stopped at once by a second %s: %d session(s) cut off",
                            signal.Signals(self.stopped_at_once_by).name, self._cut_off)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_requested or self.should_exit:
            self.stopped_at_once_by = sig
            self._cut_off = len(self.gateway.sessions)
            # uvicorn's shutdown then closes the connections without waiting for them; the app's own shutdown
            # (backend, store) still runs (force_exit would skip it, and its task would die cancelled).
            self.config.timeout_graceful_shutdown = 0
            self.should_exit = True
        else:
            self._drain_requested = True

    async def _drain_when_asked(self) -> None:
        while not self._drain_requested:
            if self.gateway.failure is not None:  # nothing to drain: no session was ever admitted
                self.should_exit = True
                return
            await asyncio.sleep(self.POLL_S)
        log.info("stopping: open utterances finish first (Ctrl-C or SIGTERM again stops at once)")
        try:
            await drain(self.gateway, self.drain_timeout_s)
        finally:
            self.should_exit = True
