#!/usr/bin/env python3
"""Soak run: steady load plus Azure-code-trace bursts through a real gateway
in front of a simulated fleet (see ``python/pdgate/bench/soak.py``).

    python bench/soak.py --duration 600 --json bench/results/soak.json
"""

import argparse
import json
import os
import sys

try:
    from pdgate.bench.soak import SoakConfig, run_soak
except ImportError:  # source tree without an installed pdgate
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    from pdgate.bench.soak import SoakConfig, run_soak


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds (default 600)")
    p.add_argument("--rate", type=float, default=4.0, help="steady requests per second")
    p.add_argument("--burst-every", type=float, default=60.0)
    p.add_argument("--burst-keep", type=float, default=0.4, help="fraction of the trace burst replayed")
    p.add_argument("--warmup", type=float, default=60.0)
    p.add_argument("--window", type=float, default=60.0, help="p99 window, seconds")
    p.add_argument("--trace", default=os.path.join(here, "..", "..", "shared", "traces", "azure2023_code.csv"))
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args()
    cfg = SoakConfig(duration_s=a.duration, rate_rps=a.rate, burst_every_s=a.burst_every, burst_keep=a.burst_keep,
                     warmup_s=a.warmup, window_s=a.window, trace=a.trace)
    res = run_soak(cfg)
    summary = {k: res[k] for k in ("elapsed_s", "requests", "ok", "error", "lost", "status_5xx", "rss_bytes",
                                   "open_fds", "added_latency_p99_ms", "gateway_exit_code")}
    print(json.dumps(summary, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["lost"] == 0 and res["status_5xx"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
