"""The routing policy interface.

A policy picks one instance out of a list of candidates for one leg of a
request. Policies are registered by name (see :mod:`pdgate.policies`) and
chosen per role in the config (``prefill_policy``, ``decode_policy``), like
vllm-router's prefill/decode policies and llm-d's scheduler plugins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from pdgate.fleet import Instance


@dataclass
class RequestInfo:
    """What a policy may know about a request.

    Attributes:
        request_id: the ``X-Request-Id`` used on both legs.
        endpoint: ``completions`` or ``chat/completions``.
        body: the client's JSON body (read-only by convention).
        prompt_tokens: prompt length in tokens when known, else ``None``.
    """

    request_id: str
    endpoint: str
    body: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: int | None = None


class RoutingPolicy(Protocol):
    """Chooses an instance for one leg of a request."""

    name: str

    def select(self, candidates: Sequence[Instance], request: RequestInfo) -> Instance:
        """Return one of ``candidates`` (non-empty) for ``request``.

        Raises:
            ValueError: ``candidates`` is empty.
        """
        ...
