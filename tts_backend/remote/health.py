"""A worker's health port: plain HTTP/1.0 for probes and Prometheus, nothing else.

  GET /health   200 while the process serves (liveness)
  GET /ready    200 once the backend is warm and the worker is not draining, else 503 (readiness)
  GET /metrics  the worker's and its backend's metrics in Prometheus' text format

Three fixed answers need no web framework (tts_backend never imports one): a request head is read up to
8 KiB within 5 s, answered, and the connection closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable

from ..base import BackendMetric

log = logging.getLogger(__name__)

MAX_HEAD = 8192
HEAD_TIMEOUT_S = 5.0


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def prometheus_text(metrics: list[BackendMetric], prefix: str = "voxgate_") -> str:
    lines = []
    for metric in metrics:
        name = prefix + metric.name
        sample_name = name + "_total" if metric.kind == "counter" else name
        lines.append(f"# HELP {sample_name} {_escape(metric.help)}")
        lines.append(f"# TYPE {sample_name} {metric.kind}")
        for values, value in metric.samples:
            labels = ",".join(f'{label}="{_escape(v)}"' for label, v in zip(metric.labels, values))
            lines.append(f"{sample_name}{{{labels}}} {_number(value)}" if labels else f"{sample_name} {_number(value)}")
    return "\n".join(lines) + "\n"


class HealthServer:
    """is_alive / is_ready: callables read at each probe; metrics: the families for /metrics."""

    def __init__(self, port: int, is_ready: Callable[[], bool],
                 metrics: Callable[[], Awaitable[list[BackendMetric]]], host: str = "127.0.0.1") -> None:
        self.port = port
        self.host = host
        self.is_ready = is_ready
        self.metrics = metrics
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port, limit=MAX_HEAD)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _answer(self, path: str) -> tuple[int, str, str]:
        if path == "/health":
            return 200, "text/plain", "ok\n"
        if path == "/ready":
            return (200, "text/plain", "ready\n") if self.is_ready() else (503, "text/plain", "not ready\n")
        if path == "/metrics":
            return 200, "text/plain; version=0.0.4", prometheus_text(await self.metrics())
        return 404, "text/plain", "not found\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            if len(request_line) != 3 or request_line[0] not in ("GET", "HEAD"):
                status, kind, body = 400, "text/plain", "bad request\n"
            else:
                status, kind, body = await self._answer(request_line[1].split("?", 1)[0])
            reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 503: "Service Unavailable"}[status]
            payload = body.encode()
            writer.write(f"HTTP/1.0 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {len(payload)}\r\n"
                         f"Connection: close\r\n\r\n".encode())
            if request_line and request_line[0] != "HEAD":
                writer.write(payload)
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a probe that sent no complete head in time, or too much of one: dropped
        except Exception:  # noqa: BLE001 - a probe must never take the worker down
            log.exception("health request failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
