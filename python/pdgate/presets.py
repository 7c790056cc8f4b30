"""Named pdgate routing configurations for benchmarks (``bench/goodput.py``).

Each preset is a dict of :class:`pdgate.config.GatewayConfig` fields to
merge over the instance lists. :func:`routing_presets` scales the latency
model and the SLOs to a simulated fleet's clock: the gateway measures wall
time, a fleet simulated ``speed`` times faster than real time finishes
everything ``speed`` times sooner, so the profile's coefficients and the SLO
targets are divided by ``speed``.
"""

from __future__ import annotations

from typing import Any


def routing_presets(profile: str | None = None, speed: float = 1.0, slo_ttft_s: float = 2.0,
                    slo_tpot_s: float = 0.1, long_tokens: int = 4096,
                    sim_words: bool = False) -> dict[str, dict[str, Any]]:
    """Route/admission presets by label (instance-policy-only configs are not included).

    Args:
        profile: simulator profile seeding the predictor (``None``: defaults).
        speed: simulated seconds per wall second of the fleet.
        slo_ttft_s / slo_tpot_s: the SLO pair, in (simulated) seconds.
        long_tokens: boundary of the short and long pools (``dedicated``);
            pools alternate over the instances (short, long, short, ...).
        sim_words: count text prompts as the simulator does (one token per word).
    """
    common: dict[str, Any] = {
        "prefill_policy": "least_load", "decode_policy": "least_load",
        "predictor": {"profile": profile, "time_scale": speed},
        "slo": {"classes": {"default": {"ttft_s": slo_ttft_s / speed, "tpot_s": slo_tpot_s / speed}}},
        "tokenizer": {"words": sim_words},
    }
    pools = {"short": {"max_tokens": long_tokens}, "long": {"min_tokens": long_tokens}}

    def goodput_sjf(max_deflected: int) -> dict[str, Any]:
        """The goodput route with shortest-prompt-first prefill admission."""
        return {**common, "route_policy": "goodput",
                "goodput": {"max_deflected_per_decode": max_deflected, "others_weight": 1.0},
                "admission_policy": "priority",
                "priority": {"long_threshold_tokens": 1000, "long_penalty": 1, "aging_rate": 0.1 * speed,
                             "max_wait_s": 60.0 / speed, "max_in_flight": 4}}

    def goodput_fcfs(max_deflected: int) -> dict[str, Any]:
        """The goodput route, prefill legs admitted first come first served (4 in flight per
        prefill instance, at most 1 long): no request is held back, which keeps the TTFT tail short."""
        return {**common, "route_policy": "goodput", "admission_policy": "request_parallel",
                "goodput": {"max_deflected_per_decode": max_deflected, "others_weight": 1.0}}

    def pooled(order: str, queue_s: float = 0.4, **extra: Any) -> dict[str, Any]:
        """Late binding: one gateway-wide queue, each request routed when a prefill instance
        or a decode instance (deflection) has room for it."""
        return {**common, "route_policy": "pooled", "goodput": {"others_weight": 1.0},
                "pooled": {"order": order, "max_queue_s": queue_s / speed, "aging_rate": 0.5 * speed,
                           "max_wait_s": 30.0 / speed, "tick_s": 0.02 / speed, **extra}}

    alternate = ["short", "long"] * 32
    return {
        "request_parallel": {**common, "admission_policy": "request_parallel"},
        "priority": {**common, "admission_policy": "priority"},
        "dedicated": {**common, "route_policy": "dedicated", "pools": pools,
                      "prefill_pools": alternate, "decode_pools": alternate},
        "deflection": {**common, "route_policy": "deflection"},
        "goodput": {**common, "route_policy": "goodput"},
        # pdgate's best on bursty traces (bench/results/goodput*.md): least predicted SLO
        # violation per request, one deflected prefill per decode instance, the requests it
        # would slow weighted fully; prefill legs admitted shortest-first (one priority unit
        # per 1000 prompt tokens, aging 0.1 unit per simulated second, none waits over 60 s),
        # 4 in flight per prefill instance.
        "goodput+sjf": goodput_sjf(1),
        # the same with up to 4 deflected prefills per decode instance: with the decode
        # instances' chunk budget sized to the TPOT SLO (bench/goodput.py DEFAULT_DECODE_SET) it
        # absorbs more of a prefill overload (bench/results/goodput_quick.md)
        "goodput+sjf+d4": goodput_sjf(4),
        "goodput+fcfs+d4": goodput_fcfs(4),
        # late binding (``pooled``): one gateway-wide queue, each request routed when a prefill
        # instance, or (prefill path congested) a decode instance, has room for it; an executor
        # takes work while what it holds drains within 0.4 simulated s (about one full prefill step)
        "pooled": pooled("fcfs"),
        "pooled+sjf": pooled("sjf"),
        # arrival order, prompts over 6000 tokens after the shorter ones (the longest ~10% of the
        # Azure code trace) until they waited 10 simulated s longer: the order that minimizes the
        # pooled fluid model's P95 TTFT here (bench/fluid_bound.py, `long_last`)
        "pooled+longlast": pooled("long_last", long_threshold_tokens=6000, aging_rate=0.1 * speed),
        # the same, and a P/D request that waited 1 simulated s or more by the end of its prefill
        # gets its first token from the prefill leg (pdgate.gateway.first_token): its TTFT does not
        # wait for the KV transfer and a decode step with room; waiting no longer than that, it keeps
        # its first token from the decode instance, so short answers keep their TPOT
        "pooled+longlast+ft": {**pooled("long_last", long_threshold_tokens=6000, aging_rate=0.1 * speed),
                               "first_token": {"from_prefill": True, "min_wait_s": 1.0 / speed}},
        "goodput+deadline": {**common, "route_policy": "goodput", "admission_policy": "deadline",
                             "priority": {"aging_rate": 0.0, "max_wait_s": 60.0 / speed}},
    }
