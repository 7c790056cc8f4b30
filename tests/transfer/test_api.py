"""In-process checks of the Python surface: tensor/buffer adapters,
asyncio completion, argument errors."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from pdgate._native import ClosedError, InvalidArgumentError, NotFoundError, compat_hash
from pdgate.transfer import (
    AsyncTransfers,
    buffer_info,
    register_blocks,
    register_buffer,
)


def test_buffer_info_zero_copy():
    torch = pytest.importorskip("torch")
    t = torch.arange(64, dtype=torch.bfloat16)
    assert buffer_info(t) == (t.data_ptr(), 128, "host")
    a = np.arange(10, dtype=np.int32)
    assert buffer_info(a) == (a.ctypes.data, 40, "host")
    ba = bytearray(b"abcdef")
    addr, n, _ = buffer_info(ba)
    assert n == 6 and addr == np.frombuffer(ba, dtype=np.uint8).ctypes.data
    ro = b"readonly-bytes"
    assert buffer_info(ro)[1] == len(ro)
    assert buffer_info(a[::2].copy())[1] == 20
    with pytest.raises(ValueError):
        buffer_info(a[::2])
    with pytest.raises(ValueError):
        buffer_info(t.view(8, 8).t())
    with pytest.raises(ValueError):
        buffer_info(object())


def test_loopback_torch_kv_and_asyncio(engines):
    torch = pytest.importorskip("torch")
    eng_a = engines("api-a", "tcp")
    eng_b = engines("api-b", "tcp")
    # vLLM CPU layout per layer: [num_blocks, kv_heads, block_size, 2*head_size]
    src = [
        torch.randn(16, 2, 32, 128, dtype=torch.float32).to(torch.bfloat16)
        for _ in range(2)
    ]
    dst = [torch.zeros_like(s) for s in src]
    for s in src:
        register_blocks(eng_a, s)
    for d in dst:
        register_blocks(eng_b, d)
    peer = eng_b.add_peer(eng_a.metadata())

    async def go() -> None:
        aw = AsyncTransfers(eng_b)
        x1 = eng_b.read_blocks(peer, [0, 1, 2, 9], [3, 4, 5, 15], notify="done")
        x2 = eng_b.read_blocks(peer, [7], [7])
        await aw.wait(x2, timeout_s=10)
        await aw.wait(x1, timeout_s=10)
        aw.close()

    asyncio.run(go())
    for s, d in zip(src, dst):
        assert torch.equal(d[[0, 1, 2, 9, 7]], s[[3, 4, 5, 15, 7]])
        assert not d[10].any()


def test_strided_view_and_errors(engines):
    torch = pytest.importorskip("torch")
    eng = engines("api-c", "tcp")
    # Block-major cache [blocks, layers, ...]: a layer view is strided.
    cache = torch.zeros(8, 3, 256, dtype=torch.uint8)
    r = register_blocks(eng, cache[:, 1], block_dim=0)
    with pytest.raises(ValueError):
        register_blocks(eng, cache.transpose(1, 2)[:, 0])
    with pytest.raises(InvalidArgumentError):
        eng.register(0, 100, 10)
    with pytest.raises(InvalidArgumentError):
        eng.register(cache.data_ptr(), 100, 200)
    with pytest.raises(InvalidArgumentError):
        eng.register(cache.data_ptr(), 100, 10, mem_type="tpu")
    buf = bytearray(4096)
    r2 = register_buffer(eng, buf, 512)
    with pytest.raises(NotFoundError):
        eng.read_blocks("nobody", [0], [0])
    with pytest.raises(NotFoundError):
        eng.wait(12345)
    with pytest.raises(InvalidArgumentError):
        eng.grant_lease("x", -1.0)
    eng.deregister(r)
    eng.deregister(r2)
    with pytest.raises(NotFoundError):
        eng.deregister(r2)
    assert isinstance(compat_hash("x"), int)
    assert eng.ucx_version.startswith("1.")
    eng.close()
    eng.close()


def test_poll_then_wait_and_close(engines):
    eng_a = engines("api-d", "tcp")
    eng_b = engines("api-e", "tcp")
    src, dst = bytearray(b"x" * 8192), bytearray(8192)
    register_buffer(eng_a, src, 1024)
    register_buffer(eng_b, dst, 1024)
    peer = eng_b.add_peer(eng_a.metadata())
    x = eng_b.read_blocks(peer, [0, 1], [6, 7])
    done: list[int] = []
    for _ in range(500):
        ok, failed = eng_b.poll()
        assert not failed
        done += ok
        if done:
            break
        time.sleep(0.01)
    assert done == [x]
    assert dst[:2048] == b"x" * 2048
    with pytest.raises(NotFoundError):
        eng_b.wait(x, timeout_s=1.0)  # already collected: never blocks
    eng_b.close()
    with pytest.raises(ClosedError):
        eng_b.read_blocks(peer, [0], [0])
