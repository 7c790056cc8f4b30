"""Relaying the decode leg's answer to the client (a mixin of :class:`pdgate.gateway.proxy.PDProxy`).

- :meth:`RelayMixin._relay_error`: a decode-side error status and body, passed
  through (wrapped in OpenAI error JSON if it is not).
- :meth:`RelayMixin._relay_stream`: the SSE stream byte for byte, measuring
  TTFT/TPOT; a stream that breaks ends with an SSE ``error`` event.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, AsyncIterator

import httpx
from fastapi.responses import JSONResponse, Response

from pdgate.gateway.errors import error_body
from pdgate.gateway.legs import DecodeLeg, StreamStats, scan_sse_events

log = logging.getLogger("pdgate.proxy")


class RelayMixin:
    """Needs ``self.metrics``, ``self.predictor`` and ``self._release(inst)``."""

    metrics: Any
    predictor: Any

    def _release(self, inst: Any) -> None:  # pragma: no cover - provided by PDProxy
        raise NotImplementedError

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
                            ) -> AsyncIterator[bytes]:
        """Relay the decode SSE stream byte for byte; measure TTFT/TPOT.

        The instance's in-flight count and fleet state drop only when the
        stream ends (completed, failed, or the client went away: closing the
        upstream response makes vLLM abort the request). Inter-token gaps
        feed the predictor's decode-step refit.
        """
        inst = leg.inst
        predicted = predicted or {}
        predicted_ttft = predicted.get("ttft_s")
        stats = StreamStats(arrival=arrival)
        buf = bytearray()
        outcome = "success"
        async def chunks() -> AsyncIterator[bytes]:
            if first:
                yield first
            async for c in (rest if rest is not None else resp.aiter_raw()):
                yield c

        try:
            async for chunk in chunks():
                buf += chunk
                now = time.monotonic()
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
            self.metrics.requests.labels(route, outcome).inc()
            end = time.monotonic()
            self.metrics.e2e.observe(end - arrival)
            if outcome == "success" and stats.first_token is not None:
                self.metrics.ttft.observe(stats.first_token - arrival)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("done %s on %s route=%s ttft=%.4f predicted_ttft=%s tokens=%d e2e=%.4f",
                              leg.request_id, inst.url, route, stats.first_token - arrival,
                              f"{predicted_ttft:.4f}" if predicted_ttft else None, stats.tokens, end - arrival)
                if predicted_ttft:
                    kind = route if route in ("pd", "deflect") else None
                    self.predictor.observe_ttft(predicted_ttft, stats.first_token - arrival, kind,
                                                predicted.get("ttft_model_s"))
                n = stats.usage_tokens if stats.usage_tokens is not None else stats.tokens
                if n > 1:
                    self.metrics.tpot.observe((end - stats.first_token) / (n - 1))
