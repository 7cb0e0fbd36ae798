"""The gateway's TCP connections under uvicorn, bounded against clients that misbehave on the wire.

`header_timeout_protocol` (HTTP) gives a request's headers a deadline and lets a refusal reach a client
whose body is still coming (`_LingeringCloseTransport`); `abortable_ws_protocol` (WebSocket) lets a
session drop its connection, bounds the close handshake (`_BoundedCloseTransport`), and drops a
connection that reads nothing. cli.py hands both to uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

log = logging.getLogger("voxgate.transport")

REFUSAL_LINGER_S = 2.0  # a refused HTTP request's client may read the refusal while its body is discarded


def header_timeout_protocol(timeout_s: float, send_buffer_bytes: int = 0) -> type:
    """uvicorn's HTTP protocol, plus a deadline for a request's headers (the WebSocket upgrade request
    included): a client that trickles its headers (slowloris) is disconnected after `timeout_s` instead
    of holding a connection forever (uvicorn itself only times out idle keep-alive connections).

    `send_buffer_bytes` fixes the kernel's send buffer of each connection: left to autotuning it grows to
    megabytes (tcp_wmem), all of it audio a client that stopped reading makes the server hold."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                log.info("closing a connection whose request headers took over %g s", timeout_s)
                self.transport.close()

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(_LingeringCloseTransport(transport, self))
            sock = transport.get_extra_info("socket")
            if send_buffer_bytes and sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def data_received(self, data: bytes) -> None:
            if self.transport.lingering:
                return  # the rest of a refused request's body
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


class _LingeringCloseTransport:
    """An HTTP connection's transport whose `close()`, once a response went out before the request's body
    was read (a refusal: 401, 413, 408), lingers: the response leaves with a FIN, and what comes of the
    body is read and thrown away for REFUSAL_LINGER_S before the connection closes. Closing a socket with
    unread data resets the connection, and the client would meet the reset instead of the refusal."""

    def __init__(self, transport: asyncio.Transport, protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self.lingering = False

    def close(self) -> None:
        cycle = self._protocol.cycle
        if self.lingering:
            return
        refused_unread = cycle is not None and cycle.response_complete and cycle.more_body
        if not refused_unread or self._transport.is_closing() or not self._transport.can_write_eof():
            self._transport.close()
            return
        self.lingering = True
        self._transport.write_eof()
        self._transport.resume_reading()
        self._protocol.loop.call_later(REFUSAL_LINGER_S, self._transport.close)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class _BoundedCloseTransport:
    """A connection's transport whose `close()` has a deadline: asyncio's close waits, without limit, for
    the unsent data to go out, so a client that reads nothing would keep the connection (and the data)
    forever. `grace_s` after a close with data still unsent, the connection is dropped."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, grace_s: float) -> None:
        self._transport = transport
        self._loop = loop
        self._grace_s = grace_s
        self._abort_timer: asyncio.TimerHandle | None = None

    def close(self) -> None:
        self._transport.close()
        if self._abort_timer is None and self._transport.get_write_buffer_size():
            self._abort_timer = self._loop.call_later(self._grace_s, self._transport.abort)

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def abortable_ws_protocol(max_unsent_bytes: int, close_timeout_s: float, write_stall_s: float) -> type:
    """uvicorn's WebSocket protocol, bounded for clients that stop reading:
    - `scope["voxgate.abort"]` drops the TCP connection. A client that reads nothing cannot be sent a
      close frame (the send waits for buffer space that never comes), so the session's deadlines end it
      this way;
    - the close handshake takes `close_timeout_s` at most, and a close with data still unsent is
      followed by an abort `close_timeout_s` later (`_BoundedCloseTransport`);
    - a connection is dropped once the replies its client's own frames made the protocol write (pongs,
      which uvicorn writes whether or not the client reads, before and after authentication) pass
      `max_unsent_bytes` while unsent data has been waiting all along: a ping flood that reads nothing.
      The app's own writes do not count: one whole sentence may be a frame of megabytes (their bound is
      the session's back-pressure), and a client that pings while it arrives is not flooding;
    - a connection that accepts none of its unsent data for `write_stall_s` is dropped, whatever waits
      to write to it (a refusal, session.started, an error): every such wait ends;
    - an upgrade refused with an HTTP answer ends quietly."""
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

    class AbortableWebSocketProtocol(WebSocketsSansIOProtocol):
        _stall_timer: asyncio.TimerHandle | None = None
        _replies_unsent = 0  # bytes written in reply to the client's frames since nothing was unsent

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.close_timeout = close_timeout_s  # uvicorn's wait for the client's answer to our close frame

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(_BoundedCloseTransport(transport, self.loop, close_timeout_s))

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stall_timer is None:
                self._stall_timer = self.loop.call_later(write_stall_s, self._stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._cancel_stall_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_stall_timer()
            super().connection_lost(exc)

        def _cancel_stall_timer(self) -> None:
            if self._stall_timer is not None:
                self._stall_timer.cancel()
                self._stall_timer = None

        def _stalled(self) -> None:
            self._stall_timer = None
            log.info("dropping a WebSocket connection that accepted nothing for %g s", write_stall_s)
            self.transport.abort()

        def handle_connect(self, event) -> None:  # type: ignore[override]
            super().handle_connect(event)
            scope = getattr(self, "scope", None)
            if scope is not None:  # the app's task has not started yet: it sees this
                scope["voxgate.abort"] = self.transport.abort

        async def send(self, message) -> None:  # type: ignore[override]
            await super().send(message)
            if message["type"] == "websocket.http.response.body" and not message.get("more_body", False):
                # An upgrade refused with an HTTP answer (app.py, Api-Key clients) is complete once sent;
                # uvicorn 0.54 does not note that, then logs an error and writes a 500 to the closed socket.
                self.handshake_complete = True

        def data_received(self, data: bytes) -> None:
            unsent = self.transport.get_write_buffer_size()
            if unsent == 0:
                self._replies_unsent = 0
            super().data_received(data)
            self._replies_unsent += max(0, self.transport.get_write_buffer_size() - unsent)
            if self._replies_unsent > max_unsent_bytes and not self.transport.is_closing():
                log.info("dropping a WebSocket connection whose client sends but reads nothing (%d bytes of"
                         " replies unsent)", self._replies_unsent)
                self.transport.abort()

    return AbortableWebSocketProtocol
