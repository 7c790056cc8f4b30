"""The aiohttp leg client: httpx's surface and httpx's exception types,
against real loopback servers (raw asyncio sockets)."""

from __future__ import annotations

import asyncio
import socket
from typing import Awaitable, Callable

import httpx
import pytest

from pdgate.gateway.upstream import AiohttpLegClient

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def serve(handler: Handler) -> tuple[asyncio.AbstractServer, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def read_request(r: asyncio.StreamReader) -> bytes:
    head = await r.readuntil(b"\r\n\r\n")
    n = int([ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")][0])
    return await r.readexactly(n)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_post_stream_and_connection_reuse() -> None:
    conns = 0

    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        while True:
            try:
                body = await read_request(r)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            chunks = [b"data: 1\n\n", b"data: " + body + b"\n\n"]
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            for c in chunks:
                w.write(b"%x\r\n%s\r\n" % (len(c), c))
                await w.drain()
            w.write(b"0\r\n\r\n")
            await w.drain()

    server, url = await serve(h)
    async with server, AiohttpLegClient() as c:
        r = await c.post(url + "/v1/completions", content=b'{"a":1}', headers={"X-Request-Id": "r1"})
        assert r.status_code == 200 and r.content == b'data: 1\n\ndata: {"a":1}\n\n' and r.is_closed
        resp = await c.send(c.build_request("POST", url + "/x", content=b"zz"), stream=True)
        got = b"".join([chunk async for chunk in resp.aiter_raw()])
        assert got == b"data: 1\n\ndata: zz\n\n"
        await resp.aclose()
        assert conns == 1  # keep-alive: both requests on one connection


async def test_refused_connect_is_httpx_connect_error() -> None:
    async with AiohttpLegClient() as c:
        with pytest.raises(httpx.ConnectError):
            await c.post(f"http://127.0.0.1:{free_port()}/v1/completions", content=b"{}")


async def test_read_timeout_and_cut_stream_map_to_httpx_errors() -> None:
    async def slow(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await asyncio.sleep(5)

    async def cut(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await w.drain()
        w.close()

    s1, u1 = await serve(slow)
    s2, u2 = await serve(cut)
    async with s1, s2, AiohttpLegClient() as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post(u1 + "/v1/completions", content=b"{}", timeout=httpx.Timeout(0.3, connect=1.0))
        with pytest.raises(httpx.RemoteProtocolError):
            await c.post(u2 + "/v1/completions", content=b"{}")
        resp = await c.send(c.build_request("POST", u2 + "/v1/completions", content=b"{}"), stream=True)
        with pytest.raises(httpx.RemoteProtocolError):
            async for _ in resp.aiter_raw():
                pass
        assert resp.is_closed


async def test_scraper_over_the_aiohttp_client_reads_gauges_and_marks_an_unreachable_instance() -> None:
    """The gateway scrapes ``/metrics`` over this client (GET, a float timeout): the load gauges
    land on the instance; a refused port counts scrape errors and marks it unhealthy after
    ``UNHEALTHY_AFTER`` attempts, as over httpx."""
    from pdgate.config import ScrapeConfig
    from pdgate.fleet import Fleet, Instance
    from pdgate.metrics import GatewayMetrics
    from pdgate.state.scraper import UNHEALTHY_AFTER, MetricsScraper

    paths: list[bytes] = []

    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await r.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            paths.append(head.split(b" ")[0] + b" " + head.split(b" ")[1])
            body = (b'vllm:num_requests_running{engine="0"} 3.0\nvllm:num_requests_running{engine="1"} 2.0\n'
                    b'vllm:num_requests_waiting{engine="0"} 7.0\nvllm:kv_cache_usage_perc{engine="0"} 0.25\n')
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await w.drain()

    server, url = await serve(h)
    dead = f"http://127.0.0.1:{free_port()}"
    live_inst, dead_inst = Instance(url=url, role="prefill"), Instance(url=dead, role="decode")
    metrics = GatewayMetrics()
    async with server, AiohttpLegClient(64) as c:
        scraper = MetricsScraper(Fleet([live_inst, dead_inst]), c, ScrapeConfig(), metrics)
        for _ in range(UNHEALTHY_AFTER):
            await scraper.scrape_once()
    assert paths and set(paths) == {b"GET /metrics"}
    assert live_inst.scraped == {"num_requests_running": 5.0, "num_requests_waiting": 7.0,
                                 "kv_cache_usage_perc": 0.25}
    assert live_inst.healthy and live_inst.scrape_fresh(10.0)
    assert not dead_inst.healthy and not dead_inst.scraped
    assert metrics.scrape_errors.labels(dead)._value.get() == UNHEALTHY_AFTER
