"""Gateway overhead: pdgate vs vllm-router in front of fixed-response backends.

Backends (``python -m pdgate.sim.fixed``, one prefill and one decode, each its
own process) answer at once, so what is measured is the router: two hops per
request (prefill leg, then decode leg), ``/v1/completions`` non-streamed and
streamed (``--stream-tokens`` SSE events per answer, one chunk each,
``--itl-ms`` apart: the router relays them one by one, as it does vLLM's).
A raw asyncio HTTP/1.1 keep-alive client holds ``concurrency`` requests in
flight for ``--duration`` seconds per point and records req/s and latency.
The baseline row sends the same two legs straight to the backends; added
latency = router latency - baseline latency at the same concurrency.

Cores are pinned with ``taskset``: router on ``--router-cpus``, backends and
client on ``--other-cpus`` (on a 2-core machine: 0 and 1). The client is
Python, so at high concurrency the figures can be client-bound (the
baseline's req/s shows that ceiling).

    .venv/bin/python bench/overhead.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from pdgate.localfleet.vllm_server import free_port
from pdgate.bench import bench_dir
from pdgate.sim.harness import Proc, RouterSpec, start_router, vllm_router_bin, wait_ready
from pdgate.sim.report import overhead_markdown

HERE = bench_dir()  # the repository's bench/ (results, default trace paths)
BODY = json.dumps({"model": "sim-model", "prompt": "hello world", "max_tokens": 8, "stream": False}).encode()
STREAM_TOKENS = 16


def stream_body(tokens: int) -> bytes:
    """A streamed completion request of ``tokens`` tokens."""
    return json.dumps({"model": "sim-model", "prompt": "hello world", "max_tokens": tokens, "stream": True}).encode()


PREFILL_BODY = json.dumps({"model": "sim-model", "prompt": "hello world", "max_tokens": 1, "stream": False,
                           "kv_transfer_params": {"do_remote_decode": True}}).encode()


def _req(host: str, port: int, path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    else:
        i = lower.find(b"content-length:")
        n = int(lower[i + 15:lower.index(b"\r\n", i)]) if i >= 0 else 0
        await reader.readexactly(n)
    return status


async def _worker(legs: list[tuple[str, int, bytes]], stop_at: float, warm_until: float, lat: list[float],
                  errs: list[int]) -> None:
    conns = [await asyncio.open_connection(h, p) for h, p, _ in legs]
    try:
        while True:
            t = time.perf_counter()
            if t >= stop_at:
                return
            ok = True
            for (_, _, payload), (r, w) in zip(legs, conns):
                w.write(payload)
                if await _read_response(r) != 200:
                    ok = False
            done = time.perf_counter()
            if t >= warm_until:
                (lat.append(done - t) if ok else errs.append(1))
    except (OSError, asyncio.IncompleteReadError, ValueError):
        errs.append(1)
    finally:
        for _, w in conns:
            w.close()


def measure(legs: list[tuple[str, int, bytes]], concurrency: int, duration: float, warmup: float) -> dict[str, Any]:
    async def go() -> tuple[list[float], list[int], float]:
        lat: list[float] = []
        errs: list[int] = []
        t0 = time.perf_counter()
        await asyncio.gather(*[_worker(legs, t0 + warmup + duration, t0 + warmup, lat, errs)
                               for _ in range(concurrency)])
        return lat, errs, duration

    lat, errs, dur = asyncio.run(go())
    lat.sort()

    def pct(p: float) -> float:
        return 1000.0 * lat[min(len(lat) - 1, int(p / 100.0 * len(lat)))] if lat else float("nan")

    return {"concurrency": concurrency, "requests": len(lat), "rps": len(lat) / dur, "p50_ms": pct(50),
            "p99_ms": pct(99), "mean_ms": 1000.0 * statistics.fmean(lat) if lat else float("nan"),
            "errors": len(errs)}


def _with_tokens(r: dict[str, Any], mode: str, tokens: int) -> dict[str, Any]:
    """``r`` with its mode and, for streamed points, the tokens relayed per second."""
    r["mode"] = mode
    if mode != "json":
        r["tokens_per_s"] = r["rps"] * tokens
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 s per point")
    ap.add_argument("--duration", type=float, help="seconds per point (default 10, quick 3)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--stream-concurrency", type=int, nargs="*", default=[1, 32],
                    help="concurrencies of the streamed points (none: no streamed points)")
    ap.add_argument("--stream-tokens", type=int, default=STREAM_TOKENS, help="tokens per streamed answer")
    ap.add_argument("--itl-ms", type=float, default=2.0, help="backends' gap between streamed tokens (ms)")
    ap.add_argument("--router-cpus", default="0")
    ap.add_argument("--other-cpus", default="1")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    if vllm_router_bin() is None:
        print("overhead: vllm-router is required (pip install vllm-router)", file=sys.stderr)
        return 2
    duration = args.duration or (3.0 if args.quick else 10.0)
    rc = [int(c) for c in args.router_cpus.split(",")]
    oc = [int(c) for c in args.other_cpus.split(",")]
    if args.other_cpus:
        os.sched_setaffinity(0, oc)  # the client
    log_dir = tempfile.mkdtemp(prefix="pdgate-overhead-")
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    backends = []
    ports = {"prefill": free_port(), "decode": free_port()}
    for role, port in ports.items():
        p = Proc([sys.executable, "-m", "pdgate.sim.fixed", "--port", str(port), "--itl-ms", str(args.itl_ms)],
                 os.path.join(log_dir, f"fixed-{role}.log"), cpus=oc)
        backends.append(p)
        wait_ready(f"http://127.0.0.1:{port}", p, 30)
    urls = {"prefill": [f"http://127.0.0.1:{ports['prefill']}"], "decode": [f"http://127.0.0.1:{ports['decode']}"]}
    runs: list[dict[str, Any]] = []
    try:
        sbody = stream_body(args.stream_tokens)
        points = [("json", c, BODY) for c in args.concurrency] + \
                 [(f"stream {args.stream_tokens} tok", c, sbody) for c in args.stream_concurrency]
        base: dict[tuple[str, int], dict[str, Any]] = {}
        for mode, c, payload in points:
            legs = [("127.0.0.1", ports["prefill"], _req("127.0.0.1", ports["prefill"], "/v1/completions", PREFILL_BODY)),
                    ("127.0.0.1", ports["decode"], _req("127.0.0.1", ports["decode"], "/v1/completions", payload))]
            base[mode, c] = _with_tokens(measure(legs, c, duration, 1.0), mode, args.stream_tokens)
            runs.append({"router": "baseline (client sends both legs)", **base[mode, c]})
            print(runs[-1], flush=True)
        specs = [RouterSpec("vllm-router", "vllm-router", "pd",
                            {"policy": "round_robin", "max_concurrent_requests": 4096, "queue_size": 4096}),
                 RouterSpec("pdgate", "pdgate", "pd", {})]
        for spec in specs:
            proc, url = start_router(spec, urls, log_dir, cpus=rc)
            port = int(url.rsplit(":", 1)[1])
            try:
                for mode, c, payload in points:
                    legs = [("127.0.0.1", port, _req("127.0.0.1", port, "/v1/completions", payload))]
                    r = _with_tokens(measure(legs, c, duration, 1.0), mode, args.stream_tokens)
                    ref = base[mode, c]
                    r.update(router=spec.label, added_p50_ms=r["p50_ms"] - ref["p50_ms"],
                             added_p99_ms=r["p99_ms"] - ref["p99_ms"])
                    runs.append(r)
                    print(r, flush=True)
            finally:
                proc.stop()
    finally:
        for b in backends:
            b.stop()
    doc = {"meta": {"command": " ".join(["bench/overhead.py", *(argv or sys.argv[1:])]), "started_utc": started,
                    "duration_s": duration, "ncpu": os.cpu_count(),
                    "cpus": {"router": args.router_cpus, "backends": args.other_cpus, "client": args.other_cpus},
                    "backend": "pdgate.sim.fixed (asyncio, fixed JSON or a fixed SSE stream), 1 prefill + 1 decode, "
                               "separate processes",
                    "stream_tokens": args.stream_tokens, "itl_ms": args.itl_ms,
                    "vllm_router_flags": "--policy round_robin --max-concurrent-requests 4096 --queue-size 4096",
                    "logs": log_dir},
           "runs": runs}
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "overhead_quick" if args.quick else "overhead")
    with open(stem + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    md = overhead_markdown(doc)
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
