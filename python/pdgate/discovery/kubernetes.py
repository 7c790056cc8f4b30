"""Kubernetes pod discovery with the official ``kubernetes`` Python client.

Pods are selected by label selectors: ``prefill_selector`` and
``decode_selector`` (one watch each, the selector gives the role), or one
``selector`` plus ``role_label`` (the label's value, ``prefill`` / ``decode``
/ ``both``, gives the role). An optional ``pool_label`` names a pod's
context-length pool.

A pod is routable when it is Running, has a pod IP, its ``Ready`` condition
is ``True`` and it is not being deleted; its URL is
``<scheme>://<pod IP>:<port>`` (``port`` from the config, or the pod
annotation ``port_annotation``). Routable pods are added to the fleet
(:meth:`pdgate.fleet.Fleet.add`); pods that stop being routable or are deleted
are removed (:meth:`Fleet.remove`; requests already there finish). Only
instances this discovery added are ever removed, so static ones stay.

Each selector runs in a daemon thread (the client is synchronous): list the
pods, reconcile, then watch from the list's ``resourceVersion`` for
``watch_timeout_s``; on expiry, a ``410 Gone`` or any API error it lists
again (after a back-off for errors), so missed events heal. Fleet changes
are applied on the gateway's event loop when one is given.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable

from pdgate.config import DiscoveryConfig, Role
from pdgate.fleet import Fleet

log = logging.getLogger("pdgate.discovery")

_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
_ROLES = ("prefill", "decode", "both")


def load_core_api(cfg: DiscoveryConfig) -> Any:
    """A ``CoreV1Api`` from ``cfg.kubeconfig``, else in-cluster config, else ``~/.kube/config``.

    Raises:
        kubernetes.config.ConfigException: no usable configuration.
    """
    from kubernetes import client, config

    if cfg.kubeconfig:
        return client.CoreV1Api(config.new_client_from_config(config_file=cfg.kubeconfig))
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CoreV1Api()


def default_namespace(cfg: DiscoveryConfig) -> str:
    """``cfg.namespace``, else the pod's own namespace (service account), else ``default``."""
    if cfg.namespace:
        return cfg.namespace
    try:
        with open(_NAMESPACE_FILE) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def _get(obj: Any, *path: str) -> Any:
    """Attribute path on a client model (snake_case) or a dict (camelCase keys)."""
    for p in path:
        if obj is None:
            return None
        if isinstance(obj, dict):  # raw JSON: podIP, deletionTimestamp...
            want = p.replace("_", "").lower()
            obj = next((v for k, v in obj.items() if k.lower() == want), None)
        else:
            obj = getattr(obj, p, None)
    return obj


def pod_endpoint(pod: Any, cfg: DiscoveryConfig, role: Role | None) -> tuple[str, Role, str | None] | None:
    """``(url, role, pool)`` of a routable pod, ``None`` if it is not routable.

    ``role`` is the selector's role, or ``None`` to read ``cfg.role_label``.
    """
    labels = _get(pod, "metadata", "labels") or {}
    if role is None:
        value = labels.get(cfg.role_label or "")
        if value not in _ROLES:
            return None
        role = value
    if _get(pod, "metadata", "deletion_timestamp") is not None:
        return None
    if _get(pod, "status", "phase") != "Running":
        return None
    ip = _get(pod, "status", "pod_ip")
    if not ip:
        return None
    conditions = _get(pod, "status", "conditions") or []
    if not any(_get(c, "type") == "Ready" and _get(c, "status") == "True" for c in conditions):
        return None
    annotations = _get(pod, "metadata", "annotations") or {}
    port = cfg.port
    if cfg.port_annotation and str(annotations.get(cfg.port_annotation, "")).isdigit():
        port = int(annotations[cfg.port_annotation])
    host = f"[{ip}]" if ":" in ip else ip
    pool = labels.get(cfg.pool_label) if cfg.pool_label else None
    return f"{cfg.scheme}://{host}:{port}", role, pool


