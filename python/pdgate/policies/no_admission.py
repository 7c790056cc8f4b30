"""``none`` admission: prefill legs are dispatched at once."""

from __future__ import annotations

from typing import Any

from pdgate.fleet import Instance
from pdgate.policies.base import RequestInfo
from pdgate.policies.registry import register


@register("none")
class NoAdmission:
    name = "none"
    kind = "admission"
    aging_rate = 0.0
    max_wait_s: float | None = None

    def __init__(self, config: Any = None) -> None:
        pass

    def ticket(self, request: RequestInfo, prefill: Instance) -> None:
        return None
