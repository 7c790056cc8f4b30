"""Prompt synthesis for trace replay: prompts of exactly the traced token counts.

:class:`PromptSynthesizer` chains 512-token slices of a seeded filler text;
Mooncake ``hash_ids`` pick the slices so requests sharing ids share prefix
blocks (prefix caching is reproduced). :func:`load_tokenizer` loads a local
tokenizer directory.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Sequence
from typing import Any

from pdgate.bench.traces import MOONCAKE_BLOCK_TOKENS, ReplayPlan, TraceRequest, _unit

_WORDS = (
    "the of and to in is was that for on with as by at from this be are or an have it not but "
    "which were all their has been one more when there can also would other time into some these "
    "new two may first any only its over such after most years system model data server request "
    "token cache memory prefill decode batch queue latency network kernel value function result "
    "number state table index process between through during under while where about each many "
    "people world city water light energy market history science music river garden window paper "
    "simple small large early later public general local common special human social green quiet "
    "build write read move carry hold share store measure follow return change create compute send"
).split()


@dataclasses.dataclass
class SynthPrompt:
    """A synthesized prompt.

    Attributes:
        prompt: token ids (``prompt_mode="ids"``) or text (``"text"``).
        token_ids: the token ids (text mode: the re-encoded text).
        target_tokens: requested prompt length in tokens.
        n_tokens: actual length in tokens (text mode: after re-encoding).
    """

    prompt: list[int] | str
    token_ids: list[int]
    target_tokens: int
    n_tokens: int

    @property
    def token_error(self) -> int:
        """``n_tokens - target_tokens`` (0 when exact)."""
        return self.n_tokens - self.target_tokens


def _encode(tok: Any, text: str) -> list[int]:
    try:
        return list(tok.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tok.encode(text))


def _decode(tok: Any, ids: list[int]) -> str:
    try:
        return str(tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))
    except TypeError:
        return str(tok.decode(ids))


class PromptSynthesizer:
    """Deterministic prompts of a requested token length.

    Tokens come from a pool: English-like filler text, seeded, encoded once
    with the tokenizer (so ids are ordinary text tokens, never special ones).
    A prompt is a chain of ``block_tokens``-token blocks, each a pool slice at
    a seeded offset. Block keys are the Mooncake ``hash_ids`` when present
    (so equal ids give equal blocks, and prefix caching is reproduced), else
    ``(request index, block number)`` (unique per request). The chain is cut
    to exactly ``prompt_tokens`` ids.

    ``prompt_mode="ids"`` sends the ids (exact length; vLLM accepts
    ``prompt: [ids]``). ``"text"`` decodes them and fixes the length by
    re-encoding up to ``max_retry`` times (as vLLM's
    ``gen_prompt_decode_to_target_len``); the remaining error is reported in
    :attr:`SynthPrompt.token_error` (usually 0, rarely +-1). The server may
    add a BOS token to text prompts.

    Args:
        tokenizer: HF tokenizer or any object with ``encode``/``decode``; None
            only in ids mode, then ids are seeded random ints in
            ``[100, vocab_size)`` (for simulated fleets).
        seed: seed of pool text and block offsets.
        prompt_mode: ``"ids"`` or ``"text"``.
        block_tokens: block length in tokens (512 matches Mooncake hash_ids).
        pool_tokens: approximate pool size in tokens.
        vocab_size: id range when ``tokenizer`` is None.
    """

    def __init__(
        self,
        tokenizer: Any | None,
        *,
        seed: int = 0,
        prompt_mode: str = "ids",
        block_tokens: int = MOONCAKE_BLOCK_TOKENS,
        pool_tokens: int = 1 << 15,
        vocab_size: int | None = None,
        max_retry: int = 10,
    ) -> None:
        if prompt_mode not in ("ids", "text"):
            raise ValueError("prompt_mode must be 'ids' or 'text'")
        if tokenizer is None and (prompt_mode == "text" or not vocab_size):
            raise ValueError("without a tokenizer only prompt_mode='ids' with vocab_size works")
        self.tokenizer = tokenizer
        self.seed = seed
        self.prompt_mode = prompt_mode
        self.block_tokens = block_tokens
        self.pool_tokens = max(pool_tokens, 2 * block_tokens)
        self.vocab_size = vocab_size
        self.max_retry = max_retry
        self._pool: list[int] | None = None
        self._blocks: dict[Any, list[int]] = {}

    def _build_pool(self) -> list[int]:
        rng = random.Random(f"pdgate-pool:{self.seed}")
        if self.tokenizer is None:
            assert self.vocab_size
            return [rng.randrange(100, self.vocab_size) for _ in range(self.pool_tokens)]
        ids: list[int] = []
        while len(ids) < self.pool_tokens:
            words = []
            for _ in range(2048):
                w = rng.choice(_WORDS)
                r = rng.random()
                words.append(w + ("." if r < 0.06 else "," if r < 0.1 else ""))
            ids.extend(_encode(self.tokenizer, " " + " ".join(words)))
        return ids

    def _block(self, key: Any) -> list[int]:
        blk = self._blocks.get(key)
        if blk is None:
            if self._pool is None:
                self._pool = self._build_pool()
            pool = self._pool
            off = int(_unit("block", self.seed, key) * (len(pool) - self.block_tokens))
            blk = pool[off : off + self.block_tokens]
            if len(self._blocks) < 65536:  # bound memory on huge traces
                self._blocks[key] = blk
        return blk

    def token_ids(self, req: TraceRequest, n_tokens: int | None = None) -> list[int]:
        """Exactly ``n_tokens`` (default ``req.prompt_tokens``) ids for ``req``."""
        n = req.prompt_tokens if n_tokens is None else n_tokens
        ids: list[int] = []
        hashes = req.hash_ids or []
        k = 0
        while len(ids) < n:
            key: Any = ("h", hashes[k]) if k < len(hashes) else ("r", req.index, k)
            ids.extend(self._block(key))
            k += 1
        return ids[:n]

    def synthesize(self, req: TraceRequest) -> SynthPrompt:
        """Build the prompt of ``req`` (see class docstring)."""
        n = req.prompt_tokens
        ids = self.token_ids(req)
        if self.prompt_mode == "ids":
            return SynthPrompt(ids, ids, n, len(ids))
        # Text mode: decode, re-encode, adjust (after vLLM's
        # benchmarks/datasets gen_prompt_decode_to_target_len).
        extra = self.token_ids(req, n + 4 * self.max_retry + 64)[n:]
        best: tuple[int, str, list[int]] | None = None
        cur = ids
        for _ in range(self.max_retry + 1):
            text = _decode(self.tokenizer, cur)
            enc = _encode(self.tokenizer, text)
            err = len(enc) - n
            if best is None or abs(err) < abs(best[0]):
                best = (err, text, enc)
            if err == 0:
                break
            if err > 0:
                cur = enc[:n]
            else:
                take, extra = extra[:-err], extra[-err:]
                cur = enc + take
        assert best is not None
        err, text, enc = best
        return SynthPrompt(text, enc, n, len(enc))

    def synthesize_all(self, plan: ReplayPlan | Sequence[TraceRequest]) -> list[SynthPrompt]:
        """Prompts for every request of a plan, in plan order."""
        reqs = plan.requests if isinstance(plan, ReplayPlan) else plan
        return [self.synthesize(r) for r in reqs]


def load_tokenizer(path: str) -> Any:
    """Tokenizer of a local model dir (or cached hub name).

    A dir with ``tokenizer.json`` loads as ``PreTrainedTokenizerFast`` (no
    torch import, seconds faster); anything else via ``AutoTokenizer``. Only
    ``encode``/``decode`` of plain text are used, which both give alike.
    """
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
