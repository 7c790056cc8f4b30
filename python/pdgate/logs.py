"""Logging set-up: plain text or one JSON object per line, with the request id.

While the gateway handles a request, :data:`request_id_var` and
:data:`trace_id_var` hold its ``X-Request-Id`` and W3C trace id
(:mod:`pdgate.gateway.context` sets them for the request's whole task, which
includes uvicorn's access-log line). :class:`RequestContextFilter` copies
them onto every log record, so both formats carry them:

- ``text``: ``2026-11-29 18:00:00,123 INFO pdgate.proxy [req=abc trace=4bf9...]: message``
- ``json``: ``{"timestamp": "2026-11-29T18:00:00.123456+00:00", "level": "INFO",
  "logger": "pdgate.proxy", "message": "...", "request_id": "abc", "trace_id": "4bf9..."}``
  (plus ``exception`` with the traceback when there is one).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from contextvars import ContextVar
from typing import Literal

#: ``X-Request-Id`` of the request being handled in this context (None outside requests).
request_id_var: ContextVar[str | None] = ContextVar("pdgate_request_id", default=None)
#: W3C trace id (32 hex digits) of that request.
trace_id_var: ContextVar[str | None] = ContextVar("pdgate_trace_id", default=None)


class RequestContextFilter(logging.Filter):
    """Adds ``request_id`` and ``trace_id`` (``None`` outside a request) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        record.trace_id = trace_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: timestamp (ISO 8601, UTC), level, logger, message,
    request_id, trace_id, and exception (formatted traceback) when present."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "timestamp": dt.datetime.fromtimestamp(record.created, dt.timezone.utc).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
            "trace_id": getattr(record, "trace_id", None),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """``asctime level logger [req=... trace=...]: message``; the bracket only inside a request."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(ctx)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "request_id", None)
        record.ctx = f" [req={rid} trace={getattr(record, 'trace_id', None)}]" if rid else ""
        return super().format(record)


def configure_logging(level: str = "info", fmt: Literal["text", "json"] = "text") -> logging.Handler:
    """Route all logging (pdgate, uvicorn, uvicorn.access) to one stderr handler.

    Replaces the root logger's handlers; uvicorn's own loggers lose theirs and
    propagate to the root, so run uvicorn with ``log_config=None``.

    Returns:
        The installed handler.
    """
    handler = logging.StreamHandler()
    handler.addFilter(RequestContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
        lg.setLevel(logging.NOTSET)
    return handler
