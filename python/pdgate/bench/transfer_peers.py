"""Contenders and helper processes of the KV transfer benchmark
(:mod:`pdgate.bench.transfer`): the pdgate owner process, NIXL and ucxx
peers, one ``ucx_perftest`` round, single-thread memcpy.

Helper processes run ``python -m pdgate.bench.transfer --role ...`` and
speak JSON lines on stdout (prefixed with ``MARK``); every read is
time-bounded.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import mmap
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

# Folder holding the ``pdgate`` package: helper processes import from it.
PYROOT = Path(__file__).resolve().parents[2]

PAGE = 16 * 8 * 128 * 2 * 2  # 64 KiB: K and V of one block of one layer
WINDOW = 16
TARGET_BYTES = 256 << 20  # per measurement, bounds run time

# ----------------------------------------------------------------- helpers


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def ucx_env(tls: str) -> dict[str, str]:
    from pdgate.transfer import ucx_lib_dir

    env = dict(os.environ)
    env["UCX_TLS"] = tls
    lib = ucx_lib_dir()
    if lib:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(lib), env.get("LD_LIBRARY_PATH", "")]
        )
    env["PYTHONPATH"] = os.pathsep.join([str(PYROOT), env.get("PYTHONPATH", "")])
    return env


def alloc(nbytes: int, fill: bool) -> np.ndarray:
    """A page-aligned uint8 buffer of ``nbytes`` bytes, every page touched
    (``fill``: a per-64-KiB-page pattern, else zeros).

    Page-aligned as ``ucx_perftest``'s buffers are (``ucp_mem_map`` with
    ``UCP_MEM_MAP_ALLOCATE``): numpy's own large buffers start 16 bytes into a
    page (glibc's mmap chunk header), so every transfer would span one page
    more than perftest's and copy unaligned, which is the buffer's cost, not the
    engine's.
    """
    os_page = mmap.PAGESIZE
    base = np.empty(nbytes + os_page, dtype=np.uint8)
    off = (-base.ctypes.data) % os_page
    a = base[off:off + nbytes]
    if fill:
        rows = a.reshape(-1, min(PAGE, nbytes))
        rows[:] = (np.arange(rows.shape[0]) % 251 + 1).astype(np.uint8)[:, None]
    else:
        a[:] = 0  # touch every page before timing
    return a


def segments(
    local: list[int], remote: list[int], blen: int
) -> list[tuple[int, int, int]]:
    """Coalesced (local_off, remote_off, len) runs, as the engine plans them."""
    out: list[list[int]] = []
    for lo, ro in sorted((l * blen, r * blen) for l, r in zip(local, remote)):
        if out and out[-1][0] + out[-1][2] == lo and out[-1][1] + out[-1][2] == ro:
            out[-1][2] += blen
        else:
            out.append([lo, ro, blen])
    return [tuple(s) for s in out]  # type: ignore[misc]


class Child:
    """A helper process speaking JSON lines; every read is time-bounded."""

    def __init__(self, args: list[str], env: dict[str, str], timeout: float = 120.0):
        self.p = subprocess.Popen(
            [sys.executable, "-m", "pdgate.bench.transfer", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.hello = self.read(timeout)

    def read(self, timeout: float) -> Any:
        assert self.p.stdout is not None
        r, _, _ = select.select([self.p.stdout], [], [], timeout)
        if not r:
            self.close()
            raise TimeoutError(f"child {self.p.args!r} timed out")
        deadline = time.monotonic() + timeout
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"child exited with {self.p.wait()}")
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
            # a library's own chatter on stdout: skip it
            if time.monotonic() > deadline:
                raise TimeoutError(f"child {self.p.args!r} timed out")

    def call(self, msg: dict[str, Any], timeout: float = 600.0) -> Any:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(msg) + "\n")
        self.p.stdin.flush()
        return self.read(timeout)

    def close(self, wait: float = 10.0) -> None:
        if self.p.poll() is None:
            try:
                assert self.p.stdin is not None
                self.p.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.p.stdin.flush()
                self.p.wait(wait)
            except Exception:  # noqa: BLE001 - any failure: make sure it dies
                self.p.kill()
                self.p.wait(10)


MARK = "@@pdgate-bench "


def reply(obj: Any) -> None:
    print(MARK + json.dumps(obj), flush=True)


# ---------------------------------------------------------- pdgate owner


def role_pdgate_owner(tls: str) -> None:
    from pdgate.transfer import create_engine

    eng = create_engine("bench-owner", "bench", transports=tls)
    raw = None
    regions: list[int] = []
    reply({"ok": True})
    for line in sys.stdin:
        c = json.loads(line)
        if c["cmd"] == "exit":
            break
        if c["cmd"] == "free":
            for r in regions:
                eng.deregister(r)
            regions, raw = [], None
            reply({"ok": True})
        if c["cmd"] == "setup":
            for r in regions:
                eng.deregister(r)
            raw = None
            layers, n, blen = c["layers"], c["n"], c["blen"]
            raw = alloc(layers * n * blen, fill=True)
            regions = [
                eng.register(raw.ctypes.data + l * n * blen, n * blen, blen)
                for l in range(layers)
            ]
            reply({"meta": eng.metadata().hex()})
    eng.close()


# ----------------------------------------------------------------- NIXL


def role_nixl(side: str, spec_json: str) -> None:
    from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[import-untyped,import-not-found]

    spec = json.loads(spec_json)
    layers, n, blen = spec["layers"], spec["n"], spec["blen"]
    agent = nixl_agent(f"nixl-{side}", nixl_agent_config(backends=["UCX"]))
    raw = alloc(layers * n * blen, fill=(side == "target"))
    base = raw.ctypes.data
    agent.register_memory(
        [(base + l * n * blen, n * blen, 0, "") for l in range(layers)], "DRAM"
    )
    descs = np.array(
        [(base + i * blen, blen, 0) for i in range(layers * n)], dtype=np.uint64
    )
    if side == "target":
        reply({"meta": agent.get_agent_metadata().hex(), "base": base})
        for line in sys.stdin:
            if json.loads(line)["cmd"] == "exit":
                break
        return
    reply({"ok": True})
    c = json.loads(sys.stdin.readline())
    remote = agent.add_remote_agent(bytes.fromhex(c["meta"]))
    rbase = c["base"]
    rdescs = np.array(
        [(rbase + i * blen, blen, 0) for i in range(layers * n)], dtype=np.uint64
    )
    local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, "DRAM")
    remote_h = agent.prep_xfer_dlist(remote, rdescs, "DRAM")
    results = {}
    for case in c["cases"]:
        rounds = case["rounds"]
        times = []
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            hs = []
            for l_ids, r_ids in case["transfers"]:
                li = (
                    (np.arange(layers)[:, None] * n + np.asarray(l_ids)[None, :])
                    .ravel()
                    .astype(np.int32)
                )
                ri = (
                    (np.arange(layers)[:, None] * n + np.asarray(r_ids)[None, :])
                    .ravel()
                    .astype(np.int32)
                )
                h = agent.make_prepped_xfer("READ", local_h, li, remote_h, ri, b"")
                if agent.transfer(h) == "ERR":
                    raise RuntimeError("nixl transfer failed")
                hs.append(h)
            deadline = time.monotonic() + 180
            for h in hs:
                while (st := agent.check_xfer_state(h)) == "PROC":
                    if time.monotonic() > deadline:
                        raise TimeoutError("nixl transfer hung")
                if st != "DONE":
                    raise RuntimeError(f"nixl transfer state {st}")
                agent.release_xfer_handle(h)
            times.append(time.perf_counter() - t0)
        results[case["name"]] = times[1:]
    reply({"times": results})


def nixl_tls(tls: str) -> str:
    # NIXL's UCX backend insists on peer-failure handling, which the posix
    # and sysv shared-memory transports lack: it needs tcp next to sm.
    return "sm,tcp" if tls == "sm" else tls


def run_nixl(
    tls: str, layers: int, n: int, blen: int, cases: list[dict[str, Any]]
) -> dict[str, list[float]]:
    env = ucx_env(nixl_tls(tls))
    spec = json.dumps({"layers": layers, "n": n, "blen": blen})
    target = Child(["--role", "nixl-target", "--spec", spec], env)
    try:
        init = Child(["--role", "nixl-initiator", "--spec", spec], env)
        try:
            res = init.call(
                {
                    "meta": target.hello["meta"],
                    "base": target.hello["base"],
                    "cases": cases,
                },
                timeout=900,
            )
            return res["times"]
        finally:
            init.close()
    finally:
        target.close()


# ----------------------------------------------------------------- ucxx


def role_ucxx(side: str, spec_json: str) -> None:
    import ucxx  # type: ignore[import-untyped,import-not-found]  # optional

    spec = json.loads(spec_json)
    layers, n, blen = spec["layers"], spec["n"], spec["blen"]
    raw = alloc(layers * n * blen, fill=(side == "server"))
    lay = n * blen

    async def serve() -> None:
        done = asyncio.Event()

        async def handler(ep: Any) -> None:
            cases = json.loads(bytes(await recv_msg(ep)))
            for case in cases:
                for _ in range(case["rounds"] + 1):
                    go = np.empty(1, dtype=np.uint8)
                    await ep.recv(go)
                    sends = []
                    for l_ids, r_ids in case["transfers"]:
                        for lo, ro, ln in segments(l_ids, r_ids, blen):
                            for layer in range(layers):
                                o = layer * lay + ro
                                sends.append(ep.send(raw[o : o + ln]))
                    await asyncio.gather(*sends)
            await ep.close()
            done.set()

        lst = ucxx.create_listener(handler)
        reply({"port": lst.port})
        await asyncio.wait_for(done.wait(), 1800)

    async def client() -> None:
        c = json.loads(sys.stdin.readline())
        ep = await ucxx.create_endpoint("127.0.0.1", c["port"])
        payload = json.dumps(c["cases"]).encode()
        await ep.send(np.array([len(payload)], dtype=np.uint64))
        await ep.send(np.frombuffer(payload, dtype=np.uint8))
        results = {}
        for case in c["cases"]:
            times = []
            for _ in range(case["rounds"] + 1):
                t0 = time.perf_counter()
                recvs = []
                await ep.send(np.ones(1, dtype=np.uint8))
                for l_ids, r_ids in case["transfers"]:
                    for lo, ro, ln in segments(l_ids, r_ids, blen):
                        for layer in range(layers):
                            o = layer * lay + lo
                            recvs.append(ep.recv(raw[o : o + ln]))
                await asyncio.wait_for(asyncio.gather(*recvs), 180)
                times.append(time.perf_counter() - t0)
            results[case["name"]] = times[1:]
        reply({"times": results})

    async def recv_msg(ep: Any) -> np.ndarray:
        ln = np.empty(1, dtype=np.uint64)
        await ep.recv(ln)
        buf = np.empty(int(ln[0]), dtype=np.uint8)
        await ep.recv(buf)
        return buf

    if side == "server":
        asyncio.run(serve())
    else:
        reply({"ok": True})
        asyncio.run(client())


def run_ucxx(
    tls: str, layers: int, n: int, blen: int, cases: list[dict[str, Any]]
) -> dict[str, list[float]]:
    env = ucx_env(
        tls if tls != "sm" else "sm,tcp"
    )  # connection setup needs tcp sockets
    spec = json.dumps({"layers": layers, "n": n, "blen": blen})
    srv = Child(["--role", "ucxx-server", "--spec", spec], env)
    try:
        cli = Child(["--role", "ucxx-client", "--spec", spec], env)
        try:
            return cli.call({"port": srv.hello["port"], "cases": cases}, timeout=900)[
                "times"
            ]
        finally:
            cli.close()
    finally:
        srv.close(wait=30)


# ----------------------------------------------------------- ucx_perftest

PERFTEST_RE = re.compile(
    r"Final:\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)"
)


def perftest_round(tls: str, size: int, port: int, window: int = WINDOW) -> dict[str, Any]:
    """One ``ucx_perftest`` run (server + client, ``ucp_get``, ``window``
    outstanding) moving about ``TARGET_BYTES / 2``: overall GB/s and latency."""
    from pdgate.transfer import ucx_bin_dir

    bindir = ucx_bin_dir()
    assert bindir is not None
    exe = str(bindir / "ucx_perftest")
    iters = perftest_iters(size)
    args = ["-t", "ucp_get", "-s", str(size), "-n", str(iters)]
    args += ["-w", str(max(2, iters // 10)), "-O", str(window), "-p", str(port)]
    env = ucx_env(tls)
    srv = subprocess.Popen(
        [exe, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        time.sleep(0.4)
        out = subprocess.run(
            [exe, "127.0.0.1", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        ).stdout
    finally:
        try:
            srv.wait(10)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()
    m = PERFTEST_RE.search(out)
    if not m:
        return {"error": out[-400:]}
    # columns: iterations, latency 50%ile / average / overall (us),
    # bandwidth average / overall (MB/s), ...
    return {"gbps": float(m.group(6)) * 1048576 / 1e9, "lat_us": float(m.group(4))}


def perftest_iters(size: int) -> int:
    return max(20, min(2000, (TARGET_BYTES // 2) // size))


# ---------------------------------------------------------------- memcpy


def run_memcpy(
    layers: int, n: int, blen: int, case: dict[str, Any], rounds: int
) -> list[float]:
    src = alloc(layers * n * blen, fill=True)
    dst = alloc(layers * n * blen, fill=False)
    sb, db, lay = src.ctypes.data, dst.ctypes.data, n * blen
    segs = [segments(l, r, blen) for l, r in case["transfers"]]
    times = []
    for _ in range(rounds + 1):
        t0 = time.perf_counter()
        for ss in segs:
            for layer in range(layers):
                off = layer * lay
                for lo, ro, ln in ss:
                    ctypes.memmove(db + off + lo, sb + off + ro, ln)
        times.append(time.perf_counter() - t0)
    return times[1:]
