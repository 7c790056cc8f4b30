"""The admin API: list, add, drain and remove instances at run time.

Mounted only when ``admin.token`` is configured; every call must carry
``Authorization: Bearer <token>`` (compared in constant time), else 401.

- ``GET /admin/instances``: every instance with role, pool, breaker state,
  draining flag and in-flight legs.
- ``POST /admin/instances`` ``{"url", "role", "pool"}``: add one (201; 409 if
  present; 400 for a bad URL/role/pool).
- ``POST /admin/instances/drain`` ``{"url"}``: no new requests go there,
  in-flight ones finish; the answer says how many legs are still in flight.
- ``POST /admin/instances/undrain`` ``{"url"}``: route to it again.
- ``DELETE /admin/instances?url=URL``: remove it from routing (in-flight
  requests finish on it).
"""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from pdgate.config import InstanceConfig
from pdgate.fleet import Fleet, Instance
from pdgate.gateway.errors import GatewayError


class AddInstance(BaseModel):
    """Body of ``POST /admin/instances``."""

    url: str
    role: str
    pool: str | None = None


class InstanceRef(BaseModel):
    """Body of the drain/undrain calls."""

    url: str


def _view(inst: Instance) -> dict[str, Any]:
    return {"url": inst.url, "role": inst.role, "pool": inst.pool, "breaker": inst.breaker.state,
            "draining": inst.draining, "routable": inst.routable(), "in_flight": inst.in_flight}


def admin_router(fleet: Fleet, token: str, metrics: Any = None) -> APIRouter:
    """The admin routes over ``fleet``, guarded by ``token``."""
    expected = f"Bearer {token}".encode()

    def auth(request: Request) -> None:
        got = request.headers.get("authorization", "").encode("latin-1", "replace")
        if not secrets.compare_digest(got, expected):
            raise GatewayError(401, "admin API needs a valid bearer token", reason="admin_unauthorized",
                               headers={"WWW-Authenticate": "Bearer"})

    router = APIRouter(prefix="/admin", dependencies=[Depends(auth)], include_in_schema=False)

    def normalize(url: str) -> str:
        try:
            return InstanceConfig(url=url, role="both").url
        except ValidationError as e:
            raise GatewayError(400, f"bad instance URL: {e.errors()[0]['msg']}", "url") from None

    def find(url: str) -> Instance:
        inst = fleet.get(normalize(url))
        if inst is None:
            raise GatewayError(404, f"no instance {url[:200]}", "url")
        return inst

    @router.get("/instances")
    async def list_instances() -> JSONResponse:
        return JSONResponse({"instances": [_view(i) for i in fleet.instances]})

    @router.post("/instances")
    async def add_instance(req: AddInstance) -> JSONResponse:
        if req.role not in ("prefill", "decode", "both"):
            raise GatewayError(400, "role must be prefill, decode or both", "role")
        if req.pool is not None and req.pool not in fleet.pools:
            raise GatewayError(400, f"unknown pool {req.pool!r}", "pool")
        url = normalize(req.url)
        try:
            inst = fleet.add(url, req.role, req.pool)  # type: ignore[arg-type]
        except ValueError as e:
            raise GatewayError(409, str(e), "url") from None
        return JSONResponse(_view(inst), status_code=201)

    @router.post("/instances/drain")
    async def drain_instance(req: InstanceRef) -> JSONResponse:
        inst = find(req.url)
        inst.draining = True
        return JSONResponse(_view(inst))

    @router.post("/instances/undrain")
    async def undrain_instance(req: InstanceRef) -> JSONResponse:
        inst = find(req.url)
        inst.draining = False
        return JSONResponse(_view(inst))

    @router.delete("/instances")
    async def remove_instance(url: str) -> JSONResponse:
        inst = find(url)
        fleet.remove(inst.url)
        if metrics is not None:
            for g in (metrics.instance_healthy,):
                try:
                    g.remove(inst.url, inst.role)
                except KeyError:
                    pass
        return JSONResponse({**_view(inst), "removed": True})

    return router
