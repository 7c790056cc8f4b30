"""Request body schemas of the API endpoints, for the OpenAPI document only.

The endpoints parse and check bodies themselves (:mod:`pdgate.gateway.validation`,
so every refusal is OpenAI error JSON); these models describe the accepted
shape in ``/openapi.json`` so clients and property-based fuzzers
(schemathesis) know what to send. Other vLLM sampling fields are accepted
too (see :mod:`pdgate.gateway.fields`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = Field(default=None, description="served model name")
    max_tokens: int | None = Field(default=None, ge=1, description="tokens to generate")
    stream: bool | None = Field(default=None, description="stream the answer as SSE")
    stream_options: dict[str, bool] | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, ge=0, le=1)
    n: int | None = Field(default=None, ge=1, le=1, description="must be 1 (P/D handoff per request)")
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    priority: int | None = None
    slo_class: str | None = Field(default=None, description="gateway SLO class (not forwarded)")


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="text, token ids, or a one-element list of either")


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]] = Field(min_length=1, description="chat messages with role and content")
    max_completion_tokens: int | None = Field(default=None, ge=1)


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` declaring ``model`` as the required JSON request body."""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": model.model_json_schema()}}}}
