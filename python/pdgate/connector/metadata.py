"""Configuration and the scheduler -> worker step metadata of PdgateConnector.

Both run inside a vLLM instance: :class:`ConnectorConfig` is read once from
``--kv-transfer-config`` (``kv_connector_extra_config``) with environment
fallbacks, :class:`PdgateConnectorMetadata` is built by the scheduler side
every step and bound to the worker side before the forward pass.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

#: Fields of ``kv_transfer_params`` a decode request needs to pull KV.
REQUIRED_REMOTE_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids")


def _extra(extra: dict[str, Any], key: str, envs: tuple[str, ...], default: Any) -> Any:
    """``extra[key]``, else the first set environment variable, else default."""
    if key in extra and extra[key] is not None:
        return extra[key]
    for e in envs:
        v = os.environ.get(e)
        if v not in (None, ""):
            return v
    return default


def _metrics_port(extra: dict[str, Any], vllm_config: Any) -> int | None:
    """``metrics_port`` (+ data-parallel index), or ``None`` when unset."""
    v = _extra(extra, "metrics_port", ("PDGATE_KV_METRICS_PORT",), None)
    if v is None or str(v).strip().lower() in ("", "none"):
        return None
    port = int(v) + int(getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0)
    if not 0 < port < 65536:
        raise ValueError(f"PdgateConnector: metrics_port {port} out of range")
    return port


@dataclass(frozen=True)
class ConnectorConfig:
    """PdgateConnector settings of one vLLM instance.

    Keys of ``kv_connector_extra_config`` (environment fallback in brackets):

    - ``side_channel_host`` [``PDGATE_KV_SIDE_CHANNEL_HOST``,
      ``VLLM_NIXL_SIDE_CHANNEL_HOST``], default ``127.0.0.1``: where this
      instance serves its transfer-engine metadata.
    - ``side_channel_port`` [``PDGATE_KV_SIDE_CHANNEL_PORT``,
      ``VLLM_NIXL_SIDE_CHANNEL_PORT``], default 5610 (+ data-parallel
      index): the metadata port; it must be unique per instance on a host,
      and start-up fails loudly if it is taken.
    - ``lease_ttl_s`` [``PDGATE_KV_LEASE_TTL_S``], default 30: how long a
      prefill instance keeps a finished request's blocks for the decode side.
    - ``transfer_timeout_s`` [``PDGATE_KV_TRANSFER_TIMEOUT_S``], default 20:
      a decode read (and the handshake) fails after this; the request then
      follows ``kv_load_failure_policy``.
    - ``ucx_transports`` [``PDGATE_KV_UCX_TLS``], default ``sm`` (shared
      memory: prefill and decode on one host). Between hosts set ``tcp``
      (or ``rc,tcp`` with RDMA); ``default`` lets UCX choose. Measured here
      with vLLM on 2 busy cores: ``sm`` ~0.2 ms per pull, ``tcp`` ~40 ms,
      ``sm,tcp`` ~70 ms, and UCX's own choice stalled some pulls until their
      timeout.
    - ``metrics_port`` [``PDGATE_KV_METRICS_PORT``], default none (off):
      the worker serves the connector's transfer metrics on this port
      (+ data-parallel index) for Prometheus (:mod:`pdgate.connector.sidecar`).
    - ``metrics_host`` [``PDGATE_KV_METRICS_HOST``], default ``0.0.0.0``.
    """

    engine_id: str
    kv_role: str
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 5610
    lease_ttl_s: float = 30.0
    transfer_timeout_s: float = 20.0
    ucx_transports: str | None = "sm"
    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"

    @staticmethod
    def from_vllm(vllm_config: Any) -> ConnectorConfig:
        ktc = vllm_config.kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        port = int(_extra(extra, "side_channel_port",
                          ("PDGATE_KV_SIDE_CHANNEL_PORT", "VLLM_NIXL_SIDE_CHANNEL_PORT"), 5610))
        port += int(getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0)
        cfg = ConnectorConfig(
            engine_id=str(ktc.engine_id),
            kv_role=str(ktc.kv_role),
            side_channel_host=str(_extra(extra, "side_channel_host",
                                         ("PDGATE_KV_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_HOST"),
                                         "127.0.0.1")),
            side_channel_port=port,
            lease_ttl_s=float(_extra(extra, "lease_ttl_s", ("PDGATE_KV_LEASE_TTL_S",), 30.0)),
            transfer_timeout_s=float(_extra(extra, "transfer_timeout_s", ("PDGATE_KV_TRANSFER_TIMEOUT_S",), 20.0)),
            ucx_transports=_extra(extra, "ucx_transports", ("PDGATE_KV_UCX_TLS",), "sm") or None,
            metrics_port=_metrics_port(extra, vllm_config),
            metrics_host=str(_extra(extra, "metrics_host", ("PDGATE_KV_METRICS_HOST",), "0.0.0.0")),
        )
        if cfg.ucx_transports == "default":
            cfg = dataclasses.replace(cfg, ucx_transports=None)
        if not 0 < cfg.side_channel_port < 65536:
            raise ValueError(f"PdgateConnector: side_channel_port {cfg.side_channel_port} out of range")
        if cfg.lease_ttl_s <= 0 or cfg.transfer_timeout_s <= 0:
            raise ValueError("PdgateConnector: lease_ttl_s and transfer_timeout_s must be > 0")
        return cfg


@dataclass
class RecvReq:
    """One decode-side pull: ``local_blocks[i]`` receives the prefill
    instance's ``remote_blocks[i]`` (logical vLLM block ids)."""

    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    local_blocks: list[int]
    remote_blocks: list[int]
    #: True when the request waits in WAITING_FOR_REMOTE_KVS and must be
    #: reported in ``finished_recving``; False for a notification only
    #: (full local prefix hit, or aborted before it was scheduled).
    awaiting: bool
    lease: bytes | None = None
    #: local blocks that should have been loaded but the prefill side did not
    #: list: reported as load errors.
    missing_local: list[int] = field(default_factory=list)


@dataclass
class PdgateConnectorMetadata(KVConnectorMetadata):
    """What the worker side does this step."""

    #: decode side: request id -> pull to start
    reqs_to_recv: dict[str, RecvReq] = field(default_factory=dict)
    #: prefill side: request id -> expiry (scheduler's perf_counter clock) of
    #: blocks now held for a decode instance
    reqs_to_send: dict[str, float] = field(default_factory=dict)
    #: prefill side: requests first scheduled this step; the worker grants
    #: each a lease and returns the token in PdgateWorkerMetadata
    reqs_to_lease: set[str] = field(default_factory=set)
    #: prefill side: requests that ended without handing KV to a decode
    #: instance (aborted, error); their leases are released
    reqs_not_sent: set[str] = field(default_factory=set)
    scheduler_clock: float = 0.0


@dataclass
class PdgateWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: lease tokens (hex) granted this step."""

    leases: dict[str, str] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, PdgateWorkerMetadata):
            self.leases.update(other.leases)
        return self


def flat_block_ids(ids: Any) -> list[int]:
    """``remote_block_ids`` as one list: NIXL-style ``[[...]]`` (one list per
    KV cache group; exactly one group supported) or a flat list."""
    if ids is None:
        return []
    ids = list(ids)
    if ids and isinstance(ids[0], (list, tuple)):
        if len(ids) != 1:
            raise ValueError(f"PdgateConnector supports one KV cache group, got {len(ids)}")
        ids = list(ids[0])
    return [int(b) for b in ids]


def has_remote_fields(params: dict[str, Any]) -> bool:
    return all(params.get(k) is not None for k in REQUIRED_REMOTE_FIELDS)
