"""The first token from the prefill instance (DistServe / Splitwise style).

In vLLM's P/D protocol the prefill leg runs with ``max_tokens=1``: the
prefill instance computes the prompt *and samples the first output token*,
then holds the KV cache for the decode instance, which pulls it and
generates the whole answer again from token one. Without this module the
client's first token waits for the KV transfer and for the decode
instance's next step with room for the request. DistServe (Zhong et al.,
OSDI '24, section 2) and Splitwise (Patel et al., ISCA '24, section 3)
count the first token at the end of the prefill phase: this module does the
same for a streamed request:

1. :func:`eligible`: only when the decode instance is certain to produce the
   same first token: greedy sampling (``temperature`` 0, or ``top_k`` 1),
   one choice, no stop strings (a stop string could span tokens one and two
   and remove text already sent), no logprobs, no echo, no ``min_tokens``,
   ``max_tokens`` > 1.
2. :func:`first_event`: the SSE event for the client built from the prefill
   answer (its ``id``, ``created`` and ``model``: both legs carry the same
   ``X-Request-Id``, which vLLM uses for the response id).
3. :class:`SpliceFirstToken`: strips that first token (text, ``token_ids``,
   ``prompt_token_ids``, the chat ``role``) from the decode leg's stream, so
   the client sees each token once. If the decode stream's text does not
   start with the text already sent (it should not happen under greedy
   sampling, but float rounding may break an exact tie), the rest is
   relayed as is and the mismatch is counted.
"""

from __future__ import annotations

import json
from typing import Any

from pdgate.gateway.legs import pop_sse_events

_NO_STOP: tuple[Any, ...] = (None, "", [])


def eligible(body: dict[str, Any]) -> bool:
    """Whether a request's first token may come from the prefill instance.

    Args:
        body: the client's validated request body (completions or chat).

    Returns:
        True for a streamed, single-choice, greedy request (see the module
        docstring for the full list of conditions).
    """
    if not body.get("stream"):
        return False
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return False
    greedy = body.get("temperature") == 0 or body.get("top_k") == 1
    if not greedy:
        return False
    if body.get("stop") not in _NO_STOP or body.get("echo") or body.get("logprobs") or body.get("top_logprobs"):
        return False
    if body.get("min_tokens"):
        return False
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and (not isinstance(v, int) or v <= 1):
            return False
    so = body.get("stream_options")
    if isinstance(so, dict) and so.get("continuous_usage_stats"):
        return False
    return True


def first_text(answer: Any, chat: bool) -> str | None:
    """The first token's text in a prefill answer, or ``None`` when it cannot be used.

    Args:
        answer: the prefill instance's JSON answer (``max_tokens=1``).
        chat: a chat completion (``message.content``) rather than a completion (``text``).

    Returns:
        The text, if the answer has one non-empty choice that stopped on
        ``length`` (any other finish means the decode leg may stop there
        too, or produce something else) and holds no U+FFFD (a token that
        is part of a UTF-8 character: vLLM's streaming detokenizer holds it
        back until the character is whole).
    """
    if not isinstance(answer, dict):
        return None
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    c = choices[0]
    if c.get("finish_reason") != "length":
        return None
    if chat:
        msg = c.get("message")
        text = msg.get("content") if isinstance(msg, dict) else None
    else:
        text = c.get("text")
    if not isinstance(text, str) or not text or "\ufffd" in text:
        return None  # a partial UTF-8 character: the decode stream holds it back, so it cannot match
    return text


def first_event(answer: dict[str, Any], chat: bool, text: str) -> bytes:
    """The client's first SSE event, built from the prefill answer.

    Carries ``token_ids`` and ``prompt_token_ids`` when the prefill answer
    has them (the client asked for ``return_token_ids``).

    Returns:
        ``b"data: {...}\\n\\n"``, one chunk object as vLLM streams it.
    """
    src = answer["choices"][0]
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["delta"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice.update({"logprobs": None, "finish_reason": None})
    if not chat:
        choice["stop_reason"] = None
    for key in ("token_ids", "prompt_token_ids"):
        if isinstance(src.get(key), list):
            choice[key] = src[key][:1] if key == "token_ids" else src[key]
    event: dict[str, Any] = {"id": answer.get("id"),
                             "object": "chat.completion.chunk" if chat else "text_completion",
                             "created": answer.get("created"), "model": answer.get("model"),
                             "choices": [choice]}
    if chat and isinstance(answer.get("prompt_token_ids"), list):
        event["prompt_token_ids"] = answer["prompt_token_ids"]
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


class SpliceFirstToken:
    """Removes the already-sent first token from the decode leg's SSE stream.

    Args:
        chat: a chat completion stream.
        text: the first token's text the client already got.
        had_ids: the client's first event carried ``token_ids`` (drop the
            decode stream's first id and its ``prompt_token_ids``).

    Attributes:
        active: still looking for the first token (events are parsed);
            afterwards :meth:`feed` passes bytes through untouched.
        mismatch: the decode stream's text did not start with ``text``.
        seen_at: monotonic time the decode stream's first token arrived
            (set by the caller through :meth:`feed`'s ``now``).
    """

    def __init__(self, chat: bool, text: str, had_ids: bool) -> None:
        self.chat = chat
        self.pending = text
        self.ids_pending = had_ids
        self.strip_prompt_ids = had_ids
        self.active = True
        self.mismatch = False
        self.seen_at: float | None = None
        self._buf = bytearray()

    def feed(self, chunk: bytes, now: float) -> bytes:
        """The bytes to relay for ``chunk`` (may hold back an incomplete event)."""
        if not self.active:
            return chunk
        self._buf += chunk
        out = bytearray()
        for event in pop_sse_events(self._buf):
            out += self._event(event + b"\n\n", now)
            if not self.active:
                break
        if not self.active:
            out += self._buf
            self._buf.clear()
        return bytes(out)

    def _event(self, event: bytes, now: float) -> bytes:
        lines = event.rstrip(b"\n").split(b"\n")
        data = [ln for ln in lines if ln.startswith(b"data:")]
        if len(data) != 1:
            return event
        raw = data[0][5:].strip()
        try:
            obj = json.loads(raw)
        except ValueError:
            return event
        if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list) or not obj["choices"]:
            return event
        c = obj["choices"][0]
        if not isinstance(c, dict):
            return event
        if self.seen_at is None:
            self.seen_at = now
        delta = c.get("delta") if self.chat else None
        if self.chat and not isinstance(delta, dict):
            return event
        text = (delta.get("content") if delta is not None else c.get("text")) or ""
        if self.pending:
            if text.startswith(self.pending):
                text, self.pending = text[len(self.pending):], ""
            elif self.pending.startswith(text):
                text, self.pending = "", self.pending[len(text):]
            else:
                self.mismatch, self.pending = True, ""
        ids = c.get("token_ids")
        if self.ids_pending and isinstance(ids, list) and ids:
            c["token_ids"] = ids = ids[1:]
            self.ids_pending = False
        if self.strip_prompt_ids:
            c.pop("prompt_token_ids", None)
            obj.pop("prompt_token_ids", None)
        if delta is not None:
            delta.pop("role", None)
            if "content" in delta:
                delta["content"] = text
        else:
            c["text"] = text
        self.active = bool(self.pending) or self.ids_pending
        extra = {k for k in (delta or {}) if k not in ("content", "role")}
        if not text and not ids and c.get("finish_reason") is None and not extra and not obj.get("usage"):
            return b""  # the first token's own event: already sent
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
