"""Small helpers to talk to vLLM servers / the gateway in the e2e tests."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
from httpx_sse import EventSource

MODEL = "tiny-llama"


def prompt_ids(n: int, seed: int) -> list[int]:
    """A deterministic prompt of ``n`` token ids (avoiding special ids 0-2)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def body(prompt: Any, max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True, **extra}


def complete(url: str, req: dict[str, Any], timeout: float = 180.0) -> dict[str, Any]:
    """POST /v1/completions (non-streaming); raise on non-200."""
    r = httpx.post(url + "/v1/completions", json=req, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def token_ids(resp: dict[str, Any]) -> list[int]:
    return list(resp["choices"][0]["token_ids"])


async def acomplete(client: httpx.AsyncClient, url: str, req: dict[str, Any]) -> list[int]:
    r = await client.post(url + "/v1/completions", json=req, timeout=300.0)
    assert r.status_code == 200, r.text
    return token_ids(r.json())


def stream_completion(url: str, req: dict[str, Any], endpoint: str = "completions",
                      timeout: float = 180.0) -> tuple[list[int], dict[str, Any] | None, str]:
    """Stream a request; return (token ids, usage or None, content-type)."""
    ids: list[int] = []
    usage = None
    with httpx.stream("POST", f"{url}/v1/{endpoint}", json={**req, "stream": True}, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        ctype = r.headers["content-type"]
        # CR/LF-only SSE lines: vLLM leaves U+2028, U+0085, ... raw in its
        # JSON, and httpx's iter_lines would split a chunk there
        for event in EventSource(r).iter_sse():
            if not event.data or event.data == "[DONE]":
                continue
            obj = json.loads(event.data)
            assert "error" not in obj, obj
            for ch in obj.get("choices", []):
                ids += ch.get("token_ids") or []
            if obj.get("usage"):
                usage = obj["usage"]
    return ids, usage, ctype
