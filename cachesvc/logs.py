"""Log lines: one per event, as text or JSON, each tagged with the request id of the call that caused it.

A client gives every call an id (`REQUEST_ID_METADATA`); `RpcMetrics`, the
first interceptor of both services, holds it in `request_id` while the call's
handler runs, so every line the handler logs names it, and logs each failed
call once. Background work (write-back, prefetch, Raft) logs without one.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from contextvars import ContextVar
from datetime import UTC, datetime

from cacheclient.wire.names import MAX_REQUEST_ID_CHARS, REQUEST_ID_METADATA

__all__ = ["TEXT_LOG_FORMAT", "JsonLogFormatter", "TextLogFormatter", "configure", "request_id", "request_id_of"]

TEXT_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

request_id: ContextVar[str] = ContextVar("request_id", default="")
"""The request id of the call this thread is serving ("" outside a call, or when the caller sent none)."""

_REQUEST_ID = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_REQUEST_ID_CHARS}}}")


def request_id_of(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The request id in a call's metadata; "" when absent, too long or not made of [A-Za-z0-9._-]
    (a caller cannot put arbitrary text, a newline say, into the logs)."""
    for name, value in metadata or ():
        if name == REQUEST_ID_METADATA and isinstance(value, str) and _REQUEST_ID.fullmatch(value):
            return value
    return ""


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record, on one line: time (UTC, ISO 8601), level, logger, message,
    the request id when there is one, and the exception."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", "")
        if rid:
            doc["request_id"] = rid
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc)


class TextLogFormatter(logging.Formatter):
    """`TEXT_LOG_FORMAT`, with " [request ID]" after the message when there is one."""

    def __init__(self) -> None:
        super().__init__(TEXT_LOG_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        rid = getattr(record, "request_id", "")
        return f"{line} [request {rid}]" if rid else line


def configure(level: str, log_format: str) -> None:
    """Logs to stderr at `level`, as "text" or "json" lines, every line tagged with its request id."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter() if log_format == "json" else TextLogFormatter())
    handler.addFilter(_RequestIdFilter())
    logging.basicConfig(level=level.upper(), handlers=[handler])
