"""HTTP client for the two request legs (prefill and decode), over aiohttp.

The legs are the gateway's hot path: every API request sends one prefill and
one decode request upstream. httpx/httpcore spend ~1-2 ms of CPU per request
scanning their connection pool (``_assign_requests_to_connections`` checks
every pooled connection, with socket syscalls, on each request and release);
aiohttp's connector keeps idle connections per host in a deque and parses
HTTP in C: ~0.15-0.25 ms per request on the same host (measured here,
``bench/overhead.py``). Everything else (scrapes, health checks, catalog,
``/tokenize``) stays on httpx, and tests that inject an ``httpx`` transport
keep httpx for the legs too.

:class:`AiohttpLegClient` offers the small part of ``httpx.AsyncClient`` the
proxy uses (``build_request``, ``send(stream=True)``, ``post``) and raises
httpx's exception types, so the proxy's retry and fallback rules are the same
whichever client serves the legs:

=====================================  ==============================
aiohttp                                raised as
=====================================  ==============================
connect timeout                        ``httpx.ConnectTimeout``
refused / unreachable / DNS            ``httpx.ConnectError``
read timeout (gap between bytes)       ``httpx.ReadTimeout``
server closed the connection           ``httpx.RemoteProtocolError``
malformed or cut body                  ``httpx.RemoteProtocolError``
other socket errors                    ``httpx.ReadError``
=====================================  ==============================
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Mapping

import aiohttp
import httpx


@dataclass
class LegRequest:
    """A prepared upstream request (what ``build_request`` returns)."""

    method: str
    url: str
    content: bytes
    headers: Mapping[str, str]
    timeout: httpx.Timeout | None


def _client_timeout(t: httpx.Timeout | None) -> aiohttp.ClientTimeout:
    """httpx's per-phase timeout as aiohttp's: connect -> ``sock_connect``,
    read (longest gap between two reads) -> ``sock_read``; no total bound."""
    if t is None:
        return aiohttp.ClientTimeout(total=None)
    return aiohttp.ClientTimeout(total=None, sock_connect=t.connect, sock_read=t.read)


def _as_httpx_error(e: BaseException, url: str) -> httpx.TransportError:
    """The httpx exception the proxy expects for an aiohttp failure (table in the module doc)."""
    msg = f"{type(e).__name__}: {e}"
    req = httpx.Request("POST", url)
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(msg, request=req)
    if isinstance(e, (aiohttp.SocketTimeoutError, aiohttp.ServerTimeoutError, asyncio.TimeoutError)):
        return httpx.ReadTimeout(msg, request=req)
    if isinstance(e, aiohttp.ClientConnectorError):
        return httpx.ConnectError(msg, request=req)
    if isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError,
                      aiohttp.ClientResponseError)):
        return httpx.RemoteProtocolError(msg, request=req)
    return httpx.ReadError(msg, request=req)


_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


class LegResponse:
    """An upstream answer with the ``httpx.Response`` surface the proxy uses.

    ``content`` is set once the body was read (``aread`` or ``send(stream=False)``).
    """

    def __init__(self, resp: aiohttp.ClientResponse, url: str) -> None:
        self._resp = resp
        self._url = url
        self.status_code = resp.status
        self.headers = resp.headers
        self.content = b""
        self.is_closed = False

    async def aread(self) -> bytes:
        """The whole body (bytes); closes the response.

        Raises:
            httpx.TransportError: see the module doc.
        """
        try:
            self.content = await self._resp.read()
        except _ERRORS as e:
            await self.aclose()
            raise _as_httpx_error(e, self._url) from e
        self._done()
        return self.content

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """Body chunks as they arrive (transfer-decoded).

        Raises:
            httpx.TransportError: see the module doc.
        """
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except _ERRORS as e:
            await self.aclose()
            raise _as_httpx_error(e, self._url) from e
        self._done()

    def json(self) -> Any:
        import json

        return json.loads(self.content)

    @property
    def text(self) -> str:
        """The body read so far, decoded as UTF-8 (undecodable bytes replaced)."""
        return self.content.decode("utf-8", errors="replace")

    def _done(self) -> None:
        self.is_closed = True
        self._resp.release()  # a fully read body: the connection goes back to the pool

    async def aclose(self) -> None:
        """Drop the response; a body not read to the end closes its connection."""
        if not self.is_closed:
            self.is_closed = True
            self._resp.close()


class AiohttpLegClient:
    """Connection pool for the legs to one instance (or several), on aiohttp.

    Args:
        limit: most connections open at once (0 = no limit).
        keepalive_s: how long an idle connection is kept (seconds); below
            uvicorn's default keep-alive (5 s, vLLM's API server) so the
            gateway drops a connection before the instance does.

    Create and close it inside the running event loop (the gateway's lifespan).
    """

    def __init__(self, limit: int = 4096, keepalive_s: float = 4.0) -> None:
        connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0, keepalive_timeout=keepalive_s,
                                         use_dns_cache=True, ttl_dns_cache=10)
        self._session = aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(),
                                              trust_env=False, auto_decompress=True,
                                              skip_auto_headers=("User-Agent",),
                                              timeout=aiohttp.ClientTimeout(total=None))

    def build_request(self, method: str, url: str, *, content: bytes = b"",
                      headers: Mapping[str, str] | None = None,
                      timeout: httpx.Timeout | None = None) -> LegRequest:
        return LegRequest(method, url, content, dict(headers or {}), timeout)

    async def send(self, req: LegRequest, stream: bool = False) -> LegResponse:
        """Send ``req``; with ``stream`` return once the status line and headers arrived.

        Raises:
            httpx.TransportError: see the module doc.
        """
        try:
            resp = await self._session.request(req.method, req.url, data=req.content, headers=req.headers,
                                               timeout=_client_timeout(req.timeout), allow_redirects=False)
        except _ERRORS as e:
            raise _as_httpx_error(e, req.url) from e
        out = LegResponse(resp, req.url)
        if not stream:
            await out.aread()
        return out

    async def post(self, url: str, *, content: bytes = b"", headers: Mapping[str, str] | None = None,
                   timeout: httpx.Timeout | None = None) -> LegResponse:
        """POST and read the whole answer.

        Raises:
            httpx.TransportError: see the module doc.
        """
        return await self.send(self.build_request("POST", url, content=content, headers=headers,
                                                  timeout=timeout))

    async def get(self, url: str, *, headers: Mapping[str, str] | None = None,
                  timeout: httpx.Timeout | float | None = None) -> LegResponse:
        """GET and read the whole answer (``timeout`` in seconds applies to connect and to each read).

        Raises:
            httpx.TransportError: see the module doc.
        """
        t = httpx.Timeout(timeout) if isinstance(timeout, (int, float)) else timeout
        return await self.send(self.build_request("GET", url, headers=headers, timeout=t))

    async def aclose(self) -> None:
        await self._session.close()

    async def __aenter__(self) -> "AiohttpLegClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
