"""One log line per decision (DESIGN §8.2): a stable snake_case event name plus fields.

`log(event, **fields)` writes JSON lines (default) or `key=value` text for humans. Secrets are
never passed in: callers log ids, statuses and redacted URLs only.
"""

from __future__ import annotations

import logging
import re
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


_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def text_value(value: object) -> str:
    """A field for the text format: as is when it is plain, else JSON-quoted, so that a run id
    or an ingress body with ESC, CR/LF or bidi controls can neither forge a log line nor drive
    the terminal (JSON lines are safe by construction)."""
    text = str(value)
    if _UNSAFE.search(text) or " " in text or '"' in text:
        return orjson.dumps(text).decode().translate(_BIDI_ESCAPES)
    return text


# orjson leaves U+2028/9 and the bidi controls as they are: \u-escape them too.
_BIDI_ESCAPES = {c: f"\\u{c:04x}" for c in [0x2028, 0x2029, *range(0x202A, 0x202F),
                                             *range(0x2066, 0x206A)]}  # fmt: skip


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        parts = [f"{stamp} {record.levelname.lower():7} {text_value(record.getMessage())}"]
        for key, value in (getattr(record, "fields", None) or {}).items():
            parts.append(f"{key}={text_value(value)}")
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            parts.append(f"error={text_value(f'{type(exc).__name__}: {exc}')}")
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
