"""The fluid TTFT bound (``pdgate.bench.fluid``): exact small cases."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from pdgate.bench.fluid import fluid_ttft, main, mix_capacity, prefill_capacity


def test_fcfs_serves_in_arrival_order() -> None:
    assert np.allclose(fluid_ttft([0.0, 0.0], [100, 10], 10.0, "fcfs"), [10.0, 11.0])
    assert np.allclose(fluid_ttft([0.0, 1.0], [100, 10], 10.0, "fcfs"), [10.0, 10.0])


def test_srpt_preempts_for_a_shorter_remaining_prompt() -> None:
    assert np.allclose(fluid_ttft([0.0, 0.0], [100, 10], 10.0, "srpt"), [11.0, 1.0])
    # the long one has 90 tokens left when the short one arrives at t=1: the short goes first
    assert np.allclose(fluid_ttft([0.0, 1.0], [100, 10], 10.0, "srpt"), [11.0, 1.0])
    # idle gaps are not counted
    assert np.allclose(fluid_ttft([0.0, 50.0], [10, 10], 10.0, "srpt"), [1.0, 1.0])


def test_long_last_serves_longer_prompts_only_when_no_shorter_one_waits() -> None:
    # 100 tokens at t=0, then 10 at t=1: FCFS finishes 100 first; long_last (threshold 50) preempts it
    assert np.allclose(fluid_ttft([0.0, 1.0], [100, 10], 10.0, "fcfs"), [10.0, 10.0])
    assert np.allclose(fluid_ttft([0.0, 1.0], [100, 10], 10.0, "long_last", 50), [11.0, 1.0])
    # below the threshold it is FCFS (no preemption among the shorter)
    assert np.allclose(fluid_ttft([0.0, 1.0], [40, 10], 10.0, "long_last", 50), [4.0, 4.0])


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        fluid_ttft([0.0], [1], 0.0)
    with pytest.raises(ValueError):
        fluid_ttft([0.0], [1, 2], 1.0)
    with pytest.raises(ValueError):
        fluid_ttft([0.0], [1], 1.0, "lifo")


def test_prefill_capacity_from_the_step_model() -> None:
    prof = SimpleNamespace(max_num_batched_tokens=1000, step_base_s=0.01, prefill_token_s=1e-5,
                           decode_seq_s=1e-3)
    assert prefill_capacity(prof) == pytest.approx(1000 / 0.02)
    # 100 decodes take 100 tokens of the budget and 0.1 s of the step
    assert prefill_capacity(prof, 1000, 100) == pytest.approx(900 / (0.01 + 900e-5 + 0.1))


def test_mix_capacity_counts_attention_and_chunks() -> None:
    """Prompts that fill whole steps, no attention term: the full-budget figure. The attention
    term (chunk x context) and a long prompt's chunks lower it; decodes sharing the step too."""
    from pdgate.sim.profiles import load_profile

    prof = load_profile("a100-dsv2-lite").replace(prefill_attn_s=0.0, long_prefill_token_threshold=0)
    full = [prof.max_num_batched_tokens] * 4
    assert mix_capacity(prof, full) == pytest.approx(prefill_capacity(prof))
    with_attn = load_profile("a100-dsv2-lite")
    assert mix_capacity(with_attn, full) < prefill_capacity(with_attn)
    # a lone long prompt is not capped at long_prefill_token_threshold (vLLM 0.32): whole steps
    assert mix_capacity(prof, [3 * prof.max_num_batched_tokens]) == pytest.approx(prefill_capacity(prof))
    # on a decode instance: 32 decodes take 32 tokens of a 1024 budget and their share of the step
    dec = mix_capacity(prof, [992] * 8, 1024, 32)
    assert dec == pytest.approx(prefill_capacity(prof, 1024, 32), rel=1e-9)
    with pytest.raises(ValueError):
        mix_capacity(prof, [])


def test_cli_writes_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    out = tmp_path / "fluid.json"
    assert main(["--rates", "3", "--capacities", "57000", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {(r["capacity"], r["order"]): r for r in doc["rows"]}
    # more capacity never hurts, SRPT's p50 never exceeds FCFS's
    lo, hi = rows[("prefill instances", "fcfs")], rows[("prefill + decode instances", "fcfs")]
    assert hi["p95_s"] < lo["p95_s"]
    assert rows[("prefill instances", "srpt")]["p50_s"] <= lo["p50_s"]
    # SRPT is no P95 bound: on this burst, deferring the longest ~10% (FCFS for the rest) has a lower P95
    ll, srpt = rows[("given 57000", "long_last")], rows[("given 57000", "srpt")]
    assert ll["p95_s"] < srpt["p95_s"] and ll["long_percentile"] in (90, 92, 94, 95, 96, 97, 98, 99)
