"""PdgateConnector's own Prometheus endpoint (a sidecar port of each vLLM instance).

vLLM ships connector stats to its API server (the ``vllm:pdgate_kv_*``
metrics on the instance's ``/metrics``, :mod:`pdgate.connector.metrics`),
but only while its stats logging is on, and folded into the engine's
metrics. The worker process also exports them itself, on a port of its own,
when ``kv_connector_extra_config.metrics_port`` (env
``PDGATE_KV_METRICS_PORT``; + data-parallel index) is set; Prometheus then
scrapes it as a sidecar target next to the instance
(``deploy/prometheus/prometheus.yml``). Names, all with label ``engine_id``
and ``role`` (``kv_producer`` / ``kv_consumer``):

- ``pdgate_kv_transfer_seconds`` (histogram): one decode-side pull, from
  posting the read to the data having landed;
- ``pdgate_kv_transfer_bytes_total``: bytes pulled (decode);
- ``pdgate_kv_transfers_total``: successful pulls (decode);
- ``pdgate_kv_transfer_failures_total``: failed pulls or handshakes (decode);
- ``pdgate_kv_expired_leases_total``: requests whose blocks the prefill side
  freed because no decode instance read them in time (prefill);
- ``pdgate_kv_released_total``: requests whose blocks the prefill side freed
  on a decode notification (prefill).

No vLLM import: usable (and tested) without vLLM.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

log = logging.getLogger("vllm.pdgate_connector")

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class SidecarMetrics:
    """The connector's transfer metrics in a registry of their own.

    Args:
        engine_id: this instance's transfer engine id (label ``engine_id``).
        role: ``kv_producer``, ``kv_consumer`` or ``kv_both`` (label ``role``).
    """

    def __init__(self, engine_id: str, role: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, labels = self.registry, ["engine_id", "role"]
        values = (engine_id, role)
        self.seconds = Histogram("pdgate_kv_transfer_seconds",
                                 "Duration of one PdgateConnector KV pull (decode side), seconds.",
                                 labels, buckets=_BUCKETS, registry=r).labels(*values)
        self.bytes = Counter("pdgate_kv_transfer_bytes", "Bytes of KV cache pulled by PdgateConnector.",
                             labels, registry=r).labels(*values)
        self.transfers = Counter("pdgate_kv_transfers", "Successful PdgateConnector KV pulls.",
                                 labels, registry=r).labels(*values)
        self.failures = Counter("pdgate_kv_transfer_failures",
                                "Failed PdgateConnector KV pulls or handshakes (reported as load errors).",
                                labels, registry=r).labels(*values)
        self.expired = Counter("pdgate_kv_expired_leases",
                               "Requests whose prefill-side blocks were freed by lease expiry (unread).",
                               labels, registry=r).labels(*values)
        self.released = Counter("pdgate_kv_released",
                                "Requests whose prefill-side blocks were freed on a decode notification.",
                                labels, registry=r).labels(*values)
        self._server: Any = None

    def observe(self, data: Mapping[str, Sequence[float]]) -> None:
        """Record new observations in :class:`PdgateKVConnectorStats`' ``data`` shape
        (``xfer_seconds``, ``xfer_bytes``, ``failures``, ``expired``, ``released`` lists)."""
        for s in data.get("xfer_seconds", ()):
            self.seconds.observe(s)
        if data.get("xfer_seconds"):
            self.transfers.inc(len(data["xfer_seconds"]))
        if data.get("xfer_bytes"):
            self.bytes.inc(sum(data["xfer_bytes"]))
        for key, c in (("failures", self.failures), ("expired", self.expired), ("released", self.released)):
            if data.get(key):
                c.inc(len(data[key]))

    def render(self) -> bytes:
        """Prometheus text exposition of these metrics."""
        return generate_latest(self.registry)

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns the bound port.

        Raises:
            OSError: the port cannot be bound.
        """
        from prometheus_client import start_http_server

        self._server, _ = start_http_server(port, host, registry=self.registry)
        return int(self._server.server_address[1])

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
