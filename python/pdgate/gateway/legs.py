"""Per-leg bookkeeping of the proxy: SSE scanning and fleet-state accounting.

A decode leg (:class:`DecodeLeg`) keeps the decode instance's live counters
right whatever happens to the request: for a P/D request the instance holds
a decoding request from dispatch on; for a deflected or decode-only request
it first holds a prompt to prefill (``outstanding_prefill_tokens``, and
``deflected_in_flight`` when deflected), which turns into a decoding request
at the first streamed token. :meth:`DecodeLeg.finish` is idempotent and runs
on every exit path (end of stream, error, client disconnect).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Iterator

from pdgate.fleet import Instance


@dataclass
class StreamStats:
    """Per-request timing collected while relaying a stream (seconds)."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    usage_tokens: int | None = None


def pop_sse_events(buf: bytearray) -> Iterator[bytes]:
    """Yield each complete SSE event at the head of ``buf`` and remove it from ``buf``.

    An event ends at a blank line (``b"\\n\\n"``, as vLLM and pdgate write them); the
    yielded bytes exclude that separator. An incomplete tail stays in ``buf``, as do the
    events after the one a caller stopped at (each is removed just before it is yielded).
    """
    while True:
        end = buf.find(b"\n\n")
        if end < 0:
            return
        event = bytes(buf[:end])
        del buf[: end + 2]
        yield event


def scan_sse_events(buf: bytearray, stats: StreamStats, now: float) -> int:
    """Consume complete SSE events from ``buf``, update ``stats``; returns new content chunks.

    Counts content chunks (events whose ``choices`` is non-empty) as tokens
    and reads ``usage.completion_tokens`` when the stream carries usage.
    Hot path (once per token): an event is JSON-parsed only when the cheap
    byte checks cannot classify it (usage chunks, unusual spacing); a
    ``"usage": null`` field is no usage.
    """
    new = 0
    for event in pop_sse_events(buf):
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]" or not data:
                continue
            if b'"usage"' not in data or b'"usage":null' in data or b'"usage": null' in data:
                if b'"choices":[{' in data or b'"choices": [{' in data:
                    stats.tokens += 1
                    new += 1
                    if stats.first_token is None:
                        stats.first_token = now
                    continue
                if b'"choices":[]' in data or b'"choices": []' in data or b'"choices"' not in data:
                    continue
            try:
                obj = json.loads(data)
            except json.JSONDecodeError:
                continue
            if not isinstance(obj, dict):
                continue
            if obj.get("choices"):
                stats.tokens += 1
                new += 1
                if stats.first_token is None:
                    stats.first_token = now
            usage = obj.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                stats.usage_tokens = usage["completion_tokens"]
    return new


class DecodeLeg:
    """Fleet-state accounting of one decode leg on ``inst``.

    Args:
        inst: the decode instance.
        request_id: the request's id.
        prompt_tokens: its prompt length.
        computes_prompt: the instance prefills the prompt itself (deflected or
            decode-only) rather than pulling KV.
        deflected: it was deflected by a route policy (counted in
            ``deflected_in_flight`` until the first token).
        tpot_slo_s: the request's TPOT target (TBT headroom of later deflections).
        output_tokens: its ``max_tokens`` (how long it will keep decoding).
    """

    def __init__(self, inst: Instance, request_id: str, prompt_tokens: int, *, computes_prompt: bool,
                 deflected: bool = False, tpot_slo_s: float | None = None,
                 output_tokens: int | None = None) -> None:
        self.inst = inst
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.deflected = deflected
        self.tpot_slo_s = tpot_slo_s
        self.output_tokens = output_tokens
        self.decoding = False
        self.finished = False
        self.dispatched_at = time.monotonic()
        if computes_prompt:
            inst.add_prefill(request_id, prompt_tokens)
            if deflected:
                inst.deflected_in_flight += 1
        else:
            self._start_decoding()

    def _start_decoding(self) -> None:
        self.decoding = True
        self.inst.add_decode(self.request_id, self.prompt_tokens, self.tpot_slo_s, self.output_tokens)

    def _end_prefill(self) -> None:
        self.inst.done_prefill(self.request_id)
        if self.deflected:
            self.deflected = False
            self.inst.deflected_in_flight = max(0, self.inst.deflected_in_flight - 1)

    def on_tokens(self, n: int) -> None:
        """``n`` more tokens streamed (the first one ends a local prefill)."""
        if self.finished or n <= 0:
            return
        if not self.decoding:
            self._end_prefill()
            self._start_decoding()
            n -= 1
        if n:
            self.inst.grow_decode(self.request_id, n)

    def finish(self) -> None:
        """The leg ended (any way); idempotent."""
        if self.finished:
            return
        self.finished = True
        self._end_prefill()
        self.inst.done_decode(self.request_id)


def int_or_none(v: Any) -> int | None:
    """``v`` as an int if it is one (or an integer string), else ``None``."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            return None
    return None
