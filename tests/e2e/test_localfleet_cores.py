"""The local fleet gives each instance's model worker a core of its own.

vLLM's NixlConnector pins every CPU worker to the host's last core; without
the re-pin the prefill and decode workers of a 1P1D fleet share one core
(latencies 10-100x the isolated ones, see bench/results/goodput_fidelity.md).
"""

from __future__ import annotations

import os

import pytest

from pdgate.localfleet import LocalFleet, VllmServer


def worker_affinities(server: VllmServer) -> list[set[int]]:
    """CPU sets of every thread of the server's model-runner processes."""
    return [set(os.sched_getaffinity(t)) for t in server.model_worker_threads()]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to spread over")
def test_prefill_and_decode_workers_compute_on_different_cores(vllm_fleet: LocalFleet) -> None:
    pre = worker_affinities(vllm_fleet.prefill[0])
    dec = worker_affinities(vllm_fleet.decode[0])
    assert pre and dec, "no model worker process found"
    assert all(len(a) == 1 for a in pre + dec), (pre, dec)
    assert {min(a) for a in pre} != {min(a) for a in dec}
    assert len({min(a) for a in pre}) == 1 and len({min(a) for a in dec}) == 1
