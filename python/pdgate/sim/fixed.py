"""Fixed-response vLLM stand-in for gateway overhead measurements.

``python -m pdgate.sim.fixed --port N`` answers every ``POST
/v1/completions`` / ``/v1/chat/completions`` at once with a fixed JSON body
(a prefill-leg request, ``kv_transfer_params.do_remote_decode``, also gets
``kv_transfer_params`` back so the router proceeds to the decode leg), and
``GET /health``, ``/v1/models``, ``/metrics``, ``/get_load`` with constants.
A ``"stream": true`` request gets ``max_tokens`` SSE events (one chunk each,
``--itl-ms`` apart, so a router reads them one by one as it would from vLLM)
and ``data: [DONE]``. No model, no scheduling: what remains is the router's
own cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from typing import Any, AsyncIterator

from pdgate.sim.http import Conn, HttpRequest, Response, StreamResponse, start_server

_COMPLETION: dict[str, Any] = {"id": "cmpl-fixed", "object": "text_completion", "created": 0, "model": "sim-model",
               "choices": [{"index": 0, "text": " ok", "logprobs": None, "finish_reason": "length",
                            "stop_reason": None}],
               "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}}
_KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[0]],
       "remote_engine_id": "fixed", "remote_request_id": "fixed", "remote_host": "127.0.0.1", "remote_port": 1,
       "tp_size": 1}
BODY = json.dumps(_COMPLETION).encode()
PREFILL_BODY = json.dumps({**_COMPLETION, "kv_transfer_params": _KV}).encode()
MODELS = json.dumps({"object": "list", "data": [{"id": "sim-model", "object": "model", "owned_by": "vllm",
                                                 "max_model_len": 4096}]}).encode()
METRICS = (b'vllm:num_requests_running{model_name="sim-model"} 0\n'
           b'vllm:num_requests_waiting{model_name="sim-model"} 0\n'
           b'vllm:kv_cache_usage_perc{model_name="sim-model"} 0\n')


# a content chunk carries no usage (vLLM leaves the field out unless continuous usage stats are asked for)
_EVENT = b"data: " + json.dumps({k: v for k, v in _COMPLETION.items() if k != "usage"}
                                | {"choices": [{**_COMPLETION["choices"][0], "finish_reason": None}]}).encode() + b"\n\n"
_LAST = b"data: " + json.dumps(_COMPLETION).encode() + b"\n\ndata: [DONE]\n\n"
#: Seconds between two streamed tokens (``--itl-ms``).
ITL_S = 0.002


async def _tokens(n: int) -> AsyncIterator[bytes]:
    for _ in range(max(0, n - 1)):
        yield _EVENT
        await asyncio.sleep(ITL_S)
    yield _LAST


async def handle(req: HttpRequest, conn: Conn) -> Response | StreamResponse:
    if req.method == "POST":
        body = req.body.replace(b'":true', b'": true')
        if b'"do_remote_decode": true' in body:
            return Response(200, PREFILL_BODY)
        if b'"stream": true' in body:
            try:
                n = int(json.loads(req.body).get("max_tokens") or 16)
            except (ValueError, TypeError, AttributeError):
                n = 16
            return StreamResponse(_tokens(n))
        return Response(200, BODY)
    if req.path == "/v1/models":
        return Response(200, MODELS)
    if req.path == "/metrics":
        return Response(200, METRICS, "text/plain; version=0.0.4")
    if req.path == "/get_load":
        return Response(200, b'{"load": 0}')
    return Response(200, b"")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--itl-ms", type=float, default=2.0, help="milliseconds between streamed tokens")
    args = ap.parse_args()
    global ITL_S
    ITL_S = args.itl_ms / 1000.0

    async def run() -> None:
        server = await start_server(handle, args.host, args.port)
        async with server:
            await server.serve_forever()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
