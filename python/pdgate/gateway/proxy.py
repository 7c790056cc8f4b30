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

Before the legs, the route policy (:mod:`pdgate.policies`) decides the
request's shape: P/D, deflected (the decode leg alone, without
``kv_transfer_params``, so the decode instance computes the prompt), or
decode-only; an admission policy may hold the prefill leg in the Rust
admission queue first (cancelled if the client leaves).

If the prefill leg fails, times out or returns no ``kv_transfer_params`` the
decode instance serves the request whole (``pdgate_prefill_fallbacks_total``).
If a decode instance fails before the first byte reached the client
(refused or dropped connection, 502/503/504), the next decode instance is
tried; when none is left, one that could not be connected to is tried
again (``timeouts.connect_attempts``). Once the request reached an
instance, the retry goes without
``kv_transfer_params`` (the new instance computes the prompt: never KV that
may have been released). Every leg's outcome feeds the instance's circuit
breaker (:mod:`pdgate.health`).
Client-supplied ``kv_transfer_params`` are always dropped. Both legs carry the
same ``X-Request-Id``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx
from fastapi.responses import Response, StreamingResponse

from pdgate.config import GatewayConfig
from pdgate.fleet import Fleet, Instance
from pdgate.gateway.bodies import PREFILL_KV_PARAMS, _dumps, _loads, prefill_body  # noqa: F401 (re-exported)
from pdgate.gateway.context import trace_headers
from pdgate.gateway.errors import GatewayError
from pdgate.gateway.legs import DecodeLeg, int_or_none
from pdgate.gateway.relay import RelayMixin
from pdgate.gateway.validation import check_context
from pdgate.metrics import GatewayMetrics
from pdgate.policies import RequestInfo, RouteContext, RouteDecision, create_policy
from pdgate.predictor import LatencyPredictor
from pdgate.state.admission import AsyncAdmission
from pdgate.state.dispatch import LateBinding
from pdgate.state.tokens import TokenCounter

log = logging.getLogger("pdgate.proxy")

_JSON_HEADERS = {"Content-Type": "application/json"}
_CONNECT_BACKOFF_S = 0.2  # first wait before reconnecting to the last decode candidate; doubles, at most 1 s

#: Client headers forwarded to both legs (everything else is dropped); the
#: W3C trace context (``traceparent``, ``tracestate``) is added by
#: :func:`pdgate.gateway.context.trace_headers` (validated, or a new trace).
FORWARDED_HEADERS = ("authorization",)


class _Retry(Exception):
    """A decode leg failed before its first byte reached the client: try the next instance."""


