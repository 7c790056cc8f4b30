"""Kubernetes discovery fed API responses recorded from a real cluster.

``tests/unit/k8s_recorded/`` holds PodList and watch-stream bodies recorded
from a kind cluster (Kubernetes v1.36.2) by the k8s-openapi project (see its
README). A small HTTP server replays them to the real ``kubernetes`` client
(kubeconfig, list, watch decoding), filtering by the equality label selector
as the API server does; :class:`KubernetesDiscovery` turns them into fleet
instances. The recorded pods are selected by their own labels; no label is
changed.
"""

from __future__ import annotations

import json
import queue
import threading
import contextlib
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import parse_qs, urlparse

import pytest

pytest.importorskip("kubernetes")

from pdgate.config import DiscoveryConfig  # noqa: E402
from pdgate.discovery.kubernetes import KubernetesDiscovery, load_core_api, pod_endpoint  # noqa: E402
from pdgate.fleet import Fleet  # noqa: E402
from tests.unit.test_discovery_k8s import kubeconfig, urls, wait_for  # noqa: E402

REC = Path(__file__).parent / "k8s_recorded"
DNS = "k8s-app=kube-dns"                        # the two CoreDNS pods: Ready, pod IPs
SCHED = "component=kube-scheduler"              # hostNetwork pod: Ready, node IP
JOB = "job-name=k8s-openapi-tests-create-job"   # Failed, Ready=False, has an IP
DEPLOY = "k8s-openapi-tests-patch-deployment-key=k8s-openapi-tests-patch-deployment-value"  # Pending, no IP


def recorded_list(name: str) -> dict[str, Any]:
    return json.loads((REC / name).read_text())


def recorded_watch() -> list[dict[str, Any]]:
    return [json.loads(line) for line in (REC / "watch-pods.jsonl").read_text().splitlines()]


