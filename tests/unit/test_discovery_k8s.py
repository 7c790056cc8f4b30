"""Kubernetes discovery with the real ``kubernetes`` client against a fake API
server replaying recorded-shape API responses (PodList JSON, watch streams of
JSON lines, a 410 Gone ERROR event).

No real API server runs here: kind/k3s/envtest need container images or
binaries from registries this machine cannot reach, so the API is replayed.
The client, its kubeconfig loading, its HTTP requests and its watch decoding
are the real ones.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import parse_qs, urlparse

import pytest

pytest.importorskip("kubernetes")

from pdgate.config import DiscoveryConfig, GatewayConfig  # noqa: E402
from pdgate.discovery.kubernetes import KubernetesDiscovery, pod_endpoint  # noqa: E402
from pdgate.fleet import Fleet, Instance  # noqa: E402

NS = "llm"


def pod(name: str, role: str, ip: str | None = "10.0.0.1", ready: bool = True, phase: str = "Running",
        deleting: bool = False, rv: str = "100", annotations: dict[str, str] | None = None,
        pool: str | None = None) -> dict[str, Any]:
    """A Pod as the API server returns it (trimmed to what the client models read)."""
    labels = {"app.kubernetes.io/name": "vllm", "pdgate.io/role": role}
    if pool:
        labels["pdgate.io/pool"] = pool
    meta: dict[str, Any] = {"name": name, "namespace": NS, "uid": f"uid-{name}", "resourceVersion": rv,
                            "labels": labels, "annotations": annotations or {},
                            "creationTimestamp": "2026-11-29T17:00:00Z"}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-29T18:00:00Z"
    status: dict[str, Any] = {"phase": phase, "conditions": [
        {"type": "Initialized", "status": "True"},
        {"type": "Ready", "status": "True" if ready else "False"},
        {"type": "ContainersReady", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    return {"kind": "Pod", "apiVersion": "v1", "metadata": meta,
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}, "status": status}


class FakeApiServer:
    """Serves ``GET /api/v1/namespaces/<ns>/pods`` (list, and watch=true streams)."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}       # name -> pod (the list view)
        self.rv = 100
        self.watches: dict[str, queue.Queue[dict[str, Any] | None]] = {}  # selector -> events
        self.requests: list[dict[str, Any]] = []
        me = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                u = urlparse(self.path)
                q = {k: v[0] for k, v in parse_qs(u.query).items()}
                me.requests.append({"path": u.path, **q, "auth": self.headers.get("Authorization")})
                if u.path != f"/api/v1/namespaces/{NS}/pods":
                    self.send_error(404)
                    return
                sel = q.get("labelSelector", "")
                if q.get("watch") != "true":
                    k, v = sel.split("=", 1) if "=" in sel else ("", "")
                    items = [p for p in me.pods.values() if p["metadata"]["labels"].get(k) == v]
                    body = json.dumps({"kind": "PodList", "apiVersion": "v1",
                                       "metadata": {"resourceVersion": str(me.rv)}, "items": items}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                events = me.watches.setdefault(sel, queue.Queue())
                deadline = time.monotonic() + float(q.get("timeoutSeconds", 30))
                try:
                    while time.monotonic() < deadline:
                        try:
                            ev = events.get(timeout=0.1)
                        except queue.Empty:
                            continue
                        if ev is None:
                            break
                        line = json.dumps(ev).encode() + b"\n"
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def put(self, p: dict[str, Any], kind: str = "MODIFIED", selector: str = "pdgate.io/role=decode") -> None:
        """Change a pod: update the list view and stream the event to watchers of ``selector``."""
        self.rv += 1
        p["metadata"]["resourceVersion"] = str(self.rv)
        if kind == "DELETED":
            self.pods.pop(p["metadata"]["name"], None)
        else:
            self.pods[p["metadata"]["name"]] = p
        self.watches.setdefault(selector, queue.Queue()).put({"type": kind, "object": p})

    def gone(self, selector: str) -> None:
        """The watch's resourceVersion expired: an ERROR event with a 410 Status."""
        self.watches.setdefault(selector, queue.Queue()).put(
            {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                         "message": "too old resource version: 101 (200)", "reason": "Expired",
                                         "code": 410}})

    def close(self) -> None:
        for q in self.watches.values():
            q.put(None)
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    s = FakeApiServer()
    yield s
    s.close()


