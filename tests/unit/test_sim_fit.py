"""The fidelity check's calibration arithmetic: fitting step-time coefficients to
measurements, merging two calibrations, and measuring how far the host moved."""

from __future__ import annotations

import pytest

from pdgate.sim.fidelity import host_drift, merge_raw, profile_from
from pdgate.sim.fit import fit

TRUE = {"step_base_s": 0.012, "decode_seq_s": 0.001, "decode_kv_token_s": 2e-7,
        "prefill_token_s": 1e-4, "prefill_attn_s": 1e-8, "request_overhead_s": 0.003}


def synthetic(scale: float = 1.0) -> dict:
    """measure()-shaped points generated from TRUE (times x ``scale``: a slower host)."""
    t = TRUE
    prefill = []
    for n in (64, 512, 1024, 2048):
        lat = t["request_overhead_s"] + t["step_base_s"] + t["prefill_token_s"] * n + t["prefill_attn_s"] * n * n / 2
        prefill.append({"n": n, "latency_s": lat * scale})
    decode = [{"batch": b, "context": k, "itl_s": scale * (t["step_base_s"] + t["decode_seq_s"] * b
                                                          + t["decode_kv_token_s"] * b * k)}
              for b, k in ((1, 88), (4, 88), (16, 88), (1, 1048), (4, 536))]
    pd = [{"n": n, "decode_ttft_s": scale * (t["request_overhead_s"] + 0.02 + 1e-6 * n
                                             + t["step_base_s"] + t["decode_seq_s"] + t["decode_kv_token_s"] * n)}
          for n in (128, 1024)]
    return {"prefill": prefill, "decode": decode, "pd": pd}


def test_fit_recovers_the_coefficients_that_made_the_points() -> None:
    got = fit(synthetic(), 2048)
    for k, v in TRUE.items():
        assert got[k] == pytest.approx(v, rel=0.05, abs=1e-9), k
    assert got["kv_transfer_latency_s"] == pytest.approx(0.02, rel=0.05)


def test_merged_calibrations_fit_between_the_two_hosts_speeds() -> None:
    a, b = synthetic(1.0), synthetic(1.5)
    merged = merge_raw(a, b)
    assert len(merged["decode"]) == 10 and len(merged["prefill"]) == 8 and len(merged["pd"]) == 4
    base = profile_from(merged).step_base_s
    assert TRUE["step_base_s"] < base < 1.5 * TRUE["step_base_s"]


def test_host_drift_is_the_largest_relative_change() -> None:
    a = synthetic(1.0)
    assert host_drift(a, synthetic(1.0)) == pytest.approx(0.0)
    assert host_drift(a, synthetic(1.5)) == pytest.approx(0.5)
    assert host_drift(synthetic(1.5), a) == pytest.approx(0.5)   # symmetric
    b = synthetic(1.0)
    b["decode"][2] = {**b["decode"][2], "itl_s": 3 * b["decode"][2]["itl_s"]}   # one point slowed 3x
    assert host_drift(a, b) == pytest.approx(2.0)


def test_step_noise_off_is_exactly_one_and_draws_nothing() -> None:
    from pdgate.sim.noise import StepNoise

    n = StepNoise(0.0, 1.0, seed=3)
    assert [n.factor(t) for t in (0.0, 0.5, 10.0)] == [1.0, 1.0, 1.0]


def test_step_noise_has_the_stated_spread_and_correlation() -> None:
    import math
    import statistics

    from pdgate.sim.noise import StepNoise, fit_step_noise

    n = StepNoise(0.4, 0.5, seed=1)
    dt = 0.01
    fs = [n.factor(i * dt) for i in range(60000)]          # 600 s, 1200 correlation times
    xs = [math.log(f) for f in fs]
    assert statistics.median(fs) == pytest.approx(1.0, abs=0.08)
    assert statistics.pstdev(xs) == pytest.approx(0.4, rel=0.1)
    lag = 50                                                 # 0.5 s = one tau: autocorrelation 1/e
    m = statistics.fmean(xs)
    rho = sum((a - m) * (b - m) for a, b in zip(xs, xs[lag:])) / sum((a - m) ** 2 for a in xs)
    assert rho == pytest.approx(math.exp(-1), abs=0.08)
    # the fit recovers both from the step times this noise produces (base step 10 ms)
    sigma, tau = fit_step_noise([0.01 * f for f in fs[:6000]])
    assert sigma == pytest.approx(0.4, rel=0.2) and tau == pytest.approx(0.5, rel=0.35)
    # white noise: no correlation, tau falls to one step
    import random
    rng = random.Random(0)
    sigma, tau = fit_step_noise([0.01 * math.exp(rng.gauss(0, 0.3)) for _ in range(2000)])
    assert tau == pytest.approx(0.01, rel=0.5)
    # each measured step averaged the noise over one correlation time: the 0.3 seen
    # is sigma * sqrt(v(1)), so sigma is 0.3 / sqrt(2/e) = 0.35
    assert sigma == pytest.approx(0.3 / math.sqrt(2 * math.exp(-1)), rel=0.1)


def test_step_noise_averages_over_long_steps() -> None:
    """A 1 s prefill step under noise with a 50 ms correlation time spreads far
    less than the 10 ms steps the noise was fitted on (the flaw of applying one
    factor sample to a whole long step: simulated TTFT p90 +82%)."""
    import math
    import statistics

    from pdgate.sim.noise import StepNoise, averaged_variance_ratio

    assert averaged_variance_ratio(0.0) == 1.0
    assert averaged_variance_ratio(1.0) == pytest.approx(2 * math.exp(-1))
    assert averaged_variance_ratio(1000.0) == pytest.approx(2 / 1000, rel=0.01)
    with pytest.raises(ValueError):
        averaged_variance_ratio(-1.0)
    n = StepNoise(0.4, 0.05, seed=2)
    long_steps = [math.log(n.factor(i * 1.0, 1.0)) for i in range(3000)]
    short = StepNoise(0.4, 0.05, seed=2)
    short_steps = [math.log(short.factor(i * 1.0, 0.0)) for i in range(3000)]
    assert statistics.pstdev(short_steps) == pytest.approx(0.4, rel=0.1)
    assert statistics.pstdev(long_steps) == pytest.approx(0.4 * math.sqrt(averaged_variance_ratio(20.0)), rel=0.1)
    assert statistics.pstdev(long_steps) < 0.35 * statistics.pstdev(short_steps)


def test_fit_takes_the_noise_probe_and_merge_keeps_it() -> None:
    a, b = synthetic(), synthetic()
    a["noise"] = {"gaps_s": [0.010, 0.011, 0.012, 0.013, 0.015, 0.016, 0.014, 0.012, 0.011, 0.010] * 3}
    b["noise"] = {"gaps_s": [0.02] * 5}
    merged = merge_raw(a, b)
    assert len(merged["noise"]["gaps_s"]) == 35
    got = fit(a, 2048)
    assert 0 < got["step_noise_sigma"] < 0.3 and got["step_noise_tau_s"] > 0
    assert "step_noise_sigma" not in fit(synthetic(), 2048)          # no probe, no noise fields
    assert profile_from(a).step_noise_sigma == pytest.approx(got["step_noise_sigma"])
