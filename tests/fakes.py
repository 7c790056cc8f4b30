"""In-process fake vLLM instances for the fast test tier.

A fake speaks the part of vLLM's OpenAI server and P/D protocol the gateway
uses: a request with ``kv_transfer_params.do_remote_decode`` answers with
``kv_transfer_params``; any request streams or returns ``max_tokens`` tokens
(token i is ``"t{i}"``). Every received body is recorded, and behaviour can be
switched per test (fail with a status, hang, omit params, die mid-stream).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class FakeBehaviour:
    """Knobs a test flips on a fake instance."""

    status: int = 200            # answer every completion with this status
    omit_kv_params: bool = False  # prefill answers without kv_transfer_params
    hang_s: float = 0.0          # sleep before answering
    die_after_tokens: int | None = None  # break the stream after N tokens
    token_delay_s: float = 0.0
    waiting: int = 0             # vllm:num_requests_waiting reported on /metrics


@dataclass
class FakeInstance:
    """A fake vLLM server running in a background thread on loopback."""

    name: str
    behaviour: FakeBehaviour = field(default_factory=FakeBehaviour)
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    port: int = 0
    running_streams: int = 0
    tokenize_calls: int = 0
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> FastAPI:
        app = FastAPI()
        me = self

        async def complete(request: Request, chat: bool) -> Any:
            body = await request.json()
            me.received.append(body)
            me.headers.append(dict(request.headers))
            b = me.behaviour
            if b.hang_s:
                await asyncio.sleep(b.hang_s)
            if b.status != 200:
                return JSONResponse({"error": {"message": f"{me.name} fails", "type": "x",
                                               "param": None, "code": b.status}},
                                    status_code=b.status)
            n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
            prompt = body.get("prompt") if not chat else body.get("messages")
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
            kv_req = body.get("kv_transfer_params") or {}
            out_kv = None
            if kv_req.get("do_remote_decode") and not b.omit_kv_params:
                out_kv = {"do_remote_prefill": True, "do_remote_decode": False,
                          "remote_block_ids": [[1, 2]], "remote_engine_id": me.name,
                          "remote_request_id": request.headers.get("x-request-id"),
                          "remote_host": "127.0.0.1", "remote_port": 1}
            obj = "chat.completion" if chat else "text_completion"
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                     "total_tokens": prompt_tokens + n}
            if not body.get("stream"):
                text = " ".join(f"t{i}" for i in range(n))
                choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                           "finish_reason": "length"} if chat else
                          {"index": 0, "text": text, "finish_reason": "length"})
                return {"id": "x", "object": obj, "model": "fake", "choices": [choice],
                        "usage": usage, "kv_transfer_params": out_kv,
                        "served_by": me.name}

            async def gen() -> Any:
                me.running_streams += 1
                try:
                    for i in range(n):
                        if b.die_after_tokens is not None and i >= b.die_after_tokens:
                            raise RuntimeError("fake instance died mid-stream")
                        if b.token_delay_s:
                            await asyncio.sleep(b.token_delay_s)
                        delta = ({"index": 0, "delta": {"content": f"t{i} "}} if chat
                                 else {"index": 0, "text": f"t{i} "})
                        yield f"data: {json.dumps({'object': obj, 'choices': [delta]})}\n\n"
                    if (body.get("stream_options") or {}).get("include_usage"):
                        yield f"data: {json.dumps({'object': obj, 'choices': [], 'usage': usage})}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    me.running_streams -= 1

            return StreamingResponse(gen(), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await complete(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            return await complete(request, chat=True)

        @app.get("/v1/models")
        async def models() -> Any:
            # "m" is the model name the fast-tier tests send (the gateway refuses unknown models).
            return {"object": "list", "data": [{"id": "fake-model", "object": "model", "max_model_len": 131072},
                                               {"id": "m", "object": "model", "max_model_len": 131072}]}

        @app.get("/health")
        async def health() -> Any:
            return {}

        @app.get("/metrics")
        async def metrics() -> Any:
            from fastapi.responses import PlainTextResponse

            return PlainTextResponse(
                "# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{engine="0",model_name="fake"}} {me.running_streams}\n'
                f'vllm:num_requests_waiting{{engine="0",model_name="fake"}} {me.behaviour.waiting}\n'
                'vllm:kv_cache_usage_perc{engine="0",model_name="fake"} 0.25\n')

        @app.post("/tokenize")
        async def tokenize(request: Request) -> Any:
            body = await request.json()
            me.tokenize_calls += 1
            text = body.get("prompt") if "prompt" in body else json.dumps(body.get("messages"))
            return {"count": len(str(text).split()), "max_model_len": 4096, "tokens": []}

        return app

    def start(self) -> FakeInstance:
        self._server, self._thread, url = serve_app_in_thread(self.app(), lifespan="off", what="fake instance")
        self.port = int(url.rsplit(":", 1)[1])
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)


def serve_app_in_thread(app: Any, lifespan: str = "auto",
                        what: str = "gateway") -> tuple[uvicorn.Server, threading.Thread, str]:
    """Run an ASGI app with uvicorn on a free loopback port; return (server, thread, url).
    Raises RuntimeError if it does not serve (:func:`wait_until_serving`)."""
    sock = bound_loopback_socket()
    port = int(sock.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan=lifespan))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until_serving(server, thread, what)
    return server, thread, f"http://127.0.0.1:{port}"


def bound_loopback_socket() -> socket.socket:
    """A TCP socket already bound to a free loopback port, for uvicorn's ``sockets=``.

    Binding here, rather than picking a free port number and letting uvicorn bind it
    later, leaves no window in which another process (vLLM and NIXL open many
    ephemeral ports during the e2e tier) can take the port.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def wait_until_serving(server: uvicorn.Server, thread: threading.Thread, what: str,
                       timeout_s: float = 60.0) -> None:
    """Block until ``server`` (run by ``thread``) listens.

    Raises RuntimeError at once if the thread exits first (startup failed), or after
    ``timeout_s`` seconds. The limit is generous: on a loaded CI host (real vLLM
    servers computing beside the tests) a thread can wait many seconds for the GIL
    and the CPU; the earlier 10 s limit failed a CI run.
    """
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"{what} exited during startup (see the log above)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start in {timeout_s:.0f} s")
        time.sleep(0.01)


