"""Fluid estimates of the TTFT a router can reach on a trace window.

Pool every instance's prefill throughput into one ideal server of ``C``
prompt tokens per second, with no step granularity, no KV transfer and no
decode cost, and serve the window's prompts on it in three orders: first come
first served (FCFS); preemptive shortest-remaining-prompt first (SRPT), which
minimizes the mean; and FCFS with the longest prompts last (``long_last``:
prompts over a size threshold are served, preemptively, only when no shorter
one waits), which sacrifices the largest few percent to shorten everyone
else's wait. A request's "TTFT" is the time until its last prompt token is
processed.

No order is optimal for every percentile: SRPT is not a lower bound on P95
(a policy may give up on the longest 5% outright), so :func:`main` reports
``long_last`` at the threshold (a percentile of the window's prompt sizes)
that gives the lowest P95, beside FCFS and SRPT. The best of them is an
estimate of what a fleet of that capacity can reach, not a proof that
nothing does better; it tells which TTFT targets are in reach at all before
any policy is tried.

Capacities come from a simulator profile (:func:`prefill_capacity`): a
prefill instance at its full token budget, a decode instance prefilling in
chunks of its (smaller) budget beside its decodes (Sarathi-Serve / Kairos,
arXiv 2607.02043), both from the profile's step-time model
(:mod:`pdgate.sim.profiles`) without its attention term; and, closer to what
a fleet can deliver, the same instances stepping through the window's own
prompts (:func:`mix_capacity`: attention and long-prompt chunks counted).

CLI::

    .venv/bin/python bench/fluid_bound.py            # the goodput quick window, 2P2D, rates 2-3.5
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import sys
from typing import Any, Sequence

import numpy as np


ORDERS = ("fcfs", "srpt", "long_last")
#: ``long_last`` thresholds tried, as percentiles of the window's prompt sizes.
LONG_LAST_PERCENTILES = (90, 92, 94, 95, 96, 97, 98, 99)


def fluid_ttft(arrivals_s: Sequence[float], tokens: Sequence[int], capacity_tps: float,
               order: str = "fcfs", long_tokens: float = float("inf")) -> np.ndarray:
    """Per-request completion delay (seconds) of the prompts on one ideal server.

    Args:
        arrivals_s: arrival times, seconds, non-decreasing.
        tokens: prompt tokens of each request.
        capacity_tps: service rate, prompt tokens per second (> 0).
        order: ``fcfs`` (arrival order, non-preemptive = preemptive here),
            ``srpt`` (preemptive, fewest remaining tokens first) or
            ``long_last`` (arrival order, but prompts of more than
            ``long_tokens`` only while no shorter one waits; preemptive).
        long_tokens: the ``long_last`` threshold, prompt tokens.

    Returns:
        Array of shape ``(len(arrivals_s),)``: completion time minus arrival.

    Raises:
        ValueError: unknown order, non-positive capacity or mismatched lengths.
    """
    if capacity_tps <= 0:
        raise ValueError("capacity_tps must be > 0")
    if len(arrivals_s) != len(tokens):
        raise ValueError("arrivals_s and tokens differ in length")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, not {order!r}")
    a = np.asarray(arrivals_s, dtype=float)
    rem = np.asarray(tokens, dtype=float).copy()
    out = np.zeros(len(a))
    now, i = 0.0, 0
    heap: list[tuple[float, int]] = []  # (key, index)
    while i < len(a) or heap:
        if not heap:
            now = max(now, a[i])
        while i < len(a) and a[i] <= now:
            if order == "srpt":
                key = rem[i]
            else:  # arrival order; under long_last a long prompt after every shorter one
                key = float(i) + (len(a) if order == "long_last" and rem[i] > long_tokens else 0)
            heapq.heappush(heap, (key, i))
            i += 1
        _, j = heap[0]
        nxt = a[i] if i < len(a) else np.inf
        finish = now + rem[j] / capacity_tps
        if finish <= nxt:
            heapq.heappop(heap)
            now, rem[j] = finish, 0.0
            out[j] = now - a[j]
        else:  # an arrival first: serve j until then (SRPT re-keys j by its remaining tokens)
            rem[j] -= (nxt - now) * capacity_tps
            now = nxt
            if order == "srpt":
                heapq.heapreplace(heap, (rem[j], j))
    return out


def prefill_capacity(profile: Any, budget: int | None = None, decode_batch: int = 0) -> float:
    """Prompt tokens per second one instance prefills at a full ``budget`` per step.

    Step time = ``step_base_s + budget x prefill_token_s`` (+ ``decode_batch x decode_seq_s``
    for the decodes sharing the step, which also take ``decode_batch`` tokens of the budget);
    the attention term is left out, so this is an upper bound.
    """
    b = int(budget or profile.max_num_batched_tokens)
    chunk = max(1, b - decode_batch)
    step = profile.step_base_s + chunk * profile.prefill_token_s + decode_batch * profile.decode_seq_s
    return chunk / step


def mix_capacity(profile: Any, tokens: Sequence[int], budget: int | None = None, decode_batch: int = 0) -> float:
    """Prompt tokens per second one instance prefills when every prompt of ``tokens``
    waits at once: the simulator's scheduler (:class:`pdgate.sim.scheduler.Scheduler`)
    steps through them at a ``budget``-token step (less ``decode_batch`` tokens for the
    decodes sharing a decode instance's step, whose cost is added per step), so the
    attention term (chunk x context) and the ``long_prefill_token_threshold`` chunks
    of the window's own prompt mix count, unlike :func:`prefill_capacity`. Still an
    upper bound: the queue never runs dry and nothing waits on a KV transfer.

    Raises:
        ValueError: empty ``tokens``.
    """
    from pdgate.sim.scheduler import Scheduler, SimRequest

    if not tokens:
        raise ValueError("mix_capacity: no prompts")
    b = int(budget or profile.max_num_batched_tokens)
    sched = Scheduler(profile.replace(max_num_batched_tokens=max(1, b - decode_batch),
                                      max_num_seqs=max(profile.max_num_seqs, len(tokens))),
                      enable_prefix_caching=False)
    for i, n in enumerate(tokens):
        sched.add(SimRequest(f"r{i}", int(n), 1))
    t = 0.0
    while True:
        plan = sched.schedule(t)
        if not plan.scheduled:
            break
        t += plan.duration_s + decode_batch * profile.decode_seq_s
        sched.finish_step(plan, t)
    return float(sum(tokens)) / t


def percentiles(x: np.ndarray, slo_s: float) -> dict[str, float]:
    """p50/p95/p99 (seconds) and the count over ``slo_s``."""
    return {"p50_s": float(np.percentile(x, 50)), "p95_s": float(np.percentile(x, 95)),
            "p99_s": float(np.percentile(x, 99)), "over_slo": int((x > slo_s).sum())}


def best_long_last(arrivals_s: Sequence[float], tokens: Sequence[int], capacity_tps: float,
                   slo_s: float) -> tuple[int, float, dict[str, float]]:
    """``long_last`` at the threshold (of `LONG_LAST_PERCENTILES` of the prompt
    sizes) with the lowest P95: (percentile, threshold tokens, percentiles)."""
    best: tuple[int, float, dict[str, float]] | None = None
    for q in LONG_LAST_PERCENTILES:
        thr = float(np.percentile(tokens, q))
        p = percentiles(fluid_ttft(arrivals_s, tokens, capacity_tps, "long_last", thr), slo_s)
        if best is None or p["p95_s"] < best[2]["p95_s"]:
            best = (q, thr, p)
    assert best is not None
    return best


def main(argv: list[str] | None = None) -> int:
    from pdgate.bench.goodput import DEFAULT_DECODE_SET, FLEETS, TRACES, WINDOWS
    from pdgate.bench.traces import load_trace, make_plan
    from pdgate.sim.profiles import load_profile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="azure-code", choices=sorted(TRACES))
    ap.add_argument("--fleet", default="2P2D", choices=sorted(FLEETS))
    ap.add_argument("--rates", type=float, nargs="+", default=[2.0, 2.5, 3.0, 3.5])
    ap.add_argument("--profile", default="a100-dsv2-lite")
    ap.add_argument("--decode-budget", type=int,
                    default=int(dict(x.split("=") for x in DEFAULT_DECODE_SET)["max_num_batched_tokens"]))
    ap.add_argument("--decode-batch", type=int, default=32, help="decodes sharing a decode instance's step")
    ap.add_argument("--capacities", type=float, nargs="*", default=[],
                    help="more capacities to report (prompt tokens/s), e.g. a measured effective one")
    ap.add_argument("--slo-ttft", type=float, default=2.0)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    prof = load_profile(args.profile)
    n_p, n_d = FLEETS[args.fleet]
    cap_p = n_p * prefill_capacity(prof)
    cap_d = n_d * prefill_capacity(prof, args.decode_budget, args.decode_batch)
    start, length, _ = WINDOWS[(args.trace, True)]
    trace = load_trace(TRACES[args.trace], seed=0)
    caps = {"prefill instances": cap_p, "prefill + decode instances": cap_p + cap_d}
    mix_plan = make_plan(trace, start_s=start, duration_s=length, time_scale=1.0, max_prompt_tokens=16384)
    mix = [r.prompt_tokens for r in mix_plan.requests]
    caps["prefill + decode, window mix"] = (n_p * mix_capacity(prof, mix)
                                            + n_d * mix_capacity(prof, mix, args.decode_budget, args.decode_batch))
    caps.update({f"given {c:.0f}": c for c in args.capacities})
    rows = []
    print(f"{args.trace} window [{start:g}, {start + length:g}) s, {args.fleet}, profile {args.profile}, "
          f"decode budget {args.decode_budget} beside {args.decode_batch} decodes")
    print(f"{'rate':>5} {'capacity':>28} {'tok/s':>7} {'order':>9} {'p50 s':>6} {'p95 s':>6} {'p99 s':>6} "
          f"{'>SLO':>5}")
    for rate in args.rates:
        plan = make_plan(trace, start_s=start, duration_s=length, time_scale=1.0 / rate, max_prompt_tokens=16384)
        arr = [r.arrival_s for r in plan.requests]
        tok = [r.prompt_tokens for r in plan.requests]
        for name, cap in caps.items():
            for order in ORDERS:
                extra: dict[str, Any] = {}
                if order == "long_last":
                    q, thr, p = best_long_last(arr, tok, cap, args.slo_ttft)
                    extra = {"long_percentile": q, "long_tokens": thr}
                else:
                    p = percentiles(fluid_ttft(arr, tok, cap, order), args.slo_ttft)
                rows.append({"rate_scale": rate, "capacity": name, "capacity_tps": cap, "order": order,
                             "requests": len(arr), **p, **extra})
                print(f"{rate:5g} {name:>28} {cap:7.0f} {order:>9} {p['p50_s']:6.2f} {p['p95_s']:6.2f} "
                      f"{p['p99_s']:6.2f} {p['over_slo']:5d}"
                      + (f"  (prompts > {extra['long_tokens']:.0f} tok, p{extra['long_percentile']}, last)"
                         if extra else ""))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": {"trace": args.trace, "window_s": [start, start + length], "fleet": args.fleet,
                                "profile": args.profile, "decode_budget": args.decode_budget,
                                "decode_batch": args.decode_batch, "slo_ttft_s": args.slo_ttft,
                                "command": " ".join(["bench/fluid_bound.py", *(argv or sys.argv[1:])])},
                       "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0
