"""Typed gateway configuration (pydantic).

A config comes from, lowest precedence first: defaults, a YAML/JSON file
(``pdgate serve --config FILE``), command-line flags. :func:`load_config`
merges them and validates the result.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Role = Literal["prefill", "decode", "both"]


class InstanceConfig(BaseModel):
    """One vLLM instance behind the gateway.

    Attributes:
        url: base URL, e.g. ``http://10.0.0.5:8000`` (no trailing ``/v1``).
        role: ``prefill``, ``decode`` or ``both``.
    """

    model_config = ConfigDict(extra="forbid")

    url: str
    role: Role

    @field_validator("url")
    @classmethod
    def _normalize_url(cls, v: str) -> str:
        v = v.strip().rstrip("/")
        if v.endswith("/v1"):
            v = v[: -len("/v1")]
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"instance URL must start with http:// or https://: {v!r}")
        return v


class TimeoutsConfig(BaseModel):
    """Timeouts in seconds for the legs of a request.

    Attributes:
        connect_s: TCP connect to an instance.
        prefill_s: whole prefill leg (prompt processing + KV handoff answer);
            past it the request falls back to decode-only.
        decode_first_byte_s: from sending the decode leg to its response headers.
        decode_idle_s: longest gap between two chunks of a decode stream.
    """

    model_config = ConfigDict(extra="forbid")

    connect_s: float = Field(default=5.0, gt=0)
    prefill_s: float = Field(default=600.0, gt=0)
    decode_first_byte_s: float = Field(default=600.0, gt=0)
    decode_idle_s: float = Field(default=300.0, gt=0)


class GatewayConfig(BaseModel):
    """The whole gateway configuration.

    Attributes:
        prefill: prefill instance URLs.
        decode: decode instance URLs (at least one).
        host / port: where the gateway listens.
        prefill_policy / decode_policy: routing policy names from
            :mod:`pdgate.policies` (default ``round_robin``).
        timeouts: per-leg timeouts.
        max_body_bytes: request bodies above this are refused with 413.
        metrics_interval_s: how often fleet ``/metrics`` are scraped (seconds).
    """

    model_config = ConfigDict(extra="forbid")

    prefill: list[str] = Field(default_factory=list)
    decode: list[str] = Field(default_factory=list)
    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=0, le=65535)
    prefill_policy: str = "round_robin"
    decode_policy: str = "round_robin"
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("prefill", "decode")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        return [InstanceConfig(url=u, role="both").url for u in v]

    @model_validator(mode="after")
    def _need_decode(self) -> "GatewayConfig":
        if not self.decode:
            raise ValueError("at least one decode instance is required (--decode URL)")
        from pdgate.policies import available_policies

        for name in (self.prefill_policy, self.decode_policy):
            if name not in available_policies():
                raise ValueError(f"unknown policy {name!r}; available: {sorted(available_policies())}")
        return self

    def instances(self) -> list[InstanceConfig]:
        """All instances with their roles, prefill first."""
        return [InstanceConfig(url=u, role="prefill") for u in self.prefill] + [
            InstanceConfig(url=u, role="decode") for u in self.decode
        ]


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``) or JSON config file into a dict.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file does not hold a mapping.
    """
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    return data


def load_config(file: str | Path | None = None, **overrides: Any) -> GatewayConfig:
    """Build a :class:`GatewayConfig` from a file plus overrides (flags win).

    ``None`` overrides are ignored, so unset CLI flags keep the file's values.

    Raises:
        pydantic.ValidationError: the merged config is invalid.
    """
    data: dict[str, Any] = read_config_file(file) if file else {}
    data.update({k: v for k, v in overrides.items() if v is not None})
    return GatewayConfig.model_validate(data)
