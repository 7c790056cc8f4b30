"""Round robin: each leg goes to the next candidate in turn."""

from __future__ import annotations

import itertools
import threading
from typing import Any, Sequence

from pdgate.fleet import Instance
from pdgate.policies.base import RequestInfo, need_candidates
from pdgate.policies.registry import register


@register("round_robin")
class RoundRobinPolicy:
    """Cycle through the candidates; state is a single counter.

    With a changing candidate list (an instance marked unhealthy) the counter
    keeps advancing, so load still spreads over whatever is left.
    """

    name = "round_robin"
    kind = "instance"

    def __init__(self, config: Any = None) -> None:
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def select(self, candidates: Sequence[Instance], request: RequestInfo) -> Instance:
        need_candidates(candidates)
        with self._lock:
            n = next(self._counter)
        return candidates[n % len(candidates)]
