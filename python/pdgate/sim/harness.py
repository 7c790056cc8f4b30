"""Processes and replays for benchmarks on simulated fleets.

Each benchmark run gets a fresh simulated fleet (``pdgate sim-fleet`` in its
own process, clean caches) and a router in front of it (vllm-router or
``pdgate serve``, also their own processes); the trace is replayed by
:func:`pdgate.bench.replay.run_replay` in the calling process.

Time: the fleet runs ``speed`` times faster than real time, so the replay's
arrival gaps are divided by ``speed * rate_scale`` and every measured wall
time is multiplied by ``speed`` to get simulated seconds
(:func:`to_sim_time`). Router and client overheads are real wall time and so
appear ``speed`` times larger in simulated time: keep ``speed`` small
(results state it).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import httpx

from pdgate.bench.metrics import RequestRecord, meets_slos
from pdgate.localfleet.vllm_server import free_port


@dataclasses.dataclass
class RouterSpec:
    """One router configuration in front of a fleet.

    Attributes:
        label: name in tables and plots.
        kind: ``vllm-router`` or ``pdgate``.
        mode: ``pd`` (prefill + decode pools) or ``agg`` (aggregated fleet).
        args: extra command-line flags (vllm-router) or config fields (pdgate).
    """

    label: str
    kind: str
    mode: str = "pd"
    args: dict[str, Any] = dataclasses.field(default_factory=dict)


def vllm_router_bin() -> str | None:
    """Path of the ``vllm-router`` executable (next to this interpreter first)."""
    cand = Path(sys.executable).parent / "vllm-router"
    return str(cand) if cand.exists() else shutil.which("vllm-router")


def stop_process(p: "subprocess.Popen[Any] | None", grace_s: float = 10.0) -> None:
    """SIGTERM ``p`` and wait up to ``grace_s`` seconds, then SIGKILL it; no-op if it has exited."""
    if p is not None and p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


class Proc:
    """A child process with its log file; stopped by :meth:`stop` (SIGTERM, then SIGKILL)."""

    def __init__(self, cmd: list[str], log_path: str, env: dict[str, str] | None = None,
                 cpus: Sequence[int] | None = None) -> None:
        self.cmd = cmd
        self.log_path = log_path
        log = open(log_path, "ab")  # noqa: SIM115 - the child owns it
        pre = ["taskset", "-c", ",".join(map(str, cpus))] if cpus and shutil.which("taskset") else []
        self.p = subprocess.Popen(pre + cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)
        log.close()

    def alive(self) -> bool:
        return self.p.poll() is None

    def log_tail(self, n: int = 2000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        stop_process(self.p)


def wait_ready(url: str, proc: Proc, timeout_s: float = 60.0, path: str = "/health") -> None:
    """Poll ``url + path`` until 200; raise with the log tail if the process dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.cmd[0]} exited:\n{proc.log_tail()}")
        try:
            if httpx.get(url + path, timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout_s} s:\n{proc.log_tail()}")


def start_sim_fleet(n_prefill: int, n_decode: int, n_both: int, profile: str, speed: float, log_dir: str,
                    extra: Sequence[str] = (), cpus: Sequence[int] | None = None) -> tuple[Proc, dict[str, Any]]:
    """``pdgate sim-fleet`` in a child process; returns it and its description (urls)."""
    info = tempfile.mktemp(prefix="simfleet-", suffix=".json", dir=log_dir)
    cmd = [sys.executable, "-m", "pdgate", "sim-fleet", "--prefill", str(n_prefill), "--decode", str(n_decode),
           "--both", str(n_both), "--profile", profile, "--time-scale", str(speed), "--info", info, *extra]
    proc = Proc(cmd, os.path.join(log_dir, "sim-fleet.log"), cpus=cpus)
    deadline = time.monotonic() + 60
    while not os.path.exists(info) or os.path.getsize(info) == 0:
        if not proc.alive() or time.monotonic() > deadline:
            proc.stop()
            raise RuntimeError(f"sim-fleet did not start:\n{proc.log_tail()}")
        time.sleep(0.1)
    time.sleep(0.05)
    with open(info) as f:
        return proc, json.load(f)


