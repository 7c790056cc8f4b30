"""KV block transfer between prefill and decode instances (UCX, zero-copy).

The engine itself is Rust (:class:`pdgate._native.TransferEngine`); this
module finds UCX in the ``libucx-cu12`` wheel, turns tensors and buffers
into (address, length) registrations without copying, and wraps completion
in asyncio.

Field terms: a *region* is caller-owned memory registered with the engine
(one per KV cache layer); it holds *blocks* of ``block_len`` bytes. A *peer*
is another engine whose metadata was added. A *lease* pins the owner's
blocks for one request until the reader notifies or the lease's time to
live (seconds) passes; a read that finishes after that fails with
:class:`LeaseExpiredError` instead of returning stale bytes.

Example (two processes; the owner holds the prefilled KV cache)::

    # owner (prefill side)
    eng = create_engine("prefill-0", compat="llama3-8b|bf16|16|32")
    for layer in kv_caches:                      # torch tensors
        register_blocks(eng, layer)              # block dim 0
    port = eng.listen("0.0.0.0", 0)
    token = eng.grant_lease("req-42", ttl_s=30.0)
    # ... send (host, port, block_ids, token) to the decode side ...

    # reader (decode side)
    eng = create_engine("decode-0", compat="llama3-8b|bf16|16|32")
    for layer in kv_caches:
        register_blocks(eng, layer)
    peer = eng.connect(f"{host}:{port}")
    xfer = eng.read_blocks(peer, local_ids, remote_ids,
                           notify=b"req-42", lease=token)
    await AsyncTransfers(eng).wait(xfer)         # or eng.wait(xfer)
    # the owner sees {"msg": b"req-42", "released_lease": "req-42", ...}
    # in eng.get_notifications() and frees its blocks.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
from pathlib import Path
from typing import Any

from pdgate._native import (
    BlockOutOfRangeError,
    LeaseExpiredError,
    PeerUnreachableError,
    RejectedMetadataError,
    TransferEngine,
    TransferTimeoutError,
    TransportError,
    compat_hash,
    fetch_metadata,
)

__all__ = [
    "AsyncTransfers",
    "BlockOutOfRangeError",
    "LeaseExpiredError",
    "PeerUnreachableError",
    "RejectedMetadataError",
    "TransferEngine",
    "TransferTimeoutError",
    "TransportError",
    "buffer_info",
    "compat_hash",
    "create_engine",
    "fetch_metadata",
    "kv_compat",
    "register_blocks",
    "register_buffer",
    "ucx_bin_dir",
    "ucx_lib_dir",
]


def ucx_lib_dir() -> Path | None:
    """Folder holding ``libucp.so.0``: ``$PDGATE_UCX_LIB_DIR``, else the
    ``libucx-cu12`` wheel's ``lib/`` (its libraries are preloaded with
    ``libucx.load_library()``), else None (use the loader path)."""
    env = os.environ.get("PDGATE_UCX_LIB_DIR")
    if env:
        return Path(env)
    try:
        import libucx  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return None
    libucx.load_library()
    d = Path(libucx.__file__).resolve().parent / "lib"
    return d if (d / "libucp.so.0").exists() else None


def ucx_bin_dir() -> Path | None:
    """Folder with the wheel's UCX tools (``ucx_perftest``, ``ucx_info``)."""
    lib = ucx_lib_dir()
    if lib is None:
        return None
    b = lib.parent / "bin"
    return b if b.is_dir() else None


def kv_compat(
    *, layout: str, dtype: str, block_size: int, num_layers: int, extra: str = ""
) -> str:
    """Canonical KV compatibility description; engines pair only when
    theirs hash equal (block layout, dtype, block size in tokens, layers)."""
    return f"layout={layout}|dtype={dtype}|block_size={block_size}|layers={num_layers}|{extra}"


def create_engine(
    engine_id: str,
    compat: str = "",
    *,
    transports: str | None = None,
    ucx_options: dict[str, str] | None = None,
    lease_slots: int = 4096,
) -> TransferEngine:
    """Start a :class:`TransferEngine` using the wheel's UCX.

    Args:
        engine_id: unique name of this engine.
        compat: KV layout description (see :func:`kv_compat`).
        transports: UCX transports (``"tcp"``, ``"sm"``...), None = UCX default.
        ucx_options: extra UCX settings (names without ``UCX_``).
        lease_slots: concurrent leases this engine can grant.

    Raises:
        TransportError: UCX could not be loaded or started.
    """
    lib = ucx_lib_dir()
    return TransferEngine(
        engine_id,
        compat,
        ucp_lib=str(lib / "libucp.so.0") if lib else None,
        transports=transports,
        ucx_options=ucx_options,
        lease_slots=lease_slots,
    )


