"""Worker side of PdgateConnector: the pdgate transfer engine over vLLM's
KV cache (runs in the vLLM worker; TP=1/PP=1, one KV cache group).

Each attention layer's cache tensor is one registered region whose block
dimension is vLLM's (kernel) block; decode pulls with one ``read_blocks``
per request over all layers, adjacent blocks coalesced by the engine. A
background thread watches the engine's event fd and time-stamps
completions, notifications and lease expiries; ``transfer_results`` hands
them to vLLM at the next step.
"""

from __future__ import annotations

import re
import select
import threading
import time
from typing import Any

from vllm.logger import init_logger

from pdgate.connector.metadata import (
    ConnectorConfig,
    PdgateConnectorMetadata,
    PdgateWorkerMetadata,
    RecvReq,
)
from pdgate.connector.metrics import PdgateKVConnectorStats
from pdgate.connector.sidecar import SidecarMetrics

logger = init_logger("vllm.pdgate_connector")

#: Workers living in this process, by engine id (two instances in one
#: process must not share an engine id).
_LOCAL_WORKERS: dict[str, PdgateWorker] = {}
#: An unused notification is forgotten after this many seconds.
_EARLY_NOTIF_TTL_S = 600.0


def _layer_key(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


class PdgateWorker:
    def __init__(self, cfg: ConnectorConfig, vllm_config: Any, kv_cache_config: Any) -> None:
        self.cfg = cfg
        self.block_size = int(vllm_config.cache_config.block_size)
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.engine: Any = None
        self.port = 0
        self.ratio = 1  # kernel blocks per vLLM block
        self.bytes_per_block = 0  # all layers, one vLLM block
        self._kv_caches: list[Any] = []
        self._lock = threading.Lock()
        # decode side
        self._xfers: dict[int, tuple[str, RecvReq, float]] = {}
        self._done: list[tuple[int, float, BaseException | None]] = []
        self._failed_now: list[tuple[str, RecvReq]] = []
        self._invalid: set[int] = set()
        self._peers: dict[str, tuple[str, int]] = {}
        # prefill side
        self._sending: dict[str, float] = {}
        self._freed: dict[str, float] = {}  # notified/expired before meta arrived
        self._notifs: list[str] = []
        self._expired: list[str] = []
        self._leases_out: dict[str, str] = {}
        self._lease_backstop_s = max(4 * cfg.lease_ttl_s, cfg.lease_ttl_s + 600.0)
        self.stats = PdgateKVConnectorStats()
        self.sidecar: SidecarMetrics | None = None  # own /metrics port (cfg.metrics_port)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- setup -------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from pdgate.transfer import create_engine, kv_compat, register_blocks

        names = sorted(kv_caches, key=_layer_key)
        tensors = [kv_caches[n] for n in names]
        if not tensors:
            raise RuntimeError("PdgateConnector: no KV cache tensors to register")
        t0 = tensors[0]
        if any(t.shape != t0.shape or t.dtype != t0.dtype for t in tensors):
            raise RuntimeError("PdgateConnector: layers with different KV cache shapes are not supported")
        if len({t.data_ptr() for t in tensors}) != len(tensors):
            raise RuntimeError("PdgateConnector: layers sharing one KV cache tensor are not supported")
        kernel_blocks = int(t0.shape[0])
        if kernel_blocks % self.num_blocks:
            raise RuntimeError(f"PdgateConnector: {kernel_blocks} kernel blocks per layer is not a multiple "
                               f"of {self.num_blocks} vLLM blocks")
        self.ratio = kernel_blocks // self.num_blocks
        compat = kv_compat(layout="vllm-cpu-" + "x".join(str(d) for d in t0.shape[1:]), dtype=str(t0.dtype),
                           block_size=self.block_size, num_layers=len(tensors), extra=f"ratio={self.ratio}")
        self.engine = create_engine(self.cfg.engine_id, compat, transports=self.cfg.ucx_transports)
        for t in tensors:
            register_blocks(self.engine, t)
        self._kv_caches = tensors  # keep the memory alive while registered
        self.bytes_per_block = self.ratio * len(tensors) * t0[0].numel() * t0.element_size()
        try:
            self.port = int(self.engine.listen(self.cfg.side_channel_host, self.cfg.side_channel_port))
        except Exception as e:
            self.engine.close()
            raise RuntimeError(
                f"PdgateConnector: cannot serve transfer metadata on {self.cfg.side_channel_host}:"
                f"{self.cfg.side_channel_port} ({e}); every instance on a host needs its own "
                "side_channel_port") from e
        if self.cfg.engine_id in _LOCAL_WORKERS:
            raise RuntimeError(f"PdgateConnector: engine id {self.cfg.engine_id!r} already used in this process")
        _LOCAL_WORKERS[self.cfg.engine_id] = self
        self._thread = threading.Thread(target=self._watch, name="pdgate-kv-events", daemon=True)
        self._thread.start()
        if self.cfg.metrics_port is not None:
            sidecar = SidecarMetrics(self.cfg.engine_id, self.cfg.kv_role)
            try:
                port = sidecar.serve(self.cfg.metrics_port, self.cfg.metrics_host)
                self.sidecar = sidecar
                logger.info("PdgateConnector %s: transfer metrics on %s:%d/metrics", self.cfg.engine_id,
                            self.cfg.metrics_host, port)
            except OSError as e:  # metrics must not take the instance down
                logger.error("PdgateConnector: cannot serve metrics on %s:%d (%s); every instance on a "
                             "host needs its own metrics_port", self.cfg.metrics_host, self.cfg.metrics_port, e)
        logger.info("PdgateConnector %s (%s): %d layers x %d blocks of %d B, metadata on %s:%d, UCX %s",
                    self.cfg.engine_id, self.cfg.kv_role, len(tensors), kernel_blocks,
                    self.bytes_per_block // max(1, len(tensors) * self.ratio), self.cfg.side_channel_host,
                    self.port, self.engine.ucx_version)

    def _watch(self) -> None:
        """Collect engine events as they happen (exact completion times)."""
        fd = self.engine.event_fd()
        while not self._stop.is_set():
            try:
                select.select([fd], [], [], 0.2)
                self.engine.drain_event_fd()
                ok, bad = self.engine.poll()
                notifs = self.engine.get_notifications()
                expired = self.engine.expired_leases()
            except Exception:  # noqa: BLE001 - engine closed
                if self._stop.is_set():
                    return
                time.sleep(0.05)
                continue
            now = time.perf_counter()
            with self._lock:
                self._done += [(i, now, None) for i in ok] + [(i, now, e) for i, e in bad]
                self._notifs += [n["msg"].decode("utf-8", "replace") for n in notifs]
                self._expired += expired

    # ---- prefill side ------------------------------------------------
    # A lease is granted when a prefill request is first scheduled (its token
    # must reach the scheduler before the request's kv_transfer_params leave
    # the engine) with a long backstop TTL; the worker releases it itself when
    # the request's real deadline (finish + lease_ttl_s) passes.
    def _grant(self, request_id: str) -> None:
        try:
            self._leases_out[request_id] = self.engine.grant_lease(request_id, self._lease_backstop_s).hex()
        except Exception as e:  # noqa: BLE001 - table full, or preempted and rescheduled
            logger.warning("PdgateConnector: no lease for %s (%s)", request_id, e)

    def worker_meta(self) -> PdgateWorkerMetadata | None:
        if not self._leases_out:
            return None
        out, self._leases_out = self._leases_out, {}
        return PdgateWorkerMetadata(leases=out)

    # ---- decode side -------------------------------------------------
    def _phys(self, ids: list[int]) -> list[int]:
        r = self.ratio
        return ids if r == 1 else [b * r + i for b in ids for i in range(r)]

    def _peer(self, r: RecvReq) -> str:
        if r.remote_engine_id == self.cfg.engine_id:
            raise RuntimeError(f"remote engine id {r.remote_engine_id!r} is this instance's own id")
        if self._peers.get(r.remote_engine_id) == (r.remote_host, r.remote_port):
            return r.remote_engine_id
        got = self.engine.connect(f"{r.remote_host}:{r.remote_port}", timeout_s=min(5.0, self.cfg.transfer_timeout_s))
        if got != r.remote_engine_id:
            self._forget_peer(got)
            raise RuntimeError(f"{r.remote_host}:{r.remote_port} is engine {got!r}, "
                               f"not {r.remote_engine_id!r} (stale or clashing side channel)")
        self._peers[got] = (r.remote_host, r.remote_port)
        return got

    def _forget_peer(self, engine_id: str) -> None:
        self._peers.pop(engine_id, None)
        try:
            self.engine.remove_peer(engine_id)
        except Exception:  # noqa: BLE001, S110 - not connected
            pass

    def start_load_kv(self, meta: PdgateConnectorMetadata) -> None:
        if self.engine is None:
            return
        now = time.perf_counter()
        for rid in meta.reqs_to_lease:
            self._grant(rid)
        for rid in meta.reqs_not_sent:
            self.engine.release_lease(rid)
        for rid, exp in meta.reqs_to_send.items():
            self._sending[rid] = now + (exp - meta.scheduler_clock)
        for rid, r in meta.reqs_to_recv.items():
            try:
                peer = self._peer(r)
                xid = self.engine.read_blocks(
                    peer, self._phys(r.local_blocks), self._phys(r.remote_blocks),
                    notify=r.remote_request_id.encode(), lease=r.lease, timeout_s=self.cfg.transfer_timeout_s)
            except Exception as e:  # noqa: BLE001 - any failure becomes a load error
                logger.warning("PdgateConnector: pull for %s from %s failed to start: %s", rid,
                               r.remote_engine_id, e)
                self._forget_peer(r.remote_engine_id)
                with self._lock:
                    self._failed_now.append((rid, r))
                continue
            with self._lock:
                self._xfers[xid] = (rid, r, time.perf_counter())

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call.

        Observations recorded meanwhile also go to the sidecar metrics.
        """
        if self.sidecar is None:
            return self._transfer_results()
        before = {k: len(v) for k, v in self.stats.data.items()}
        out = self._transfer_results()
        self.sidecar.observe({k: v[before.get(k, 0):] for k, v in self.stats.data.items()})
        return out

    def _transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        if self.engine is None:
            return sending, recving, failed
        with self._lock:
            done, self._done = self._done, []
            notifs, self._notifs = self._notifs, []
            expired, self._expired = self._expired, []
            failed_now, self._failed_now = self._failed_now, []
            finished = []
            for xid, t_end, exc in done:
                ent = self._xfers.pop(xid, None)
                if ent is not None:
                    finished.append((ent, t_end, exc))
        for rid, r in failed_now:
            self._fail(rid, r, recving, failed)
        for (rid, r, t0), t_end, exc in finished:
            if exc is not None:
                logger.warning("PdgateConnector: pull for %s from %s failed: %s", rid, r.remote_engine_id, exc)
                if type(exc).__name__ in ("PeerUnreachableError", "TransportError", "ClosedError"):
                    self._forget_peer(r.remote_engine_id)
                self._fail(rid, r, recving, failed)
                continue
            if r.local_blocks:
                self.stats.record_transfer(t_end - t0, len(r.local_blocks) * self.bytes_per_block)
            if r.missing_local:
                self._invalid.update(r.missing_local)
                failed.add(rid)
            if r.awaiting:
                recving.add(rid)
        # prefill side
        now = time.perf_counter()
        for rid in notifs:
            self.engine.release_lease(rid)  # a read without the token leaves it held
            if self._sending.pop(rid, None) is not None:
                sending.add(rid)
                self.stats.record_released()
            else:
                self._freed[rid] = now
        for rid in expired:
            if self._sending.pop(rid, None) is not None:
                sending.add(rid)
                self.stats.record_expired()
                logger.warning("PdgateConnector: lease of %s expired; blocks freed unread", rid)
            else:
                self._freed[rid] = now
        for rid, deadline in list(self._sending.items()):
            if rid in self._freed:
                del self._sending[rid]
                del self._freed[rid]
                sending.add(rid)
                self.stats.record_released()
            elif now >= deadline:
                # Late reads holding the token now fail with LeaseExpiredError.
                self.engine.release_lease(rid)
                logger.warning("PdgateConnector: %s not read by a decode instance within %.0f s; blocks freed",
                               rid, self.cfg.lease_ttl_s)
                del self._sending[rid]
                sending.add(rid)
                self.stats.record_expired()
        for rid, t in list(self._freed.items()):
            if now - t > _EARLY_NOTIF_TTL_S:
                del self._freed[rid]
        return sending, recving, failed

    def _fail(self, rid: str, r: RecvReq, recving: set[str], failed: set[str]) -> None:
        self.stats.record_failure()
        if r.awaiting:
            self._invalid.update(r.local_blocks)
            self._invalid.update(r.missing_local)
            recving.add(rid)
            failed.add(rid)

    def block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def take_stats(self) -> PdgateKVConnectorStats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def shutdown(self) -> None:
        self._stop.set()
        if self.sidecar is not None:
            self.sidecar.stop()
        if _LOCAL_WORKERS.get(self.cfg.engine_id) is self:
            del _LOCAL_WORKERS[self.cfg.engine_id]
        if self.engine is not None:
            self.engine.close()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
