"""vLLM-style serving metrics on small hand-computed examples.

Expected values below were worked out by hand from the definitions in
vllm/benchmarks/serve.py (calculate_metrics); numpy.percentile interpolates
linearly: p-th percentile of sorted x[0..n-1] sits at rank p/100*(n-1).
"""

from __future__ import annotations

import math

import pytest

from pdgate.bench.metrics import (
    RequestRecord,
    compute_metrics,
    format_metrics_table,
    meets_slos,
    parse_slo,
    parse_slos,
)


def _records():
    a = RequestRecord(index=0, send_s=0.0, chunk_times_s=[0.1, 0.3, 0.6], usage_output_tokens=3,
                      prompt_tokens=10, server_prompt_tokens=11, success=True, status=200)
    b = RequestRecord(index=1, send_s=1.0, chunk_times_s=[1.2, 1.3], usage_output_tokens=5,
                      prompt_tokens=20, success=True, status=200)
    c = RequestRecord(index=2, send_s=1.5, prompt_tokens=30, success=False, status=500, error="HTTP 500: boom")
    d = RequestRecord(index=3, send_s=1.6, chunk_times_s=[1.64], usage_output_tokens=1,
                      prompt_tokens=40, success=True, status=200)
    return [a, b, c, d]


def test_per_request_definitions():
    a, b, c, d = _records()
    # A: TTFT 0.1, E2EL 0.6, ITL [0.2, 0.3], TPOT (0.6-0.1)/(3-1) = 0.25
    assert a.ttft_s == pytest.approx(0.1) and a.e2el_s == pytest.approx(0.6)
    assert a.itl_s == pytest.approx([0.2, 0.3]) and a.tpot_s == pytest.approx(0.25)
    # B: 5 tokens in 2 chunks (bundled): TPOT uses usage tokens: (0.3-0.2)/4 = 0.025
    assert b.tpot_s == pytest.approx(0.025) and b.itl_s == pytest.approx([0.1])
    # D: one token, no TPOT; C: failed, no TTFT
    assert d.tpot_s is None and d.itl_s == []
    assert c.ttft_s is None and c.e2el_s is None
    # Without usage the output count falls back to the number of chunks.
    e = RequestRecord(send_s=0.0, chunk_times_s=[0.1, 0.2, 0.3, 0.4], success=True)
    assert e.output_tokens == 4 and e.tpot_s == pytest.approx(0.1)


def test_aggregates():
    m = compute_metrics(_records(), duration_s=2.0)
    assert (m.total, m.completed, m.failed) == (4, 3, 1)
    assert m.total_output_tokens == 9  # 3 + 5 + 1
    assert m.total_input_tokens == 71  # 11 (server count) + 20 + 40; failed C excluded
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx(40.0)
    # TTFT sample [0.1, 0.2, 0.04] -> sorted [0.04, 0.1, 0.2]
    assert m.ttft.count == 3
    assert m.ttft.mean == pytest.approx(0.34 / 3)
    assert m.ttft.median == pytest.approx(0.1)
    assert m.ttft.percentiles[90.0] == pytest.approx(0.18)  # rank 1.8: 0.1 + 0.8*0.1
    assert m.ttft.max == pytest.approx(0.2)
    assert m.ttft.std == pytest.approx(math.sqrt((0.0733333**2 + 0.0133333**2 + 0.0866667**2) / 3), rel=1e-4)
    # TPOT sample [0.25, 0.025] (D has one token: excluded)
    assert m.tpot.count == 2
    assert m.tpot.mean == pytest.approx(0.1375)
    assert m.tpot.percentiles[90.0] == pytest.approx(0.2275)  # 0.025 + 0.9*0.225
    # ITL sample [0.2, 0.3, 0.1]
    assert m.itl.count == 3 and m.itl.mean == pytest.approx(0.2)
    assert m.itl.percentiles[50.0] == pytest.approx(0.2)
    assert m.itl.percentiles[99.0] == pytest.approx(0.298)  # rank 1.98
    # E2EL sample [0.6, 0.3, 0.04]
    assert m.e2el.mean == pytest.approx(0.94 / 3) and m.e2el.max == pytest.approx(0.6)
    assert m.errors == {"HTTP 500: boom": 1}
    assert m.request_goodput is None and m.slo_attainment is None


@pytest.mark.parametrize(
    "slos, good",
    [
        ({"ttft": 0.15}, 2),  # A (0.1) and D (0.04); B (0.2) misses; C failed
        ({"ttft": 0.15, "tpot": 0.1}, 1),  # A's TPOT 0.25 misses; D's TPOT counts as 0
        ({"e2el": 0.35}, 2),  # B (0.3) and D (0.04)
        ({"ttft": 10.0, "tpot": 10.0, "e2el": 10.0}, 3),  # every success; failed C never good
    ],
)
def test_goodput(slos, good):
    m = compute_metrics(_records(), duration_s=2.0, slos=slos)
    assert m.good == good
    assert m.request_goodput == pytest.approx(good / 2.0)
    assert m.slo_attainment == pytest.approx(good / 4)


def test_meets_slos_failed_request():
    c = _records()[2]
    assert not meets_slos(c, {"ttft": 100.0})


def test_empty_and_all_failed():
    m = compute_metrics([], duration_s=0.0, slos={"ttft": 1.0})
    assert m.total == 0 and m.request_throughput == 0.0 and m.ttft.mean == 0.0
    recs = [RequestRecord(send_s=0.0, error="x"), RequestRecord(send_s=0.1, error="x")]
    m = compute_metrics(recs, duration_s=1.0, slos={"ttft": 1.0})
    assert m.completed == 0 and m.failed == 2 and m.good == 0 and m.slo_attainment == 0.0
    assert m.errors == {"x": 2}


def test_send_lag():
    recs = [RequestRecord(scheduled_s=1.0, send_s=1.25), RequestRecord(scheduled_s=2.0, send_s=2.05)]
    m = compute_metrics(recs, duration_s=3.0)
    assert m.send_lag.max == pytest.approx(0.25) and m.send_lag.mean == pytest.approx(0.15)


def test_parse_slo_units():
    assert parse_slo("ttft:500") == ("ttft", pytest.approx(0.5))  # bare = ms (vLLM --goodput)
    assert parse_slo("ttft:0.5s") == ("ttft", pytest.approx(0.5))
    assert parse_slo("TPOT:50ms") == ("tpot", pytest.approx(0.05))
    assert parse_slo("e2el:20s") == ("e2el", pytest.approx(20.0))
    assert parse_slos(["ttft:500", "tpot:50"]) == {"ttft": pytest.approx(0.5), "tpot": pytest.approx(0.05)}
    for bad in ("itl:5", "ttft", "ttft:", "ttft:abc", "ttft:-1", "ttft:0"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_table_and_dict():
    m = compute_metrics(_records(), duration_s=2.0, slos={"ttft": 0.15})
    text = format_metrics_table(m)
    for word in ("TTFT", "TPOT", "ITL", "E2EL", "Request goodput", "HTTP 500: boom", "ttft<=150ms"):
        assert word in text
    d = m.to_dict()
    assert d["ttft"]["p90_ms"] == pytest.approx(180.0)
    assert d["request_goodput_rps"] == pytest.approx(1.0) and d["slos_ms"] == {"ttft": pytest.approx(150.0)}
    assert d["failed"] == 1 and d["errors"] == {"HTTP 500: boom": 1}
