"""How every Voxgate process writes its log lines - the gateway's (`voxgate serve`) and the workers'
(`voxgate worker`) - and how credentials are masked in them and in errors that name a URL.

It lives here, not in gateway/, because a worker process must not import the gateway (the arrows point
gateway -> tts_backend), and both must mask alike: `redact` for a message or an error, `JsonFormatter`
(one object per line) and `TextFormatter` (for people) for whole records, each carrying the record's
structured fields (`extra=`: session_id, voice, format, ...), masked like the message.

What is masked: the values of query parameters that authenticate (`api_key`, `token`; uvicorn logs
request paths), read as the query parser reads a name (percent-decoded, `+` as a space, any case), so
`?api%5Fkey=` is masked as `?api_key=` is; Authorization credentials (`Bearer ...`, `Api-Key ...`); and
the password of a URL (`redis://user:PASSWORD@host`, `?password=`), which `--redis-url`, `-o discover=`
and `--registry` may hold.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any
from urllib.parse import unquote_plus

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
# terminal colour codes) is for terminals, not for a log line.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName", "color_message"}
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_BARE_VALUE = re.compile(r"[^\s\"'=]+")  # a text field's value written without quotes


def _mask_parameter(match: re.Match[str]) -> str:
    name, value = match.group(1), match.group(2)
    if value and unquote_plus(name).strip().lower() in _MASKED_PARAMETERS:
        return f"{name}=[redacted]"
    return match.group(0)


def _mask_userinfo(match: re.Match[str]) -> str:
    user, has_password, _ = match.group(2).partition(":")
    return f"{match.group(1)}{user}:[redacted]@" if has_password else f"{match.group(1)}[redacted]@"


def redact(text: str) -> str:
    """Mask credentials in a log message, or in an error that names a URL (a Redis URL's password)."""
    if "=" in text:
        text = _PARAMETER.sub(_mask_parameter, text)
    if "@" in text:
        text = _URL_USERINFO.sub(_mask_userinfo, text)
    return _SCHEME.sub(lambda m: m.group(1) + "[redacted]", text)


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """A record's structured fields (what `extra=` or a logging filter added), masked; session_id first."""
    fields: dict[str, Any] = {}
    session_id = getattr(record, "session_id", None)
    if session_id:
        fields["session_id"] = session_id
    for name, value in vars(record).items():
        if name in _STANDARD or name in fields or name == "session_id":
            continue
        if isinstance(value, str):
            value = redact(value)
        elif not isinstance(value, (int, float, bool, type(None))):
            value = redact(repr(value))
        fields[name] = value
    return fields


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, then the record's fields (and its exception)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": redact(_ANSI_ESCAPE.sub("", record.getMessage())),
        }
        for name, value in record_fields(record).items():
            entry.setdefault(name, value)
        if record.exc_info:
            entry["exception"] = redact(self.formatException(record.exc_info))
        return json.dumps(entry, ensure_ascii=False)


def _text_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if _BARE_VALUE.fullmatch(text) else json.dumps(text, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """A line for people: `TIME LEVEL LOGGER: MESSAGE key=value ...`, the same fields as the JSON lines
    (a value with spaces or quotes in JSON quotes), credentials masked."""

    def __init__(self, fmt: str = "%(asctime)s %(levelname)s %(name)s: %(message)s", **kwargs: Any) -> None:
        super().__init__(fmt, **kwargs)

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        record.asctime = self.formatTime(record, self.datefmt)
        line = self.formatMessage(record)
        fields = record_fields(record)
        if fields:
            line += " " + " ".join(f"{name}={_text_value(value)}" for name, value in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return redact(line)
