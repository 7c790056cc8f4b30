"""Routing policies: one per module, registered by name.

Importing this package registers the built-in policies.
"""

from pdgate.policies.base import RequestInfo, RoutingPolicy
from pdgate.policies.registry import available_policies, create_policy, register
from pdgate.policies import round_robin as _round_robin  # noqa: F401  (registers)

__all__ = ["RequestInfo", "RoutingPolicy", "available_policies", "create_policy", "register"]
