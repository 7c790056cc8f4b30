"""Reporting of the KV block transfer benchmark (`pdgate.bench.transfer`):
the JSON notes, the per-row table line, and the summary with the targets
(>= 90% of ucx_perftest bandwidth for ops >= 256 KiB; ahead of NIXL on the
fragmented KV cases)."""

from __future__ import annotations

import statistics
from typing import Any

BIG_OP = 256 << 10  # the ceiling target applies to operations of at least this size
NOTES = [
    (
        "GB/s = 1e9 bytes/s; a rep is one execution of a case (all its transfers posted, then waited for), except "
        "in pdgate's raw bandwidth case, which streams as ucx_perftest -O 16 does: 16 transfers in flight at all "
        "times, each completion posting the next, a rep being 16 completions (runs before 2026-12-01 drained the "
        "window after every 16)"
    ),
    (
        "target: >= 90% of the ceiling's bandwidth for ops >= 256 KiB over the windowed cases (kv, raw bandwidth); "
        "the raw latency case (one transfer in flight) is summarized apart as latency: the microseconds pdgate adds "
        "per transfer (caller -> progress thread -> caller hand-offs; ucx_perftest is one thread calling UCX). "
        "Runs before 2026-12-01 counted the latency case in the bandwidth target"
    ),
    (
        "ceiling: ucx_perftest (ucp_get, window 16, or 1 for the raw latency case that moves one transfer "
        "at a time; message = the case's mean coalesced op size, same UCX install and UCX_TLS) and pdgate run in alternating rounds (perftest, pdgate, perftest, pdgate, ...); "
        "a perftest round is one ucx_perftest run (its overall bandwidth), a pdgate round is reps_per_round "
        "reps moving about the same bytes (total bytes / total time)"
    ),
    (
        "pdgate_over_ceiling_best = best pdgate round / best perftest round; pdgate_over_ceiling_median = "
        "median / median. The summary's >= 90% target check uses best-vs-best: on a shared host the "
        "least-disturbed round of each is the fairest estimate of what each can do"
    ),
    (
        "NIXL, ucxx and memcpy run after pdgate (not alternated): gbps_median / gbps_best are over their reps; "
        "pdgate_over_nixl_* compare per-rep figures of both (pdgate's rep_gbps_*)"
    ),
    "host_load: os.getloadavg() (1, 5, 15 min) at start and end; each row has the 1-min load when it began",
    "NIXL uses the UCX bundled in its wheel; pdgate and ucx_perftest use libucx-cu12",
    (
        "buffers: page-aligned for every contender, as ucx_perftest allocates its own (UCP_MEM_MAP_ALLOCATE); "
        "runs before 2026-11-30 19:00 UTC used numpy buffers starting 16 bytes into a page"
    ),
    (
        "footprint: ucx_perftest's outstanding GETs all read one message-sized buffer into one, so its data stays "
        "in cache when the message fits. The raw cases read one block the same way (the bandwidth case reads block "
        "0 sixteen times; runs before 2026-11-30 19:20 UTC read 16 distinct blocks). The kv cases move every block "
        "of the prompt once (the real workload, up to 4 GiB): for ops that fit in cache their perftest ceiling is "
        "a cache-resident figure that no distinct-block copy reaches"
    ),
    (
        "NIXL over sm runs with UCX_TLS=sm,tcp: its UCX backend requires peer-failure handling, "
        "which posix/sysv lack (pdgate falls back to no peer-failure handling on sm)"
    ),
    (
        "ucxx (successor of ucx-py, same API; ucx-py-cu12 itself cannot be installed from PyPI) moves the same "
        "segments with tag send/recv; over sm it needs tcp for connection setup (UCX_TLS=sm,tcp)"
    ),
]



def fmt(d: dict[str, Any] | None, best: bool = False) -> str:
    if not d:
        return "-"
    if "gbps_median" not in d:
        return "err"
    return f"{d['gbps_median']:.2f}/{d['gbps_best']:.2f}" if best else f"{d['gbps_median']:.2f}"


def label(r: dict[str, Any]) -> str:
    what = f"{r['tokens']}tok" if r["kind"] == "kv" else f"{r['msg_bytes'] >> 10}KiB"
    return f"{r['kind']} {what} {r['case']}"


def print_header() -> None:
    print(
        "GB/s; pdgate and perftest: median/best of alternating rounds; ceiling ratios best-vs-best "
        "(the target check) and median-vs-median; nixl, ucxx, memcpy: median over reps",
        flush=True,
    )


