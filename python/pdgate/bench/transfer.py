"""KV block transfer benchmark: pdgate vs ucx_perftest (the ceiling) vs NIXL
vs ucxx (the ucx-py API) vs single-thread memcpy, same run, same transport.

One command::

    python bench/transfer_bench.py                 # tcp and sm, full sizes
    python bench/transfer_bench.py --quick         # small sizes (smoke)

Prints a table and writes ``bench/results/transfer.json`` (machine, UCX
version, transport, host load, GB/s and per-transfer latency of every
contender, the ratios pdgate/ceiling and pdgate/NIXL).

Layout: Llama-3-8B-like KV cache as vLLM's CPU backend lays it out (one
region per layer, K and V of a block in one 64 KiB page: 16 tokens x 8 KV
heads x 128 dims x bf16 x {K,V}), 32 layers, prompts of 512..32k tokens,
contiguous block ids (coalesced into one run per layer) and fragmented ones
(random permutations: no two blocks adjacent, 64 KiB operations). Raw
messages: one block of 4 KiB..64 MiB, 16 transfers of it in flight (bandwidth)
and one at a time (latency), each reading the same block as ucx_perftest's
window reads its one buffer. Every contender moves the same bytes between
two processes (memcpy: within one process). pdgate and NIXL pull (READ);
ucx_perftest runs ``ucp_get`` with 16 outstanding (1 for the one-at-a-time
latency case); ucxx moves the same
segments with tagged send/recv (it has no one-sided API).

Ceiling on a shared host: for every case, ucx_perftest and pdgate run in
alternating rounds (perftest, pdgate, perftest, pdgate, ...; ``--rounds``,
default 5 each), each round moving about the same bytes. Per contender the
JSON holds every round's GB/s, the median and the best round; the ratio
pdgate/ceiling is given best-vs-best and median-vs-median, and the target
check uses best-vs-best: on a shared host the least-disturbed round of each
is the fairest estimate of what each can do.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import platform
import random
import statistics
import sys
import time
from collections import deque
from importlib.metadata import version
from pathlib import Path
from typing import Any

from pdgate.bench import bench_dir
from pdgate.bench.transfer_report import (  # noqa: F401 - re-exported for callers and tests
    BIG_OP,
    NOTES,
    add_summary,
    label,
    latency_cell,
    print_header,
    print_row,
    print_summary,
    spread,
)
from pdgate.bench.transfer_peers import (
    PAGE,
    TARGET_BYTES,
    WINDOW,
    Child,
    alloc,
    log,
    nixl_tls,
    perftest_iters,
    perftest_round,
    role_nixl,
    role_pdgate_owner,
    role_ucxx,
    run_memcpy,
    run_nixl,
    run_ucxx,
    segments,
    ucx_env,
)

#: How to install an optional peer of the benchmark (printed when it is missing).
PEER_INSTALL = {
    "nixl": "pip install nixl",
    "ucxx": 'pip install --no-deps ucxx-cu12==0.52.* libucxx-cu12==0.52.* "librmm-cu12==26.10.*" rapids-logger',
}

LAYERS = 32
PROMPTS = [512, 2048, 8192, 32768]
RAW_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
def make_cases(kind: str, n_blocks: int) -> list[dict[str, Any]]:
    """A case: `transfers`, each a (local_ids, remote_ids) pair applied to
    every layer."""
    rng = random.Random(42)
    if kind == "kv":
        ids = list(range(n_blocks))
        loc, rem = ids[:], ids[:]
        rng.shuffle(loc)
        rng.shuffle(rem)
        return [
            {"name": "contiguous", "transfers": [(ids, ids)]},
            {"name": "fragmented", "transfers": [(loc, rem)]},
        ]
    return [
        # as ucx_perftest: its window of GETs all read one message buffer into one
        # (``ucp_perf_test_alloc_mem`` allocates one message), so every contender
        # reads the same block WINDOW times, with the same (cache-sized) footprint
        {"name": "bandwidth", "transfers": [([0], [0]) for _ in range(WINDOW)], "stream": True},
        {"name": "latency", "transfers": [([0], [0])]},
    ]


def reps_for(nbytes: int, quick: bool) -> int:
    """Reps of the non-alternated contenders (NIXL, ucxx, memcpy)."""
    return max(2, min(20 if not quick else 8, TARGET_BYTES // max(nbytes, 1)))


def run_pdgate(eng: Any, peer: str, case: dict[str, Any], reps: int) -> list[float]:
    """Seconds per rep. A ``stream`` case keeps its transfers in flight across
    reps, as ``ucx_perftest -O`` keeps its window full (see `stream_pdgate`);
    any other posts a rep's transfers, waits for all, then starts the next."""
    if case.get("stream"):
        return stream_pdgate(eng, peer, case, reps)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        xs = [eng.read_blocks(peer, l, r, timeout_s=120.0) for l, r in case["transfers"]]
        for x in xs:
            eng.wait(x, timeout_s=180.0)
        times.append(time.perf_counter() - t0)
    return times


