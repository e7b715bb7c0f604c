"""Logging setup for `kvbroker serve`: text for people, JSON lines for log pipelines.

``--log-format json`` writes one JSON object per line: ``ts`` (RFC 3339, UTC, milliseconds),
``level``, ``logger``, ``msg`` (the formatted message), ``exc`` when there is a traceback,
and every ``extra=`` field of the call. Secrets never reach the output: a password in a URL
(``redis://:pw@host``) is replaced by ``***`` in the message and in every string field, and
an extra field whose name says it is a secret (password, token, ...) is dropped to ``***``.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import sys
from typing import Any, TextIO

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# scheme://user:password@host -> scheme://user:***@host; scheme://password@host -> scheme://***@host
_URL_PASSWORD = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^\s/@]*)@")
_SECRET_KEYS = re.compile(r"pass(word|wd)?|secret|token|api[_-]?key|authorization|credential", re.IGNORECASE)

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_RECORD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}


def redact_text(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``."""

    def hide(m: re.Match[str]) -> str:
        user, sep, _ = m.group("userinfo").partition(":")
        return f"{m.group('scheme')}{user}:***@" if sep else f"{m.group('scheme')}***@"

    return _URL_PASSWORD.sub(hide, text) if "@" in text else text


def _clean(key: str, value: Any) -> Any:
    if _SECRET_KEYS.search(key):
        return "***"
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, int | float | bool) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _clean(str(k), v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_clean(key, v) for v in value]
    return redact_text(str(value))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, [exc], then the extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": redact_text(record.getMessage()),
        }
        if record.exc_info:
            out["exc"] = redact_text(self.formatException(record.exc_info))
        elif record.exc_text:
            out["exc"] = redact_text(record.exc_text)
        if record.stack_info:
            out["stack"] = redact_text(self.formatStack(record.stack_info))
        for key, value in record.__dict__.items():
            if key not in _RECORD_ATTRS and key not in out:
                out[key] = _clean(key, value)
        return json.dumps(out, default=str, ensure_ascii=False)


class RedactingFormatter(logging.Formatter):
    """The text format, with URL passwords hidden like the JSON one."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record))


def make_formatter(log_format: str) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter()
    if log_format == "text":
        return RedactingFormatter(TEXT_FORMAT)
    raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")


def setup_logging(level: str = "info", log_format: str = "text", stream: TextIO | None = None) -> logging.Handler:
    """Replace the root logger's handlers with one that writes ``log_format`` to stderr.

    Returns the handler (tests read it; callers may ignore it)."""
    formatter = make_formatter(log_format)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    return handler