def buffer_info(obj: Any) -> tuple[int, int, str]:
    """``(address, nbytes, mem_type)`` of a contiguous tensor or buffer,
    without copying.

    Accepts torch tensors (CPU or CUDA), objects with ``__dlpack__``
    (via ``torch.from_dlpack``), and any C-contiguous buffer-protocol object
    (bytearray, numpy array, mmap...). The caller keeps ``obj`` alive while
    it is registered.

    Raises:
        ValueError: not contiguous, or not a tensor/buffer.
    """
    if type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr"):
        if not obj.is_contiguous():
            raise ValueError("tensor must be contiguous")
        mt = "cuda" if obj.device.type == "cuda" else "host"
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size()), mt
    if hasattr(obj, "__dlpack__") and not isinstance(
        obj, (bytes, bytearray, memoryview)
    ):
        try:
            import torch
        except ImportError:  # pragma: no cover - numpy arrays also have buffers
            pass
        else:
            return buffer_info(torch.from_dlpack(obj))
    try:
        mv = memoryview(obj)
    except TypeError as e:
        raise ValueError(
            f"{type(obj).__name__} is neither a tensor nor a buffer"
        ) from e
    if not mv.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    n = mv.nbytes
    if n == 0:
        raise ValueError("empty buffer")
    if not mv.readonly:
        addr = ctypes.addressof((ctypes.c_char * n).from_buffer(mv.cast("B")))
    else:
        import numpy as np

        addr = int(np.frombuffer(mv.cast("B"), dtype=np.uint8).ctypes.data)
    return addr, n, "host"


def register_buffer(
    engine: TransferEngine,
    obj: Any,
    block_len: int,
    block_stride: int = 0,
    block_count: int = 0,
) -> int:
    """Register a whole tensor/buffer as one region of ``block_len``-byte
    blocks every ``block_stride`` bytes (0 = packed); returns the region id.
    Keep ``obj`` alive until ``engine.deregister(region)``."""
    addr, n, mt = buffer_info(obj)
    return engine.register(addr, n, block_len, block_stride, block_count, mt)


def register_blocks(engine: TransferEngine, tensor: Any, block_dim: int = 0) -> int:
    """Register a KV cache tensor whose dimension ``block_dim`` indexes
    blocks (vLLM's per-layer cache ``[num_blocks, heads, block_size, C]``
    on CPU). A block is the contiguous span below that dimension; blocks
    may be strided (e.g. a layer view of a block-major cache). Returns the
    region id.

    Raises:
        ValueError: the span under ``block_dim`` is not contiguous.
    """
    t = tensor
    es = t.element_size()
    inner = 1
    for d in range(t.dim() - 1, block_dim, -1):
        if t.stride(d) != inner:
            raise ValueError("each block must be contiguous below block_dim")
        inner *= t.shape[d]
    for d in range(block_dim):
        if t.shape[d] != 1:
            raise ValueError("dimensions before block_dim must have size 1")
    block_len = inner * es
    stride = t.stride(block_dim) * es
    count = t.shape[block_dim]
    length = (count - 1) * stride + block_len
    mt = "cuda" if t.device.type == "cuda" else "host"
    return engine.register(int(t.data_ptr()), length, block_len, stride, count, mt)


class AsyncTransfers:
    """asyncio front for one engine: ``await wait(xfer_id)``.

    Watches the engine's event fd in the running loop and collects results
    with ``engine.poll()``; once wrapped, collect results only through this
    object. Notifications are queued for :meth:`next_notification`.
    """

    def __init__(self, engine: TransferEngine) -> None:
        self.engine = engine
        self._loop = asyncio.get_running_loop()
        self._results: dict[int, BaseException | None] = {}
        self._futures: dict[int, asyncio.Future[None]] = {}
        self._notifs: asyncio.Queue[Any] = asyncio.Queue()
        self._fd = engine.event_fd()
        self._loop.add_reader(self._fd, self._on_event)
        self._on_event()

    def _on_event(self) -> None:
        self.engine.drain_event_fd()
        done, failed = self.engine.poll()
        for i in done:
            self._settle(i, None)
        for i, exc in failed:
            self._settle(i, exc)
        for n in self.engine.get_notifications():
            self._notifs.put_nowait(n)

    def _settle(self, xfer_id: int, exc: BaseException | None) -> None:
        fut = self._futures.pop(xfer_id, None)
        if fut is None:
            self._results[xfer_id] = exc
        elif not fut.done():
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)

    async def wait(self, xfer_id: int, timeout_s: float | None = None) -> None:
        """Wait for a transfer; raises its error (a PdgateError subclass),
        or ``TimeoutError`` after ``timeout_s`` seconds."""
        if xfer_id in self._results:
            exc = self._results.pop(xfer_id)
            if exc is not None:
                raise exc
            return
        fut = self._futures.get(xfer_id)
        if fut is None:
            fut = self._loop.create_future()
            self._futures[xfer_id] = fut
        self._on_event()  # results may have landed before the fd was read
        await asyncio.wait_for(asyncio.shield(fut), timeout_s)

    async def next_notification(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Next notification (``{"peer", "msg", "released_lease"}``)."""
        return await asyncio.wait_for(self._notifs.get(), timeout_s)

    def close(self) -> None:
        """Stop watching the event fd (the engine stays open)."""
        self._loop.remove_reader(self._fd)
