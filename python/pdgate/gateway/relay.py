"""Relaying the decode leg's answer to the client (a mixin of :class:`pdgate.gateway.proxy.PDProxy`).

- :meth:`RelayMixin._relay_error`: a decode-side error status and body, passed
  through (wrapped in OpenAI error JSON if it is not).
- :meth:`RelayMixin._relay_stream`: the SSE stream byte for byte, measuring
  TTFT/TPOT; a stream that breaks ends with an SSE ``error`` event.
- :meth:`RelayMixin._relay_after_first_token`: a stream whose first token
  came from the prefill leg (:mod:`pdgate.gateway.first_token`); the decode
  leg is opened after it is sent, and its failures become SSE ``error``
  events.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, AsyncIterator

import httpx
from fastapi.responses import JSONResponse, Response

from pdgate.gateway import first_token
from pdgate.gateway.errors import GatewayError, error_body
from pdgate.gateway.legs import DecodeLeg, StreamStats, scan_sse_events

log = logging.getLogger("pdgate.proxy")


def _sse_error(status: int, message: str) -> bytes:
    return b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\n"


class RelayMixin:
    """Needs ``self.config``, ``self.metrics``, ``self.predictor``,
    ``self._release(inst)`` and ``self._send_decode(...)``."""

    config: Any
    metrics: Any
    predictor: Any

    def _release(self, inst: Any) -> None:  # pragma: no cover - provided by PDProxy
        raise NotImplementedError

    async def _send_decode(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - provided by PDProxy
        raise NotImplementedError

    def _first_token(self, endpoint: str, body: dict[str, Any], answer: Any,
                     arrival: float) -> tuple[bytes, first_token.SpliceFirstToken] | None:
        """The client's first SSE event from the prefill answer and the splice
        for the decode stream, when ``first_token.from_prefill`` is on and the
        request qualifies (:func:`pdgate.gateway.first_token.eligible`); else ``None``."""
        cfg = self.config.first_token
        if not cfg.from_prefill or not first_token.eligible(body):
            return None
        if time.monotonic() - arrival < cfg.min_wait_s:
            return None
        chat = endpoint == "chat/completions"
        text = first_token.first_text(answer, chat)
        if text is None:
            return None
        had_ids = isinstance(answer["choices"][0].get("token_ids"), list)
        return first_token.first_event(answer, chat, text), first_token.SpliceFirstToken(chat, text, had_ids)

    async def _relay_after_first_token(self, early: tuple[bytes, first_token.SpliceFirstToken], endpoint: str,
                                       body: dict[str, Any], info: Any, headers: dict[str, str], route: str,
                                       decision: Any, arrival: float, overhead_base: float,
                                       ) -> AsyncIterator[bytes]:
        """Send the first token, then open the decode leg and relay the rest of its stream.

        The decode leg's retries (:meth:`PDProxy._send_decode`) still apply:
        a greedy answer is the same on every instance, so the splice removes
        the first token from whichever one answers. A failure to open it
        (no instance, all failed, an error status) ends the stream with an
        SSE ``error`` event: the 200 status is already on its way.
        """
        event, splice = early
        first_at = time.monotonic()
        self.metrics.prefill_first_tokens.labels("sent").inc()
        yield event
        try:
            resp, leg, first, rest = await self._send_decode(endpoint, body, info, headers, route, decision,
                                                             True, overhead_base)
        except GatewayError as e:
            yield _sse_error(e.status, e.message)
            return
        if resp.status_code != 200:
            err = await self._relay_error(resp, leg, route, arrival)
            yield b"data: " + bytes(err.body) + b"\n\n"
            return
        async for chunk in self._relay_stream(resp, leg, route, arrival, decision.predicted, first, rest,
                                              splice=splice, first_at=first_at):
            yield chunk

    async def _relay_error(self, resp: httpx.Response, leg: DecodeLeg, route: str,
                           arrival: float) -> Response:
        """Pass a decode-side error status and body through (wrapped if not JSON)."""
        try:
            content = await resp.aread()
        except httpx.HTTPError:
            content = b""
        finally:
            await resp.aclose()
            leg.finish()
            self._release(leg.inst)
        outcome = "client_error" if 400 <= resp.status_code < 500 else "upstream_error"
        self.metrics.requests.labels(route, outcome).inc()
        try:
            payload = json.loads(content)
            if not isinstance(payload, dict) or "error" not in payload:
                raise ValueError
        except ValueError:
            payload = error_body(resp.status_code, content.decode("utf-8", "replace")[:2000]
                                 or f"decode instance answered {resp.status_code}")
        return JSONResponse(payload, status_code=resp.status_code)

    async def _relay_stream(self, resp: httpx.Response, leg: DecodeLeg, route: str,
                            arrival: float, predicted: dict[str, float] | None = None,
                            first: bytes = b"", rest: AsyncIterator[bytes] | None = None,
                            splice: first_token.SpliceFirstToken | None = None,
                            first_at: float | None = None) -> AsyncIterator[bytes]:
        """Relay the decode SSE stream byte for byte; measure TTFT/TPOT.

        With ``splice`` the client already got the first token at
        ``first_at`` (monotonic seconds): the decode stream's copy of it is
        removed, TTFT counts from ``first_at``, and the predictor's TTFT refit
        sees the decode leg's own first token.

        The instance's in-flight count and fleet state drop only when the
        stream ends (completed, failed, or the client went away: closing the
        upstream response makes vLLM abort the request). Inter-token gaps
        feed the predictor's decode-step refit.
        """
        inst = leg.inst
        predicted = predicted or {}
        predicted_ttft = predicted.get("ttft_s")
        stats = StreamStats(arrival=arrival)
        if splice is not None:
            stats.first_token, stats.tokens = first_at, 1
        buf = bytearray()
        outcome = "success"
        async def chunks() -> AsyncIterator[bytes]:
            if first:
                yield first
            async for c in (rest if rest is not None else resp.aiter_raw()):
                yield c

        try:
            async for chunk in chunks():
                now = time.monotonic()
                if splice is not None and splice.active:
                    chunk = splice.feed(chunk, now)
                    if splice.seen_at is not None and not leg.decoding:
                        leg.on_tokens(1)  # a local prefill (retry) ended with the spliced token
                    if not chunk:
                        continue
                buf += chunk
                new = scan_sse_events(buf, stats, now)
                if new:
                    was_decoding = leg.decoding
                    batch, kv = inst.decode_batch, inst.kv_tokens
                    leg.on_tokens(new)
                    if new == 1 and was_decoding and stats.last_token is not None:
                        self.predictor.observe_decode_gap(batch, kv, now - stats.last_token)
                    stats.last_token = now
                yield chunk
        except httpx.HTTPError as e:
            outcome = "upstream_error"
            inst.breaker.record_failure()
            log.warning("decode stream from %s broke: %r", inst.url, e)
            err = error_body(502, f"decode instance stream failed: {e!r}")
            yield b"data: " + json.dumps(err).encode() + b"\n\n"
        except BaseException:  # client disconnect cancels the generator
            outcome = "cancelled"
            raise
        finally:
            await resp.aclose()
            leg.finish()
            self._release(inst)
            if splice is not None and splice.mismatch:
                self.metrics.prefill_first_tokens.labels("mismatch").inc()
                log.warning("request %s: the decode stream did not start with the prefill's first token",
                            leg.request_id)
            self.metrics.requests.labels(route, outcome).inc()
            end = time.monotonic()
            self.metrics.e2e.observe(end - arrival)
            if outcome == "success" and stats.first_token is not None:
                self.metrics.ttft.observe(stats.first_token - arrival)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("done %s on %s route=%s ttft=%.4f predicted_ttft=%s tokens=%d e2e=%.4f",
                              leg.request_id, inst.url, route, stats.first_token - arrival,
                              f"{predicted_ttft:.4f}" if predicted_ttft else None, stats.tokens, end - arrival)
                own_first = stats.first_token if splice is None else splice.seen_at
                if predicted_ttft and own_first is not None:
                    kind = route if route in ("pd", "deflect") else None
                    self.predictor.observe_ttft(predicted_ttft, own_first - arrival, kind,
                                                predicted.get("ttft_model_s"))
                n = stats.usage_tokens if stats.usage_tokens is not None else stats.tokens
                if n > 1:
                    self.metrics.tpot.observe((end - stats.first_token) / (n - 1))
