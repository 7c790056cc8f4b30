"""Prompt token counting for routing decisions.

Order of sources: a prompt given as token ids is counted exactly; with
``tokenizer.words`` text counts one token per whitespace-separated word (the
simulator's rule); otherwise text goes to the local tokenizer (``tokenizer.path``) or, if configured, an instance's
``POST /tokenize`` (vLLM's endpoint, answer ``{"count": N, ...}``). Counts
are cached (LRU by prompt). When no source works the count is estimated as
one token per 4 UTF-8 bytes, and every estimate is counted in
``pdgate_prompt_token_estimates_total{reason}``: never a silent guess.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from typing import Any

import httpx

from pdgate.config import TokenizerConfig

log = logging.getLogger("pdgate.tokens")


def _token_id_prompt(prompt: Any) -> list[int] | None:
    """The ids of a token-id prompt (``[1,2,3]`` or ``[[1,2,3]]``), else ``None``."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    # Hot path: a JSON list of ints is checked at its ends only (the instance
    # validates every element; a mixed list only makes the count approximate).
    if (isinstance(prompt, list) and prompt and type(prompt[0]) is int and type(prompt[-1]) is int):
        return prompt
    return None


def prompt_text(endpoint: str, body: dict[str, Any]) -> str:
    """The prompt as one string (chat messages joined with role tags)."""
    if endpoint == "completions":
        p = body.get("prompt")
        if isinstance(p, list):
            return "".join(x if isinstance(x, str) else json.dumps(x) for x in p)
        return str(p)
    parts = []
    for m in body.get("messages") or []:
        if not isinstance(m, dict):
            continue
        c = m.get("content", "")
        if isinstance(c, list):
            c = "".join(str(x.get("text", "")) for x in c if isinstance(x, dict))
        parts.append(f"<|{m.get('role', 'user')}|>{c}\n")
    return "".join(parts) + "<|assistant|>"


def estimate_tokens(text: str) -> int:
    """Fallback estimate: one token per 4 UTF-8 bytes (at least 1)."""
    return max(1, (len(text.encode("utf-8", "replace")) + 3) // 4)


class TokenCounter:
    """Counts prompt tokens (see module doc).

    Args:
        config: tokenizer settings.
        metrics: the gateway metrics (for ``token_estimates``), optional.
    """

    def __init__(self, config: TokenizerConfig | None = None, metrics: Any = None) -> None:
        self.config = config or TokenizerConfig()
        self.metrics = metrics
        self._cache: OrderedDict[str, int] = OrderedDict()
        self._tok: Any = None
        if self.config.path:
            try:
                from transformers import AutoTokenizer

                self._tok = AutoTokenizer.from_pretrained(self.config.path)
            except Exception as e:  # noqa: BLE001 - any load failure means "no local tokenizer"
                log.warning("cannot load tokenizer %s: %r; prompts will be tokenized remotely or estimated",
                            self.config.path, e)

    def _estimate(self, text: str, reason: str) -> int:
        if self.metrics is not None:
            self.metrics.token_estimates.labels(reason).inc()
        return estimate_tokens(text)

    def _local(self, endpoint: str, body: dict[str, Any], text: str) -> int:
        tok = self._tok
        if endpoint == "chat/completions" and getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(body.get("messages"), add_generation_prompt=True, tokenize=True)
            return len(ids)
        return len(tok(text, add_special_tokens=True)["input_ids"])

    async def count(self, endpoint: str, body: dict[str, Any], client: httpx.AsyncClient | None = None,
                    instance_url: str | None = None) -> int:
        """Prompt tokens of a validated request body."""
        return (await self.measure(endpoint, body, client, instance_url))[0]

    async def measure(self, endpoint: str, body: dict[str, Any], client: httpx.AsyncClient | None = None,
                      instance_url: str | None = None) -> tuple[int, bool]:
        """Prompt tokens of a validated request body and whether the count is
        exact (token ids, a tokenizer) rather than estimated."""
        if endpoint == "completions":
            ids = _token_id_prompt(body.get("prompt"))
            if ids is not None:
                return len(ids), True
        text = prompt_text(endpoint, body)
        if self.config.words:
            return max(1, len(text.split())), True
        key = hashlib.blake2b(f"{endpoint}\0{text}".encode("utf-8", "replace"), digest_size=16).hexdigest()
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit, True
        n: int | None = None
        if self._tok is not None:
            try:
                n = self._local(endpoint, body, text)
            except Exception as e:  # noqa: BLE001
                log.debug("local tokenization failed: %r", e)
        if n is None and self.config.use_instance and client is not None and instance_url:
            n = await self._remote(endpoint, body, client, instance_url)
        if n is None:
            return self._estimate(text, "no_tokenizer" if self._tok is None and not self.config.use_instance
                                  else "tokenizer_failed"), False
        if self.config.cache_size:
            self._cache[key] = n
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)
        return n, True

    async def _remote(self, endpoint: str, body: dict[str, Any], client: httpx.AsyncClient,
                      url: str) -> int | None:
        req: dict[str, Any] = {"model": body.get("model")}
        if endpoint == "completions":
            req["prompt"] = body.get("prompt")
        else:
            req["messages"] = body.get("messages")
        try:
            r = await client.post(f"{url}/tokenize", json=req, timeout=5.0)
            if r.status_code == 200:
                c = r.json().get("count")
                if isinstance(c, int):
                    return c
        except (httpx.HTTPError, ValueError) as e:
            log.debug("remote tokenize on %s failed: %r", url, e)
        return None
