"""OpenAI-style error responses.

The body shape is the one OpenAI and vLLM's OpenAI server return:
``{"error": {"message": str, "type": str, "param": str | None, "code": int}}``.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    431: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class GatewayError(Exception):
    """An error with an HTTP status that the gateway turns into error JSON.

    Args:
        status: HTTP status code (4xx for the client's fault, 5xx otherwise).
        message: human-readable text for the client.
        param: the offending request field, if any.
        reason: label for ``pdgate_rejected_requests_total{reason}`` when the
            request is refused before reaching an instance.
        headers: extra response headers (e.g. ``Retry-After``).
    """

    def __init__(self, status: int, message: str, param: str | None = None, *,
                 reason: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.reason = reason
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None) -> dict[str, object]:
    """The OpenAI error JSON for ``status`` (a dict ready to serialize)."""
    etype = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": etype, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """A ``JSONResponse`` carrying :func:`error_body`."""
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)
