"""The FastAPI application: OpenAI-compatible endpoints over a P/D fleet.

Endpoints:
- ``POST /v1/completions``, ``POST /v1/chat/completions``: streaming (SSE,
  ``text/event-stream``) and non-streaming, routed by :class:`PDProxy`.
- ``GET /v1/models``: the union of the fleet's models.
- ``GET /health``: gateway liveness plus the fleet's view (503 while draining).
- ``GET /metrics``: Prometheus text format.
- ``/admin/...``: the admin API (:mod:`pdgate.gateway.admin`), only with a token.

With ``metrics_port`` set, ``/health`` and ``/metrics`` move to a second app
(:func:`create_ops_app`) served on that port. Limits and drain are applied
by :class:`pdgate.gateway.limits.GuardMiddleware`; the per-instance health
checks and circuit breakers live in :mod:`pdgate.health`.

Every error is OpenAI error JSON with the right status; nothing the gateway
raises escapes as a bare 500 page.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdgate import __version__
from pdgate.config import GatewayConfig
from pdgate.fleet import Fleet
from pdgate.gateway.admin import admin_router
from pdgate.gateway.catalog import ModelCatalog
from pdgate.gateway.context import RequestContextMiddleware
from pdgate.gateway.errors import GatewayError, error_response
from pdgate.gateway.limits import Gate, GuardMiddleware
from pdgate.gateway.proxy import PDProxy
from pdgate.gateway.schemas import ChatCompletionRequest, CompletionRequest, openapi_body
from pdgate.gateway.upstream import AiohttpLegClient
from pdgate.gateway.validation import parse_body, request_id_from_header, validate_request
from pdgate.logs import request_id_var
from pdgate.health import HealthChecker
from pdgate.metrics import GatewayMetrics
from pdgate.state.scraper import MetricsScraper

log = logging.getLogger("pdgate.gateway")


async def _read_body(request: Request, limit: int) -> bytes:
    """Read the request body, refusing more than ``limit`` bytes.

    Raises:
        GatewayError(413): declared or actual size above ``limit``.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise GatewayError(400, "invalid Content-Length header", reason="invalid_content_length") from None
        if n > limit:
            raise GatewayError(413, f"request body over {limit} bytes", reason="body_too_large")
    chunks = bytearray()
    async for chunk in request.stream():
        chunks += chunk
        if len(chunks) > limit:
            raise GatewayError(413, f"request body over {limit} bytes", reason="body_too_large")
    return bytes(chunks)


