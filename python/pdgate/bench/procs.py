"""Subprocess fleets for reliability tests and the soak: ``pdgate sim-fleet``
and ``pdgate serve`` as real processes (signals, RSS and file descriptors are
those of a deployed gateway).

Example::

    with SimFleetProcess(1, 1) as fleet, GatewayProcess(fleet.config()) as gw:
        httpx.post(gw.url + "/v1/completions", json={...})
        gw.terminate()   # SIGTERM: graceful drain
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from pdgate.localfleet.vllm_server import free_port
from pdgate.sim.harness import stop_process


class SimFleetProcess:
    """``pdgate sim-fleet`` in a child process.

    Args:
        n_prefill / n_decode: instance counts.
        profile: simulator profile name.
        time_scale: simulated seconds per wall second.
        extra: more ``sim-fleet`` flags.

    Raises:
        RuntimeError: the fleet did not print its description within 30 s.
    """

    def __init__(self, n_prefill: int = 1, n_decode: int = 1, profile: str = "cpu-tiny",
                 time_scale: float = 1.0, extra: list[str] | None = None) -> None:
        self.cmd = [sys.executable, "-m", "pdgate", "sim-fleet", "--prefill", str(n_prefill), "--decode",
                    str(n_decode), "--profile", profile, "--time-scale", str(time_scale), *(extra or [])]
        self.proc: subprocess.Popen[str] | None = None
        self.info: dict[str, Any] = {}

    def start(self) -> "SimFleetProcess":
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     start_new_session=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"sim-fleet exited with {self.proc.wait(5)}")
        self.info = json.loads(line)
        return self

    @property
    def prefill_urls(self) -> list[str]:
        return list(self.info["urls"].get("prefill", []))

    @property
    def decode_urls(self) -> list[str]:
        return list(self.info["urls"].get("decode", []))

    def config(self, **kw: Any) -> dict[str, Any]:
        """A gateway config dict over this fleet (``kw`` merged in)."""
        return {"prefill": self.prefill_urls, "decode": self.decode_urls, "host": "127.0.0.1",
                "tokenizer": {"words": True}, **kw}

    def stop(self) -> None:
        stop_process(self.proc)

    def __enter__(self) -> "SimFleetProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class GatewayProcess:
    """``pdgate serve --config FILE`` in a child process, on free ports.

    Args:
        config: gateway config dict (``port`` and, if ``ops_port``,
            ``metrics_port`` are filled in with free ports).
        ops_port: serve ``/health`` and ``/metrics`` on a separate port.
        log_path: where the gateway's output goes (default a temp file).

    Raises:
        RuntimeError: the gateway exited or was not healthy within 30 s.
    """

    def __init__(self, config: dict[str, Any], ops_port: bool = False, log_path: str | None = None) -> None:
        self.config = {**config, "port": free_port()}
        if ops_port:
            self.config["metrics_port"] = free_port()
        self.url = f"http://127.0.0.1:{self.config['port']}"
        self.ops_url = f"http://127.0.0.1:{self.config.get('metrics_port', self.config['port'])}"
        self.dir = Path(tempfile.mkdtemp(prefix="pdgate-gw-"))
        self.log_path = Path(log_path) if log_path else self.dir / "gateway.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "GatewayProcess":
        cfg = self.dir / "gateway.json"
        cfg.write_text(json.dumps(self.config))
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen([sys.executable, "-m", "pdgate", "serve", "--config", str(cfg)],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("gateway exited:\n" + self.log())
            try:
                if httpx.get(self.ops_url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError("gateway not healthy in 30 s:\n" + self.log())

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-4000:]
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def terminate(self) -> None:
        """Send SIGTERM (starts the graceful drain)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def rss_bytes(self) -> int:
        """Resident set size of the gateway process (Linux ``/proc``)."""
        with open(f"/proc/{self.pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def open_fds(self) -> int:
        """Open file descriptors of the gateway process (Linux ``/proc``)."""
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def __enter__(self) -> "GatewayProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.terminate()
        try:
            self.wait(15)
        except subprocess.TimeoutExpired:
            self.kill()
