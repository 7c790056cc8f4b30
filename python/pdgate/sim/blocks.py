"""KV block pool with prefix caching by block hash (after vLLM V1's
``vllm/v1/core/block_pool.py`` and ``kv_cache_utils.py``).

* The pool has ``num_blocks`` blocks of ``block_size`` tokens.
* A full block of a request is *cached* under a chained hash of its tokens
  (hash of the previous block's hash and this block's token ids), so equal
  prefixes map to equal hashes.
* A block whose reference count drops to 0 goes to the tail of the free
  queue but keeps its hash: it can still be hit until it is evicted, which
  happens when it is popped from the head of the free queue (LRU).
* ``usage`` is ``1 - free / total`` as vLLM's ``vllm:kv_cache_usage_perc``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Sequence


def block_hashes(token_ids: Sequence[int], block_size: int = 16, salt: Hashable = None) -> list[int]:
    """Chained hashes of the full ``block_size``-token blocks of ``token_ids``.

    ``h_i = hash((h_{i-1}, tokens[i*bs:(i+1)*bs]))`` with ``h_{-1} = hash(salt)``;
    a trailing partial block gets no hash (vLLM caches full blocks only).
    """
    out: list[int] = []
    h = hash(("pdgate-sim", salt))
    for i in range(len(token_ids) // block_size):
        h = hash((h, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        out.append(h)
    return out


class BlockPool:
    """Reference-counted KV blocks with an LRU free queue and a hash index.

    Args:
        num_blocks: capacity in blocks.
        block_size: tokens per block.
        enable_caching: keep hashes of freed blocks for prefix hits.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.queries = 0  # prefix-cache queried tokens (vllm:prefix_cache_queries)
        self.hits = 0     # prefix-cache hit tokens (vllm:prefix_cache_hits)

    @property
    def num_free(self) -> int:
        """Blocks with reference count 0 (evictable cached ones included)."""
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (``vllm:kv_cache_usage_perc``)."""
        return 1.0 - len(self.free) / self.num_blocks

    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes`` (not referenced yet)."""
        out: list[int] = []
        if not self.enable_caching:
            return out
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def record_query(self, queried_tokens: int, hit_tokens: int) -> None:
        """Count a prefix-cache lookup (tokens)."""
        self.queries += queried_tokens
        self.hits += hit_tokens

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix hit), removing them from the free queue."""
        for b in block_ids:
            if self.ref[b] == 0:
                self.free.pop(b, None)
            self.ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks (evicting LRU cached ones), or None if fewer are free."""
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.hash_of[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.hash_of[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; unreferenced blocks become free.

        Blocks are freed in reverse order so a request's tail blocks are
        evicted before its head (vLLM does the same: heads are likelier shared).
        """
        for b in reversed(block_ids):
            if self.ref[b] <= 0:
                raise RuntimeError(f"block {b} released twice")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None  # tail of the LRU queue, hash kept for later hits

    def cache(self, block_id: int, h: int) -> None:
        """Register a full block under its hash (first writer wins, as in vLLM)."""
        if not self.enable_caching or self.hash_of[block_id] is not None:
            return
        if h not in self.cached:
            self.cached[h] = block_id
        self.hash_of[block_id] = h
