"""The gateway's TCP connections under uvicorn, bounded against clients that misbehave on the wire.

`http_protocol` (HTTP) gives a request's head a deadline and a size limit, and lets a refusal reach a
client whose request is still coming (`_LingeringCloseTransport`); `abortable_ws_protocol` (WebSocket) lets a
session drop its connection, bounds the close handshake (`_BoundedCloseTransport`), and drops a
connection that reads nothing. cli.py hands both to uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket

from .protocol import ErrorCode

log = logging.getLogger("voxgate.transport")

REFUSAL_LINGER_S = 2.0  # a refused HTTP request's client may read the refusal while its body is discarded


def http_protocol(header_timeout_s: float, max_request_line_bytes: int, max_head_bytes: int,
                  send_buffer_bytes: int = 0) -> type:
    """uvicorn's HTTP protocol (httptools; the WebSocket upgrade request goes through it too), bounded
    before authentication, for clients that send a request's head too slowly or too much of it:

    - the head (request line and headers) gets `header_timeout_s`: a client that trickles it (slowloris)
      is disconnected instead of holding a connection forever (uvicorn only times out idle keep-alive
      connections);
    - a request line longer than `max_request_line_bytes` is answered 414 and a head longer than
      `max_head_bytes` 431, each counted as the bytes arrive and before the parser sees the excess; a
      chunked body's trailer section (with the chunk lines since the last body bytes) gets the head's
      limit too (431, or the connection ends if the response has begun). Both
      parsers below keep what they have of an unfinished URL or header by appending to bytes (uvicorn's
      on_url, httptools' header fields), which costs time growing with the square of its size: before
      this bound a 40 MB URL cost 2.1 CPU-s and a 40 MB header was read whole and answered 200.

    A request pipelined behind another's body in one read has its head counted from the next read on,
    and its request line is then bounded by the head's limit (431, not 414): still at most one read
    (256 KiB) over the bound.

    uvicorn is handed this class as its `http` protocol, so its h11 implementation is never used.

    `send_buffer_bytes` fixes the kernel's send buffer of each connection: left to autotuning it grows to
    megabytes (tcp_wmem), all of it audio a client that stopped reading makes the server hold."""
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

    class BoundedHttpProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _in_head = True  # reading a request's head, or waiting for the next request on this connection
        # The next request's head begins with the next byte received (nothing of it parsed yet), so its
        # request line can be measured from there.
        _next_head_unseen = True
        _head_bytes = 0  # bytes of the current head received so far
        _line_bytes: int | None = 0  # ... of its request line, while that goes on; None once it has ended
        _heads_done = 0  # heads parsed whole on this connection
        _body_bytes = 0  # body bytes the parser delivered on this connection
        # Bytes received after the current request's head that the parser delivered as no body since the last
        # body bytes: chunk lines, then the trailer section. Bounded as the head is: the parser keeps an
        # unfinished trailer field by appending to bytes, and uvicorn adds each field to the request's
        # headers (before: a 32 MiB trailer cost 2.5 CPU-s).
        _unbodied_bytes = 0
        _upgraded = False

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                log.info("closing a connection whose request headers took over %g s", header_timeout_s)
                self.transport.close()

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(_LingeringCloseTransport(transport, self))
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                # asyncio sets TCP_NODELAY only on sockets created with proto IPPROTO_TCP, and a listener made
                # with socket.socket(family, SOCK_STREAM) (ours, uvicorn's) has proto 0: with Nagle on, a
                # small message written after audio (a pong, an acknowledgement, audio.start) waited for the
                # client's delayed ACK, 40 ms.
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if send_buffer_bytes and sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            # Begun inside a read that was not measured from the head's first byte (a request pipelined
            # behind a body, or behind a whole request in one read): its line's start is unknown.
            self._next_head_unseen = False
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            self._in_head = False
            self._unbodied_bytes = 0
            self._heads_done += 1
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head, self._next_head_unseen, self._head_bytes, self._line_bytes = True, True, 0, None

        def handle_websocket_upgrade(self) -> None:
            self._upgraded = True
            super().handle_websocket_upgrade()

        def data_received(self, data: bytes) -> None:
            if self.transport.lingering:
                return  # the rest of a refused request
            while data and self._in_head:
                if self._next_head_unseen:  # these bytes start the next request
                    self._next_head_unseen, self._head_bytes, self._line_bytes = False, 0, 0
                room = max_head_bytes - self._head_bytes
                if room <= 0:
                    self._refuse(431, f"the request's head exceeds the {max_head_bytes}-byte limit")
                    return
                piece, data = data[:room], data[room:]
                if self._line_bytes is not None:
                    end = piece.find(b"\n")
                    line = self._line_bytes + (len(piece) if end < 0 else end)
                    if line > max_request_line_bytes:
                        self._refuse(414, f"the request line exceeds the {max_request_line_bytes}-byte limit")
                        return
                    self._line_bytes = line if end < 0 else None
                self._head_bytes += len(piece)
                heads_done = self._heads_done
                super().data_received(piece)
                if self._upgraded or self.transport.is_closing():
                    return  # uvicorn too drops what follows an upgrade request in the bytes it was handed
                if data and self._heads_done == heads_done:  # no head ended in `piece`: this one is too long
                    self._refuse(431, f"the request's head exceeds the {max_head_bytes}-byte limit")
                    return
            while data and not self._in_head:  # a body, and whatever follows it in this read
                room = max_head_bytes - self._unbodied_bytes
                if room <= 0:
                    self._refuse_trailer()
                    return
                piece, data = data[:room], data[room:]
                body_before = self._body_bytes
                super().data_received(piece)
                if self.transport.is_closing():
                    return
                delivered = self._body_bytes - body_before
                # What of `piece` was no body: chunk lines, and the trailer if it began there.
                self._unbodied_bytes = len(piece) - delivered if delivered else self._unbodied_bytes + len(piece)
            if data:  # a request pipelined behind the one that ended in this read
                super().data_received(data)

        def on_body(self, body: bytes) -> None:
            self._body_bytes += len(body)
            super().on_body(body)

        def _refuse_trailer(self) -> None:
            """The bytes after the head that are no body passed the head's limit: a trailer section (or
            chunk extensions) too long. Answered 431 if the app has not begun its response, else the
            connection just ends; the app's response, if any, goes nowhere."""
            message = f"the request's trailer exceeds the {max_head_bytes}-byte limit"
            cycle = self.cycle
            answered = cycle is not None and cycle.response_started
            if cycle is not None:
                cycle.disconnected = True
            if answered:
                log.info("closing a connection: %s", message)
                self.transport.close()
            else:
                self._refuse(431, message)

        def _refuse(self, status: int, message: str) -> None:
            """Answer `status` before the head was read, then linger: the client may still be sending it."""
            self._disarm()
            log.info("refused a request with %d: %s", status, message)
            body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                         "code": ErrorCode.message_too_large.value, "param": None}}).encode()
            head = [STATUS_LINE[status]]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                     b"connection: close\r\n\r\n"]
            self.transport.write(b"".join(head) + body)
            self.transport.linger()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return BoundedHttpProtocol


class _LingeringCloseTransport:
    """An HTTP connection's transport whose `close()`, once a response went out before the request's body
    was read (a refusal: 401, 413, 408), lingers: the response leaves with a FIN, and what comes of the
    body is read and thrown away for REFUSAL_LINGER_S before the connection closes. Closing a socket with
    unread data resets the connection, and the client would meet the reset instead of the refusal.
    `linger()` does the same for a refusal sent before the request's head was read (414, 431)."""

    def __init__(self, transport: asyncio.Transport, protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self.lingering = False

    def close(self) -> None:
        cycle = self._protocol.cycle
        if self.lingering:
            return
        if cycle is not None and cycle.response_complete and cycle.more_body:  # refused, its body unread
            self.linger()
        else:
            self._transport.close()

    def linger(self) -> None:
        if self.lingering:
            return
        if self._transport.is_closing() or not self._transport.can_write_eof():
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
