"""The local fleet gives each instance's model worker a core of its own.

vLLM's NixlConnector pins every CPU worker to the host's last core; without
the re-pin the prefill and decode workers of a 1P1D fleet share one core
(latencies 10-100x the isolated ones, see bench/results/goodput_fidelity.md).
"""

from __future__ import annotations

import os

import psutil  # type: ignore[import-untyped]
import pytest

from pdgate.localfleet import LocalFleet


def worker_affinities(server_pid: int) -> list[set[int]]:
    """CPU sets of every thread of the model-runner processes under ``server_pid``."""
    out = []
    for child in psutil.Process(server_pid).children(recursive=True):
        if "Worker" in child.name():
            out.extend(set(os.sched_getaffinity(t.id)) for t in child.threads())
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to spread over")
def test_prefill_and_decode_workers_compute_on_different_cores(vllm_fleet: LocalFleet) -> None:
    pre = worker_affinities(vllm_fleet.prefill[0].proc.pid)  # type: ignore[union-attr]
    dec = worker_affinities(vllm_fleet.decode[0].proc.pid)  # type: ignore[union-attr]
    assert pre and dec, "no model worker process found"
    assert all(len(a) == 1 for a in pre + dec), (pre, dec)
    assert {min(a) for a in pre} != {min(a) for a in dec}
    assert len({min(a) for a in pre}) == 1 and len({min(a) for a in dec}) == 1
