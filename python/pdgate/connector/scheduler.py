"""Scheduler side of PdgateConnector (runs in vLLM's engine core).

Prefill instance (``do_remote_decode`` requests): when a request finishes,
keep its blocks (``request_finished`` returns True), grant a transfer-engine
lease for them and return NIXL-compatible ``kv_transfer_params`` plus
``pdgate_lease``. The worker side frees them when the decode instance's
notification arrives or the lease expires.

Decode instance (``do_remote_prefill`` requests): report the prompt tokens
not cached locally as loadable asynchronously, pair the newly allocated
blocks with the prefill instance's blocks *by position* (a local prefix-cache
hit of k blocks reads only remote blocks k..), and hand the pull to the
worker. A request that needs nothing (full local hit) or is aborted before
being scheduled still produces a notification so the prefill side frees its
blocks at once instead of at lease expiry.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from pdgate.connector.metadata import (
    ConnectorConfig,
    PdgateConnectorMetadata,
    PdgateWorkerMetadata,
    RecvReq,
    flat_block_ids,
    has_remote_fields,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = init_logger("vllm.pdgate_connector")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PdgateScheduler:
    def __init__(self, cfg: ConnectorConfig, vllm_config: Any) -> None:
        self.cfg = cfg
        self.block_size = int(vllm_config.cache_config.block_size)
        self._recv: dict[str, RecvReq] = {}
        self._send: dict[str, float] = {}
        # prefill side lease plumbing (tokens come from the worker side)
        self._to_lease: set[str] = set()
        self._not_sent: set[str] = set()
        self._tokens: dict[str, str] = {}
        self._awaiting_token: dict[str, dict[str, Any]] = {}

    # ---- decode side -------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        p = request.kv_transfer_params
        if not p or not p.get("do_remote_prefill") or not has_remote_fields(p):
            return 0, False
        n = len(request.prompt_token_ids or [])
        remote_n = p.get("remote_num_tokens")
        if remote_n:
            n = min(n, int(remote_n))
        # Never more than the prefill side listed blocks for.
        n = min(n, len(flat_block_ids(p.get("remote_block_ids"))) * self.block_size)
        count = n - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        p = request.kv_transfer_params
        if p and p.get("do_remote_decode") and request.request_id not in self._tokens:
            self._to_lease.add(request.request_id)  # prefill side, first allocation
        if not p or not p.get("do_remote_prefill"):
            return
        # Whatever happens next, this request is handled once.
        p["do_remote_prefill"] = False
        if not has_remote_fields(p):
            logger.warning("PdgateConnector: incomplete kv_transfer_params for %s; computing locally",
                           request.request_id)
            return
        remote = flat_block_ids(p["remote_block_ids"])
        local: list[int] = []
        remote_sel: list[int] = []
        missing: list[int] = []
        if num_external_tokens > 0:
            group = blocks.blocks[0]
            n_hit = sum(1 for b in group if b.block_hash is not None and not b.is_null)
            n_needed = _cdiv(n_hit * self.block_size + num_external_tokens, self.block_size)
            for pos, b in enumerate(group[:n_needed]):
                if b.block_hash is not None or b.is_null:
                    continue  # local prefix-cache hit: not read
                if pos < len(remote):
                    local.append(int(b.block_id))
                    remote_sel.append(remote[pos])
                else:
                    missing.append(int(b.block_id))
        self._recv[request.request_id] = self._recv_req(p, local, remote_sel, num_external_tokens > 0, missing)

    def _recv_req(self, p: dict[str, Any], local: list[int], remote: list[int], awaiting: bool,
                  missing: list[int] | None = None) -> RecvReq:
        lease = p.get("pdgate_lease")
        return RecvReq(
            remote_engine_id=str(p["remote_engine_id"]),
            remote_request_id=str(p["remote_request_id"]),
            remote_host=str(p["remote_host"]),
            remote_port=int(p["remote_port"]),
            local_blocks=local,
            remote_blocks=remote,
            awaiting=awaiting,
            lease=bytes.fromhex(lease) if isinstance(lease, str) and lease else None,
            missing_local=missing or [],
        )

    # ---- both --------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> PdgateConnectorMetadata:
        meta = PdgateConnectorMetadata(reqs_to_recv=self._recv, reqs_to_send=self._send,
                                       reqs_to_lease=self._to_lease, reqs_not_sent=self._not_sent,
                                       scheduler_clock=time.perf_counter())
        self._recv = {}
        self._send = {}
        self._to_lease = set()
        self._not_sent = set()
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Lease tokens granted by the worker side. A request that finished in
        the same step already returned its kv_transfer_params: the dict is
        completed here, before vLLM serializes the step's outputs."""
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(wm, PdgateWorkerMetadata):
            for rid, tok in wm.leases.items():
                params = self._awaiting_token.pop(rid, None)
                if params is not None:
                    params["pdgate_lease"] = tok
                else:
                    self._tokens[rid] = tok
        # Requests still without a token read without one (the lease could
        # not be granted); never patch a dict vLLM has already sent.
        self._awaiting_token.clear()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        p = request.kv_transfer_params
        if not p:
            return False, None
        if p.get("do_remote_prefill"):
            # Decode side, finished before update_state_after_alloc (aborted
            # while waiting): tell the prefill side to free its blocks now.
            p["do_remote_prefill"] = False
            if has_remote_fields(p):
                self._recv[request.request_id] = self._recv_req(p, [], [], False)
            return False, None
        if not p.get("do_remote_decode"):
            return False, None
        # Prefill side.
        rid = request.request_id
        self._to_lease.discard(rid)
        token = self._tokens.pop(rid, None)
        ids = [int(b) for b in block_ids]
        host, port = self.cfg.side_channel_host, self.cfg.side_channel_port
        if (request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
                or not ids or not port):
            self._not_sent.add(rid)
            return False, None
        self._send[rid] = time.perf_counter() + self.cfg.lease_ttl_s
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [ids],
            "remote_engine_id": self.cfg.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": host,
            "remote_port": port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": request.num_computed_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "pdgate_lease": token,
            "pdgate_lease_expiry_unix": time.time() + self.cfg.lease_ttl_s,
        }
        if token is None:
            self._awaiting_token[rid] = params
        return True, params
