"""Structured logs: one JSON object per line, with the session id of the session that logged it.

`session_id_var` is set by a session once it has an id; asyncio tasks copy the context they are created
in, so every line a session's reader, sender and synthesis tasks log carries it. Credentials never reach
the output: the values of query parameters that authenticate (uvicorn logs request paths) and
Authorization credentials are masked in every message and field. A parameter's name is compared as the query parser reads it
(percent-decoded, `+` as a space, any case), so `?api%5Fkey=` is masked as `?api_key=` is. The password of
a URL (`redis://user:PASSWORD@host`, `?password=`) is masked too: `--redis-url` may hold one. Text content
is logged only at debug level (`text_for_log`).
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
from typing import Any
from urllib.parse import unquote_plus

session_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("voxgate_session_id", default=None)

CREDENTIAL_PARAMETERS = frozenset({"api_key", "token"})  # the query names gateway.auth reads a credential from
# name=value: a name as it may stand in a query string (percent escapes included), the value up to the
# next parameter or whitespace; plus Authorization credentials. A name starts only where a run of name
# characters starts (the lookbehind): without it, a long run not followed by '=' is scanned again from each
# of its positions, and a request path of 48 KB kept the event loop busy for 20 s.
_PARAMETER = re.compile(r"(?<![^\s?&=;\"'/])([^\s?&=;\"'/]+)=([^&\s]*)")
_MASKED_PARAMETERS = CREDENTIAL_PARAMETERS | {"password"}  # password=: a Redis URL's, in its query
# scheme://userinfo@: the userinfo of a URL (user:password, or a lone name that may be a password).
# The scheme starts where a run of scheme characters starts (not at every '.', '+' or '-' inside one: see above).
_URL_USERINFO = re.compile(r"(?i)(?<![a-z0-9+.-])([a-z][a-z0-9+.-]*://)([^\s/?#\"']*)@")
_SCHEME = re.compile(r"(?i)((?:bearer|api-key)\s+)[^\s\"']+")  # Authorization schemes gateway.auth reads
# LogRecord attributes that are not user-supplied `extra` fields; uvicorn's `color_message` (the message with
# terminal colour codes) is for terminals, not for a JSON line.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName", "color_message"}
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _mask_parameter(match: re.Match[str]) -> str:
    name, value = match.group(1), match.group(2)
    if value and unquote_plus(name).strip().lower() in _MASKED_PARAMETERS:
        return f"{name}=[redacted]"
    return match.group(0)


def _mask_userinfo(match: re.Match[str]) -> str:
    user, has_password, _ = match.group(2).partition(":")
    return f"{match.group(1)}{user}:[redacted]@" if has_password else f"{match.group(1)}[redacted]@"


def redact(text: str) -> str:
    """Mask credentials in a log message (or in an error that names a URL)."""
    if "=" in text:
        text = _PARAMETER.sub(_mask_parameter, text)
    if "@" in text:
        text = _URL_USERINFO.sub(_mask_userinfo, text)
    return _SCHEME.sub(lambda m: m.group(1) + "[redacted]", text)


def text_for_log(logger: logging.Logger, text: str) -> str:
    """What a log line may say about user text: the text itself only at debug level, else its length."""
    return repr(text) if logger.isEnabledFor(logging.DEBUG) else f"<{len(text)} characters>"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": redact(_ANSI_ESCAPE.sub("", record.getMessage())),
        }
        session_id = getattr(record, "session_id", None) or session_id_var.get()
        if session_id:
            entry["session_id"] = session_id
        for name, value in vars(record).items():
            if name not in _STANDARD and name not in entry:
                if isinstance(value, str):
                    value = redact(value)
                elif not isinstance(value, (int, float, bool, type(None))):
                    value = redact(repr(value))
                entry[name] = value
        if record.exc_info:
            entry["exception"] = redact(self.formatException(record.exc_info))
        return json.dumps(entry, ensure_ascii=False)


class RedactingFormatter(logging.Formatter):
    """Plain text, credentials masked."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def resolve_format(fmt: str) -> str:
    """`auto`: text for a person at a terminal, JSON for a collector reading a pipe or file."""
    if fmt == "auto":
        return "text" if sys.stderr.isatty() else "json"
    return fmt


def log_config(level: str, fmt: str = "auto") -> dict[str, Any]:
    """A logging.config dict for uvicorn's `log_config`: the gateway's and uvicorn's loggers, one format."""
    fmt = resolve_format(fmt)
    formatter = (
        {"()": "gateway.logs.JsonFormatter"}
        if fmt == "json"
        else {"()": "gateway.logs.RedactingFormatter", "format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}
    )
    level = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": formatter},
        "handlers": {"default": {"class": "logging.StreamHandler", "formatter": "default", "stream": "ext://sys.stderr"}},
        "loggers": {
            "voxgate": {"handlers": ["default"], "level": level, "propagate": False},
            "uvicorn": {"handlers": ["default"], "level": level, "propagate": False},
            "uvicorn.error": {"level": level},
            "uvicorn.access": {"handlers": ["default"], "level": level, "propagate": False},
        },
    }
