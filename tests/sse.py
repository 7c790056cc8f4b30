"""Read an OpenAI-style SSE stream into text, token ids and events (shared by the sim and e2e tiers)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from httpx_sse import EventSource


@dataclass
class StreamRead:
    """One streamed answer.

    Attributes:
        first_s: seconds from sending the request to the first event with content (text, a
            chat delta or token ids), or ``None`` if none came.
        text: the concatenated ``text`` (completions) or ``delta.content`` (chat).
        ids: every choice's ``token_ids`` in order.
        events: the decoded JSON events, ``[DONE]`` excluded.
    """

    first_s: float | None = None
    text: str = ""
    ids: list[int] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ids_per_event(self) -> list[list[int]]:
        """Token ids of each choice event (vLLM may put several tokens in one event)."""
        return [c.get("token_ids") or [] for e in self.events for c in e.get("choices", [])]

    @property
    def errors(self) -> list[dict[str, Any]]:
        """Events that carry an ``error`` object."""
        return [e for e in self.events if "error" in e]


def read_stream(url: str, req: dict[str, Any], endpoint: str = "completions",
                timeout: float = 180.0) -> StreamRead:
    """POST ``req`` to ``{url}/v1/{endpoint}`` and read its SSE answer to the end.

    Lines are split on CR/LF only (httpx-sse): vLLM leaves U+2028 and U+0085 raw in its JSON, and
    ``httpx.Response.iter_lines`` would split an event there.

    Raises:
        AssertionError: the status is not 200.
    """
    out = StreamRead()
    t0 = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/{endpoint}", json=req, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for event in EventSource(r).iter_sse():
            if not event.data or event.data == "[DONE]":
                continue
            obj = json.loads(event.data)
            out.events.append(obj)
            for c in obj.get("choices", []):
                piece = ((c.get("delta") or {}).get("content") if "delta" in c else c.get("text")) or ""
                tokens = c.get("token_ids") or []
                if (piece or tokens) and out.first_s is None:
                    out.first_s = time.monotonic() - t0
                out.text += piece
                out.ids += tokens
    return out