def create_app(config: GatewayConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """Build the gateway app for ``config``.

    Args:
        config: validated gateway configuration.
        transport: optional httpx transport for the upstream client (tests).

    Returns:
        A FastAPI app; run it with uvicorn. ``app.state`` holds ``fleet``,
        ``metrics``, ``gate`` (limits and drain state) and (while running)
        ``proxy``, ``catalog``, ``scraper`` (the ``/metrics`` scraper task
        feeding the fleet state) and ``health`` (the health checker).
    """
    metrics = GatewayMetrics()
    fleet = Fleet.from_config(config, metrics)
    gate = Gate(config.limits, config.drain, metrics)
    # httpx logs every upstream request at INFO (scrapes included): far too chatty.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger("httpx").level))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # One connection pool per instance: httpcore scans its whole pool on
        # every request, so one shared pool of hundreds of connections costs
        # CPU per request that grows with the fleet's concurrency.
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
        timeout = httpx.Timeout(60.0)
        async with contextlib.AsyncExitStack() as stack:
            client = await stack.enter_async_context(
                httpx.AsyncClient(limits=limits, transport=transport, timeout=timeout))
            up = config.upstream

            async def fast_client(max_connections: int, keepalive: int) -> Any:
                """A pool for a hot path (legs, scrapes): aiohttp per ``upstream.client``
                (pdgate.gateway.upstream), else httpx (and always when tests inject a transport)."""
                if up.client == "aiohttp" and transport is None:
                    return await stack.enter_async_context(AiohttpLegClient(max_connections, up.keepalive_s))
                return await stack.enter_async_context(httpx.AsyncClient(
                    limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=keepalive,
                                        keepalive_expiry=up.keepalive_s),
                    transport=transport, timeout=timeout))

            per_instance: dict[str, Any] = {i.url: await fast_client(up.max_connections, 256)
                                            for i in fleet.instances}
            # Scrapes run every instance's /metrics every interval (10/s each by default), loaded or
            # not: over aiohttp they cost a fraction of httpx's CPU.
            scrape_client = await fast_client(64, 64)
            health_client = await stack.enter_async_context(
                httpx.AsyncClient(limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
                                  transport=transport, timeout=timeout))
            app.state.client = client
            catalog = ModelCatalog(fleet, client)
            app.state.catalog = catalog
            app.state.proxy = PDProxy(config, fleet, metrics, client, clients=per_instance)
            scraper = MetricsScraper(fleet, scrape_client, config.scrape, metrics)
            app.state.scraper = scraper
            checker = HealthChecker(fleet, health_client, config.health)
            app.state.health = checker
            scraper.start()
            checker.start()
            from pdgate.discovery import start_discovery

            discovery = start_discovery(config, fleet, asyncio.get_running_loop())
            app.state.discovery = discovery
            metrics_server = None
            if config.prometheus_port is not None:  # vllm-router's --prometheus-port
                from prometheus_client import start_http_server

                metrics_server, _ = start_http_server(config.prometheus_port, config.host,
                                                      registry=metrics.registry)
            try:
                yield
            finally:
                await catalog.close()
                await checker.stop()
                await scraper.stop()
                if discovery is not None:
                    await asyncio.to_thread(discovery.stop)
                if metrics_server is not None:
                    metrics_server.shutdown()
                    metrics_server.server_close()

    app = FastAPI(title="pdgate", version=__version__, lifespan=lifespan)
    app.state.config = config
    app.state.fleet = fleet
    app.state.metrics = metrics
    app.state.gate = gate
    app.add_middleware(GuardMiddleware, gate=gate)
    app.add_middleware(RequestContextMiddleware)  # request id + trace context on every log line

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, str(exc.errors()))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error: %r", exc)
        return error_response(500, "internal gateway error")

    async def _serve(request: Request, endpoint: str) -> Response:
        arrival = time.monotonic()
        request_id = request_id_var.get() or request_id_from_header(request.headers.get("x-request-id"))
        try:
            body = parse_body(await _read_body(request, config.max_body_bytes))
            validate_request(endpoint, body, config.limits)
            card = await request.app.state.catalog.lookup(body.get("model"))
            if not fleet.candidates("decode"):
                raise GatewayError(503, "no healthy decode instance (all ejected or draining)",
                                   reason="no_instance",
                                   headers={"Retry-After": str(max(1, math.ceil(config.health.cooldown_s)))})
        except GatewayError as e:
            metrics.requests.labels("none", "client_error" if e.status < 500 else "upstream_error").inc()
            metrics.rejected.labels(e.reason or f"http_{e.status}").inc()
            raise
        proxy: PDProxy = request.app.state.proxy

        async def disconnected() -> None:
            # The body is read, so the next ASGI message is the disconnect.
            while (await request.receive())["type"] != "http.disconnect":
                pass

        # The legs run while the client is watched: if it leaves before the
        # response starts (mid-prefill, queued, waiting for the decode's first
        # byte), the legs are cancelled, which closes their upstream
        # connections, and vLLM aborts both requests. Once streaming, the
        # StreamingResponse watches for the disconnect itself.
        work = asyncio.ensure_future(proxy.handle(endpoint, body, dict(request.headers), request_id, arrival,
                                                  None, max_model_len=ModelCatalog.max_model_len(card)))
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
            watch.cancel()
        if not work.done() or work.cancelled():
            try:
                await work
            except (asyncio.CancelledError, GatewayError):
                pass
            log.info("client left request %s before its response started; legs aborted", request_id)
            return error_response(499, "client disconnected")
        try:
            resp = work.result()
        except GatewayError as e:
            if e.reason:
                metrics.rejected.labels(e.reason).inc()
            raise
        resp.headers.setdefault("X-Request-Id", request_id)
        return resp

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await _serve(request, "completions")

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await _serve(request, "chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        merged = await request.app.state.catalog.refresh()
        if not merged:
            raise GatewayError(503, "no instance answered /v1/models")
        return JSONResponse({"object": "list", "data": list(merged.values())})

    if config.metrics_port is None:
        _add_ops_routes(app, fleet, metrics, gate)
    if config.admin.token:
        app.include_router(admin_router(fleet, config.admin.token, metrics))
    return app


def _add_ops_routes(app: FastAPI, fleet: Fleet, metrics: GatewayMetrics, gate: Gate) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({
            "status": "draining" if gate.draining else "ok",
            "version": __version__,
            "instances": [i.snapshot() for i in fleet.instances],
        }, status_code=503 if gate.draining else 200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        data, ctype = metrics.render()
        return Response(content=data, media_type=ctype)


def create_ops_app(app: FastAPI) -> FastAPI:
    """The ``/health`` + ``/metrics`` app of a gateway app (served on ``metrics_port``)."""
    ops = FastAPI(title="pdgate-ops", version=__version__, openapi_url=None, docs_url=None, redoc_url=None)
    _add_ops_routes(ops, app.state.fleet, app.state.metrics, app.state.gate)
    return ops
