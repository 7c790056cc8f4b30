"""Fault handling: dead peers, dead ports, bad metadata, bad block ids,
stalled peers. Every wait is bounded; nothing may hang."""

from __future__ import annotations

import random
import signal
import socket
import time

import numpy as np
import pytest
from pdgate._native import (
    BlockOutOfRangeError,
    PdgateError,
    PeerUnreachableError,
    RejectedMetadataError,
    TransferTimeoutError,
)
from pdgate.transfer import fetch_metadata

from .kvlayout import KVGeom

BIG = KVGeom(
    "LBHNC", 1, 1024, 65536, 1024 * 65536, 65536, 1024 * 65536, "synthetic 64 MiB"
)
SMALL = KVGeom("LBHNC", 2, 16, 4096, 16 * 4096, 4096, 2 * 16 * 4096, "synthetic")


def _reader(engines, tls, g: KVGeom, name: str):
    eng = engines(name, tls)
    raw = np.zeros(g.total_bytes, dtype=np.uint8)
    for l in range(g.num_layers):
        eng.register(
            raw.ctypes.data + l * g.layer_stride,
            g.region_len(),
            g.page_bytes,
            g.block_stride,
            g.num_blocks,
        )
    return eng, raw


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_handshake_to_dead_port(engines):
    eng = engines("lonely", "tcp")
    port = _free_port()
    t0 = time.monotonic()
    with pytest.raises(PeerUnreachableError):
        eng.connect(f"127.0.0.1:{port}", timeout_s=2.0)
    with pytest.raises(PeerUnreachableError):
        fetch_metadata(f"127.0.0.1:{port}", timeout_s=2.0)
    assert time.monotonic() - t0 < 5


def test_corrupted_and_incompatible_metadata(engines, spawn_peer):
    owner = spawn_peer("owner-meta", "tcp", SMALL, 1)
    eng, _ = _reader(engines, "tcp", SMALL, "reader-meta")
    good = fetch_metadata(owner.addr, timeout_s=5.0)
    rng = random.Random(3)
    for _ in range(50):
        bad = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
        if bytes(bad) == good:
            continue
        with pytest.raises(RejectedMetadataError):
            eng.add_peer(bytes(bad))
    for cut in (0, 1, 10, len(good) // 2, len(good) - 1):
        with pytest.raises(RejectedMetadataError):
            eng.add_peer(good[:cut])
    with pytest.raises(RejectedMetadataError):
        eng.add_peer(bytes(rng.getrandbits(8) for _ in range(300)))
    with pytest.raises(RejectedMetadataError):
        eng.add_peer(good + b"\0")
    other = spawn_peer("owner-other", "tcp", SMALL, 1, compat="another-model|fp16|16|4")
    with pytest.raises(RejectedMetadataError, match="hash"):
        eng.connect(other.addr)
    assert eng.add_peer(good) == "owner-meta"


def test_out_of_range_blocks_post_nothing(engines, spawn_peer):
    owner = spawn_peer("owner-oor", "tcp", SMALL, 1)
    eng, raw = _reader(engines, "tcp", SMALL, "reader-oor")
    peer = eng.connect(owner.addr)
    n = SMALL.num_blocks
    with pytest.raises(BlockOutOfRangeError, match="remote"):
        eng.read_blocks(peer, [0, 1], [1, n])
    with pytest.raises(BlockOutOfRangeError, match="local"):
        eng.read_blocks(peer, [n + 5], [0])
    with pytest.raises(BlockOutOfRangeError):
        eng.write_blocks(peer, [0], [2**40])
    with pytest.raises(OverflowError):
        eng.read_blocks(peer, [-1], [0])
    assert not raw.any(), "nothing was posted"
    x = eng.read_blocks(peer, [0], [n - 1])
    eng.wait(x, timeout_s=10.0)
    assert raw[: SMALL.page_bytes].any()


@pytest.mark.parametrize("tls", ["tcp", "sm"])
def test_peer_killed_mid_transfer(tls, engines, spawn_peer):
    owner = spawn_peer(f"owner-kill-{tls}", tls, BIG, 5)
    eng, _ = _reader(engines, tls, BIG, f"reader-kill-{tls}")
    peer = eng.connect(owner.addr)
    ids = list(range(0, BIG.num_blocks, 2))  # fragmented: 512 ops of 64 KiB
    xs = [eng.read_blocks(peer, ids, ids, timeout_s=8.0) for _ in range(12)]
    time.sleep(0.01)
    owner.kill(signal.SIGKILL)
    t0 = time.monotonic()
    errors = []
    for x in xs:
        try:
            eng.wait(x, timeout_s=15.0)
        except (PeerUnreachableError, TransferTimeoutError, PdgateError) as e:
            errors.append(e)
    assert time.monotonic() - t0 < 15
    assert errors, "the kill landed after every transfer finished"
    print(
        f"{len(errors)}/{len(xs)} failed:",
        {type(e).__name__ for e in errors},
        str(errors[0])[:120],
    )
    # A read after the death must fail, never hang or succeed.
    with pytest.raises(PdgateError):
        x = eng.read_blocks(peer, [0], [0], timeout_s=3.0)
        eng.wait(x, timeout_s=10.0)
    assert time.monotonic() - t0 < 20
    assert all(
        not isinstance(e, TransferTimeoutError) or "did not finish" in str(e)
        for e in errors
    )


def test_stalled_peer_times_out(engines, spawn_peer):
    owner = spawn_peer("owner-stop", "tcp", BIG, 5)
    eng, _ = _reader(engines, "tcp", BIG, "reader-stop")
    peer = eng.connect(owner.addr)
    x = eng.read_blocks(peer, [0], [0])
    eng.wait(x, timeout_s=10.0)  # the endpoint is wired up
    owner.kill(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        ids = list(range(BIG.num_blocks))
        x = eng.read_blocks(peer, ids, ids, timeout_s=1.0)
        with pytest.raises(TransferTimeoutError):
            eng.wait(x, timeout_s=10.0)
        assert time.monotonic() - t0 < 5
        with pytest.raises(PeerUnreachableError):
            eng.read_blocks(peer, [0], [0])
    finally:
        owner.kill(signal.SIGCONT)
