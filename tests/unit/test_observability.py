"""Metric naming conventions on a running gateway's /metrics, and every metric the
Grafana dashboard queries exists where Prometheus scrapes it (gateway, vLLM
instances via the simulator, the KV connector's sidecar port)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdgate.config import GatewayConfig
from pdgate.connector.sidecar import SidecarMetrics
from pdgate.gateway import create_app
from pdgate.localfleet.vllm_server import free_port
from tests.fakes import FakeInstance, serve_app_in_thread

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "pdgate-dashboard.json"
#: Base units (Prometheus conventions) and count nouns a gauge/histogram name may end with.
UNITS = ("seconds", "bytes", "ratio", "requests", "tokens", "in_flight", "info")
#: What a series name may add to its family name, by family type.
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
            "histogram": ("_bucket", "_count", "_sum", "_created"), "summary": ("_count", "_sum", "")}


@pytest.fixture(scope="module")
def gateway_metrics() -> Iterator[str]:
    """/metrics of a gateway that served a P/D request, a stream and a fallback."""
    p, d = FakeInstance("p0").start(), FakeInstance("d0").start()
    app = create_app(GatewayConfig(prefill=[p.url], decode=[d.url], prometheus_port=free_port(),
                                   scrape={"interval_s": 0.05}))
    server, thread, url = serve_app_in_thread(app)
    try:
        body = {"model": "m", "prompt": "a b", "max_tokens": 3}
        assert httpx.post(url + "/v1/completions", json=body, timeout=10).status_code == 200
        assert httpx.post(url + "/v1/completions", json={**body, "stream": True}, timeout=10).status_code == 200
        p.behaviour.status = 500
        assert httpx.post(url + "/v1/completions", json={**body, "stream": True}, timeout=10).status_code == 200
        text = httpx.get(url + "/metrics", timeout=5).text
        side = httpx.get(f"http://127.0.0.1:{app.state.config.prometheus_port}/metrics", timeout=5).text
        assert "pdgate_requests_total" in side      # --prometheus-port serves the same registry
        yield text
    finally:
        server.should_exit = True
        thread.join(5)
        p.stop()
        d.stop()


def _families(text: str) -> dict[str, tuple[str, str, set[str]]]:
    """family name -> (type, HELP, sample names)."""
    return {f.name: (f.type, f.documentation, {s.name for s in f.samples})
            for f in text_string_to_metric_families(text)}


def test_gateway_metric_names_follow_conventions(gateway_metrics: str) -> None:
    fams = {n: v for n, v in _families(gateway_metrics).items() if n.startswith("pdgate_")}
    assert len(fams) >= 14
    bad = []
    for name, (typ, help_, samples) in fams.items():
        if name.endswith("_created"):
            continue  # prometheus_client's automatic creation-time series
        if typ == "counter" and not all(x.endswith(("_total", "_created")) for x in samples):
            bad.append(f"{name}: counter samples not named *_total: {samples}")
        if not re.fullmatch(r"pdgate_[a-z][a-z0-9_]*[a-z0-9]", name) or "__" in name:
            bad.append(f"{name}: not snake_case pdgate_<what>_<unit>")
        if len(help_.strip()) < 10:
            bad.append(f"{name}: no HELP text")
        if typ == "counter":
            continue  # exposed as <name>_total; <name> itself is the <what>
        boolean = help_.startswith("1 when")
        if not boolean and not name.endswith(UNITS):
            bad.append(f"{name} ({typ}): no unit suffix {UNITS}")
        if typ == "histogram" and name.endswith(("_total", "_count")):
            bad.append(f"{name}: histogram named like a counter")
        if "time" in help_.lower() and typ in ("histogram", "gauge") and not name.endswith("_seconds"):
            bad.append(f"{name}: a time not in _seconds")
    assert not bad, "\n".join(bad)


def test_naming_check_can_fail() -> None:
    text = '# HELP pdgate_waiting x\n# TYPE pdgate_waiting gauge\npdgate_waiting 1.0\n'
    [(typ, help_, _)] = _families(text).values()
    assert typ == "gauge" and not "pdgate_waiting".endswith(UNITS) and len(help_) < 10


def dashboard_metric_names() -> set[str]:
    """Every metric name the dashboard's PromQL expressions select."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dash["templating"]["list"] if v.get("type") == "query"]
    assert len(exprs) >= 16
    names: set[str] = set()
    for e in exprs:
        e = re.sub(r"\{[^}]*\}", "", e)            # drop label matchers (le="...", job=~...)
        e = re.sub(r"\[[^\]]*\]", "", e)           # and ranges
        for tok in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", e):
            if tok.startswith(("pdgate_", "vllm:")):
                names.add(tok)
    return names


def _series_exists(name: str, fams: dict[str, tuple[str, str, set[str]]]) -> bool:
    """``name`` is a sample of some family, or a legal series of a declared family
    (labelled families without samples yet, e.g. fallbacks by reason)."""
    for fam, (typ, _, samples) in fams.items():
        if name in samples:
            return True
        if name.startswith(fam) and name[len(fam):] in SUFFIXES.get(typ, ()):
            return True
    return False


def test_dashboard_metrics_exist(gateway_metrics: str) -> None:
    from pdgate.sim import SimFleet

    names = dashboard_metric_names()
    assert {"pdgate_requests_total", "pdgate_time_to_first_token_seconds_bucket",
            "pdgate_route_decisions_total", "pdgate_prefill_fallbacks_total",
            "pdgate_kv_transfer_bytes_total", "vllm:num_requests_running"} <= names
    sidecar = SidecarMetrics("e0", "kv_consumer")
    sidecar.observe({"xfer_seconds": [0.01], "xfer_bytes": [4096], "failures": [1], "expired": [1],
                     "released": [1]})
    with SimFleet(1, 1) as fleet:
        vllm_text = httpx.get(fleet.decode_urls[0] + "/metrics", timeout=5).text
    sources = {"gateway": _families(gateway_metrics), "vllm": _families(vllm_text),
               "connector": _families(sidecar.render().decode())}
    missing = []
    for n in sorted(names):
        src = "vllm" if n.startswith("vllm:") else "connector" if n.startswith("pdgate_kv_") else "gateway"
        if not _series_exists(n, sources[src]):
            missing.append(f"{n} (expected on the {src} /metrics)")
    assert not missing, "dashboard queries metrics nobody exports:\n" + "\n".join(missing)
    # the check itself can fail
    assert not _series_exists("pdgate_no_such_metric_total", sources["gateway"])
    assert not _series_exists("pdgate_requests_bucket", sources["gateway"])


def test_sidecar_serves_its_registry() -> None:
    s = SidecarMetrics("eng", "kv_producer")
    port = s.serve(0, "127.0.0.1")
    try:
        s.observe({"released": [1, 1]})
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert 'pdgate_kv_released_total{engine_id="eng",role="kv_producer"} 2.0' in text
        fams = _families(text)
        assert all(len(h) >= 10 for _, h, _ in fams.values())
    finally:
        s.stop()