def stream_pdgate(eng: Any, peer: str, case: dict[str, Any], reps: int) -> list[float]:
    """``reps x W`` transfers (W = the case's transfer count) with W in flight
    at all times: each completion (oldest first) posts the next, so the window
    never drains between reps, as in ``ucx_perftest -O W`` (the ceiling's own
    method). Returns the seconds between consecutive W-th completions (the
    first from the first post), one per rep; their sum is the whole run."""
    window = len(case["transfers"])
    total = reps * window
    pending: deque[int] = deque()
    posted = done = 0
    times: list[float] = []
    last = time.perf_counter()
    while posted < min(window, total):
        l, r = case["transfers"][posted % window]
        pending.append(eng.read_blocks(peer, l, r, timeout_s=120.0))
        posted += 1
    while pending:
        eng.wait(pending.popleft(), timeout_s=180.0)
        done += 1
        if posted < total:
            l, r = case["transfers"][posted % window]
            pending.append(eng.read_blocks(peer, l, r, timeout_s=120.0))
            posted += 1
        if done % window == 0:
            now = time.perf_counter()
            times.append(now - last)
            last = now
    return times


def over_reps(times: list[float], nbytes: int, ntransfers: int) -> dict[str, Any]:
    return {
        "gbps_median": nbytes / statistics.median(times) / 1e9,
        "gbps_best": nbytes / min(times) / 1e9,
        "lat_ms_per_transfer": statistics.median(times) / ntransfers * 1e3,
        "reps": len(times),
    }


def over_rounds(gbps: list[float]) -> dict[str, Any]:
    return {
        "gbps_median": statistics.median(gbps),
        "gbps_best": max(gbps),
        "rounds_gbps": [round(g, 4) for g in gbps],
        "rounds": len(gbps),
    }


def ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    if key in a and key in b and b[key]:
        return round(a[key] / b[key], 3)
    return None


