"""Circuit breaker per instance: state machine, passive failures from the
proxy, active health checks; ejected instances get no requests, none left
means a fast 503; ejection and re-admission within the configured bounds."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pdgate.config import GatewayConfig, HealthConfig
from pdgate.gateway import create_app
from pdgate.health import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from tests.backend import FakeBackend, asgi_client

BODY = {"model": "m", "prompt": "a b", "max_tokens": 2}


def test_breaker_state_machine() -> None:
    now = [0.0]
    changes: list[tuple[str, str]] = []
    b = CircuitBreaker(HealthConfig(failures_to_eject=3, cooldown_s=10, successes_to_readmit=2),
                       on_change=lambda o, n: changes.append((o, n)), clock=lambda: now[0])
    b.record_failure(); b.record_failure(); b.record_success()   # noqa: E702 - a success resets the count
    b.record_failure(); b.record_failure()                       # noqa: E702
    assert b.state == CLOSED and b.allows_requests()
    b.record_failure()
    assert b.state == OPEN and not b.allows_requests() and b.ejections == 1
    now[0] = 9.9
    assert b.state == OPEN
    now[0] = 10.0
    assert b.state == HALF_OPEN and not b.allows_requests()     # active probes decide
    b.record_failure()
    assert b.state == OPEN                                       # probe failed: cooldown again
    now[0] = 20.0
    b.record_success()
    assert b.state == HALF_OPEN
    b.record_success()
    assert b.state == CLOSED and b.allows_requests()
    assert changes == [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, OPEN), (OPEN, HALF_OPEN),
                       (HALF_OPEN, CLOSED)]


def test_half_open_lets_trial_requests_through_without_active_checks() -> None:
    now = [0.0]
    b = CircuitBreaker(HealthConfig(enabled=False, failures_to_eject=1, cooldown_s=1), clock=lambda: now[0])
    b.record_failure()
    assert not b.allows_requests()
    now[0] = 1.0
    assert b.allows_requests()


def cfg(n_decode: int = 2, **health: Any) -> GatewayConfig:
    return GatewayConfig(prefill=["http://p0:8000"], decode=[f"http://d{i}:8000" for i in range(n_decode)],
                         scrape={"enabled": False}, health=health)


async def test_passive_failures_eject_and_no_request_reaches_ejected_instance() -> None:
    backend = FakeBackend()
    backend.down.add("d0:8000")
    app = create_app(cfg(enabled=False, failures_to_eject=2, cooldown_s=60), transport=backend.transport())
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        for _ in range(6):  # retried transparently on d1 while d0 fails
            assert (await c.post("/v1/completions", json=BODY)).status_code == 200
        d0_calls = backend.per_path()[("d0:8000", "/v1/completions")]
        assert d0_calls == 2, "d0 got requests after its breaker opened"
        d0 = app.state.fleet.get("http://d0:8000")
        assert d0.breaker.state == OPEN and not d0.routable()
        m = (await c.get("/metrics")).text
    assert 'pdgate_instance_ejections_total{instance="http://d0:8000",role="decode"} 1.0' in m
    assert 'pdgate_instance_healthy{instance="http://d0:8000",role="decode"} 0.0' in m
    assert 'pdgate_instance_healthy{instance="http://d1:8000",role="decode"} 1.0' in m
    assert 'pdgate_decode_retries_total{reason="connect"} 2.0' in m


async def test_all_decode_ejected_fails_fast_with_503() -> None:
    backend = FakeBackend()
    backend.down.add("d0:8000")
    app = create_app(cfg(n_decode=1, enabled=False, failures_to_eject=1, cooldown_s=60),
                     transport=backend.transport())
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        r = await c.post("/v1/completions", json=BODY)
        assert r.status_code == 502                     # the failure that ejects it
        n = backend.completion_calls
        t0 = time.monotonic()
        r = await c.post("/v1/completions", json=BODY)
        assert r.status_code == 503 and "retry-after" in r.headers
        assert time.monotonic() - t0 < 0.5
        assert backend.completion_calls == n            # not routed to the dead one
        assert 'reason="no_instance"' in (await c.get("/metrics")).text


async def test_prefill_ejected_requests_go_decode_only() -> None:
    backend = FakeBackend()
    backend.status["p0:8000"] = 503
    app = create_app(cfg(n_decode=1, enabled=False, failures_to_eject=2, cooldown_s=60),
                     transport=backend.transport())
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        for _ in range(5):
            assert (await c.post("/v1/completions", json=BODY)).status_code == 200
    assert backend.per_path()[("p0:8000", "/v1/completions")] == 2


async def test_active_health_checks_eject_and_readmit_within_bounds() -> None:
    h = HealthConfig(interval_s=0.05, timeout_s=0.2, failures_to_eject=3, cooldown_s=0.3)
    backend = FakeBackend()
    app = create_app(cfg(**h.model_dump()), transport=backend.transport())
    eject_bound = h.failures_to_eject * (h.interval_s + h.timeout_s) + 0.2
    readmit_bound = h.cooldown_s + h.successes_to_readmit * (h.interval_s + h.timeout_s) + 0.2
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        d0 = app.state.fleet.get("http://d0:8000")
        await asyncio.sleep(0.1)
        assert d0.breaker.state == CLOSED
        backend.down.add("d0:8000")
        t0 = time.monotonic()
        while d0.routable():
            assert time.monotonic() - t0 < eject_bound, "not ejected in time"
            await asyncio.sleep(0.01)
        n = backend.per_path()[("d0:8000", "/v1/completions")]
        for _ in range(4):
            assert (await c.post("/v1/completions", json=BODY)).status_code == 200
        assert backend.per_path()[("d0:8000", "/v1/completions")] == n
        backend.down.discard("d0:8000")
        t0 = time.monotonic()
        while not d0.routable():
            assert time.monotonic() - t0 < readmit_bound, "not re-admitted in time"
            await asyncio.sleep(0.01)
        for _ in range(4):
            assert (await c.post("/v1/completions", json=BODY)).status_code == 200
        assert backend.per_path()[("d0:8000", "/v1/completions")] > n
        health = (await c.get("/health")).json()
        assert {i["url"]: i["breaker"] for i in health["instances"]}["http://d0:8000"] == "closed"


async def test_stale_keepalive_connection_retried_on_same_instance() -> None:
    """A connection dropped before any answer (a pooled keep-alive connection
    the instance had closed) gets one more try on the same instance; the
    breaker is not charged; the retry carries no kv_transfer_params."""
    backend = FakeBackend()
    app = create_app(cfg(n_decode=1, enabled=False, failures_to_eject=1, cooldown_s=60),
                     transport=backend.transport())
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        backend.drop_once.add("d0:8000")
        assert (await c.post("/v1/completions", json=BODY)).status_code == 200
        d0 = app.state.fleet.get("http://d0:8000")
        assert d0.breaker.state == CLOSED and d0.breaker.failures == 0
        decode_bodies = [b for h, b in backend.bodies if h == "d0:8000"]
        assert len(decode_bodies) == 2 and "kv_transfer_params" in decode_bodies[0]
        assert "kv_transfer_params" not in decode_bodies[1]
        assert 'pdgate_decode_retries_total{reason="stale_connection"} 1.0' in (await c.get("/metrics")).text


async def test_connect_timeout_on_last_decode_candidate_is_retried_there() -> None:
    """A connect that times out sent nothing: with no other decode instance
    the gateway tries the same one again (up to ``connect_attempts``) and the
    request succeeds; past the attempts it fails with 502 and charges the breaker."""
    backend = FakeBackend()
    config = cfg(n_decode=1, enabled=False, failures_to_eject=5, cooldown_s=60)
    app = create_app(config, transport=backend.transport())
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        d0 = app.state.fleet.get("http://d0:8000")
        backend.connect_timeouts["d0:8000"] = 2
        assert (await c.post("/v1/completions", json=BODY)).status_code == 200
        assert backend.connect_timeouts["d0:8000"] == 0
        assert d0.breaker.failures == 0
        text = (await c.get("/metrics")).text
        assert 'pdgate_decode_retries_total{reason="connect_same_instance"} 2.0' in text
        backend.connect_timeouts["d0:8000"] = config.timeouts.connect_attempts
        r = await c.post("/v1/completions", json=BODY)
        assert r.status_code == 502 and "ConnectTimeout" in r.json()["error"]["message"]
        assert d0.breaker.failures == 1