def print_row(tls: str, r: dict[str, Any]) -> None:
    what = f"{r['tokens']}tok" if r["kind"] == "kv" else f"{r['msg_bytes'] >> 10}KiB"
    print(
        f"{tls:4} {r['kind']:3} {what:>9} {r['case']:10} op={r['op_bytes'] >> 10:>6}KiB "
        f"pdgate={fmt(r['pdgate'], True)} ({r['pdgate']['lat_ms_per_transfer']:.3f} ms) "
        f"perftest={fmt(r.get('perftest'), True)} "
        f"ceil best/best={r.get('pdgate_over_ceiling_best', '-')} med/med={r.get('pdgate_over_ceiling_median', '-')} "
        f"nixl={fmt(r.get('nixl'))} ucxx={fmt(r.get('ucxx'))} memcpy={fmt(r.get('memcpy'))} "
        f"ratio_nixl={r.get('pdgate_over_nixl_median', '-')} load={r['load_avg_1m']}",
        flush=True,
    )


def spread(xs: list[float]) -> dict[str, Any]:
    return {"min": min(xs, default=None), "median": statistics.median(xs) if xs else None, "n": len(xs)}


def add_summary(result: dict[str, Any]) -> None:
    """Targets: pdgate >= 90% of ucx_perftest *bandwidth* for ops >= 256 KiB
    (best round vs best round) over the windowed cases (every KV case and the
    raw ``bandwidth`` case: perftest keeps 16 GETs in flight); ahead of NIXL
    on the fragmented KV cases.

    The raw ``latency`` case (one transfer in flight, perftest ``-O 1``)
    measures per-transfer latency, not bandwidth: it is summarized apart, as
    the microseconds pdgate adds per transfer (the hand-off from the caller
    to the progress thread and back, which ucx_perftest, one thread calling
    UCX, does not have) and its ratio.
    """
    summ = {}
    for run in result["runs"]:
        big = [r for r in run["kv"] + run["raw"] if r["op_bytes"] >= BIG_OP and "pdgate_over_ceiling_best" in r]
        bw = [r for r in big if r["case"] != "latency"]
        lat = [r for r in big if r["case"] == "latency"]
        best = [r["pdgate_over_ceiling_best"] for r in bw]
        med = [r["pdgate_over_ceiling_median"] for r in bw]
        frag = {
            f"{r['tokens']}tok": r["pdgate_over_nixl_median"]
            for r in run["kv"]
            if r["case"] == "fragmented" and "pdgate_over_nixl_median" in r
        }
        summ[run["transport"]] = {
            "pdgate_over_ceiling_ops_ge_256KiB_best_vs_best": spread(best),
            "pdgate_over_ceiling_ops_ge_256KiB_median_vs_median": spread(med),
            "below_90pct_best_vs_best": {label(r): r["pdgate_over_ceiling_best"] for r in bw if r["pdgate_over_ceiling_best"] < 0.9},
            "pdgate_over_nixl_fragmented_median": frag,
            "target_ceiling_90pct_met": bool(best) and min(best) >= 0.9,
            "target_ceiling_basis": (
                "bandwidth (windowed cases: kv and raw bandwidth), best round vs best round "
                "(alternating rounds, shared host)"
            ),
            "target_ahead_of_nixl_fragmented_met": bool(frag) and min(frag.values()) > 1.0,
            "one_at_a_time_latency_ops_ge_256KiB": {label(r): latency_cell(r) for r in lat},
        }
    result["summary"] = summ


def latency_cell(r: dict[str, Any]) -> dict[str, Any]:
    """A one-at-a-time row: per-transfer latency of pdgate (median rep) and
    perftest (median round's typical latency), in us, the difference and
    the best-vs-best bandwidth ratio."""
    pd_us = r["pdgate"]["lat_ms_per_transfer"] * 1e3
    pt_us = r.get("perftest", {}).get("lat_us_per_msg")
    return {
        "pdgate_us": round(pd_us, 1),
        "perftest_us": pt_us,
        "added_us": None if pt_us is None else round(pd_us - pt_us, 1),
        "pdgate_over_ceiling_best": r.get("pdgate_over_ceiling_best"),
    }


def added(us: float | None) -> str:
    return "-" if us is None else f"{us:+.1f} us"


def print_summary(result: dict[str, Any]) -> None:
    for tls, s in result["summary"].items():
        b = s["pdgate_over_ceiling_ops_ge_256KiB_best_vs_best"]
        m = s["pdgate_over_ceiling_ops_ge_256KiB_median_vs_median"]
        print(
            f"{tls}: bandwidth pdgate/ceiling for ops >= 256 KiB, best-vs-best (target basis) min {b['min']} median "
            f"{b['median']} (n={b['n']}); median-vs-median min {m['min']} median {m['median']}; "
            f">= 90% met: {s['target_ceiling_90pct_met']}; ahead of NIXL fragmented: "
            f"{s['target_ahead_of_nixl_fragmented_met']}",
            flush=True,
        )
        for name, c in s.get("one_at_a_time_latency_ops_ge_256KiB", {}).items():
            print(f"{tls}: {name} (one in flight): pdgate {c['pdgate_us']} us vs perftest {c['perftest_us']} us "
                  f"({added(c['added_us'])}), best/best {c['pdgate_over_ceiling_best']}", flush=True)
