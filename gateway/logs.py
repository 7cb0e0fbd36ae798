"""Structured logs: one JSON object per line (or a line of text for people), with the session id of the
session that logged it.

`session_id_var` is set by a session once it has an id; asyncio tasks copy the context they are created
in, so every line a session's reader, sender and synthesis tasks log carries it (`SessionIdFilter` puts it
on the record). The formatters and the masking of credentials (`redact`) are tts_backend/log_format.py's,
shared with the worker processes. Text content is logged only at debug level (`text_for_log`).

`log_config` sends every logger through the one handler and formatter: uvicorn's, the gateway's and the
backends' (`gateway.*`, `tts_backend.*`, `voxgate.*` at the chosen level), and any other library's
warnings through the root logger, so nothing reaches Python's last-resort handler unformatted.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from typing import Any

from tts_backend.log_format import JsonFormatter, TextFormatter, redact

__all__ = ["JsonFormatter", "SessionIdFilter", "TextFormatter", "log_config", "redact",
           "resolve_format", "session_id_var", "text_for_log"]

session_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("voxgate_session_id", default=None)

PROJECT_LOGGERS = ("voxgate", "gateway", "tts_backend")  # named loggers and module loggers (__name__)


class SessionIdFilter(logging.Filter):
    """Puts the id of the session being served (from `session_id_var`) on a record that has none."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "session_id", None):
            session_id = session_id_var.get()
            if session_id:
                record.session_id = session_id
        return True


def text_for_log(logger: logging.Logger, text: str) -> str:
    """What a log line may say about user text: the text itself only at debug level, else its length."""
    return repr(text) if logger.isEnabledFor(logging.DEBUG) else f"<{len(text)} characters>"


def resolve_format(fmt: str) -> str:
    """`auto`: text for a person at a terminal, JSON for a collector reading a pipe or file."""
    if fmt == "auto":
        return "text" if sys.stderr.isatty() else "json"
    return fmt


def log_config(level: str, fmt: str = "auto") -> dict[str, Any]:
    """A logging.config dict for uvicorn's `log_config`: every logger, one handler, one format."""
    formatter = JsonFormatter if resolve_format(fmt) == "json" else TextFormatter
    level = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": {"()": f"{formatter.__module__}.{formatter.__qualname__}"}},
        "filters": {"session": {"()": "gateway.logs.SessionIdFilter"}},
        "handlers": {"default": {"class": "logging.StreamHandler", "formatter": "default", "filters": ["session"],
                                 "stream": "ext://sys.stderr"}},
        "loggers": {
            **{name: {"level": level} for name in PROJECT_LOGGERS},  # they propagate to the root's handler
            "uvicorn": {"handlers": ["default"], "level": level, "propagate": False},
            "uvicorn.error": {"level": level},
            "uvicorn.access": {"handlers": ["default"], "level": level, "propagate": False},
        },
        # Other libraries: their warnings and errors, formatted and masked like ours.
        "root": {"handlers": ["default"], "level": "WARNING"},
    }
