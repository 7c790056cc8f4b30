"""``VllmServer.stop``: the server process shuts its own children down; nothing is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdgate.localfleet.vllm_server import VllmServer

CHILD = """
import signal, sys, time
m = sys.argv[1]
def term(*_):
    open(m + ".child_sigterm", "w").close()
    sys.exit(1)
signal.signal(signal.SIGTERM, term if sys.argv[2] == "polite" else signal.SIG_IGN)
signal.signal(signal.SIGUSR1, lambda *_: sys.exit(0))
while True:
    time.sleep(0.05)
"""

LEADER = """
import signal, subprocess, sys, time
m, mode, child_src = sys.argv[1], sys.argv[2], sys.argv[3]
child = subprocess.Popen([sys.executable, "-c", child_src, m, mode])
def term(*_):
    open(m + ".leader_sigterm", "w").close()
    if mode == "polite":          # as vLLM's API server: shut the engine down, then exit
        child.send_signal(signal.SIGUSR1)
        child.wait()
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
open(m + ".ready", "w").write(str(child.pid))
while True:
    time.sleep(0.05)
"""


def _start(tmp_path: Path, mode: str) -> tuple[VllmServer, str]:
    marker = str(tmp_path / "m")
    proc = subprocess.Popen([sys.executable, "-c", LEADER, marker, mode, CHILD], start_new_session=True)
    deadline = time.monotonic() + 20
    while not os.path.exists(marker + ".ready"):
        assert time.monotonic() < deadline and proc.poll() is None, "leader did not start"
        time.sleep(0.02)
    time.sleep(0.3)  # the child installs its handlers
    srv = VllmServer(None)  # type: ignore[arg-type]  # stop() needs only the process
    srv.proc = proc
    return srv, marker


def _dead(pid: int) -> bool:
    """Gone, or a zombie (an orphan waits for PID 1 to reap it, which a container may never do)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def _dies(pid: int, within_s: float = 2.0) -> bool:
    """SIGKILL is delivered asynchronously: dead within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while not _dead(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _child(marker: str) -> int:
    return int(Path(marker + ".ready").read_text())


def test_stop_lets_the_server_shut_its_children_down(tmp_path: Path) -> None:
    """Only the leader gets SIGTERM: it stops its child its own way (vLLM's engine unlinks its
    shared memory then), and the child never sees a SIGTERM of its own."""
    srv, marker = _start(tmp_path, "polite")
    srv.stop(timeout_s=10)
    assert os.path.exists(marker + ".leader_sigterm")
    assert not os.path.exists(marker + ".child_sigterm")
    assert _dies(_child(marker)) and srv.proc is None


def test_stop_kills_what_the_server_leaves_behind(tmp_path: Path) -> None:
    """A child that ignores SIGTERM and outlives its leader is SIGKILLed (bounded wait)."""
    srv, marker = _start(tmp_path, "stubborn")
    t0 = time.monotonic()
    assert not _dead(_child(marker))
    srv.stop(timeout_s=10)
    assert os.path.exists(marker + ".leader_sigterm")
    assert _dies(_child(marker))
    assert time.monotonic() - t0 < 12
    srv.stop()  # idempotent


@pytest.mark.parametrize("mode", ["polite"])
def test_stop_of_a_server_that_already_exited(tmp_path: Path, mode: str) -> None:
    srv, _ = _start(tmp_path, mode)
    srv.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    srv.proc.wait(10)  # type: ignore[union-attr]
    srv.stop(timeout_s=1)
    assert srv.proc is None


CRASHER = """
import sys, time
from multiprocessing import shared_memory
shm = shared_memory.SharedMemory(create=True, size=1 << 20)
open(sys.argv[1], "w").write(shm.name)
while True:
    time.sleep(0.05)
"""


def test_stop_removes_the_shared_memory_a_killed_server_leaked(tmp_path: Path) -> None:
    """A server killed with its whole group (a crash, or a test's SIGKILL) leaves its
    ``/dev/shm/psm_*`` queue behind; ``stop`` removes what ``record_shm`` noted."""
    from pdgate.localfleet.vllm_server import shm_files

    name_file = tmp_path / "name"
    proc = subprocess.Popen([sys.executable, "-c", CRASHER, str(name_file)], start_new_session=True)
    deadline = time.monotonic() + 20
    while not name_file.exists() or not name_file.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, "crasher did not start"
        time.sleep(0.02)
    path = "/dev/shm/" + name_file.read_text()
    srv = VllmServer(None)  # type: ignore[arg-type]
    srv.proc = proc
    deadline = time.monotonic() + 5
    while path not in shm_files(proc.pid):
        assert time.monotonic() < deadline, f"{path} not among {shm_files(proc.pid)}"
        time.sleep(0.02)
    srv.record_shm()
    os.killpg(proc.pid, signal.SIGKILL)  # the resource tracker dies with it: nobody unlinks
    proc.wait(10)
    assert os.path.exists(path)
    srv.stop(timeout_s=1)
    assert not os.path.exists(path)