def start_router(spec: RouterSpec, urls: dict[str, list[str]], log_dir: str,
                 cpus: Sequence[int] | None = None) -> tuple[Proc, str]:
    """Start the router of ``spec`` in front of ``urls``; returns (process, base url)."""
    port = free_port()
    log = os.path.join(log_dir, f"router-{spec.label.replace('/', '_').replace(' ', '_')}.log")
    if spec.kind == "vllm-router":
        exe = vllm_router_bin()
        if exe is None:
            raise RuntimeError("vllm-router is not installed (pip install vllm-router)")
        cmd = [exe, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
               # its Prometheus exporter has a fixed default port: two routers would clash
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        if spec.mode == "pd":
            cmd.append("--vllm-pd-disaggregation")
            for u in urls["prefill"]:
                cmd += ["--prefill", u]
            for u in urls["decode"]:
                cmd += ["--decode", u]
        else:
            cmd += ["--worker-urls", *urls["both"]]
        for k, v in spec.args.items():
            cmd += [f"--{k.replace('_', '-')}", str(v)]
        proc = Proc(cmd, log, cpus=cpus)
    elif spec.kind == "pdgate":
        cfg: dict[str, Any] = {"host": "127.0.0.1", "port": port, "log_level": "warning",
                               "prefill": urls.get("prefill", []), "decode": urls.get("decode") or urls["both"]}
        cfg.update(spec.args)
        path = os.path.join(log_dir, f"pdgate-{port}.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        proc = Proc([sys.executable, "-m", "pdgate", "serve", "--config", path], log, cpus=cpus)
    else:
        raise ValueError(f"unknown router kind {spec.kind!r}")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, 60.0)
    except BaseException:
        proc.stop()
        raise
    return proc, url


def to_sim_time(records: Sequence[RequestRecord], speed: float) -> list[RequestRecord]:
    """Copies of ``records`` with every time multiplied by ``speed`` (wall -> simulated seconds)."""
    out = []
    for r in records:
        c = copy.copy(r)
        c.scheduled_s = r.scheduled_s * speed
        c.send_s = None if r.send_s is None else r.send_s * speed
        c.end_s = None if r.end_s is None else r.end_s * speed
        c.chunk_times_s = [t * speed for t in r.chunk_times_s]
        out.append(c)
    return out


def slo_attainment(records: Sequence[RequestRecord], ttft_s: float, tpot_s: float,
                   scales: Sequence[float] = (1.0,)) -> dict[str, float]:
    """Fraction of all requests meeting ``TTFT <= ttft_s * k`` and ``TPOT <= tpot_s * k`` per scale ``k``
    (DistServe's SLO-scale sweep); failed requests count as misses."""
    n = len(records) or 1
    return {f"{k:g}": sum(1 for r in records if meets_slos(r, {"ttft": ttft_s * k, "tpot": tpot_s * k})) / n
            for k in scales}


def read_counters(url: str, names: Sequence[str]) -> list[tuple[str, dict[str, str], float]] | None:
    """Samples ``(name, labels, value)`` of ``url``'s ``/metrics`` whose sample name is in
    ``names`` (e.g. ``vllm:num_preemptions_total``, ``pdgate_route_decisions_total``);
    ``None`` if the scrape fails."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url + "/metrics", timeout=5, trust_env=False).text
    except httpx.HTTPError:
        return None
    want = set(names)
    return [(smp.name, dict(smp.labels), float(smp.value))
            for fam in text_string_to_metric_families(text) for smp in fam.samples if smp.name in want]


def scrape_fleet(urls: Sequence[str]) -> dict[str, dict[str, float]]:
    """Selected counters of each instance's ``/metrics`` (preemptions, loop lag, transfers),
    summed over labels."""
    keys = ("vllm:num_preemptions_total", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
            "pdgate_sim_kv_transfers_total", "pdgate_sim_kv_load_failures_total",
            "pdgate_sim_loop_lag_seconds_sum", "pdgate_sim_loop_lag_seconds_count", "vllm:request_success_total",
            "vllm:prompt_tokens_total")
    out: dict[str, dict[str, float]] = {}
    for u in urls:
        samples = read_counters(u, keys)
        if samples is None:
            continue
        vals: dict[str, float] = {}
        for name, _, v in samples:
            vals[name] = vals.get(name, 0.0) + v
        out[u] = vals
    return out