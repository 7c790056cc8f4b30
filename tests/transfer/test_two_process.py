"""Two processes move random KV block sets over UCX tcp and sm, byte-exact,
with vLLM's CPU KV cache layout."""

from __future__ import annotations

import random

import numpy as np
import pytest
from pdgate._native import LeaseExpiredError

from .kvlayout import KVGeom, block_bytes, fill

SEED = 1234


def _local(engines, tls: str, g: KVGeom, name: str):
    eng = engines(name, tls)
    raw = np.zeros(g.total_bytes, dtype=np.uint8)
    regs = [
        eng.register(
            raw.ctypes.data + l * g.layer_stride,
            g.region_len(),
            g.page_bytes,
            g.block_stride,
            g.num_blocks,
        )
        for l in range(g.num_layers)
    ]
    return eng, raw, regs


def _random_sets(rng: random.Random, n: int):
    """A contiguous run, a fragmented set and a shuffled mix."""
    k = rng.randint(3, n // 3)
    start = rng.randint(0, n - k)
    yield list(range(start, start + k)), rng.sample(range(n), k)
    frag = sorted(rng.sample(range(0, n, 2), k))
    yield frag, frag
    ids = rng.sample(range(n), n // 2)
    yield ids, rng.sample(range(n), n // 2)


@pytest.mark.parametrize("tls", ["tcp", "sm"])
def test_read_and_write_random_blocks(tls, geom, engines, spawn_peer):
    owner = spawn_peer(f"owner-{tls}", tls, geom, SEED)
    eng, raw, _ = _local(engines, tls, geom, f"reader-{tls}")
    peer = eng.connect(owner.addr, timeout_s=5.0)
    assert peer == f"owner-{tls}"
    src = fill(SEED, geom.total_bytes)  # the owner's bytes
    rng = random.Random(7)
    n = geom.num_blocks
    for remote_ids, local_ids in _random_sets(rng, n):
        raw[:] = 0
        x = eng.read_blocks(peer, local_ids, remote_ids, timeout_s=10.0)
        eng.wait(x, timeout_s=15.0)
        for layer in range(geom.num_layers):
            for lb, rb in zip(local_ids, remote_ids):
                assert np.array_equal(
                    block_bytes(raw, geom, layer, lb), block_bytes(src, geom, layer, rb)
                ), (layer, lb, rb)
        untouched = set(range(n)) - set(local_ids)
        b = next(iter(untouched))
        assert not block_bytes(raw, geom, 0, b).any()
    # Push: write our (random) blocks into a subset of the owner's blocks.
    raw[:] = fill(99, geom.total_bytes)
    local_ids = rng.sample(range(n), 9)
    remote_ids = rng.sample(range(n), 9)
    x = eng.write_blocks(
        peer,
        local_ids,
        remote_ids,
        regions=[0, 2],
        remote_regions=[1, 3],
        timeout_s=10.0,
    )
    eng.wait(x, timeout_s=15.0)
    import hashlib

    for lreg, rreg in [(0, 1), (2, 3)]:
        h = hashlib.sha256()
        for lb in local_ids:
            h.update(block_bytes(raw, geom, lreg, lb).tobytes())
        assert owner.call("digest", layer=rreg, blocks=remote_ids) == h.hexdigest()


@pytest.mark.parametrize("tls", ["tcp", "sm"])
def test_notify_releases_lease_and_expiry_fails_loudly(tls, engines, spawn_peer, geom):
    owner = spawn_peer(f"owner-l-{tls}", tls, geom, SEED)
    eng, raw, _ = _local(engines, tls, geom, f"reader-l-{tls}")
    peer = eng.connect(owner.addr)
    token = bytes.fromhex(owner.call("lease", req="req-1", ttl=30.0))
    x = eng.read_blocks(peer, [0, 1, 2], [5, 6, 7], notify=b"req-1", lease=token)
    eng.wait(x, timeout_s=10.0)
    import time

    deadline = time.monotonic() + 5
    notes: list = []
    while not notes and time.monotonic() < deadline:
        notes = owner.call("notifs")  # type: ignore[assignment]
        time.sleep(0.02)
    assert notes == [
        {"peer": f"reader-l-{tls}", "msg": "req-1", "released_lease": "req-1"}
    ]
    # The released lease no longer admits reads.
    x = eng.read_blocks(peer, [0], [5], lease=token)
    with pytest.raises(LeaseExpiredError):
        eng.wait(x, timeout_s=10.0)
    # Expiry: the owner frees the blocks, a late read fails loudly.
    token = bytes.fromhex(owner.call("lease", req="req-2", ttl=0.05))
    time.sleep(0.3)
    assert owner.call("expired") == ["req-2"]
    raw[:] = 0
    x = eng.read_blocks(peer, [3], [9], lease=token)
    with pytest.raises(LeaseExpiredError, match="lease"):
        eng.wait(x, timeout_s=10.0)