class KubernetesDiscovery:
    """Keeps a :class:`Fleet` in sync with the selected pods.

    Args:
        cfg: the ``discovery`` config.
        fleet: the fleet to update.
        api: a ``kubernetes.client.CoreV1Api`` (default: :func:`load_core_api`).
        loop: event loop owning ``fleet`` (``None``: apply changes in the watch thread).
        backoff_s: wait after an API error before listing again.
    """

    def __init__(self, cfg: DiscoveryConfig, fleet: Fleet, api: Any = None,
                 loop: asyncio.AbstractEventLoop | None = None, backoff_s: float = 2.0) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.api = api if api is not None else load_core_api(cfg)
        self.loop = loop
        self.backoff_s = backoff_s
        self.namespace = default_namespace(cfg)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watches: list[Any] = []
        self._lock = threading.Lock()
        #: pod key (namespace/name) -> URL this discovery added for it
        self.pods: dict[str, str] = {}
        #: pod key -> the selector that saw it (a relist removes only its own pods)
        self._selector_of: dict[str, str] = {}
        self.errors = 0

    def selectors(self) -> list[tuple[str, Role | None]]:
        """(label selector, role or None = from ``role_label``) to watch."""
        c = self.cfg
        if c.role_label and c.selector:
            return [(c.selector, None)]
        out: list[tuple[str, Role | None]] = []
        if c.prefill_selector:
            out.append((c.prefill_selector, "prefill"))
        if c.decode_selector:
            out.append((c.decode_selector, "decode"))
        return out

    def start(self) -> None:
        """Start one watch thread per selector."""
        for selector, role in self.selectors():
            t = threading.Thread(target=self._run, args=(selector, role), daemon=True,
                                 name=f"pdgate-k8s-{role or 'pods'}")
            t.start()
            self._threads.append(t)
        log.info("kubernetes discovery in namespace %s: %s", self.namespace, self.selectors())

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop watching (pods found so far stay in the fleet); idempotent."""
        self._stop.set()
        for w in list(self._watches):
            w.stop()
            resp = getattr(w, "_resp", None)  # unblock a read waiting for the next event
            if resp is not None:
                try:
                    getattr(resp, "shutdown", resp.close)()
                except Exception:  # noqa: BLE001, S110 - already closed
                    pass
        for t in self._threads:
            t.join(timeout_s)

    # -- fleet updates (on the loop when given) ------------------------------
    def _apply(self, fn: Callable[[], None]) -> None:
        if self.loop is not None and self.loop.is_running():
            done = threading.Event()

            def run() -> None:
                try:
                    fn()
                finally:
                    done.set()

            self.loop.call_soon_threadsafe(run)
            done.wait(10.0)
        else:
            fn()

    def _set(self, key: str, endpoint: tuple[str, Role, str | None] | None) -> None:
        """Make pod ``key`` routable at ``endpoint`` (or not routable: ``None``)."""
        with self._lock:
            old = self.pods.get(key)
            new = endpoint[0] if endpoint else None
            if old == new:
                return
            if old is not None:
                del self.pods[key]
            added = False
            if endpoint is not None and self.fleet.get(endpoint[0]) is None:
                self.pods[key] = endpoint[0]
                added = True

        def change() -> None:
            if old is not None:
                self.fleet.remove(old)
                log.info("discovery: removed %s (pod %s)", old, key)
            if added and endpoint is not None:
                url, role, pool = endpoint
                if pool is not None and pool not in self.fleet.pools:
                    log.warning("discovery: pod %s names unknown pool %r; added without pool", key, pool)
                    pool = None
                try:
                    self.fleet.add(url, role, pool)
                    log.info("discovery: added %s as %s (pod %s)", url, role, key)
                except ValueError:
                    pass  # a static instance with that URL exists

        self._apply(change)

    # -- list + watch -----------------------------------------------------------
    @staticmethod
    def _key(pod: Any) -> str:
        return f"{_get(pod, 'metadata', 'namespace')}/{_get(pod, 'metadata', 'name')}"

    def _owned_by(self, selector: str) -> set[str]:
        with self._lock:
            return {k for k in self.pods if self._selector_of.get(k) == selector}

    def _relist(self, selector: str, role: Role | None) -> str:
        """List the pods, reconcile, return the list's resourceVersion."""
        pods = self.api.list_namespaced_pod(self.namespace, label_selector=selector)
        seen = set()
        for pod in pods.items or []:
            key = self._key(pod)
            seen.add(key)
            self._selector_of[key] = selector
            self._set(key, pod_endpoint(pod, self.cfg, role))
        for key in self._owned_by(selector) - seen:
            self._set(key, None)
        return str(pods.metadata.resource_version)

    def _run(self, selector: str, role: Role | None) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        while not self._stop.is_set():
            try:
                rv = self._relist(selector, role)
                w = watch.Watch()
                self._watches.append(w)
                try:
                    for ev in w.stream(self.api.list_namespaced_pod, self.namespace, label_selector=selector,
                                       resource_version=rv, timeout_seconds=self.cfg.watch_timeout_s):
                        if self._stop.is_set():
                            break
                        kind = ev["type"]
                        if kind not in ("ADDED", "MODIFIED", "DELETED"):
                            continue  # BOOKMARK: only a resourceVersion, no pod
                        pod = ev["object"]
                        key = self._key(pod)
                        self._selector_of[key] = selector
                        if kind == "DELETED":
                            self._set(key, None)
                        else:
                            self._set(key, pod_endpoint(pod, self.cfg, role))
                finally:
                    self._watches.remove(w)
            except ApiException as e:
                if e.status == 410:  # resourceVersion too old: list again at once
                    log.info("discovery: watch of %r expired (410); listing again", selector)
                    continue
                self._error(selector, e)
            except Exception as e:  # noqa: BLE001 - API server down, network: retry
                if self._stop.is_set():
                    return
                self._error(selector, e)

    def _error(self, selector: str, e: BaseException) -> None:
        self.errors += 1
        log.warning("discovery: watching %r failed (%r); retrying in %.1f s", selector, e, self.backoff_s)
        self._stop.wait(self.backoff_s)
