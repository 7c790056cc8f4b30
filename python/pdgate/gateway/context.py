"""Per-request context: request id and W3C trace context (``traceparent``).

:class:`RequestContextMiddleware` (pure ASGI, so the context covers the whole
request task, uvicorn's access-log line included) sets, for every HTTP
request:

- the request id: the client's ``X-Request-Id`` if it is a safe token, else a
  new one (:func:`pdgate.gateway.validation.request_id_from_header`);
- the trace context: the client's ``traceparent`` if it is valid W3C Trace
  Context (version ``00``: ``00-<32 hex trace id>-<16 hex parent id>-<2 hex
  flags>``, ids not all zero), with its ``tracestate``; otherwise a new
  trace (random trace id and parent id, flags ``01`` = sampled) and no
  ``tracestate``.

The proxy sends that context to both legs (:func:`trace_headers`), so the
prefill and the decode request of one client request share a trace id, and
vLLM instances started with ``--otlp-traces-endpoint`` attach their spans to
it. The gateway forwards the context as is and records no spans of its own
(pass-through, as W3C allows for a participant that does not trace); the
trace id is on every log line of the request (:mod:`pdgate.logs`).
"""

from __future__ import annotations

import re
import secrets
from contextvars import ContextVar
from typing import Any, Awaitable, Callable, MutableMapping

from pdgate.gateway.validation import request_id_from_header
from pdgate.logs import request_id_var, trace_id_var

_TRACEPARENT_RE = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")

#: (traceparent, tracestate or None) of the request being handled.
trace_context_var: ContextVar[tuple[str, str | None] | None] = ContextVar("pdgate_trace_context",
                                                                           default=None)


def parse_traceparent(value: str | None) -> tuple[str, str, str] | None:
    """``(trace_id, parent_id, flags)`` of a valid ``traceparent`` header, else ``None``.

    Follows W3C Trace Context level 1: version ``ff`` and all-zero ids are
    invalid; version ``00`` allows nothing after the flags; later versions may
    append fields (ignored).
    """
    if not value:
        return None
    m = _TRACEPARENT_RE.match(value.strip().lower())
    if m is None:
        return None
    version, trace_id, parent_id, flags, rest = m.groups()
    if version == "ff" or trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    if version == "00" and rest:
        return None
    return trace_id, parent_id, flags


def new_traceparent() -> str:
    """A new sampled ``traceparent`` with random trace and parent ids."""
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


def trace_context_from_headers(traceparent: str | None, tracestate: str | None) -> tuple[str, str | None]:
    """The context to propagate: the client's if valid (normalized to version 00), else a new one."""
    parsed = parse_traceparent(traceparent)
    if parsed is None:
        return new_traceparent(), None
    trace_id, parent_id, flags = parsed
    return f"00-{trace_id}-{parent_id}-{flags}", (tracestate.strip() or None) if tracestate else None


def trace_headers(client_headers: dict[str, str] | None = None) -> dict[str, str]:
    """``traceparent`` (+ ``tracestate``) for the legs of the current request.

    Uses the context the middleware set; outside it (direct proxy use) derives
    one from ``client_headers`` (a new trace per call: call it once per request).
    """
    ctx = trace_context_var.get()
    if ctx is None:
        lower = {k.lower(): v for k, v in (client_headers or {}).items()}
        ctx = trace_context_from_headers(lower.get("traceparent"), lower.get("tracestate"))
    out = {"traceparent": ctx[0]}
    if ctx[1]:
        out["tracestate"] = ctx[1]
    return out


Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


class RequestContextMiddleware:
    """Sets :data:`pdgate.logs.request_id_var`, :data:`trace_id_var` and
    :data:`trace_context_var` for each HTTP request (see the module doc)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        ctx = trace_context_from_headers(headers.get("traceparent"), headers.get("tracestate"))
        tokens = (request_id_var.set(request_id_from_header(headers.get("x-request-id"))),
                  trace_id_var.set(ctx[0].split("-")[1]), trace_context_var.set(ctx))
        try:
            await self.app(scope, receive, send)
        finally:
            request_id_var.reset(tokens[0])
            trace_id_var.reset(tokens[1])
            trace_context_var.reset(tokens[2])
