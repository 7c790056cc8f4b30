"""Round robin: each leg goes to the next candidate in turn."""

from __future__ import annotations

import itertools
import threading
from typing import Sequence

from pdgate.fleet import Instance
from pdgate.policies.base import RequestInfo
from pdgate.policies.registry import register


@register("round_robin")
class RoundRobinPolicy:
    """Cycle through the candidates; state is a single counter.

    With a changing candidate list (an instance marked unhealthy) the counter
    keeps advancing, so load still spreads over whatever is left.
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def select(self, candidates: Sequence[Instance], request: RequestInfo) -> Instance:
        if not candidates:
            raise ValueError("no candidate instances")
        with self._lock:
            n = next(self._counter)
        return candidates[n % len(candidates)]
