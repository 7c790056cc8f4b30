"""The routing policy interfaces.

Three kinds of policy, each registered by name (see :mod:`pdgate.policies`):

- **instance** policies pick one instance out of candidates for one leg
  (``select``), chosen per role in the config (``prefill_policy``,
  ``decode_policy``), like vllm-router's prefill/decode policies;
- **route** policies decide the shape of a request (``decide``): P/D through a
  prefill and a decode instance, deflected (the decode instance computes the
  prompt itself), or decode-only; they compose the instance policies;
- **admission** policies gate prefill legs through the Rust admission queue
  (``ticket``: which lanes, which priority), e.g. request-parallel prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, Sequence

from pdgate.fleet import Fleet, Instance

if TYPE_CHECKING:
    from pdgate.config import GatewayConfig, SloClass
    from pdgate.predictor import LatencyPredictor

RouteKind = Literal["pd", "deflect", "decode_only"]


@dataclass
class RequestInfo:
    """What a policy may know about a request.

    Attributes:
        request_id: the ``X-Request-Id`` used on both legs.
        endpoint: ``completions`` or ``chat/completions``.
        body: the client's JSON body (read-only by convention).
        prompt_tokens: prompt length in tokens when known, else ``None``.
        priority: priority class (lower = more urgent), from the body's
            ``priority`` or the priority header.
        slo_class: SLO class name; ``ttft_slo_s`` / ``tpot_slo_s`` its targets.
        doomed: the route policy predicts it misses its SLO whatever it does
            (set after the decision; the ``deadline`` admission defers it).
    """

    request_id: str
    endpoint: str
    body: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: int | None = None
    priority: int = 0
    slo_class: str = "default"
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    doomed: bool = False

    @property
    def output_tokens(self) -> int | None:
        """``max_tokens`` (or ``max_completion_tokens``) when the request states it."""
        v = self.body.get("max_completion_tokens") or self.body.get("max_tokens")
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    @property
    def tokens(self) -> int:
        """Prompt tokens, 1 when unknown."""
        return self.prompt_tokens if self.prompt_tokens is not None else 1


@dataclass
class RouteDecision:
    """How one request is served.

    Attributes:
        kind: ``pd`` (prefill leg then decode leg), ``deflect`` (the decode
            instance prefills the prompt itself, no KV transfer) or
            ``decode_only`` (no prefill instance available).
        prefill: the prefill instance (``pd`` only).
        decode: the decode instance, or ``None`` to let the decode policy
            pick when the decode leg starts.
        decode_candidates: where the decode policy may pick (``None``: every
            decode instance).
        choice: label for ``pdgate_route_decisions_total{choice}``.
        predicted: predicted values behind the decision (seconds), for logs
            and the predictor's error metric.
    """

    kind: RouteKind
    prefill: Instance | None = None
    decode: Instance | None = None
    decode_candidates: list[Instance] | None = None
    choice: str = ""
    predicted: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.choice:
            self.choice = self.kind


@dataclass
class RouteContext:
    """What route policies compose: the fleet, per-role policies, the predictor."""

    fleet: Fleet
    prefill_policy: "InstancePolicy"
    decode_policy: "InstancePolicy"
    predictor: "LatencyPredictor"
    config: "GatewayConfig"

    def slo_of(self, name: str) -> "SloClass":
        slo = self.config.slo
        return slo.classes.get(name) or slo.classes[slo.default]


class InstancePolicy(Protocol):
    """Chooses an instance for one leg of a request."""

    name: str
    kind: str  # "instance"

    def select(self, candidates: Sequence[Instance], request: RequestInfo) -> Instance:
        """Return one of ``candidates`` (non-empty) for ``request``.

        Raises:
            ValueError: ``candidates`` is empty.
        """
        ...


#: Backwards-compatible name of :class:`InstancePolicy`.
RoutingPolicy = InstancePolicy


class RoutePolicy(Protocol):
    """Decides how a request is served."""

    name: str
    kind: str  # "route"

    def decide(self, ctx: RouteContext, request: RequestInfo) -> RouteDecision:
        ...


@dataclass
class AdmissionTicket:
    """Lanes (``(name, limit)``) and priority of a gated prefill leg."""

    lanes: list[tuple[str, int]]
    priority: int = 0


class AdmissionPolicy(Protocol):
    """Gates prefill legs through the admission queue."""

    name: str
    kind: str  # "admission"
    aging_rate: float
    max_wait_s: float | None

    def ticket(self, request: RequestInfo, prefill: Instance) -> AdmissionTicket | None:
        """The ticket for ``request`` on ``prefill``, or ``None`` to dispatch at once."""
        ...


def need_candidates(candidates: Sequence[Instance]) -> None:
    if not candidates:
        raise ValueError("no candidate instances")
