"""Routing policies: one per module, registered by name.

Instance policies (``prefill_policy`` / ``decode_policy``): ``round_robin``,
``least_load``, ``power_of_two``, ``prefix_aware``. Route policies
(``route_policy``): ``pd``, ``dedicated``, ``deflection``, ``goodput``,
``pooled`` (late binding).
Admission policies (``admission_policy``): ``none``, ``request_parallel``,
``priority``, ``deadline``. Importing this package registers them all.
"""

from pdgate.policies.base import (
    AdmissionTicket, RequestInfo, RouteContext, RouteDecision, RoutingPolicy,
)
from pdgate.policies.registry import available_policies, create_policy, register
from pdgate.policies import (  # noqa: F401  (registers)
    round_robin as _round_robin,
    least_load as _least_load,
    power_of_two as _power_of_two,
    prefix_aware as _prefix_aware,
    pd as _pd,
    dedicated as _dedicated,
    deflection as _deflection,
    goodput as _goodput,
    pooled as _pooled,
    no_admission as _no_admission,
    request_parallel as _request_parallel,
    priority as _priority,
    deadline as _deadline,
)

__all__ = ["AdmissionTicket", "RequestInfo", "RouteContext", "RouteDecision", "RoutingPolicy",
           "available_policies", "create_policy", "register"]