def kubeconfig(tmp_path: Path, server: str) -> str:
    f = tmp_path / "kubeconfig"
    f.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "gw", "user": {"token": "s3cret"}}],
        "contexts": [{"name": "test", "context": {"cluster": "fake", "user": "gw", "namespace": NS}}]}))
    return str(f)


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def urls(fleet: Fleet) -> dict[str, str]:
    return {i.url: i.role for i in fleet.instances}


def test_watch_adds_ready_pods_and_removes_unready_or_deleted(api: FakeApiServer, tmp_path: Path) -> None:
    P, D = "pdgate.io/role=prefill", "pdgate.io/role=decode"
    api.pods = {"p1": pod("p1", "prefill", "10.0.0.1"), "d1": pod("d1", "decode", "10.0.1.1"),
                "d2": pod("d2", "decode", "10.0.1.2", ready=False)}
    static = Instance(url="http://static-d:8000", role="decode")
    fleet = Fleet([static])
    cfg = DiscoveryConfig(type="kubernetes", namespace=NS, prefill_selector=P, decode_selector=D, port=8100,
                          kubeconfig=kubeconfig(tmp_path, api.url), watch_timeout_s=30)
    disc = KubernetesDiscovery(cfg, fleet, backoff_s=0.1)
    disc.start()
    try:
        wait_for(lambda: len(fleet.instances) == 3)
        assert urls(fleet) == {"http://static-d:8000": "decode", "http://10.0.0.1:8100": "prefill",
                               "http://10.0.1.1:8100": "decode"}
        lists = [r for r in api.requests if r.get("watch") != "true"]
        assert {r["labelSelector"] for r in lists} == {P, D}
        assert all(r["auth"] == "Bearer s3cret" for r in api.requests)   # kubeconfig token used
        wait_for(lambda: {r.get("labelSelector") for r in api.requests if r.get("watch") == "true"} == {P, D})
        assert all(r["resourceVersion"] == "100" for r in api.requests if r.get("watch") == "true")

        api.put(pod("d2", "decode", "10.0.1.2", ready=True))                 # became Ready
        wait_for(lambda: "http://10.0.1.2:8100" in urls(fleet))
        api.put(pod("p1", "prefill", "10.0.0.1", ready=False), selector=P)  # not Ready any more
        wait_for(lambda: "http://10.0.0.1:8100" not in urls(fleet))
        api.put(pod("d1", "decode", "10.0.1.1"), "DELETED")
        wait_for(lambda: "http://10.0.1.1:8100" not in urls(fleet))
        api.put(pod("d3", "decode", None, phase="Pending"), "ADDED")        # no IP yet
        api.put(pod("d4", "decode", "10.0.1.4", annotations={"pdgate.io/port": "9001"}), "ADDED")
        wait_for(lambda: "http://10.0.1.4:9001" in urls(fleet))
        assert not any("None" in u for u in urls(fleet))
        api.put(pod("d4", "decode", "10.0.1.4", deleting=True))             # terminating: drain
        wait_for(lambda: "http://10.0.1.4:9001" not in urls(fleet))
        api.put(pod("d3", "decode", "10.0.1.3"))                            # got its IP, Ready
        wait_for(lambda: "http://10.0.1.3:8100" in urls(fleet))
        assert urls(fleet) == {"http://static-d:8000": "decode", "http://10.0.1.2:8100": "decode",
                               "http://10.0.1.3:8100": "decode"}

        # 410 Gone: the client raises, discovery lists again and reconciles
        # (d2 vanished from the list while the watch was broken).
        api.pods.pop("d2")
        api.pods["d5"] = pod("d5", "decode", "10.0.1.5")
        api.rv = 300
        api.gone(D)
        wait_for(lambda: "http://10.0.1.5:8100" in urls(fleet) and "http://10.0.1.2:8100" not in urls(fleet))
        assert any(r.get("watch") == "true" and r["resourceVersion"] == "300" for r in api.requests)
        assert fleet.get("http://static-d:8000") is static                  # static instance untouched
    finally:
        t = time.monotonic()
        disc.stop()
        assert time.monotonic() - t < 5