# -- fixed fleet snapshots for policy unit tests ------------------------------

def snapshot_fleet(n_prefill: int = 2, n_decode: int = 2, pools: dict[str, Any] | None = None,
                   pool_of: dict[str, str] | None = None) -> Any:
    """A :class:`pdgate.fleet.Fleet` of ``p0..`` / ``d0..`` instances (no servers)."""
    from pdgate.config import PoolRange
    from pdgate.fleet import Fleet, Instance

    pool_of = pool_of or {}
    insts = [Instance(url=f"http://p{i}:1", role="prefill", pool=pool_of.get(f"p{i}"))
             for i in range(n_prefill)]
    insts += [Instance(url=f"http://d{i}:1", role="decode", pool=pool_of.get(f"d{i}"))
              for i in range(n_decode)]
    return Fleet(insts, {k: PoolRange.model_validate(v) for k, v in (pools or {}).items()})


def route_context(fleet: Any, prefill_policy: str = "least_load", decode_policy: str = "least_load",
                  **cfg: Any) -> Any:
    """A :class:`pdgate.policies.RouteContext` over ``fleet`` with a config built from ``cfg``."""
    from pdgate.config import GatewayConfig
    from pdgate.policies import RouteContext, create_policy
    from pdgate.predictor import LatencyPredictor

    config = GatewayConfig(decode=["http://unused:1"], **cfg)
    return RouteContext(fleet, create_policy(prefill_policy, config=config),
                        create_policy(decode_policy, config=config),
                        LatencyPredictor.from_config(config.predictor), config)


def request(tokens: int, rid: str = "r", prompt: Any = None, **kw: Any) -> Any:
    """A :class:`pdgate.policies.RequestInfo` of ``tokens`` prompt tokens."""
    from pdgate.policies import RequestInfo

    body = {"model": "m", "prompt": prompt if prompt is not None else [7] * tokens, "max_tokens": 16}
    return RequestInfo(request_id=rid, endpoint="completions", body=body, prompt_tokens=tokens, **kw)
