"""Prefix-aware: block-hash affinity with load balance.

The prompt is cut into blocks (``block_tokens`` token ids, or
``4 * block_tokens`` characters of text) and each block gets a chained hash
(hash of the previous block's hash and its own content, as vLLM's prefix
cache keys blocks). Each instance remembers the hashes of prompts sent to it
(LRU, bounded). A request goes to the candidate holding the longest run of
its leading blocks, unless that candidate's outstanding tokens exceed the
least loaded one's by more than ``balance_tokens`` plus ``balance_ratio`` x
the least load, in which case load wins (as vllm-router's cache_aware
policy balances cache hits against imbalance).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Sequence

from pdgate.fleet import Instance
from pdgate.policies.base import RequestInfo, need_candidates
from pdgate.policies.least_load import LeastLoadPolicy
from pdgate.policies.registry import register
from pdgate.state.tokens import _token_id_prompt, prompt_text


def block_hashes(endpoint: str, body: dict[str, Any], block_tokens: int = 16) -> list[bytes]:
    """Chained hashes of the prompt's full blocks."""
    ids = _token_id_prompt(body.get("prompt")) if endpoint == "completions" else None
    chunks: list[bytes] = []
    if ids is not None:
        for i in range(0, len(ids) - block_tokens + 1, block_tokens):
            chunks.append(",".join(map(str, ids[i:i + block_tokens])).encode())
    else:
        text = prompt_text(endpoint, body).encode()
        step = 4 * block_tokens
        chunks = [text[i:i + step] for i in range(0, len(text) - step + 1, step)]
    out: list[bytes] = []
    prev = b""
    for c in chunks:
        prev = hashlib.blake2b(prev + c, digest_size=12).digest()
        out.append(prev)
    return out


@register("prefix_aware")
class PrefixAwarePolicy:
    name = "prefix_aware"
    kind = "instance"

    def __init__(self, config: Any = None, block_tokens: int = 16, max_blocks_per_instance: int = 200_000,
                 balance_tokens: int = 8192, balance_ratio: float = 0.5) -> None:
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks_per_instance
        self.balance_tokens = balance_tokens
        self.balance_ratio = balance_ratio
        self._seen: dict[str, OrderedDict[bytes, None]] = {}
        self._fallback = LeastLoadPolicy()

    def match(self, inst: Instance, hashes: list[bytes]) -> int:
        """Leading blocks of ``hashes`` that ``inst`` has seen."""
        seen = self._seen.get(inst.url)
        if not seen:
            return 0
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def _remember(self, inst: Instance, hashes: list[bytes]) -> None:
        seen = self._seen.setdefault(inst.url, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_blocks:
            seen.popitem(last=False)

    def select(self, candidates: Sequence[Instance], request: RequestInfo) -> Instance:
        need_candidates(candidates)
        hashes = block_hashes(request.endpoint, request.body, self.block_tokens)
        least = self._fallback.select(candidates, request)
        chosen = least
        if hashes:
            best = max(candidates, key=lambda i: (self.match(i, hashes), -i.load_tokens()))
            if self.match(best, hashes) > 0:
                bound = least.load_tokens() * (1 + self.balance_ratio) + self.balance_tokens
                if best.load_tokens() <= bound:
                    chosen = best
        self._remember(chosen, hashes)
        return chosen
