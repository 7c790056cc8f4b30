"""The prefill/decode request flow.

One client request becomes two legs, as vLLM's NixlConnector expects (see
vLLM's ``examples/online_serving/disaggregated_serving`` proxies and
../shared/FIELD_NOTES.md):

1. Prefill leg, to a prefill instance: the client's body with
   ``max_tokens=1``, ``stream=false``, no ``stream_options``, no
   ``min_tokens``, and ``kv_transfer_params = {do_remote_decode: true, ...}``.
   Its JSON answer carries the ``kv_transfer_params`` the decode side needs.
2. Decode leg, to a decode instance: the client's original body plus exactly
   those returned ``kv_transfer_params``; its answer (stream or JSON) goes to
   the client as is, so ``usage`` is the decode instance's count for the
   whole request.

If the prefill leg fails, times out or returns no ``kv_transfer_params`` the
decode instance serves the request whole (``pdgate_prefill_fallbacks_total``).
Client-supplied ``kv_transfer_params`` are always dropped. Both legs carry the
same ``X-Request-Id``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdgate.config import GatewayConfig
from pdgate.fleet import Fleet, Instance
from pdgate.gateway.errors import GatewayError, error_body
from pdgate.metrics import GatewayMetrics
from pdgate.policies import RequestInfo, create_policy

log = logging.getLogger("pdgate.proxy")

#: The request-side ``kv_transfer_params`` that asks a prefill instance to
#: keep the KV cache for a remote decode (vLLM NixlConnector protocol).
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

#: Client headers forwarded to both legs (everything else is dropped).
FORWARDED_HEADERS = ("authorization", "traceparent", "tracestate")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body derived from the client's (a new dict).

    ``max_tokens`` (and ``max_completion_tokens`` when given) become 1,
    ``stream`` false; ``stream_options`` and ``min_tokens`` are removed
    because vLLM rejects or mis-handles them on a 1-token non-stream request.
    """
    p = dict(body)
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["stream"] = False
    p.pop("stream_options", None)
    p.pop("min_tokens", None)
    p["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return p


@dataclass
class _StreamStats:
    """Per-request timing collected while relaying a stream (seconds)."""

    arrival: float
    first_token: float | None = None
    tokens: int = 0
    usage_tokens: int | None = None


def _scan_sse_events(buf: bytearray, stats: _StreamStats, now: float) -> None:
    """Consume complete SSE events from ``buf`` and update ``stats``.

    Counts content chunks (events whose ``choices`` is non-empty) as tokens
    and reads ``usage.completion_tokens`` when the stream carries usage.
    """
    while True:
        end = buf.find(b"\n\n")
        if end < 0:
            return
        event = bytes(buf[:end])
        del buf[: end + 2]
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]" or not data:
                continue
            try:
                obj = json.loads(data)
            except json.JSONDecodeError:
                continue
            if obj.get("choices"):
                stats.tokens += 1
                if stats.first_token is None:
                    stats.first_token = now
            usage = obj.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                stats.usage_tokens = usage["completion_tokens"]