class PDProxy(RelayMixin):
    """Routes requests through prefill and decode instances.

    Args:
        config: validated gateway config.
        fleet: the instances.
        metrics: the gateway's metrics.
        client: a shared ``httpx.AsyncClient`` (owned by the app).
        predictor: latency predictor (default: built from ``config.predictor``).
        tokens: prompt token counter (default: built from ``config.tokenizer``).
        clients: per-instance clients by URL (default: ``client`` for all).
    """

    def __init__(self, config: GatewayConfig, fleet: Fleet, metrics: GatewayMetrics,
                 client: httpx.AsyncClient, predictor: LatencyPredictor | None = None,
                 tokens: TokenCounter | None = None,
                 clients: dict[str, httpx.AsyncClient] | None = None) -> None:
        self.config = config
        self.fleet = fleet
        self.metrics = metrics
        self.client = client
        self.clients = dict(clients or {})
        self.prefill_policy = create_policy(config.prefill_policy, config=config)
        self.decode_policy = create_policy(config.decode_policy, config=config)
        self.route_policy = create_policy(config.route_policy, config=config)
        self.admission_policy = create_policy(config.admission_policy, config=config)
        self.predictor = predictor or LatencyPredictor.from_config(config.predictor, metrics)
        self.tokens = tokens or TokenCounter(config.tokenizer, metrics)
        self.ctx = RouteContext(fleet, self.prefill_policy, self.decode_policy, self.predictor, config)
        self.admission = AsyncAdmission(self.admission_policy.aging_rate,
                                        self.admission_policy.max_wait_s, metrics)
        # a late-binding route (``pooled``) routes from one gateway-wide queue when capacity frees
        self.pool = (LateBinding(self.ctx, self.route_policy, scan=config.pooled.scan,
                                 tick_s=config.pooled.tick_s, metrics=metrics)
                     if getattr(self.route_policy, "late_binding", False) else None)
        self._dispatched: dict[str, dict[str, int]] = {}  # url -> {request id: tokens} sent for prefill
        t = config.timeouts
        self._prefill_timeout = httpx.Timeout(t.prefill_s, connect=t.connect_s)
        self._decode_timeout = httpx.Timeout(t.decode_idle_s, connect=t.connect_s)
        # vLLM sends a non-streamed answer's headers with its body, after the last token:
        # the whole generation is one wait for the first byte.
        self._decode_whole_timeout = httpx.Timeout(t.decode_first_byte_s, connect=t.connect_s)

    # -- bookkeeping -------------------------------------------------------
    def _acquire(self, inst: Instance) -> None:
        inst.acquire()
        self.metrics.in_flight.labels(inst.url, inst.role).set(inst.in_flight)

    def _release(self, inst: Instance) -> None:
        inst.release()
        self.metrics.in_flight.labels(inst.url, inst.role).set(inst.in_flight)

    def _client(self, inst: Instance) -> httpx.AsyncClient:
        return self.clients.get(inst.url, self.client)

    def _headers(self, client_headers: dict[str, str], request_id: str) -> dict[str, str]:
        h = {k: v for k, v in client_headers.items() if k.lower() in FORWARDED_HEADERS}
        h.update(trace_headers(client_headers))
        h["X-Request-Id"] = request_id
        return h

    async def request_info(self, endpoint: str, body: dict[str, Any], headers: dict[str, str],
                           request_id: str, max_model_len: int | None = None) -> RequestInfo:
        """Prompt tokens, priority class and SLO class of a request.

        Removes the gateway-only ``slo_class`` body field.

        Raises:
            GatewayError(400): a priority or SLO class that is not valid, or
                (when ``max_model_len`` is known and the prompt's token count
                exact) prompt plus ``max_tokens`` over the model's context.
        """
        lower = {k.lower(): v for k, v in headers.items()}
        prio = self.config.priority
        raw = body.get("priority", lower.get(prio.header.lower()))
        priority = prio.default_priority if raw is None else int_or_none(raw)
        if priority is None:
            raise GatewayError(400, "'priority' must be an integer", "priority", reason="invalid_field")
        slo = self.config.slo
        cls = body.pop("slo_class", None) or lower.get(slo.header.lower()) or slo.default
        if not isinstance(cls, str) or cls not in slo.classes:
            raise GatewayError(400, f"unknown SLO class {str(cls)[:100]!r}; known: {sorted(slo.classes)}",
                               "slo_class", reason="invalid_field")
        dec = self.fleet.candidates("decode")
        n, exact = await self.tokens.measure(endpoint, body, self.client, dec[0].url if dec else None)
        if exact:
            check_context(n, body, max_model_len)
        target = slo.classes[cls]
        return RequestInfo(request_id=request_id, endpoint=endpoint, body=body, prompt_tokens=n,
                           priority=priority, slo_class=cls, ttft_slo_s=target.ttft_s,
                           tpot_slo_s=target.tpot_s)

    def decide(self, info: RequestInfo) -> RouteDecision:
        """Run the route policy; count and log the decision."""
        try:
            d = self.route_policy.decide(self.ctx, info)
        except ValueError as e:  # no candidates of some role
            log.warning("route policy %s failed for %s: %r", self.route_policy.name, info.request_id, e)
            d = RouteDecision("decode_only")
        return self._counted(d, info)

    async def place(self, info: RequestInfo,
                    disconnected: Callable[[], Awaitable[Any]] | None = None) -> RouteDecision:
        """The route decision: at once, or (late-binding route) once the
        gateway-wide queue dispatches the request.

        Raises:
            asyncio.CancelledError / GatewayError(499): cancelled or the client left while queued.
        """
        if self.pool is None:
            return self.decide(info)
        d = await self._unless_gone(asyncio.ensure_future(self.pool.place(info)), disconnected)
        return self._counted(d, info)

    def _counted(self, d: RouteDecision, info: RequestInfo) -> RouteDecision:
        self.metrics.route_decisions.labels(self.route_policy.name, d.choice).inc()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route %s: policy=%s choice=%s prefill=%s decode=%s tokens=%s predicted=%s",
                      info.request_id, self.route_policy.name, d.choice,
                      d.prefill.url if d.prefill else None, d.decode.url if d.decode else None,
                      info.prompt_tokens, {k: round(v, 4) for k, v in d.predicted.items()})
        return d

    # -- prefill leg -------------------------------------------------------
    async def _admit(self, info: RequestInfo, inst: Instance,
                     disconnected: Callable[[], Awaitable[Any]] | None) -> int | None:
        """Wait for admission of the prefill leg (if the admission policy gates it).

        Raises:
            asyncio.CancelledError / GatewayError(499): cancelled or the client left.
        """
        ticket = self.admission_policy.ticket(info, inst)
        if ticket is None:
            return None
        return await self._unless_gone(asyncio.ensure_future(self.admission.wait(ticket.lanes, ticket.priority)),
                                       disconnected)

    @staticmethod
    async def _unless_gone(wait: "asyncio.Future[Any]", disconnected: Callable[[], Awaitable[Any]] | None) -> Any:
        """``wait``'s result, unless the client leaves first (``wait`` is cancelled).

        Raises:
            GatewayError(499): the client disconnected first.
        """
        if disconnected is None:
            return await wait
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({wait, watch}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            wait.cancel()
            raise
        finally:
            watch.cancel()
        if wait.done():
            return wait.result()
        wait.cancel()
        try:
            await wait
        except asyncio.CancelledError:
            pass
        raise GatewayError(499, "client disconnected while queued")

    async def _run_prefill(self, endpoint: str, body: dict[str, Any], info: RequestInfo,
                           headers: dict[str, str], inst: Instance,
                           disconnected: Callable[[], Awaitable[Any]] | None = None,
                           ) -> tuple[dict[str, Any] | None, Any]:
        """Run the prefill leg on ``inst``.

        Returns:
            (``kv_transfer_params``, the whole JSON answer), or ``(None, None)``.

        Never raises for upstream trouble: every failure is a fallback,
        counted in ``pdgate_prefill_fallbacks_total{reason}``.
        """
        n = info.tokens
        inst.add_prefill(info.request_id, n)
        entry: int | None = None
        if info.doomed:
            inst.deferred.add(info.request_id)
        try:
            entry = await self._admit(info, inst, disconnected)
        except BaseException:
            inst.done_prefill(info.request_id)
            raise
        inst.deferred.discard(info.request_id)
        sent = self._dispatched.setdefault(inst.url, {})
        ahead = list(sent.values())
        sent[info.request_id] = n
        self._acquire(inst)
        reason = None
        start = time.monotonic()
        try:
            resp = await self._client(inst).post(f"{inst.url}/v1/{endpoint}", content=_dumps(prefill_body(body)),
                                                 headers={**headers, **_JSON_HEADERS},
                                                 timeout=self._prefill_timeout)
            if resp.status_code >= 500:
                inst.breaker.record_failure()
            else:
                inst.breaker.record_success()
            if resp.status_code != 200:
                reason = f"http_{resp.status_code // 100}xx"
                log.warning("prefill %s on %s answered %s", info.request_id, inst.url, resp.status_code)
            else:
                data = _loads(resp.content)
                params = data.get("kv_transfer_params") if isinstance(data, dict) else None
                if isinstance(params, dict) and params:
                    self.predictor.observe_prefill(ahead, n, time.monotonic() - start)
                    return params, data
                reason = "no_kv_transfer_params"
        except httpx.TimeoutException:
            reason = "timeout"
            inst.breaker.record_failure()
        except (httpx.HTTPError, ValueError) as e:
            reason = "connect_error" if isinstance(e, httpx.ConnectError) else "error"
            if isinstance(e, httpx.TransportError):
                inst.breaker.record_failure()
            log.warning("prefill %s on %s failed: %r", info.request_id, inst.url, e)
        finally:
            sent.pop(info.request_id, None)
            inst.done_prefill(info.request_id)
            if entry is not None:
                self.admission.release(entry)
            self._release(inst)
        self.metrics.prefill_fallbacks.labels(reason or "error").inc()
        return None, None

    # -- whole request -----------------------------------------------------
    async def handle(self, endpoint: str, body: dict[str, Any], client_headers: dict[str, str],
                     request_id: str, arrival: float,
                     disconnected: Callable[[], Awaitable[Any]] | None = None,
                     max_model_len: int | None = None) -> Response:
        """Serve one validated request; returns the response for the client.

        ``disconnected`` (optional) returns when the client goes away; it
        cancels a prefill leg still waiting for admission. ``max_model_len``
        (tokens, optional) is the model's context length.

        Raises:
            GatewayError: bad priority / SLO class or prompt over the context
                (400), no routable decode instance (503), no decode instance
                could be reached (502/504).
        """
        if body.pop("kv_transfer_params", None) is not None:
            self.metrics.dropped_kv_params.inc()
        try:
            info = await self.request_info(endpoint, body, client_headers, request_id, max_model_len)
        except GatewayError:
            self.metrics.requests.labels("none", "client_error").inc()
            raise
        if self.config.priority.forward_to_vllm and "priority" not in body:
            body["priority"] = info.priority
        headers = self._headers(client_headers, request_id)
        try:
            decision = await self.place(info, disconnected)
        except (GatewayError, asyncio.CancelledError):
            self.metrics.requests.labels("none", "cancelled").inc()
            raise
        info.doomed = decision.predicted.get("miss", 0.0) >= 1.0
        kv_params = answer = None
        prefill_span = 0.0
        if decision.kind == "pd" and decision.prefill is not None:
            t_pre = time.monotonic()
            try:
                kv_params, answer = await self._run_prefill(endpoint, body, info, headers, decision.prefill,
                                                    disconnected)
            except (GatewayError, asyncio.CancelledError):
                self.metrics.requests.labels("pd", "cancelled").inc()
                raise
            prefill_span = time.monotonic() - t_pre
        route = "pd" if kv_params is not None else ("deflect" if decision.kind == "deflect" else "decode_only")
        decode_body = dict(body)
        if kv_params is not None:
            decode_body["kv_transfer_params"] = kv_params
        stream = bool(body.get("stream"))
        early = self._first_token(endpoint, body, answer, arrival) if kv_params is not None else None
        if early is not None:  # the client's first token comes from the prefill leg
            return StreamingResponse(
                self._relay_after_first_token(early, endpoint, decode_body, info, headers, route, decision,
                                              arrival, arrival + prefill_span),
                status_code=200, media_type="text/event-stream",
                headers={"X-Request-Id": request_id, "Cache-Control": "no-cache"})
        resp, leg, first, rest = await self._send_decode(endpoint, decode_body, info, headers, route,
                                                         decision, stream, arrival + prefill_span)
        inst = leg.inst
        if resp.status_code != 200:
            return await self._relay_error(resp, leg, route, arrival)
        if stream:
            return StreamingResponse(
                self._relay_stream(resp, leg, route, arrival, decision.predicted, first, rest),
                status_code=200,
                media_type="text/event-stream",
                headers={"X-Request-Id": request_id, "Cache-Control": "no-cache"},
            )
        content = first
        await resp.aclose()
        leg.finish()
        self._release(inst)
        self.metrics.requests.labels(route, "success").inc()
        self.metrics.e2e.observe(time.monotonic() - arrival)
        return Response(content=content, status_code=200, media_type="application/json",
                        headers={"X-Request-Id": request_id})

    async def _send_decode(self, endpoint: str, body: dict[str, Any], info: RequestInfo,
                           headers: dict[str, str], route: str, decision: RouteDecision,
                           stream: bool = False, overhead_base: float | None = None,
                           ) -> tuple[httpx.Response, DecodeLeg, bytes, AsyncIterator[bytes] | None]:
        """Open the decode leg and read its first bytes; retry on other decode instances.

        The decision's decode instance goes first; otherwise (and for the
        retries) the decode policy picks among the allowed candidates. Each
        instance is tried at most once. A failure before the first byte
        reached the client (connect error, connection dropped, 502/503/504)
        moves to the next instance; once the request reached an instance the
        retries carry no ``kv_transfer_params``.

        ``overhead_base`` (monotonic seconds): arrival plus the prefill leg's
        span; the first attempt's send time minus it is observed in
        ``pdgate_added_latency_seconds``.

        Returns:
            (response, leg, first bytes, rest): the first chunk of a 200
            stream and the iterator over the remaining chunks; the whole body
            of a 200 JSON answer; ``b""`` for an error status (its body is
            still unread). ``rest`` is ``None`` unless streaming.

        Raises:
            GatewayError(503): no routable decode instance.
            GatewayError(502/504): every decode candidate failed, or timed out.
        """
        candidates = list(decision.decode_candidates or self.fleet.candidates("decode"))
        first = decision.decode
        if first is not None and first not in candidates:
            candidates.append(first)
        if not candidates:
            self.metrics.requests.labels(route, "upstream_error").inc()
            raise GatewayError(503, "no healthy decode instance (all ejected or draining)",
                               reason="no_instance", headers={"Retry-After": "1"})
        last_error = "no decode instance"
        payload = _dumps(body)
        computes_prompt = route != "pd"
        stale_tried: set[str] = set()
        connect_tries: dict[str, int] = {}
        while candidates:
            inst = first if first is not None else self.decode_policy.select(candidates, info)
            first = None
            candidates.remove(inst)
            self._acquire(inst)
            leg = DecodeLeg(inst, info.request_id, info.tokens, computes_prompt=computes_prompt,
                            deflected=route == "deflect", tpot_slo_s=info.tpot_slo_s,
                            output_tokens=info.output_tokens)
            resp: httpx.Response | None = None
            reached, stale = True, False
            try:
                client = self._client(inst)
                req = client.build_request("POST", f"{inst.url}/v1/{endpoint}", content=payload,
                                           headers={**headers, **_JSON_HEADERS},
                                           timeout=self._decode_timeout if stream else self._decode_whole_timeout)
                if overhead_base is not None:
                    self.metrics.added_latency.observe(max(0.0, time.monotonic() - overhead_base))
                    overhead_base = None
                resp = await client.send(req, stream=True)
                if resp.status_code in (502, 503, 504) and candidates:
                    raise _Retry(f"answered {resp.status_code}")
                if resp.status_code >= 500:
                    inst.breaker.record_failure()
                    return resp, leg, b"", None
                if resp.status_code != 200:
                    inst.breaker.record_success()
                    return resp, leg, b"", None
                it: AsyncIterator[bytes] | None = None
                if stream:
                    it = resp.aiter_raw()
                    head = b""
                    async for chunk in it:  # first non-empty chunk (a dead stream raises or ends)
                        if chunk:
                            head = chunk
                            break
                    if not head:
                        raise _Retry("closed the stream before the first byte")
                else:
                    head = await resp.aread()
                inst.breaker.record_success()
                return resp, leg, head, it
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, _Retry,
                    httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
                reached = not isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout))
                # A connection error before any answer is most often a pooled
                # keep-alive connection the instance had closed: one more try
                # there, on a fresh connection, before blaming the instance.
                stale = (resp is None and isinstance(e, (httpx.RemoteProtocolError, httpx.ReadError,
                                                         httpx.WriteError)) and inst.url not in stale_tried)
                last_error = f"decode instance {inst.url} failed before the first byte: {e!r}"
                log.warning("%s (request %s)", last_error, info.request_id)
            except httpx.TimeoutException:
                self._abandon(inst, leg, resp)
                inst.breaker.record_failure()
                self.metrics.requests.labels(route, "upstream_error").inc()
                raise GatewayError(504, f"decode instance {inst.url} timed out") from None
            except BaseException:
                self._abandon(inst, leg, resp)
                raise
            leg.finish()
            self._release(inst)
            if resp is not None:
                await resp.aclose()
            if stale:
                stale_tried.add(inst.url)
                candidates.append(inst)
                first = inst
                self.metrics.decode_retries.labels("stale_connection").inc()
            elif not reached and not candidates and \
                    connect_tries.get(inst.url, 1) < self.config.timeouts.connect_attempts:
                # The last candidate could not be connected to: nothing was
                # sent, so try it again after a short backoff before failing.
                tries = connect_tries.get(inst.url, 1)
                connect_tries[inst.url] = tries + 1
                candidates.append(inst)
                first = inst
                self.metrics.decode_retries.labels("connect_same_instance").inc()
                await asyncio.sleep(min(1.0, _CONNECT_BACKOFF_S * 2 ** (tries - 1)))
            else:
                inst.breaker.record_failure()
                if candidates:
                    self.metrics.decode_retries.labels("connect" if not reached else "dropped").inc()
            if reached and "kv_transfer_params" in body:
                body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
                payload = _dumps(body)
                computes_prompt = True
        self.metrics.requests.labels(route, "upstream_error").inc()
        raise GatewayError(502, last_error)

    def _abandon(self, inst: Instance, leg: DecodeLeg, resp: httpx.Response | None) -> None:
        leg.finish()
        self._release(inst)
        if resp is not None and not resp.is_closed:
            asyncio.ensure_future(resp.aclose())
