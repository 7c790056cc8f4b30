"""Short soak (CI version of ``bench/soak.py``, ~75 s): steady load plus
Azure-code-trace bursts through a real ``pdgate serve`` process in front of a
simulated fleet. Nothing may be lost, nothing may answer 5xx, the gateway
must drain and exit 0, and its open file descriptors and RSS must not grow
(per burst-period window means after warm-up)."""

from __future__ import annotations

from pathlib import Path

from pdgate.bench.soak import SoakConfig, run_soak

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "azure2023_code.csv"


def test_short_soak_loses_nothing() -> None:
    cfg = SoakConfig(duration_s=75, rate_rps=3.0, burst_every_s=15, burst_window_s=6, burst_keep=0.3,
                     warmup_s=15, window_s=15, trace=str(TRACE), request_timeout_s=60)
    res = run_soak(cfg)
    assert res["requests"] > 300
    assert res["lost"] == 0, res["lost_examples"]
    assert res["status_5xx"] == 0, res["errors_by_status"]
    assert res["ok"] == res["requests"], res["errors_by_status"]
    assert res["gateway_exit_code"] == 0
    # no growth after warm-up: a short run still fills pools and caches, so the
    # CI bound is looser than the 10-minute run's 5% (bench/results/soak.json);
    # fds are compared by their floor (fewest connections open), which load
    # alone does not raise
    assert res["open_fds"]["floor_growth_pct"] <= 15, res["open_fds"]
    assert res["rss_bytes"]["growth_pct"] <= 15, res["rss_bytes"]
    p99 = [w["p99_ms"] for w in res["added_latency_windows"] if w["p99_ms"] is not None]
    assert p99 and max(p99) < 1000, res["added_latency_windows"]
