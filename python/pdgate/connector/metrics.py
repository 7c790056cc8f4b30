"""Transfer statistics of PdgateConnector and their Prometheus export.

The worker side records into :class:`PdgateKVConnectorStats`; vLLM ships the
``data`` dict to its API server process, which calls
:class:`PdgatePromMetrics.observe`. Exported on the instance's ``/metrics``:

- ``vllm:pdgate_kv_transfer_seconds`` (histogram): one decode-side pull,
  from posting the read to the data having landed (decode instance).
- ``vllm:pdgate_kv_transfer_bytes_total``: bytes pulled (decode).
- ``vllm:pdgate_kv_transfers_total``: successful pulls (decode).
- ``vllm:pdgate_kv_transfer_failures_total``: failed pulls or handshakes
  (decode); their blocks were reported as load errors.
- ``vllm:pdgate_kv_expired_leases_total``: requests whose blocks the prefill
  instance freed because no decode instance read them in time (prefill).
- ``vllm:pdgate_kv_released_total``: requests whose blocks the prefill
  instance freed on a decode notification (prefill).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

_KEYS = ("xfer_seconds", "xfer_bytes", "failures", "expired", "released")


@dataclass
class PdgateKVConnectorStats(KVConnectorStats):
    """Observations since the last collection (lists of numbers)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        for k in _KEYS:
            self.data.setdefault(k, [])

    def reset(self) -> None:
        self.data = {k: [] for k in _KEYS}

    def record_transfer(self, seconds: float, nbytes: int) -> None:
        self.data["xfer_seconds"].append(float(seconds))
        self.data["xfer_bytes"].append(int(nbytes))

    def record_failure(self) -> None:
        self.data["failures"].append(1)

    def record_expired(self) -> None:
        self.data["expired"].append(1)

    def record_released(self) -> None:
        self.data["released"].append(1)

    def clone_and_reset(self) -> PdgateKVConnectorStats:
        old = copy.copy(self)
        self.reset()
        return old

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in _KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in _KEYS:
            self.data.setdefault(k, []).extend(other.data.get(k, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        secs = self.data["xfer_seconds"]
        n = len(secs)
        total_b = sum(self.data["xfer_bytes"])
        total_s = sum(secs)
        return {
            "Num successful transfers": n,
            "Avg xfer time (ms)": round(total_s / n * 1e3, 3) if n else 0,
            "Avg MB per transfer": round(total_b / n / 2**20, 3) if n else 0,
            "Throughput (MB/s)": round(total_b / 2**20 / total_s, 3) if total_s > 0 else 0,
            "Num failed transfers": len(self.data["failures"]),
            "Num expired leases": len(self.data["expired"]),
            "Num released on notification": len(self.data["released"]),
        }


class PdgatePromMetrics(KVConnectorPromMetrics):
    """Registers the ``vllm:pdgate_kv_*`` metrics (per engine label)."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        per = self.per_engine_labelvalues

        def counter(name: str, doc: str) -> dict:
            return create_metric_per_engine(self._counter_cls(name=name, documentation=doc,
                                                              labelnames=labelnames), per)

        hist = cast(Any, self._histogram_cls)(
            name="vllm:pdgate_kv_transfer_seconds",
            documentation="Duration of one PdgateConnector KV pull (decode side).",
            buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0],
            labelnames=labelnames)
        self.h_seconds: dict[int, Any] = create_metric_per_engine(hist, per)
        self.c_bytes = counter("vllm:pdgate_kv_transfer_bytes", "Bytes of KV pulled by PdgateConnector.")
        self.c_xfers = counter("vllm:pdgate_kv_transfers", "Successful PdgateConnector KV pulls.")
        self.c_fail = counter("vllm:pdgate_kv_transfer_failures",
                              "Failed PdgateConnector KV pulls or handshakes (blocks reported as load errors).")
        self.c_expired = counter("vllm:pdgate_kv_expired_leases",
                                 "Requests whose prefill-side blocks were freed by lease expiry.")
        self.c_released = counter("vllm:pdgate_kv_released",
                                  "Requests whose prefill-side blocks were freed on a decode notification.")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        for s in d.get("xfer_seconds", []):
            self.h_seconds[engine_idx].observe(s)
        if d.get("xfer_seconds"):
            self.c_xfers[engine_idx].inc(len(d["xfer_seconds"]))
        if d.get("xfer_bytes"):
            self.c_bytes[engine_idx].inc(sum(d["xfer_bytes"]))
        for key, c in (("failures", self.c_fail), ("expired", self.c_expired), ("released", self.c_released)):
            if d.get(key):
                c[engine_idx].inc(len(d[key]))
