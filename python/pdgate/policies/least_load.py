"""Least load: the candidate with the fewest outstanding tokens.

Outstanding tokens = prompt tokens dispatched and not yet prefilled plus KV
tokens held by decoding requests (:meth:`pdgate.fleet.Instance.load_tokens`),
the gateway's own live counters. Ties go to fewer legs in flight, then to
the scraped queue length, then to the scraped running requests (both when
fresh: they include other gateway replicas' traffic, which this replica's
own counters never see), then in turn (round robin), so equal instances
share load.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from pdgate.fleet import Instance
from pdgate.policies.base import RequestInfo, need_candidates
from pdgate.policies.registry import register


def load_key(inst: Instance) -> tuple[int, int, int, int]:
    """Sort key: outstanding tokens, legs in flight, scraped waiting requests,
    scraped running requests (the last two: own counts when the scrape is stale)."""
    return (inst.load_tokens(), inst.in_flight, inst.waiting_requests(), inst.running_requests())


@register("least_load")
class LeastLoadPolicy:
    name = "least_load"
    kind = "instance"

    def __init__(self, config: Any = None) -> None:
        self._turn = itertools.count()

    def select(self, candidates: Sequence[Instance], request: RequestInfo) -> Instance:
        need_candidates(candidates)
        k = next(self._turn) % len(candidates)
        rotated = list(candidates[k:]) + list(candidates[:k])
        return min(rotated, key=load_key)
