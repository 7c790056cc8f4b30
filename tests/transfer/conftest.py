"""Fixtures for the transfer tests: UCX from the libucx-cu12 wheel, vLLM's
KV layout, and a peer engine in a separate process (always time-bounded)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .kvlayout import TEST_SHAPE, KVGeom, vllm_geom

HERE = Path(__file__).resolve().parent
COMPAT = "test-kv|bf16|32|4"

transfer_mod = pytest.importorskip("pdgate.transfer")
if transfer_mod.ucx_lib_dir() is None:  # pragma: no cover
    pytest.skip("libucx-cu12 is not installed", allow_module_level=True)


def _fallback_geom(layout: str) -> KVGeom:
    s = TEST_SHAPE
    page = s["num_kv_heads"] * s["block_size"] * 2 * s["head_size"] * 2
    nl, nb = s["num_layers"], s["num_blocks"]
    if layout == "LBHNC":
        ls, bs = nb * page, page
    else:
        ls, bs = page, nl * page
    return KVGeom(
        layout, nl, nb, page, ls, bs, nl * nb * page, "fallback (vLLM not installed)"
    )


@pytest.fixture(scope="session", params=["LBHNC", "BLHNC"])
def geom(request: pytest.FixtureRequest) -> KVGeom:
    """LBHNC is the CPU backend's own layout (from vLLM); BLHNC (block-major,
    also a vLLM layout) gives strided per-layer regions."""
    g = vllm_geom(request.param)
    return g if g is not None else _fallback_geom(request.param)


class PeerProc:
    """The owner engine in a child process."""

    def __init__(
        self, engine_id: str, tls: str, geom: KVGeom, seed: int, compat: str = COMPAT
    ):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(HERE.parents[1] / "python"), env.get("PYTHONPATH", "")]
        )
        self.p = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "peer_proc.py"),
                engine_id,
                tls,
                geom.to_json(),
                str(seed),
                compat,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        hello = self._read(20.0)
        self.port = hello["port"]
        self.pid = hello["pid"]
        self.addr = f"127.0.0.1:{self.port}"

    def _read(self, timeout: float) -> dict:
        assert self.p.stdout is not None
        r, _, _ = select.select([self.p.stdout], [], [], timeout)
        if not r:
            self.kill()
            raise TimeoutError("peer process did not answer")
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"peer process exited ({self.p.poll()})")
        return json.loads(line)

    def call(self, cmd: str, timeout: float = 10.0, **kw: object) -> object:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.p.stdin.flush()
        return self._read(timeout).get("out")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, sig)

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.kill(signal.SIGCONT)
                self.call("exit", timeout=5.0)
            except (OSError, TimeoutError, RuntimeError, ValueError):
                self.kill()  # it is going away either way
        try:
            self.p.wait(5.0)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(5.0)


@pytest.fixture
def spawn_peer() -> Iterator:
    procs: list[PeerProc] = []

    def make(*a: object, **kw: object) -> PeerProc:
        p = PeerProc(*a, **kw)  # type: ignore[arg-type]
        procs.append(p)
        return p

    yield make
    for p in procs:
        p.close()


@pytest.fixture
def engines() -> Iterator:
    made = []

    def make(engine_id: str, tls: str, compat: str = COMPAT, **kw: object):
        e = transfer_mod.create_engine(engine_id, compat, transports=tls, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()