class PDProxy:
    """Routes requests through prefill and decode instances.

    Args:
        config: validated gateway config.
        fleet: the instances.
        metrics: the gateway's metrics.
        client: a shared ``httpx.AsyncClient`` (owned by the app).
    """

    def __init__(self, config: GatewayConfig, fleet: Fleet, metrics: GatewayMetrics,
                 client: httpx.AsyncClient) -> None:
        self.config = config
        self.fleet = fleet
        self.metrics = metrics
        self.client = client
        self.prefill_policy = create_policy(config.prefill_policy)
        self.decode_policy = create_policy(config.decode_policy)
        t = config.timeouts
        self._prefill_timeout = httpx.Timeout(t.prefill_s, connect=t.connect_s)
        self._decode_timeout = httpx.Timeout(t.decode_idle_s, connect=t.connect_s)

    # -- bookkeeping -------------------------------------------------------
    def _acquire(self, inst: Instance) -> None:
        inst.acquire()
        self.metrics.in_flight.labels(inst.url, inst.role).set(inst.in_flight)

    def _release(self, inst: Instance) -> None:
        inst.release()
        self.metrics.in_flight.labels(inst.url, inst.role).set(inst.in_flight)

    def _headers(self, client_headers: dict[str, str], request_id: str) -> dict[str, str]:
        h = {k: v for k, v in client_headers.items() if k.lower() in FORWARDED_HEADERS}
        h["X-Request-Id"] = request_id
        return h

    # -- prefill leg -------------------------------------------------------
    async def _run_prefill(self, endpoint: str, body: dict[str, Any], info: RequestInfo,
                           headers: dict[str, str]) -> dict[str, Any] | None:
        """Run the prefill leg; return its ``kv_transfer_params`` or ``None``.

        Never raises for upstream trouble: every failure is a fallback,
        counted in ``pdgate_prefill_fallbacks_total{reason}``.
        """
        candidates = self.fleet.candidates("prefill")
        if not candidates:
            return None
        inst = self.prefill_policy.select(candidates, info)
        self._acquire(inst)
        reason = None
        try:
            resp = await self.client.post(f"{inst.url}/v1/{endpoint}", json=prefill_body(body),
                                          headers=headers, timeout=self._prefill_timeout)
            if resp.status_code != 200:
                reason = f"http_{resp.status_code // 100}xx"
                log.warning("prefill %s on %s answered %s", info.request_id, inst.url, resp.status_code)
            else:
                params = resp.json().get("kv_transfer_params")
                if isinstance(params, dict) and params:
                    return params
                reason = "no_kv_transfer_params"
        except httpx.TimeoutException:
            reason = "timeout"
        except (httpx.HTTPError, ValueError) as e:
            reason = "connect_error" if isinstance(e, httpx.ConnectError) else "error"
            log.warning("prefill %s on %s failed: %r", info.request_id, inst.url, e)
        finally:
            self._release(inst)
        self.metrics.prefill_fallbacks.labels(reason or "error").inc()
        return None

    # -- whole request -----------------------------------------------------
    async def handle(self, endpoint: str, body: dict[str, Any], client_headers: dict[str, str],
                     request_id: str, arrival: float) -> Response:
        """Serve one validated request; returns the response for the client.

        Raises:
            GatewayError: no decode instance could be reached (502/504).
        """
        if body.pop("kv_transfer_params", None) is not None:
            self.metrics.dropped_kv_params.inc()
        info = RequestInfo(request_id=request_id, endpoint=endpoint, body=body)
        headers = self._headers(client_headers, request_id)
        kv_params = await self._run_prefill(endpoint, body, info, headers)
        route = "pd" if kv_params is not None else "decode_only"
        decode_body = dict(body)
        if kv_params is not None:
            decode_body["kv_transfer_params"] = kv_params
        stream = bool(body.get("stream"))
        resp, inst = await self._send_decode(endpoint, decode_body, info, headers, route)
        if resp.status_code != 200:
            return await self._relay_error(resp, inst, route, arrival)
        if stream:
            return StreamingResponse(
                self._relay_stream(resp, inst, route, arrival),
                status_code=200,
                media_type="text/event-stream",
                headers={"X-Request-Id": request_id, "Cache-Control": "no-cache"},
            )
        try:
            content = await resp.aread()
        except httpx.HTTPError as e:
            self.metrics.requests.labels(route, "upstream_error").inc()
            raise GatewayError(502, f"decode instance failed mid-response: {e!r}") from None
        finally:
            await resp.aclose()
            self._release(inst)
        self.metrics.requests.labels(route, "success").inc()
        self.metrics.e2e.observe(time.monotonic() - arrival)
        return Response(content=content, status_code=200, media_type="application/json",
                        headers={"X-Request-Id": request_id})

    async def _send_decode(self, endpoint: str, body: dict[str, Any], info: RequestInfo,
                           headers: dict[str, str], route: str) -> tuple[httpx.Response, Instance]:
        """Open the decode leg; on a connect failure try the other decode instances once each.

        Raises:
            GatewayError(502/504): every decode candidate failed to answer.
        """
        candidates = list(self.fleet.candidates("decode"))
        last_error = "no decode instance"
        while candidates:
            inst = self.decode_policy.select(candidates, info)
            candidates.remove(inst)
            self._acquire(inst)
            try:
                req = self.client.build_request("POST", f"{inst.url}/v1/{endpoint}", json=body,
                                                headers=headers, timeout=self._decode_timeout)
                return await self.client.send(req, stream=True), inst
            except httpx.ConnectError as e:
                self._release(inst)
                last_error = f"decode instance {inst.url} unreachable: {e!r}"
                log.warning("%s (request %s)", last_error, info.request_id)
            except httpx.TimeoutException:
                self._release(inst)
                self.metrics.requests.labels(route, "upstream_error").inc()
                raise GatewayError(504, f"decode instance {inst.url} timed out") from None
            except BaseException:
                self._release(inst)
                raise
        self.metrics.requests.labels(route, "upstream_error").inc()
        raise GatewayError(502, last_error)

    async def _relay_error(self, resp: httpx.Response, inst: Instance, route: str,
                           arrival: float) -> Response:
        """Pass a decode-side error status and body through (wrapped if not JSON)."""
        try:
            content = await resp.aread()
        except httpx.HTTPError:
            content = b""
        finally:
            await resp.aclose()
            self._release(inst)
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

    async def _relay_stream(self, resp: httpx.Response, inst: Instance, route: str,
                            arrival: float) -> AsyncIterator[bytes]:
        """Relay the decode SSE stream byte for byte; measure TTFT/TPOT.

        The instance's in-flight count drops only when the stream ends
        (completed, failed, or the client went away: closing the upstream
        response makes vLLM abort the request).
        """
        stats = _StreamStats(arrival=arrival)
        buf = bytearray()
        outcome = "success"
        try:
            async for chunk in resp.aiter_raw():
                buf += chunk
                _scan_sse_events(buf, stats, time.monotonic())
                yield chunk
        except httpx.HTTPError as e:
            outcome = "upstream_error"
            log.warning("decode stream from %s broke: %r", inst.url, e)
            err = error_body(502, f"decode instance stream failed: {e!r}")
            yield b"data: " + json.dumps(err).encode() + b"\n\n"
        except BaseException:  # client disconnect cancels the generator
            outcome = "cancelled"
            raise
        finally:
            await resp.aclose()
            self._release(inst)
            self.metrics.requests.labels(route, outcome).inc()
            end = time.monotonic()
            self.metrics.e2e.observe(end - arrival)
            if outcome == "success" and stats.first_token is not None:
                self.metrics.ttft.observe(stats.first_token - arrival)
                n = stats.usage_tokens if stats.usage_tokens is not None else stats.tokens
                if n > 1:
                    self.metrics.tpot.observe((end - stats.first_token) / (n - 1))