def matches(pod: dict[str, Any], selector: str) -> bool:
    """Equality-based label selector (``k=v[,k=v]``), as the API server applies it."""
    labels = pod.get("metadata", {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in (t.split("=", 1) for t in selector.split(",") if t))


class ReplayApiServer:
    """Replays recorded ``GET .../pods`` lists and watch streams.

    Args:
        lists: recorded PodList bodies; their items, filtered by the request's
            label selector, form the list answer (resourceVersion of the first).
        watch: recorded watch-stream events; each watch request gets those
            matching its selector (BOOKMARKs always), then any pushed with
            :meth:`push`, and stays open until its ``timeoutSeconds``.
    """

    def __init__(self, lists: list[dict[str, Any]], watch: list[dict[str, Any]]) -> None:
        self.items = [p for pl in lists for p in pl["items"]]
        self.rv = lists[0]["metadata"]["resourceVersion"]
        self.watch = watch
        self.extra: dict[str, queue.Queue[dict[str, Any] | None]] = {}
        self.served: list[tuple[str, str, int]] = []     # (kind, selector, events or items sent)
        me = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                u = urlparse(self.path)
                q = {k: v[0] for k, v in parse_qs(u.query).items()}
                sel = q.get("labelSelector", "")
                if not (u.path.startswith("/api/v1/namespaces/") and u.path.endswith("/pods")):
                    self.send_error(404)
                    return
                if q.get("watch") != "true":
                    items = [p for p in me.items if matches(p, sel)]
                    body = json.dumps({"kind": "PodList", "apiVersion": "v1",
                                       "metadata": {"resourceVersion": me.rv}, "items": items}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    me.served.append(("list", sel, len(items)))
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                sent = 0
                try:
                    for ev in me.watch:
                        if ev["type"] == "BOOKMARK" or matches(ev["object"], sel):
                            self._line(ev)
                            sent += 1
                    me.served.append(("watch", sel, sent))
                    extra = me.extra.setdefault(sel, queue.Queue())
                    deadline = time.monotonic() + float(q.get("timeoutSeconds", 30))
                    while time.monotonic() < deadline:
                        try:
                            more = extra.get(timeout=0.1)
                        except queue.Empty:
                            continue
                        if more is None:
                            break
                        self._line(more)
                    self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    pass

            def _line(self, ev: dict[str, Any]) -> None:
                line = json.dumps(ev).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def push(self, selector: str, ev: dict[str, Any]) -> None:
        """Stream one more event to the watchers of ``selector``."""
        self.extra.setdefault(selector, queue.Queue()).put(ev)

    def close(self) -> None:
        for q in self.extra.values():
            q.put(None)
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def discovering(cfg: DiscoveryConfig, fleet: Fleet) -> Iterator[KubernetesDiscovery]:
    """Kubernetes discovery running over ``fleet`` for the ``with`` block."""
    disc = KubernetesDiscovery(cfg, fleet, backoff_s=0.1)
    disc.start()
    try:
        yield disc
    finally:
        disc.stop()


@pytest.fixture
def cluster() -> Iterator[ReplayApiServer]:
    s = ReplayApiServer([recorded_list("pod-list.json"), recorded_list("job-pods.json"),
                         recorded_list("deployment-pods.json")], recorded_watch())
    yield s
    s.close()


def test_recorded_list_and_watch_build_the_fleet(cluster: ReplayApiServer, tmp_path: Path) -> None:
    fleet = Fleet([])
    cfg = DiscoveryConfig(type="kubernetes", namespace="kube-system", prefill_selector=SCHED,
                          decode_selector=DNS, kubeconfig=kubeconfig(tmp_path, cluster.url))
    with discovering(cfg, fleet) as disc:
        want = {"http://172.18.0.3:8000": "prefill", "http://10.244.0.3:8000": "decode",
                "http://10.244.0.2:8000": "decode"}
        wait_for(lambda: urls(fleet) == want)
        # The recorded watch (ADDED for the same pods, then a BOOKMARK) was
        # replayed to both watches and changed nothing.
        wait_for(lambda: {(k, s) for k, s, _ in cluster.served if k == "watch"} == {("watch", DNS),
                                                                                   ("watch", SCHED)})
        assert ("watch", DNS, 3) in cluster.served and ("watch", SCHED, 2) in cluster.served
        time.sleep(0.2)
        assert urls(fleet) == want and disc.errors == 0
        assert all("None" not in k for k in disc._selector_of)     # the BOOKMARK named no pod
        # A recorded CoreDNS pod object in a DELETED event (the envelope is
        # ours: no DELETED event was recorded): that pod leaves the fleet.
        gone = next(e["object"] for e in recorded_watch()
                    if e["type"] == "ADDED" and e["object"]["status"].get("podIP") == "10.244.0.2")
        cluster.push(DNS, {"type": "DELETED", "object": gone})
        wait_for(lambda: "http://10.244.0.2:8000" not in urls(fleet))
        assert urls(fleet) == {"http://172.18.0.3:8000": "prefill", "http://10.244.0.3:8000": "decode"}


def test_recorded_unready_and_ipless_pods_stay_out(cluster: ReplayApiServer, tmp_path: Path) -> None:
    """The Job's Failed pod (Ready=False, with an IP) and the Deployment's
    Pending pods (no IP) are listed and watched, yet never routed to."""
    fleet = Fleet([])
    cfg = DiscoveryConfig(type="kubernetes", namespace="default", prefill_selector=JOB,
                          decode_selector=DEPLOY, kubeconfig=kubeconfig(tmp_path, cluster.url))
    with discovering(cfg, fleet) as disc:
        wait_for(lambda: {s for k, s, _ in cluster.served if k == "watch"} == {JOB, DEPLOY})
        assert ("list", JOB, 1) in cluster.served and ("list", DEPLOY, 2) in cluster.served
        time.sleep(0.2)
        assert fleet.instances == [] and disc.errors == 0


@pytest.mark.parametrize("selector,expect", [
    (DNS, ["http://10.244.0.3:8000", "http://10.244.0.2:8000"]),
    (SCHED, ["http://172.18.0.3:8000"]),
    (JOB, [None]),                  # Failed, Ready=False
    (DEPLOY, [None, None]),         # Pending, no IP
])
def test_pod_endpoint_on_recorded_pods(cluster: ReplayApiServer, tmp_path: Path, selector: str,
                                      expect: list[str | None]) -> None:
    """``pod_endpoint`` on each recorded pod as the real client lists it (V1Pod models)."""
    cfg = DiscoveryConfig(type="kubernetes", decode_selector=selector,
                          kubeconfig=kubeconfig(tmp_path, cluster.url))
    pods = load_core_api(cfg).list_namespaced_pod("default", label_selector=selector).items
    got = [pod_endpoint(p, cfg, "decode") for p in pods]
    assert [g[0] if g else None for g in got] == expect
