"""Checks on client requests before anything reaches an instance.

The gateway refuses (OpenAI error JSON, 4xx, never forwarded) what vLLM
would refuse anyway and what it must understand to route safely: malformed
JSON, wrong types or ranges of the fields it reads or rewrites, unknown
top-level fields (optional, :mod:`pdgate.gateway.fields`), ``n`` > 1 and
batched prompts (one P/D handoff per request), ``max_tokens`` past the
model's context. Status codes follow vLLM's OpenAI server: 400 for a bad
request, 404 for an unknown model (checked in :mod:`pdgate.gateway.catalog`).
"""

from __future__ import annotations

import json
import math
import re
import uuid
from typing import Any

from pdgate.config import LimitsConfig
from pdgate.gateway.errors import GatewayError
from pdgate.gateway.fields import ALLOWED_FIELDS

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_MAX_TOKEN_ID = (1 << 31) - 1


def request_id_from_header(value: str | None) -> str:
    """Use the client's ``X-Request-Id`` if it is a safe token, else a new one.

    A safe id is 1-128 characters of ``[A-Za-z0-9._:-]``, so it can never
    inject headers or log lines when forwarded to both legs.
    """
    if value and _REQUEST_ID_RE.match(value):
        return value
    return uuid.uuid4().hex


def _bad(message: str, param: str | None = None, reason: str = "invalid_field") -> GatewayError:
    return GatewayError(400, message, param, reason=reason)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_body(raw: bytes) -> dict[str, Any]:
    """Parse a JSON object body.

    Raises:
        GatewayError(400): not UTF-8 (or a lone surrogate escape), not JSON
            (``NaN``/``Infinity`` included, nesting too deep, integers too
            long), or not a JSON object.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad("request body is not valid UTF-8", reason="invalid_utf8") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise _bad(f"request body is not valid JSON: {e.msg} at position {e.pos}",
                   reason="invalid_json") from None
    except (ValueError, RecursionError) as e:
        raise _bad(f"request body is not valid JSON: {str(e)[:200]}", reason="invalid_json") from None
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", reason="invalid_json")
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise _bad("request body holds a lone UTF-16 surrogate (invalid Unicode)",
                       reason="invalid_utf8") from None
    return body


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and (not isinstance(v, float) or math.isfinite(v)))


def _check_int(body: dict[str, Any], name: str, minimum: int, maximum: int | None = None) -> None:
    v = body.get(name)
    if v is None:
        return
    if not _is_int(v):
        raise _bad(f"'{name}' must be an integer", name)
    if v < minimum:
        raise _bad(f"'{name}' must be >= {minimum}, got {v}", name)
    if maximum is not None and v > maximum:
        raise _bad(f"'{name}' must be <= {maximum}, got {v}", name)


def _check_num(body: dict[str, Any], name: str, lo: float, hi: float | None = None) -> None:
    v = body.get(name)
    if v is None:
        return
    if not _is_num(v):
        raise _bad(f"'{name}' must be a number", name)
    if v < lo or (hi is not None and v > hi):
        raise _bad(f"'{name}' must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}", name)


def _token_ids_ok(ids: list[Any]) -> bool:
    return bool(ids) and all(_is_int(t) and 0 <= t <= _MAX_TOKEN_ID for t in ids)


def _check_prompt(prompt: Any) -> None:
    if prompt is None:
        raise _bad("'prompt' is required", "prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("'prompt' must not be empty", "prompt")
        return
    if not isinstance(prompt, list) or not prompt:
        raise _bad("'prompt' must be a non-empty string, list of token ids, or a one-element list of those",
                   "prompt")
    if all(_is_int(t) for t in prompt):
        if not _token_ids_ok(prompt):
            raise _bad(f"token ids in 'prompt' must be in [0, {_MAX_TOKEN_ID}]", "prompt")
        return
    if len(prompt) > 1:
        raise _bad("batched prompts (several prompts in one request) are not supported through the "
                   "P/D gateway; send one request per prompt", "prompt")
    _check_prompt(prompt[0] if isinstance(prompt[0], str) or (
        isinstance(prompt[0], list) and all(_is_int(t) for t in prompt[0])) else object())


def _check_messages(msgs: Any) -> None:
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list", "messages")
    for m in msgs:
        if not isinstance(m, dict):
            raise _bad("each message must be an object", "messages")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise _bad("each message needs a 'role' string", "messages")
        c = m.get("content")
        if c is not None and not isinstance(c, (str, list)):
            raise _bad("message 'content' must be a string, a list of parts, or null", "messages")
        if isinstance(c, list) and not all(isinstance(p, dict) for p in c):
            raise _bad("message content parts must be objects", "messages")


def validate_request(endpoint: str, body: dict[str, Any], limits: LimitsConfig | None = None) -> None:
    """Validate a parsed request body (see module doc).

    Args:
        endpoint: ``completions`` or ``chat/completions``.
        body: parsed JSON object.
        limits: input limits (``max_tokens_cap``, ``reject_unknown_fields``);
            defaults apply when ``None``.

    Raises:
        GatewayError(400): a missing, unknown, mistyped or out-of-range field.
    """
    limits = limits or LimitsConfig()
    if limits.reject_unknown_fields:
        allowed = ALLOWED_FIELDS[endpoint]
        for k in body:
            if k not in allowed:
                raise _bad(f"unknown field '{k[:100]}'", k[:100], reason="unknown_field")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise _bad("'model' must be a non-empty string", "model")
    if endpoint == "completions":
        _check_prompt(body.get("prompt"))
        if body.get("prompt_embeds") is not None:
            raise _bad("'prompt_embeds' is not supported through the P/D gateway", "prompt_embeds")
    else:
        _check_messages(body.get("messages"))
    for flag in ("stream", "ignore_eos", "echo", "return_token_ids"):
        if body.get(flag) is not None and not isinstance(body[flag], bool):
            raise _bad(f"'{flag}' must be a boolean", flag)
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        if so.get("include_usage") is not None and not isinstance(so["include_usage"], bool):
            raise _bad("'stream_options.include_usage' must be a boolean", "stream_options")
    cap = limits.max_tokens_cap
    _check_int(body, "max_tokens", 1, cap)
    _check_int(body, "max_completion_tokens", 1, cap)
    _check_int(body, "min_tokens", 0, cap)
    _check_int(body, "n", 1)
    if body.get("n") not in (None, 1):
        raise _bad("'n' > 1 is not supported through the P/D gateway", "n")
    _check_int(body, "best_of", 1)
    if body.get("best_of") not in (None, 1):
        raise _bad("'best_of' > 1 is not supported through the P/D gateway", "best_of")
    _check_num(body, "temperature", 0.0, 1e6)
    _check_num(body, "top_p", 0.0, 1.0)
    _check_num(body, "min_p", 0.0, 1.0)
    _check_num(body, "presence_penalty", -2.0, 2.0)
    _check_num(body, "frequency_penalty", -2.0, 2.0)
    _check_num(body, "repetition_penalty", 0.0, 1e6)
    _check_int(body, "top_k", -1)
    _check_int(body, "seed", -(1 << 63), (1 << 64) - 1)
    _check_int(body, "priority", -(1 << 31), (1 << 31) - 1)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _bad("'stop' must be a string or a list of strings", "stop")
    st = body.get("stop_token_ids")
    if st is not None and not (isinstance(st, list) and all(_is_int(t) for t in st)):
        raise _bad("'stop_token_ids' must be a list of integers", "stop_token_ids")
    slo = body.get("slo_class")
    if slo is not None and not isinstance(slo, str):
        raise _bad("'slo_class' must be a string", "slo_class")


def check_context(prompt_tokens: int, body: dict[str, Any], max_model_len: int | None) -> None:
    """Refuse a request that cannot fit the model's context (vLLM's 400).

    Args:
        prompt_tokens: exact prompt length in tokens.
        body: the validated body (``max_tokens`` / ``max_completion_tokens``).
        max_model_len: the model's context length in tokens (``None``: unknown, no check).

    Raises:
        GatewayError(400): prompt plus requested output over ``max_model_len``.
    """
    if max_model_len is None:
        return
    out = body.get("max_completion_tokens") or body.get("max_tokens") or 1
    if prompt_tokens + out > max_model_len:
        raise GatewayError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                           f"requested {prompt_tokens + out} tokens ({prompt_tokens} in the prompt, {out} "
                           "in the completion). Please reduce the length of the prompt or the completion.",
                           "max_tokens" if prompt_tokens < max_model_len else "prompt",
                           reason="context_length")
