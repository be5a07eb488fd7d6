"""One log line per decision (DESIGN §8.2): a stable snake_case event name plus fields.

`log(event, **fields)` writes JSON lines (default) or `key=value` text for humans. Secrets are
never passed in: callers log ids, statuses and redacted URLs only. Fields `bound` for a block go
on every line logged in it, and in every task started from it (a context variable): a fleet's
delivery of one database names it on each of its lines (relay/fleet.py).
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

import orjson

from relay.settings import redact_url

_logger = logging.getLogger("relay")


# Libraries log through their own loggers (psycopg, psycopg_pool, anyio, asyncio, uvicorn):
# configure() puts one handler on the root logger, so their lines take the same shape as the
# relay's. Their messages are free text that may quote a conninfo or URL: redacted here.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"]+")


def redact_text(text: str) -> str:
    """Free text with the password of every URL and key=value conninfo in it replaced by ***."""
    text = _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
    return redact_url(text)  # no scheme at the start: the conninfo `password=` rule


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, replica, then `event` and the fields of
    the relay's own records or `msg` (redacted) of a library's."""

    def __init__(self, replica: str | None = None) -> None:
        super().__init__()
        self.replica = replica

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        if self.replica is not None:
            out["replica"] = self.replica
        fields = getattr(record, "fields", None)
        if fields is not None:
            out["event"] = record.getMessage()
            out.update(fields)
        else:
            out["msg"] = redact_text(record.getMessage())
        if record.exc_info and record.exc_info[1] is not None:
            out["error"] = redact_text(error_text(record.exc_info[1], 1000))
            if fields is None or record.levelno >= logging.CRITICAL:
                out["traceback"] = redact_text(self.formatException(record.exc_info))
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
    """`--log-format text`, for humans: the local date and time to the millisecond with its
    offset (a line must say which day, and which of two lines in one second came first), the
    level, the event, then its fields as key=value; a field without a value is left out
    (`trace_id=None` said nothing)."""

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.fromtimestamp(record.created).astimezone()
        stamp = when.isoformat(timespec="milliseconds")
        fields = getattr(record, "fields", None)
        message = record.getMessage() if fields is not None else redact_text(record.getMessage())
        parts = [f"{stamp} {record.levelname.lower():7} {text_value(message)}"]
        if fields is None and record.name != "relay":
            parts.append(f"logger={text_value(record.name)}")
        for key, value in (fields or {}).items():
            if value is not None:
                parts.append(f"{key}={text_value(value)}")
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            parts.append(f"error={text_value(redact_text(f'{type(exc).__name__}: {exc}'))}")
        return " ".join(parts)


LIBRARY_LEVEL = logging.WARNING  # psycopg_pool's INFO lines are noise next to the relay's
# The HTTP client's loggers speak per request (httpx: an INFO line per POST; httpcore: a DEBUG
# line per step): the relay's own `delivered` / `post_failed` lines say it once, with the run.
# Their warnings and errors still come through, at debug level too.
PER_REQUEST_LOGGERS = ("httpx", "httpcore", "hpack")


def configure(
    fmt: str = "json", level: str = "info", stream: Any = None, replica: str | None = None
) -> None:
    """Send every logger's records (the relay's and its libraries') to `stream` (stderr) in
    `fmt`: one handler on the root logger, replacing the one an earlier call installed and
    leaving other handlers (a test runner's) alone."""
    handler = _Handler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(replica) if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if not isinstance(h, _Handler)] + [handler]
    relay_level = logging.getLevelName(level.upper())
    root.setLevel(relay_level if relay_level <= logging.DEBUG else max(relay_level, LIBRARY_LEVEL))
    for name in PER_REQUEST_LOGGERS:
        logging.getLogger(name).setLevel(LIBRARY_LEVEL)
    _logger.handlers[:] = []
    _logger.setLevel(relay_level)
    _logger.propagate = True


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler configure() installs (and a later call replaces)."""


def install_hooks() -> None:
    """Uncaught exceptions (main thread, other threads, asyncio callbacks) as log records, so
    that they take the configured shape too (a command's `main`, not a library, calls this)."""

    def excepthook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        _logger.critical("uncaught_exception", exc_info=(kind, exc, tb), extra={"fields": {}})

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is None or args.exc_type is SystemExit:
            return
        _logger.critical(
            "uncaught_exception",
            exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
            extra={"fields": {"thread": args.thread.name if args.thread else None}},
        )

    sys.excepthook = excepthook
    threading.excepthook = thread_hook
    logging.captureWarnings(True)


def enabled(level: int) -> bool:
    """Whether a line at `level` is written: callers on the hot path skip building it."""
    return _logger.isEnabledFor(level)


# The fields `bound` puts on every line of the current context (none by default).
_BOUND: ContextVar[dict[str, Any] | None] = ContextVar("relay_log_fields", default=None)


@contextmanager
def bound(**fields: Any) -> Iterator[None]:
    """`fields` on every line logged in the block, and in the tasks started from it; they go
    first, before each line's own."""
    token = _BOUND.set({**(_BOUND.get() or {}), **fields})
    try:
        yield
    finally:
        _BOUND.reset(token)


def log(event: str, level: int = logging.INFO, **fields: Any) -> None:
    if _logger.isEnabledFor(level):
        context = _BOUND.get()
        _logger.log(level, event, extra={"fields": {**context, **fields} if context else fields})


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
