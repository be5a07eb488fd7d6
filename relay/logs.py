"""One log line per decision (DESIGN §8.2): a stable snake_case event name plus fields.

`log(event, **fields)` writes JSON lines (default) or `key=value` text for humans. Secrets are
never passed in: callers log ids, statuses and redacted URLs only.
"""

from __future__ import annotations

import logging
import sys
import time
from datetime import UTC, datetime
from typing import Any

import orjson

_logger = logging.getLogger("relay")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            out.update(fields)
        if record.exc_info and record.exc_info[1] is not None:
            out["error"] = f"{type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        parts = [f"{stamp} {record.levelname.lower():7} {record.getMessage()}"]
        for key, value in (getattr(record, "fields", None) or {}).items():
            parts.append(f"{key}={value}")
        if record.exc_info and record.exc_info[1] is not None:
            parts.append(f"error={type(record.exc_info[1]).__name__}: {record.exc_info[1]}")
        return " ".join(parts)


def configure(fmt: str = "json", level: str = "info", stream: Any = None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    _logger.handlers[:] = [handler]
    _logger.setLevel(level.upper())
    _logger.propagate = False


def log(event: str, level: int = logging.INFO, **fields: Any) -> None:
    if _logger.isEnabledFor(level):
        _logger.log(level, event, extra={"fields": fields})


def debug(event: str, **fields: Any) -> None:
    log(event, logging.DEBUG, **fields)


def info(event: str, **fields: Any) -> None:
    log(event, logging.INFO, **fields)


def warning(event: str, **fields: Any) -> None:
    log(event, logging.WARNING, **fields)


def error(event: str, **fields: Any) -> None:
    log(event, logging.ERROR, **fields)


def error_text(exc: BaseException, limit: int = 200) -> str:
    """An exception as a log field: its type and the start of its message."""
    return f"{type(exc).__name__}: {str(exc).strip()[:limit]}"
