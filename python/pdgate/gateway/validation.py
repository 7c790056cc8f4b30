"""Checks on client requests before anything reaches an instance.

The gateway validates only what it must understand to route safely (shape,
types of the fields it reads or rewrites); everything else is left to vLLM,
whose own 4xx answers are passed through unchanged.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from pdgate.gateway.errors import GatewayError

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id_from_header(value: str | None) -> str:
    """Use the client's ``X-Request-Id`` if it is a safe token, else a new one.

    A safe id is 1-128 characters of ``[A-Za-z0-9._:-]``, so it can never
    inject headers or log lines when forwarded to both legs.
    """
    if value and _REQUEST_ID_RE.match(value):
        return value
    return uuid.uuid4().hex


def parse_body(raw: bytes) -> dict[str, Any]:
    """Parse a JSON object body.

    Raises:
        GatewayError(400): not UTF-8, not JSON, or not a JSON object.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise GatewayError(400, "request body is not valid UTF-8") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise GatewayError(400, f"request body is not valid JSON: {e.msg} at position {e.pos}") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "request body must be a JSON object")
    return body


def _check_int(body: dict[str, Any], name: str, minimum: int) -> None:
    if name in body and body[name] is not None:
        v = body[name]
        if isinstance(v, bool) or not isinstance(v, int):
            raise GatewayError(400, f"'{name}' must be an integer", name)
        if v < minimum:
            raise GatewayError(400, f"'{name}' must be >= {minimum}, got {v}", name)


def validate_request(endpoint: str, body: dict[str, Any]) -> None:
    """Validate the fields the gateway reads or rewrites.

    Args:
        endpoint: ``completions`` or ``chat/completions``.
        body: parsed JSON object.

    Raises:
        GatewayError(400): a missing or mistyped field.
    """
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise GatewayError(400, "'model' must be a string", "model")
    if endpoint == "completions":
        prompt = body.get("prompt")
        if prompt is None:
            raise GatewayError(400, "'prompt' is required", "prompt")
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, (str, list)) and len(prompt) == 0):
            raise GatewayError(400, "'prompt' must be a non-empty string or list", "prompt")
    else:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise GatewayError(400, "'messages' must be a non-empty list", "messages")
        if not all(isinstance(m, dict) for m in msgs):
            raise GatewayError(400, "each message must be an object", "messages")
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        raise GatewayError(400, "'stream' must be a boolean", "stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise GatewayError(400, "'stream_options' must be an object", "stream_options")
    _check_int(body, "max_tokens", 1)
    _check_int(body, "max_completion_tokens", 1)
    _check_int(body, "n", 1)
    if body.get("n") not in (None, 1):
        raise GatewayError(400, "'n' > 1 is not supported through the P/D gateway", "n")