def test_role_label_selector_and_pools(api: FakeApiServer, tmp_path: Path) -> None:
    api.pods = {"a": pod("a", "prefill", "10.1.0.1", pool="short"), "b": pod("b", "both", "10.1.0.2"),
                "c": pod("c", "router", "10.1.0.3")}
    for p in api.pods.values():
        p["metadata"]["labels"]["app"] = "llm"
    fleet = Fleet([], pools=GatewayConfig(decode=["http://x:1"], pools={"short": {"max_tokens": 512}}).pools)
    cfg = DiscoveryConfig(type="kubernetes", namespace=NS, selector="app=llm", role_label="pdgate.io/role",
                          pool_label="pdgate.io/pool", kubeconfig=kubeconfig(tmp_path, api.url))
    disc = KubernetesDiscovery(cfg, fleet, backoff_s=0.1)
    disc.start()
    try:
        wait_for(lambda: len(fleet.instances) == 2)
        got = {i.url: (i.role, i.pool) for i in fleet.instances}
        assert got == {"http://10.1.0.1:8000": ("prefill", "short"), "http://10.1.0.2:8000": ("both", None)}
    finally:
        disc.stop()


def test_api_errors_back_off_and_recover(tmp_path: Path) -> None:
    """API server unreachable at first: discovery keeps retrying, then syncs."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    fleet = Fleet([])
    cfg = DiscoveryConfig(type="kubernetes", namespace=NS, decode_selector="pdgate.io/role=decode",
                          kubeconfig=kubeconfig(tmp_path, f"http://127.0.0.1:{port}"))
    disc = KubernetesDiscovery(cfg, fleet, backoff_s=0.05)
    disc.start()
    try:
        wait_for(lambda: disc.errors >= 2)
        assert fleet.instances == []
    finally:
        disc.stop()


@pytest.mark.parametrize("kw,expect", [
    ({}, "http://10.0.0.9:8000"),
    ({"ready": False}, None), ({"ip": None}, None), ({"phase": "Pending"}, None),
    ({"deleting": True}, None), ({"ip": "fd00::9"}, "http://[fd00::9]:8000"),
])
def test_pod_endpoint(kw: dict, expect: str | None) -> None:
    kw.setdefault("ip", "10.0.0.9")
    ep = pod_endpoint(pod("x", "decode", **kw), DiscoveryConfig(), "decode")
    assert (ep[0] if ep else None) == expect


def test_config_requires_selectors() -> None:
    with pytest.raises(ValueError, match="decode_selector"):
        DiscoveryConfig(type="kubernetes")
    # no static decode instance needed when pods are discovered
    cfg = GatewayConfig(discovery={"type": "kubernetes", "decode_selector": "r=d"})
    assert cfg.decode == []


def test_gateway_routes_to_discovered_pods(api: FakeApiServer, tmp_path: Path) -> None:
    """``discovery.type: kubernetes`` in the gateway: no static instances; a
    completion is served by the pods once they are Ready."""
    import httpx

    from pdgate.gateway import create_app
    from tests.fakes import FakeInstance, serve_app_in_thread

    p, d = FakeInstance("p0").start(), FakeInstance("d0").start()
    api.pods = {"p": pod("p", "prefill", "127.0.0.1", annotations={"pdgate.io/port": str(p.port)}),
                "d": pod("d", "decode", "127.0.0.1", ready=False, annotations={"pdgate.io/port": str(d.port)})}
    cfg = GatewayConfig(discovery={"type": "kubernetes", "namespace": NS,
                                   "prefill_selector": "pdgate.io/role=prefill",
                                   "decode_selector": "pdgate.io/role=decode",
                                   "kubeconfig": kubeconfig(tmp_path, api.url)})
    app = create_app(cfg)
    server, thread, url = serve_app_in_thread(app)
    try:
        wait_for(lambda: len(app.state.fleet.instances) == 1)
        api.put(pod("d", "decode", "127.0.0.1", annotations={"pdgate.io/port": str(d.port)}))
        wait_for(lambda: len(app.state.fleet.instances) == 2)
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "a b", "max_tokens": 2}, timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "t0 t1"
        assert len(p.received) == 1 and len(d.received) == 1     # both legs went to the pods
    finally:
        server.should_exit = True
        thread.join(10)
        p.stop()
        d.stop()
