"""How the local fleet splits CPU cores between prefill and decode instances.

A KV pull needs both ends to make progress: with a prefill and a decode
worker pinned to one core, NixlConnector pulls stalled for minutes (1 prefill
+ 2 decode on 2 cores). ``split_cores`` must never put the two roles on one
core when there are at least two.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pdgate.localfleet import split_cores


def test_enough_cores_gives_each_instance_its_own() -> None:
    assert split_cores([0, 1, 2, 3], 1, 2) == ([0], [1, 2])
    assert split_cores([0, 1], 1, 1) == ([0], [1])


def test_more_instances_than_cores_keeps_roles_apart() -> None:
    assert split_cores([0, 1], 1, 2) == ([0], [1])
    assert split_cores([0, 1], 2, 2) == ([0], [1])
    assert split_cores([0, 1, 2, 3], 1, 6) == ([0], [1, 2, 3])
    assert split_cores([0, 1, 2, 3], 6, 1) == ([0, 1, 2], [3])


def test_one_role_or_one_core() -> None:
    assert split_cores([0, 1], 0, 3) == ([], [0, 1])
    assert split_cores([0, 1], 3, 0) == ([0, 1], [])
    assert split_cores([5], 1, 2) == ([5], [5])
    assert split_cores([], 1, 1) == ([], [])


@given(n_cpus=st.integers(1, 16), n_prefill=st.integers(0, 12), n_decode=st.integers(0, 12))
def test_split_properties(n_cpus: int, n_prefill: int, n_decode: int) -> None:
    cpus = list(range(10, 10 + n_cpus))
    pre, dec = split_cores(cpus, n_prefill, n_decode)
    assert set(pre) <= set(cpus) and set(dec) <= set(cpus)
    assert bool(pre) == (n_prefill > 0) and bool(dec) == (n_decode > 0)
    if n_prefill and n_decode and n_cpus >= 2:
        assert not set(pre) & set(dec), (pre, dec)
    if n_prefill + n_decode <= n_cpus:
        # one core per instance, none shared
        assert len(pre) == n_prefill and len(dec) == n_decode
        assert len(set(pre) | set(dec)) == n_prefill + n_decode


class StubServer:
    def __init__(self, url: str) -> None:
        self.url = url
        self.pinned: set[int] | None = None

    def pin_model_workers(self, cpus: set[int]) -> int:
        self.pinned = cpus
        return 1


def test_spread_over_cores_pins_by_the_split(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdgate.localfleet import LocalFleet

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    fleet = LocalFleet(1, 2, log_dir=None)
    fleet.prefill = [StubServer("p0")]  # type: ignore[list-item]
    fleet.decode = [StubServer("d0"), StubServer("d1")]  # type: ignore[list-item]
    assert fleet.spread_over_cores() == {"p0": 0, "d0": 1, "d1": 1}
    fleet.prefill = [StubServer("p0"), StubServer("p1")]  # type: ignore[list-item]
    fleet.decode = [StubServer("d0")]  # type: ignore[list-item]
    assert fleet.spread_over_cores() == {"p0": 0, "p1": 0, "d0": 1}


def test_free_port_stays_below_the_ephemeral_range_and_never_repeats() -> None:
    """Ports handed out for later binding come from below the kernel's
    ephemeral range (no other process's bind(0) can take them meanwhile)."""
    from pdgate.localfleet.vllm_server import _ephemeral_low, free_port

    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == 300
    low = _ephemeral_low()
    if low - max(1024, low - 12000) >= 1000:
        assert all(max(1024, low - 12000) <= p < low for p in ports)
