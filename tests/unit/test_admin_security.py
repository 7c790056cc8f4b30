"""Admin API (bearer token, off without one), instance drain through it, and
the security property: the gateway connects only to configured or
admin-registered instances, whatever a request carries."""

from __future__ import annotations

import asyncio
from typing import Any

from pdgate.config import GatewayConfig
from pdgate.gateway import create_app
from tests.backend import FakeBackend, asgi_client

TOKEN = "s3cret-admin-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}
BODY = {"model": "m", "prompt": "a b", "max_tokens": 2}


def cfg(**kw: Any) -> GatewayConfig:
    return GatewayConfig(prefill=["http://p0:8000"], decode=["http://d0:8000"], scrape={"enabled": False},
                         health={"enabled": False}, **kw)


async def test_admin_api_off_without_token() -> None:
    app = create_app(cfg(), transport=FakeBackend().transport())
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        assert (await c.get("/admin/instances", headers=AUTH)).status_code == 404
        r = await c.post("/admin/instances", json={"url": "http://x:1", "role": "decode"}, headers=AUTH)
        assert r.status_code in (404, 405)
        assert len(app.state.fleet.instances) == 2


async def test_admin_requires_bearer_token() -> None:
    app = create_app(cfg(admin={"token": TOKEN}), transport=FakeBackend().transport())
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        for h in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN},
                  {"authorization": f"Basic {TOKEN}"}):
            r = await c.get("/admin/instances", headers=h)
            assert r.status_code == 401 and r.json()["error"]["code"] == 401
            r = await c.post("/admin/instances", json={"url": "http://x:1", "role": "decode"}, headers=h)
            assert r.status_code == 401
        assert len(app.state.fleet.instances) == 2
        r = await c.get("/admin/instances", headers=AUTH)
        assert r.status_code == 200 and {i["url"] for i in r.json()["instances"]} == {
            "http://p0:8000", "http://d0:8000"}
        assert "/admin" not in str((await c.get("/openapi.json")).json()["paths"])


async def test_admin_add_drain_remove() -> None:
    backend = FakeBackend()
    backend.delay_s = 0.2
    app = create_app(cfg(admin={"token": TOKEN}), transport=backend.transport())
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        r = await c.post("/admin/instances", json={"url": "http://d1:8000/v1", "role": "decode"}, headers=AUTH)
        assert r.status_code == 201 and r.json()["url"] == "http://d1:8000"
        assert (await c.post("/admin/instances", json={"url": "http://d1:8000", "role": "decode"},
                             headers=AUTH)).status_code == 409
        assert (await c.post("/admin/instances", json={"url": "ftp://x", "role": "decode"},
                             headers=AUTH)).status_code == 400
        assert (await c.post("/admin/instances", json={"url": "http://x:1", "role": "boss"},
                             headers=AUTH)).status_code == 400
        for _ in range(4):
            assert (await c.post("/v1/completions", json=BODY)).status_code == 200
        assert backend.per_path()[("d1:8000", "/v1/completions")] == 2    # round robin over d0, d1
        # drain d0 while a request is in flight there: it finishes, no new ones arrive
        inflight = asyncio.ensure_future(c.post("/v1/completions", json=BODY))
        await asyncio.sleep(0.25)   # prefill done, decode leg in flight on d0 (round robin)
        r = await c.post("/admin/instances/drain", json={"url": "http://d0:8000"}, headers=AUTH)
        assert r.status_code == 200 and r.json()["draining"] is True
        n0 = backend.per_path()[("d0:8000", "/v1/completions")]
        assert (await inflight).status_code == 200
        for _ in range(3):
            assert (await c.post("/v1/completions", json=BODY)).status_code == 200
        assert backend.per_path()[("d0:8000", "/v1/completions")] == n0
        r = await c.request("DELETE", "/admin/instances", params={"url": "http://d1:8000"}, headers=AUTH)
        assert r.status_code == 200 and r.json()["removed"] is True
        r = await c.post("/v1/completions", json=BODY)
        assert r.status_code == 503      # d0 draining, d1 removed: nothing routable
        r = await c.post("/admin/instances/undrain", json={"url": "http://d0:8000"}, headers=AUTH)
        assert (await c.post("/v1/completions", json=BODY)).status_code == 200
        assert (await c.request("DELETE", "/admin/instances", params={"url": "http://nope:1"},
                                headers=AUTH)).status_code == 404


EVIL_HEADERS = {
    "host": "169.254.169.254", "x-forwarded-host": "evil.example:80", "x-forwarded-for": "10.9.9.9",
    "x-forwarded-proto": "https", "forwarded": "for=1.2.3.4;host=evil.example", "x-real-ip": "10.9.9.9",
    "x-original-url": "http://evil.example/", "x-rewrite-url": "http://evil.example/",
    "x-request-id": "evil.example:80",
}

EVIL_BODIES = [
    {**BODY, "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "evil.example", "remote_port": 80,
                                    "remote_engine_id": "x", "remote_block_ids": [[1]]}},
    {**BODY, "kv_transfer_params": {"do_remote_decode": True, "remote_host": "evil.example"}},
    {**BODY, "model": "http://evil.example:80/v1"},
    {**BODY, "prompt": "http://evil.example:80/v1/completions", "user": "http://evil.example"},
    {**BODY, "vllm_xargs": {"url": "http://evil.example"}, "stream": True},
]


async def test_nothing_in_a_request_redirects_traffic() -> None:
    backend = FakeBackend(models=("m", "http://evil.example:80/v1"))
    app = create_app(cfg(admin={"token": TOKEN}), transport=backend.transport())
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await c.post("/admin/instances", json={"url": "http://d1:8000", "role": "decode"}, headers=AUTH)
        for body in EVIL_BODIES:
            for ep in ("completions", "chat/completions"):
                b = dict(body)
                if ep == "chat/completions":
                    b.pop("prompt")
                    b["messages"] = [{"role": "user", "content": "http://evil.example"}]
                r = await c.post(f"/v1/{ep}", json=b, headers=EVIL_HEADERS)
                assert r.status_code in (200, 400), r.text
        await c.get("/v1/models", headers=EVIL_HEADERS)
    assert backend.completion_calls > 0
    assert backend.hosts() <= {"p0:8000", "d0:8000", "d1:8000"}, backend.hosts()
    for host, body in backend.bodies:
        kv = body.get("kv_transfer_params") or {}
        assert kv.get("remote_host") in (None, "p0"), f"{host} got foreign kv params {kv}"
