"""Fixtures for the simulator tier: simulated fleets in a background thread."""

from __future__ import annotations

from typing import Iterator

import pytest

from pdgate.sim import SimFleet
from pdgate.sim.profiles import Profile

#: A fast, simple profile: 5 ms steps, 0.1 ms per prompt token, 2 ms per decode sequence.
FAST = Profile(name="test-fast", num_gpu_blocks=4096, max_num_seqs=64, max_num_batched_tokens=2048,
               max_model_len=8192, step_base_s=0.005, prefill_token_s=1e-4, prefill_attn_s=0.0,
               decode_seq_s=1e-4, decode_kv_token_s=0.0, kv_bytes_per_token=1000,
               kv_transfer_bandwidth_Bps=1e7, kv_transfer_latency_s=0.01, request_overhead_s=0.0,
               vocab_size=1000, sources=("test",))


@pytest.fixture(scope="module")
def pd_fleet() -> Iterator[SimFleet]:
    """1 prefill + 1 decode + 1 aggregated instance, real time."""
    with SimFleet(1, 1, 1, profile=FAST, time_scale=1.0) as f:
        yield f
