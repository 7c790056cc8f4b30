"""A minimal asyncio HTTP/1.1 server for simulated instances.

Dozens of instances and hundreds of streams share one process and one event
loop, so the server is kept to what the gateway, vllm-router and benchmark
clients use: keep-alive, ``Content-Length`` or chunked request bodies, JSON
responses, and chunked streaming responses (SSE). While a handler runs, the
connection is watched for EOF so a client disconnect aborts the request
(``Conn.on_disconnect``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
from typing import Any, AsyncIterator, Awaitable, Callable

log = logging.getLogger("pdgate.sim.http")

REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           413: "Payload Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}
MAX_HEADER = 65536
MAX_BODY = 64 << 20


@dataclasses.dataclass
class HttpRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclasses.dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"


@dataclasses.dataclass
class StreamResponse:
    """Chunked response; ``chunks`` yields bytes (several events may share one chunk)."""

    chunks: AsyncIterator[bytes]
    status: int = 200
    content_type: str = "text/event-stream; charset=utf-8"


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(status, json.dumps(obj).encode())


class _BadRequest(Exception):
    pass


class DropConnection(ConnectionError):
    """Raised by a handler (or a stream) to close the connection abruptly,
    without an answer or mid-stream (fault injection: a crashed instance)."""


class Conn:
    """One client connection: buffered request parsing and disconnect watching."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.buf = bytearray()
        self.eof = False
        self._watch: asyncio.Task[None] | None = None
        self._on_disconnect: list[Callable[[], None]] = []

    async def _fill(self) -> bool:
        data = await self.reader.read(65536)
        if not data:
            self.eof = True
            return False
        self.buf.extend(data)
        return True

    async def _read_until(self, sep: bytes, limit: int) -> bytes | None:
        while True:
            i = self.buf.find(sep)
            if i >= 0:
                out = bytes(self.buf[:i])
                del self.buf[: i + len(sep)]
                return out
            if len(self.buf) > limit:
                raise _BadRequest("header too large")
            if not await self._fill():
                return None

    async def _read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not await self._fill():
                raise _BadRequest("truncated body")
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def read_request(self) -> HttpRequest | None:
        """Next request, or None at EOF before one starts."""
        head = await self._read_until(b"\r\n\r\n", MAX_HEADER)
        if head is None:
            return None
        lines = head.decode("latin-1").split("\r\n")
        try:
            method, target, _version = lines[0].split(" ", 2)
        except ValueError:
            raise _BadRequest("bad request line") from None
        headers: dict[str, str] = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            total = 0
            while True:
                size_line = await self._read_until(b"\r\n", 1024)
                if size_line is None:
                    raise _BadRequest("truncated chunk")
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    await self._read_until(b"\r\n", MAX_HEADER)
                    break
                total += size
                if total > MAX_BODY:
                    raise _BadRequest("body too large")
                parts.append(await self._read_exact(size))
                await self._read_exact(2)
            body = b"".join(parts)
        else:
            n = int(headers.get("content-length") or 0)
            if n > MAX_BODY:
                raise _BadRequest("body too large")
            body = await self._read_exact(n) if n else b""
        return HttpRequest(method, target.split("?", 1)[0], headers, body)

    # -- disconnect watching ------------------------------------------------
    def on_disconnect(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` if the client closes the connection before the response ends."""
        self._on_disconnect.append(fn)
        if self._watch is None and not self.eof:
            self._watch = asyncio.get_running_loop().create_task(self._watcher())
        elif self.eof:
            fn()

    async def _watcher(self) -> None:
        try:
            while await self._fill():
                pass
        except (ConnectionError, OSError):
            self.eof = True
        for fn in self._on_disconnect:
            fn()

    async def stop_watching(self) -> None:
        self._on_disconnect.clear()
        if self._watch is not None:
            self._watch.cancel()
            try:
                await self._watch
            except (asyncio.CancelledError, Exception):
                pass
            self._watch = None

    # -- writing -------------------------------------------------------------
    async def send(self, resp: Response | StreamResponse, keep_alive: bool) -> None:
        conn = b"keep-alive" if keep_alive else b"close"
        reason = REASONS.get(resp.status, "OK").encode()
        w = self.writer
        if isinstance(resp, Response):
            w.write(b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\nconnection: %s\r\n\r\n"
                    % (resp.status, reason, resp.content_type.encode(), len(resp.body), conn) + resp.body)
            await w.drain()
            return
        w.write(b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n"
                b"cache-control: no-cache\r\nconnection: %s\r\n\r\n"
                % (resp.status, reason, resp.content_type.encode(), conn))
        async for data in resp.chunks:
            if data:
                w.write(b"%x\r\n%s\r\n" % (len(data), data))
                await w.drain()
        w.write(b"0\r\n\r\n")
        await w.drain()


Handler = Callable[[HttpRequest, Conn], Awaitable["Response | StreamResponse"]]


async def _serve_conn(handler: Handler, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
    conn = Conn(reader, writer)
    try:
        while True:
            try:
                req = await conn.read_request()
            except _BadRequest as e:
                await conn.send(json_response({"error": {"message": str(e), "type": "BadRequestError",
                                                         "code": 400}}, 400), False)
                return
            if req is None:
                return
            keep = req.headers.get("connection", "").lower() != "close"
            try:
                resp = await handler(req, conn)
            except DropConnection:
                raise
            except Exception as e:  # never let a handler bug kill the connection silently
                log.exception("handler failed")
                resp = json_response({"error": {"message": repr(e), "type": "InternalServerError",
                                                "code": 500}}, 500)
            try:
                await conn.send(resp, keep)
            finally:
                if isinstance(resp, StreamResponse):
                    aclose = getattr(resp.chunks, "aclose", None)
                    if aclose is not None:
                        await aclose()
                await conn.stop_watching()
            if not keep or conn.eof:
                return
    except (ConnectionError, OSError, asyncio.IncompleteReadError):
        return
    except asyncio.CancelledError:  # server shutdown; asyncio's stream callback would log it
        return
    finally:
        await conn.stop_watching()
        writer.close()


async def start_server(handler: Handler, host: str = "127.0.0.1", port: int = 0) -> asyncio.Server:
    """Listen on ``host:port`` (0 = any free port) and serve ``handler``."""
    return await asyncio.start_server(lambda r, w: _serve_conn(handler, r, w), host, port,
                                      reuse_address=True, backlog=1024)
