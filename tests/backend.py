"""An in-process fake fleet as an httpx transport (no sockets).

``FakeBackend().transport()`` goes into ``create_app(config, transport=...)``:
every upstream call of the gateway lands in :meth:`FakeBackend.handle`, which
answers as a vLLM instance (``/v1/models``, ``/health``, ``/metrics``,
completions with the NixlConnector P/D handshake, SSE or JSON) and records
the call, so tests can assert that a request never reached an instance, or
that the gateway never connected anywhere it should not.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import httpx

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


def asgi_client(app: Any, client: tuple[str, int] = ("10.0.0.1", 40000)) -> httpx.AsyncClient:
    """An httpx client calling ``app`` in-process (run its lifespan around it)."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=client), base_url="http://gw",
                             timeout=30)


class FakeBackend:
    """Fake vLLM instances keyed by ``host:port``.

    Args:
        models: served model ids (every instance serves all of them).
        max_model_len: context length stated on the model cards (tokens).
    """

    def __init__(self, models: tuple[str, ...] = ("m",), max_model_len: int = 4096) -> None:
        self.models = models
        self.max_model_len = max_model_len
        self.calls: list[tuple[str, str, str]] = []   # (method, host:port, path)
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        self.down: set[str] = set()                     # host:port refusing connections
        self.status: dict[str, int] = {}                # host:port -> status of completions
        self.delay_s = 0.0                              # sleep before answering a completion
        self.drop_once: set[str] = set()                # host:port dropping the next completion's connection
        self.connect_timeouts: dict[str, int] = {}      # host:port -> completions whose connect times out
        self.in_flight = 0
        self.max_in_flight = 0
        self.max_model_len_of: dict[str, int] = {}      # host:port -> its own context length

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    @property
    def completion_calls(self) -> int:
        return sum(1 for _, _, p in self.calls if p in COMPLETION_PATHS)

    def hosts(self) -> set[str]:
        return {h for _, h, _ in self.calls}

    def per_path(self) -> Counter[tuple[str, str]]:
        return Counter((h, p) for _, h, p in self.calls)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        host = f"{request.url.host}:{request.url.port}"
        path = request.url.path
        self.calls.append((request.method, host, path))
        if host in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.method == "GET" and path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": m, "object": "model", "max_model_len": self.max_model_len_of.get(host, self.max_model_len)}
                for m in self.models]})
        if request.method == "GET" and path == "/health":
            return httpx.Response(200)
        if request.method == "GET" and path == "/metrics":
            return httpx.Response(200, text="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")
        if request.method == "POST" and path in COMPLETION_PATHS:
            if self.connect_timeouts.get(host, 0) > 0:
                self.connect_timeouts[host] -= 1
                raise httpx.ConnectTimeout("", request=request)
            body = json.loads(request.content)
            self.bodies.append((host, body))
            if host in self.drop_once:
                self.drop_once.discard(host)
                raise httpx.ReadError("connection reset by peer", request=request)
            if self.delay_s:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                try:
                    await asyncio.sleep(self.delay_s)
                finally:
                    self.in_flight -= 1
            status = self.status.get(host, 200)
            if status != 200:
                return httpx.Response(status, json={"error": {"message": "fake failure", "type": "x",
                                                              "param": None, "code": status}})
            return self._complete(host, body, chat=path.endswith("chat/completions"))
        return httpx.Response(404, json={"error": {"message": "not found", "type": "NotFoundError",
                                                   "param": None, "code": 404}})

    def _complete(self, host: str, body: dict[str, Any], chat: bool) -> httpx.Response:
        n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 4)
        kv = body.get("kv_transfer_params") or {}
        out: dict[str, Any] = {"id": "x", "object": "chat.completion" if chat else "text_completion",
                               "model": body.get("model"), "usage": {"completion_tokens": n}}
        if kv.get("do_remote_decode"):
            out["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                         "remote_block_ids": [[1]], "remote_engine_id": host,
                                         "remote_host": host.split(":")[0], "remote_port": 5600}
        if not body.get("stream"):
            text = " ".join(f"t{i}" for i in range(n))
            out["choices"] = [{"index": 0, "message": {"role": "assistant", "content": text}} if chat
                              else {"index": 0, "text": text}]
            return httpx.Response(200, json=out)
        events = "".join(
            "data: " + json.dumps({"choices": [{"index": 0, "text": f"t{i} "}]}) + "\n\n" for i in range(n))
        data = (events + "data: [DONE]\n\n").encode()

        async def chunks() -> Any:  # a real stream (bytes content would count as already read)
            yield data

        return httpx.Response(200, content=chunks(), headers={"content-type": "text/event-stream"})
