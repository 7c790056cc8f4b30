"""PdgateConnector: vLLM ``KVConnectorBase_V1`` over pdgate's transfer engine.

Load it with::

    --kv-transfer-config '{"kv_connector": "PdgateConnector",
                           "kv_connector_module_path": "pdgate.connector",
                           "kv_role": "kv_producer" | "kv_consumer",
                           "kv_buffer_device": "cpu",
                           "kv_connector_extra_config": {"side_channel_port": 5600}}'

It speaks NixlConnector's P/D protocol (same ``kv_transfer_params`` fields,
pull mode), so a router that drives NixlConnector drives it unchanged.
Supported: TP=1, PP=1, DCP=1, one full-attention KV cache group (the CPU
backend); anything else is rejected at start-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from pdgate.connector.metadata import ConnectorConfig, PdgateConnectorMetadata
from pdgate.connector.metrics import PdgateKVConnectorStats, PdgatePromMetrics
from pdgate.connector.scheduler import PdgateScheduler
from pdgate.connector.worker import PdgateWorker

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request


def _check_layout(vllm_config: Any, kv_cache_config: Any) -> None:
    pc = vllm_config.parallel_config
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "decode_context_parallel_size",
                 "prefill_context_parallel_size"):
        v = getattr(pc, name, 1) or 1
        if v != 1:
            raise ValueError(f"PdgateConnector supports {name}=1 only (got {v})")
    if vllm_config.model_config is not None and getattr(vllm_config.model_config, "use_mla", False):
        raise ValueError("PdgateConnector does not support MLA models")
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is not None and len(groups) != 1:
        raise ValueError(f"PdgateConnector supports one KV cache group (got {len(groups)})")


class PdgateConnector(KVConnectorBase_V1):
    """Pull-mode P/D KV connector on the pdgate UCX transfer engine."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _check_layout(vllm_config, kv_cache_config)
        self.cfg = ConnectorConfig.from_vllm(vllm_config)
        self._sched: PdgateScheduler | None = None
        self._worker: PdgateWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = PdgateScheduler(self.cfg, vllm_config)
        else:
            self._worker = PdgateWorker(self.cfg, vllm_config, kv_cache_config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        if vllm_config.model_config is None or vllm_config.model_config.use_mla:
            return None
        return "LBHNC"  # per layer: [block, head, token, K|V], one contiguous page per block

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._kv_cache_config.transfer_group_ids

    # ---- worker side -------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._connector_metadata
        if isinstance(meta, PdgateConnectorMetadata):
            self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, recving, failed = self._worker.transfer_results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending, r.finished_recving

    def build_connector_worker_meta(self) -> Any:
        return self._worker.worker_meta() if self._worker is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.block_ids_with_load_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> PdgateKVConnectorStats | None:
        return self._worker.take_stats() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ---- scheduler side ----------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._sched is not None
        self._sched.update_connector_output(connector_output)

    # ---- metrics -----------------------------------------------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PdgateKVConnectorStats:
        return PdgateKVConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> PdgatePromMetrics:
        return PdgatePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
