"""Power of two choices: sample two candidates, take the less loaded.

Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing"
(IEEE TPDS 2001): with two random probes the maximum load drops
exponentially compared to one, at O(1) cost per decision. Load is the
outstanding-token count of :func:`pdgate.policies.least_load.load_key`.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

from pdgate.fleet import Instance
from pdgate.policies.base import RequestInfo, need_candidates
from pdgate.policies.least_load import load_key
from pdgate.policies.registry import register


@register("power_of_two")
class PowerOfTwoPolicy:
    name = "power_of_two"
    kind = "instance"

    def __init__(self, config: Any = None, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def select(self, candidates: Sequence[Instance], request: RequestInfo) -> Instance:
        need_candidates(candidates)
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(list(candidates), 2)
        return a if load_key(a) <= load_key(b) else b