def alternate(
    tls: str, eng: Any, peer: str, case: dict[str, Any], row: dict[str, Any], args: argparse.Namespace, ports: Any
) -> None:
    """perftest, pdgate, perftest, pdgate, ...: `args.rounds` rounds each."""
    nbytes, nt = row["bytes_per_rep"], row["transfers_per_rep"]
    with_pt = "perftest" not in args.skip
    # one transfer at a time (raw latency case): one GET outstanding
    window = 1 if row["case"] == "latency" else WINDOW
    pt_bytes = perftest_iters(row["op_bytes"]) * row["op_bytes"]
    reps = max(1, min(100, -(-pt_bytes // nbytes)))
    run_pdgate(eng, peer, case, 1)  # warm-up
    pd_times: list[float] = []
    pd_rounds: list[float] = []
    pt: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        if with_pt:
            pt.append(perftest_round(tls, row["op_bytes"], next(ports), window))
        t = run_pdgate(eng, peer, case, reps)
        pd_times += t
        pd_rounds.append(nbytes * len(t) / sum(t) / 1e9)
    pd = over_rounds(pd_rounds)
    rep = over_reps(pd_times, nbytes, nt)
    pd.update(
        reps_per_round=reps,
        rep_gbps_median=rep["gbps_median"],
        rep_gbps_best=rep["gbps_best"],
        lat_ms_per_transfer=rep["lat_ms_per_transfer"],
    )
    row["pdgate"] = pd
    if not with_pt:
        return
    ok = [p for p in pt if "gbps" in p]
    if not ok:
        row["perftest"] = {"error": pt[-1].get("error", "no result")}
        return
    row["perftest"] = over_rounds([p["gbps"] for p in ok])
    row["perftest"].update(
        lat_us_per_msg=statistics.median(p["lat_us"] for p in ok),
        iters=perftest_iters(row["op_bytes"]),
        window=window,
        test="ucp_get",
        errors=len(pt) - len(ok),
    )
    row["pdgate_over_ceiling_best"] = ratio(pd, row["perftest"], "gbps_best")
    row["pdgate_over_ceiling_median"] = ratio(pd, row["perftest"], "gbps_median")


def bench_setup(
    tls: str, owner: Child, eng: Any, setup: tuple[str, int, int, int, int], args: argparse.Namespace, ports: Any
) -> list[dict[str, Any]]:
    """All contenders on one pool geometry and transport; memory is freed
    between contenders (a 32k-token prompt is 4 GiB a side)."""
    kind, layers, n, blen, tokens = setup
    log(f"[{tls}] {kind} layers={layers} blocks={n} block={blen}B")
    meta = owner.call({"cmd": "setup", "layers": layers, "n": n, "blen": blen})["meta"]
    peer = eng.add_peer(bytes.fromhex(meta))
    local = alloc(layers * n * blen, fill=False)
    regs = [eng.register(local.ctypes.data + l * n * blen, n * blen, blen) for l in range(layers)]
    cases = make_cases(kind, n)
    rows = []
    try:
        for case in cases:
            nt = len(case["transfers"])
            nbytes = sum(len(t[0]) for t in case["transfers"]) * blen * layers
            segs = sum(len(segments(l, r, blen)) for l, r in case["transfers"]) * layers
            case["rounds"] = reps_for(nbytes, args.quick)  # reps of NIXL, ucxx, memcpy
            row: dict[str, Any] = {
                "transport": tls,
                "kind": kind,
                "case": case["name"],
                "tokens": tokens or None,
                "msg_bytes": blen if kind == "raw" else None,
                "bytes_per_rep": nbytes,
                "transfers_per_rep": nt,
                "ops_per_rep": segs,
                "op_bytes": nbytes // segs,
                "load_avg_1m": round(os.getloadavg()[0], 2),
            }
            alternate(tls, eng, peer, case, row, args, ports)
            # spot check: a few blocks arrived with the owner's pattern
            for l_ids, r_ids in case["transfers"][:2] if kind == "kv" else []:
                for lb, rb in list(zip(l_ids, r_ids))[:3]:
                    got = local[(layers - 1) * n * blen + lb * blen]
                    want = ((layers - 1) * n + rb) % 251 + 1
                    if got != want:
                        raise AssertionError(f"byte mismatch in {kind}/{case['name']}: {got} != {want}")
            rows.append(row)
    finally:
        for r in regs:
            eng.deregister(r)
        del local
        eng.remove_peer(peer)
        owner.call({"cmd": "free"})
    for row, case in zip(rows, cases):
        t = run_memcpy(layers, n, blen, case, case["rounds"])  # warm-up dropped
        row["memcpy"] = over_reps(t, row["bytes_per_rep"], row["transfers_per_rep"])
    run_peers(tls, layers, n, blen, cases, rows, args.skip)
    for row in rows:
        pd_reps = {"gbps_median": row["pdgate"]["rep_gbps_median"], "gbps_best": row["pdgate"]["rep_gbps_best"]}
        for key in ("median", "best"):
            r = ratio(pd_reps, row.get("nixl", {}), f"gbps_{key}")
            if r is not None:
                row[f"pdgate_over_nixl_{key}"] = r
        print_row(tls, row)
    return rows


def run_peers(tls: str, layers: int, n: int, blen: int, cases: list[dict[str, Any]],
              rows: list[dict[str, Any]], skip: Any) -> None:
    """Fill each row's ``nixl`` and ``ucxx`` entries (GB/s over reps) for the same cases.

    A peer named in ``skip`` is left out; one that is not installed gets
    ``{"error": "<name> not installed"}`` and one line on stderr with its
    install command; one that fails gets the exception's text. Never raises.
    """
    for name, fn in (("nixl", run_nixl), ("ucxx", run_ucxx)):
        if name in skip:
            continue
        if importlib.util.find_spec(name) is None:  # one line, not a child's ImportError traceback
            print(f"transfer bench: {name} is not installed, its column is skipped ({PEER_INSTALL[name]})",
                  file=sys.stderr)
            for row in rows:
                row[name] = {"error": f"{name} not installed"}
            continue
        try:
            res = fn(tls, layers, n, blen, cases)
            for row, case in zip(rows, cases):
                row[name] = over_reps(res[case["name"]], row["bytes_per_rep"], row["transfers_per_rep"])
                if name == "nixl":
                    row[name]["ucx_tls"] = nixl_tls(tls)
        except Exception as e:  # noqa: BLE001 - reported in the JSON
            for row in rows:
                row[name] = {"error": repr(e)[:300]}


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        cpu = next(
            (l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("model name")),
            "",
        )
        mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        mem = 0
    return {
        "host": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_bytes": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", default="main")
    ap.add_argument("--tls", default="tcp")
    ap.add_argument("--spec", default="{}")
    ap.add_argument("--transports", default="tcp,sm")
    ap.add_argument("--quick", action="store_true", help="small sizes only (smoke run)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of ucx_perftest and pdgate (each)")
    ap.add_argument("--prompts", default=None, help="comma-separated prompt lengths in tokens ('none': raw messages only)")
    ap.add_argument("--raw-sizes", default=None, help="comma-separated message sizes in bytes ('none': KV cases only)")
    ap.add_argument("--skip", default="", help="comma list of nixl,ucxx,perftest")
    ap.add_argument("--out", default=os.path.join(bench_dir(), "results", "transfer.json"))
    ap.add_argument("--resummarize", default=None, help="recompute the summary of a result file")
    return ap.parse_args(argv)


def ints(s: str | None, default: list[int]) -> list[int]:
    if s is None:
        return default
    return [int(x) for x in s.split(",") if x.strip() and x != "none"]


def main(argv: list[str] | None = None) -> int | None:
    args = parse_args(argv)
    if args.resummarize:
        res = json.loads(Path(args.resummarize).read_text())
        add_summary(res)
        Path(args.resummarize).write_text(json.dumps(res, indent=1))
        print(json.dumps(res["summary"], indent=1))
        return None
    if args.role != "main":
        if args.role == "pdgate-owner":
            role_pdgate_owner(args.tls)
        elif args.role.startswith("nixl-"):
            role_nixl(args.role[5:], args.spec)
        elif args.role.startswith("ucxx-"):
            role_ucxx(args.role[5:], args.spec)
        return None
    args.prompts = ints(args.prompts, PROMPTS[:2] if args.quick else PROMPTS)
    args.raw_sizes = ints(args.raw_sizes, [4 << 10, 256 << 10, 1 << 20] if args.quick else RAW_SIZES)
    args.skip = set(filter(None, args.skip.split(",")))
    from pdgate.transfer import create_engine

    probe = create_engine("bench-probe")
    versions: dict[str, str] = {"ucx": probe.ucx_version}
    probe.close()
    for pkg in ("nixl", "ucxx-cu12", "libucx-cu12", "numpy"):
        try:
            versions[pkg] = version(pkg)
        except Exception:  # noqa: BLE001
            versions[pkg] = "not installed"
    tlss = args.transports.split(",")
    runs = {t: {"transport": t, "kv": [], "raw": []} for t in tlss}
    result: dict[str, Any] = {
        "machine": machine(),
        "host_load": {"start": [round(x, 2) for x in os.getloadavg()], "end": None},
        "versions": versions,
        "layout": {
            "layers": LAYERS,
            "block_tokens": 16,
            "kv_heads": 8,
            "head_dim": 128,
            "dtype": "bf16",
            "page_bytes_per_block_per_layer": PAGE,
            "note": "vLLM CPU backend layout (LBHNC): K and V of a block share one page per layer",
        },
        "notes": NOTES,
        "quick": args.quick,
        "rounds": args.rounds,
        "prompts": args.prompts,
        "raw_sizes": args.raw_sizes,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs": list(runs.values()),
    }
    ports = itertools.count(20000 + os.getpid() % 20000)
    setups: list[tuple[str, int, int, int, int]] = []  # kind, layers, n, blen, tokens
    setups += [("kv", LAYERS, tok // 16, PAGE, tok) for tok in args.prompts]
    setups += [("raw", 1, 1, size, 0) for size in args.raw_sizes]  # one block, as perftest's one buffer
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    print_header()
    peers = {}
    try:
        for t in tlss:
            peers[t] = (
                Child(["--role", "pdgate-owner", "--tls", t], ucx_env(t)),
                create_engine(f"bench-reader-{t}", "bench", transports=t),
            )
        # Transports interleaved per geometry, so a cut-short run still
        # compares them on the same sizes; the file is rewritten each step.
        for setup in setups:
            for t in tlss:
                owner, eng = peers[t]
                runs[t][setup[0]].extend(bench_setup(t, owner, eng, setup, args, ports))
                result["host_load"]["end"] = [round(x, 2) for x in os.getloadavg()]
                result["finished"] = setup == setups[-1] and t == tlss[-1]
                result["ended"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                add_summary(result)
                Path(args.out).write_text(json.dumps(result, indent=1))
    finally:
        for owner, eng in peers.values():
            eng.close()
            owner.close()
    print_summary(result)
    print(f"wrote {args.out}")
    return None


if __name__ == "__main__":
    sys.exit(main())
