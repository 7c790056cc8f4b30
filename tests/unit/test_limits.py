"""Configurable limits: body size (413), header size (431), concurrency and
per-client rate (429 with Retry-After), each counted in
``pdgate_rejected_requests_total{reason}``; the token bucket itself."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.testclient import TestClient

from pdgate.config import GatewayConfig
from pdgate.gateway import create_app
from pdgate.gateway.limits import TokenBuckets
from tests.backend import FakeBackend, asgi_client


def config(**kw: Any) -> GatewayConfig:
    kw.setdefault("scrape", {"enabled": False})
    kw.setdefault("health", {"enabled": False})
    return GatewayConfig(prefill=["http://p0:8000"], decode=["http://d0:8000"], **kw)


BODY = {"model": "m", "prompt": "a b", "max_tokens": 2}


def test_token_bucket_refills_at_rate() -> None:
    now = [0.0]
    b = TokenBuckets(rate=2.0, burst=3, max_keys=2, clock=lambda: now[0])
    assert [b.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take("a") == pytest.approx(0.5)          # empty: half a second to the next token
    now[0] += 0.5
    assert b.take("a") == 0.0
    assert b.take("b") == 0.0 and b.take("c") == 0.0  # "a" evicted (LRU, 2 keys)
    assert len(b._buckets) == 2


def test_body_and_header_limits() -> None:
    backend = FakeBackend()
    app = create_app(config(max_body_bytes=2000, limits={"max_header_bytes": 4000}), transport=backend.transport())
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={**BODY, "prompt": "x " * 2000})
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
        r = c.post("/v1/completions", json=BODY, headers={"x-pad": "p" * 5000})
        assert r.status_code == 431 and r.json()["error"]["code"] == 431
        assert c.post("/v1/completions", json=BODY).status_code == 200
        m = c.get("/metrics").text
    assert 'pdgate_rejected_requests_total{reason="body_too_large"} 1.0' in m
    assert 'pdgate_rejected_requests_total{reason="header_too_large"} 1.0' in m
    assert backend.completion_calls == 2


async def test_concurrency_limit_429_with_retry_after() -> None:
    backend = FakeBackend()
    backend.delay_s = 0.3
    app = create_app(config(limits={"max_concurrent_requests": 3, "retry_after_s": 2}),
                     transport=backend.transport())
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        rs = await asyncio.gather(*(c.post("/v1/completions", json=BODY) for _ in range(8)))
        codes = sorted(r.status_code for r in rs)
        assert codes == [200] * 3 + [429] * 5
        for r in rs:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "2" and r.json()["error"]["type"] == "rate_limit_error"
        assert app.state.gate.in_flight == 0
        assert (await c.post("/v1/completions", json=BODY)).status_code == 200  # slots freed
        m = (await c.get("/metrics")).text
    assert 'pdgate_rejected_requests_total{reason="concurrency"} 5.0' in m
    assert backend.max_in_flight <= 3 * 2   # prefill + decode legs of at most 3 requests


async def test_rate_limit_per_client_ip_and_api_key() -> None:
    backend = FakeBackend()
    app = create_app(config(limits={"rate_limit_rps": 0.5, "rate_limit_burst": 2}), transport=backend.transport())
    async with app.router.lifespan_context(app):
        async with asgi_client(app, ("10.0.0.1", 1)) as a, asgi_client(app, ("10.0.0.2", 1)) as b:
            got = [(await a.post("/v1/completions", json=BODY)).status_code for _ in range(3)]
            assert got == [200, 200, 429]
            r = await a.post("/v1/completions", json=BODY, headers={"x-forwarded-for": "1.2.3.4"})
            assert r.status_code == 429, "X-Forwarded-For must not reset the client's bucket"
            assert 1 <= int(r.headers["retry-after"]) <= 2
            assert (await b.post("/v1/completions", json=BODY)).status_code == 200  # other client
    app = create_app(config(limits={"rate_limit_rps": 0.5, "rate_limit_burst": 1, "rate_limit_key": "api_key"}),
                     transport=backend.transport())
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        k1, k2 = {"authorization": "Bearer k1"}, {"authorization": "Bearer k2"}
        assert (await c.post("/v1/completions", json=BODY, headers=k1)).status_code == 200
        assert (await c.post("/v1/completions", json=BODY, headers=k1)).status_code == 429
        assert (await c.post("/v1/completions", json=BODY, headers=k2)).status_code == 200
        assert 'reason="rate_limited"' in (await c.get("/metrics")).text


def test_reliability_config_sections_validate() -> None:
    import pydantic

    c = config(limits={"max_concurrent_requests": 5, "rate_limit_rps": 2.5}, health={"cooldown_s": 1},
               drain={"deadline_s": 3}, admin={"token": "x" * 16}, metrics_port=9100)
    assert c.limits.max_concurrent_requests == 5 and c.health.cooldown_s == 1 and c.drain.deadline_s == 3
    for bad in ({"admin": {"token": "short"}}, {"limits": {"max_header_bytes": 0}},
                {"limits": {"rate_limit_key": "cookie"}}, {"health": {"failures_to_eject": 0}},
                {"limits": {"nope": 1}}, {"metrics_port": 70000}):
        with pytest.raises(pydantic.ValidationError):
            config(**bad)
