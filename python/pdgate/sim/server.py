"""The vLLM-compatible HTTP surface of one simulated instance.

Endpoints (as vLLM 0.32's OpenAI server): ``POST /v1/completions``,
``POST /v1/chat/completions`` (SSE streaming or JSON; ``max_tokens``,
``ignore_eos``, ``priority``, ``stream_options.include_usage``,
``return_token_ids``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``,
``GET /version``.

Fault injection (tests, the reliability report): ``POST /sim/fault`` with
``{"mode": M, "status": 500, "after_tokens": 1, "count": null}`` makes the
next ``count`` completion requests (all, if ``null``) fail as mode ``M``:
``crash`` (connection closed without an answer), ``hang`` (no answer until
the client leaves), ``status`` (an error answer with ``status``),
``no_kv_params`` (a prefill answers without ``kv_transfer_params``),
``lose_kv`` (a prefill answers, then its KV blocks are gone before the
decode side reads them), ``crash_mid_stream`` (the stream breaks after
``after_tokens`` tokens); ``down`` closes every connection (``/health``
too) until cleared with ``{"mode": null}``.

P/D handshake (NixlConnector protocol, see ../shared/FIELD_NOTES.md): a
request whose ``kv_transfer_params.do_remote_decode`` is true is a prefill
leg; it answers with ``kv_transfer_params`` (``do_remote_prefill``,
``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``, ...) and
keeps its blocks until the decode side reads them. A request carrying
``do_remote_prefill`` params waits for the modeled transfer, then decodes;
one without them computes its prompt locally.

Prompts: token id lists are used as given (block hashes of the ids drive
prefix caching, so Mooncake ``hash_ids`` replays share prefixes); text is
"tokenized" as one token per whitespace-separated word (no tokenizer is
loaded; :class:`SimTokenizer` gives clients the same rule).
Generated tokens are synthetic (``" t<id>"``); generation always runs to
``max_tokens`` (the simulator never samples EOS).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import time
import zlib
from typing import Any, AsyncIterator

from pdgate.sim.blocks import block_hashes
from pdgate.sim.engine import SimEngine
from pdgate.sim.http import Conn, DropConnection, HttpRequest, Response, StreamResponse, json_response
from pdgate.sim.scheduler import SimRequest, Status

_ids = itertools.count()

FAULT_MODES = ("crash", "hang", "status", "no_kv_params", "lose_kv", "crash_mid_stream", "down")


def _word_id(w: str) -> int:
    if w[:1] == "w" and w[1:].isdigit() and len(w) < 12:
        return int(w[1:])
    return zlib.crc32(w.encode()) | (1 << 32)  # never equal to a "w<n>" id


def text_token_ids(text: str) -> list[int]:
    """Pseudo-tokenization: one token per whitespace-separated word (deterministic).

    ``"w<n>"`` words are token ``n`` (so :class:`SimTokenizer` round-trips);
    other words get a CRC32-based id.
    """
    return [_word_id(w) for w in text.split()]


class SimTokenizer:
    """The simulator's tokenizer for clients that synthesize text prompts
    (:class:`pdgate.bench.prompts.PromptSynthesizer` text mode): token ``n``
    is the word ``"w<n>"``, so routers that look at prompt text (e.g.
    vllm-router ``cache_aware``) see equal text for equal token prefixes."""

    def __init__(self, vocab_size: int = 32000) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [i % self.vocab_size if i >= (1 << 32) else i for i in text_token_ids(text)]

    def decode(self, ids: list[int], **_: Any) -> str:
        return " ".join(f"w{i}" for i in ids)


def chat_token_ids(messages: Any) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            raise ValueError("each message must be an object")
        content = m.get("content", "")
        if isinstance(content, list):
            content = "".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
        parts.append(f"<|{m.get('role', 'user')}|>{content}\n")
    parts.append("<|assistant|>")
    return text_token_ids("".join(parts))


def _error(msg: str, status: int = 400, kind: str = "BadRequestError") -> Response:
    return json_response({"error": {"message": msg, "type": kind, "param": None, "code": status},
                          "object": "error", "message": msg, "type": kind, "code": status}, status)


class SimInstance:
    """HTTP front of one :class:`SimEngine`.

    Args:
        engine: the engine.
        model: served model name.
        role: ``prefill``, ``decode`` or ``both`` (informational; any
            instance honours any P/D params, as a vLLM ``kv_both`` instance).
        host / port: where it listens (filled in by :class:`SimFleet`).

    Attributes:
        requests_total: completion/chat requests accepted.
        request_ids: ``X-Request-Id`` header -> times a request carrying it
            was accepted (``""`` for none; tests check which gateway leg
            reached which instance).
    """

    def __init__(self, engine: SimEngine, model: str, role: str = "both", host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.engine = engine
        self.model = model
        self.role = role
        self.host = host
        self.port = port
        self.unknown_paths: dict[str, int] = {}
        self.requests_total = 0
        self.request_ids: collections.Counter[str] = collections.Counter()
        self.fault: dict[str, Any] | None = None
        self.faults_injected = 0

    def set_fault(self, mode: str | None, status: int = 500, after_tokens: int = 1,
                  count: int | None = None) -> None:
        """Inject a fault (see module doc); ``mode=None`` clears it.

        Raises:
            ValueError: unknown mode.
        """
        if mode is None:
            self.fault = None
            return
        if mode not in FAULT_MODES:
            raise ValueError(f"unknown fault mode {mode!r}; known: {FAULT_MODES}")
        self.fault = {"mode": mode, "status": int(status), "after_tokens": int(after_tokens), "count": count}

    def _take_fault(self) -> dict[str, Any] | None:
        f = self.fault
        if f is None:
            return None
        if f["count"] is not None:
            if f["count"] <= 0:
                self.fault = None
                return None
            f["count"] -= 1
        self.faults_injected += 1
        return f

    async def _hang(self, conn: Conn) -> None:
        gone = asyncio.get_running_loop().create_future()

        def left() -> None:
            if not gone.done():
                gone.set_result(None)

        conn.on_disconnect(left)
        await gone
        raise DropConnection("client left a hanging request")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def handle(self, req: HttpRequest, conn: Conn) -> Response | StreamResponse:
        path = req.path
        if req.method == "POST" and path == "/sim/fault":
            try:
                spec = req.json()
                self.set_fault(spec.get("mode"), spec.get("status", 500), spec.get("after_tokens", 1),
                               spec.get("count"))
            except (ValueError, TypeError, AttributeError) as e:
                return _error(str(e))
            return json_response({"fault": self.fault})
        if self.fault is not None and self.fault["mode"] == "down":
            raise DropConnection("instance down (fault injection)")
        if req.method == "GET":
            if path == "/health":
                return Response(200, b"", "application/json")
            if path == "/metrics":
                p = self.engine
                text = p.metrics.render(p.sched, self.model, p.engine_id, p.clock.time_scale)
                return Response(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")
            if path == "/v1/models":
                return json_response({"object": "list", "data": [{
                    "id": self.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                    "root": self.model, "parent": None,
                    "max_model_len": self.engine.profile.max_model_len}]})
            if path == "/get_load":  # SGLang/vllm-router power_of_two load probe
                s = self.engine.sched
                return json_response({"load": s.num_running + s.num_waiting, "num_reqs": s.num_running,
                                      "num_waiting_reqs": s.num_waiting,
                                      "num_tokens": sum(r.num_tokens for r in s.running)})
            if path == "/version":
                return json_response({"version": "0.32.0+pdgate-sim"})
        if req.method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            return await self._complete(req, conn, chat=path.endswith("chat/completions"))
        self.unknown_paths[f"{req.method} {path}"] = self.unknown_paths.get(f"{req.method} {path}", 0) + 1
        return _error(f"{req.method} {path} not found", 404, "NotFoundError")

    def _parse(self, body: Any, chat: bool) -> tuple[list[int], int]:
        if not isinstance(body, dict):
            raise ValueError("request body must be a JSON object")
        if chat:
            ids = chat_token_ids(body.get("messages"))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = text_token_ids(prompt)
            elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                ids = list(prompt)
            else:
                raise ValueError("prompt must be a string or a list of token ids (one prompt per request)")
        if not ids:
            raise ValueError("prompt is empty")
        limit = self.engine.profile.max_model_len
        mt = body.get("max_completion_tokens") if chat else None
        mt = body.get("max_tokens") if mt is None else mt
        if mt is None:
            mt = limit - len(ids)
        if not isinstance(mt, int) or mt < 1:
            raise ValueError("max_tokens must be a positive integer")
        if len(ids) + mt > limit:
            raise ValueError(f"This model's maximum context length is {limit} tokens. However, you requested "
                             f"{len(ids) + mt} tokens ({len(ids)} in the messages, {mt} in the completion).")
        return ids, mt

    async def _complete(self, http_req: HttpRequest, conn: Conn, chat: bool) -> Response | StreamResponse:
        fault = self._take_fault()
        mode = fault["mode"] if fault else None
        if mode == "crash":
            raise DropConnection("instance crashed before answering (fault injection)")
        if mode == "hang":
            await self._hang(conn)
        if mode == "status":
            assert fault is not None
            return _error("injected failure", fault["status"], "InternalServerError")
        try:
            body = http_req.json()
            ids, max_tokens = self._parse(body, chat)
        except (ValueError, TypeError) as e:
            return _error(str(e))
        model = body.get("model") or self.model
        if model != self.model:
            return _error(f"The model `{model}` does not exist.", 404, "NotFoundError")
        priority = body.get("priority", 0) or 0
        if not isinstance(priority, int):
            return _error("priority must be an integer")
        if priority != 0 and self.engine.sched.policy != "priority":
            return _error("Priority scheduling is not enabled.")
        kvp = body.get("kv_transfer_params") if isinstance(body.get("kv_transfer_params"), dict) else {}
        producer = bool(kvp.get("do_remote_decode"))
        consumer = kvp if kvp.get("do_remote_prefill") and kvp.get("remote_engine_id") else None
        self.requests_total += 1
        self.request_ids[http_req.headers.get("x-request-id", "")] += 1
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{http_req.headers.get('x-request-id', 'sim')}-{next(_ids)}"
        bs = self.engine.profile.block_size
        sreq = SimRequest(rid, len(ids), max_tokens, block_hashes=block_hashes(ids, bs), priority=priority,
                          do_remote_decode=producer, remote_prefill=consumer,
                          output_seed=zlib.crc32(str(ids).encode()))
        ev = _Signal()
        sreq.on_token = ev.fire
        self.engine.submit(sreq)
        engine = self.engine
        conn.on_disconnect(lambda: engine.abort(sreq))
        return_ids = bool(body.get("return_token_ids"))
        created = int(time.time())
        if body.get("stream"):
            so = body.get("stream_options") or {}
            break_after = fault["after_tokens"] if mode == "crash_mid_stream" and fault else None
            return StreamResponse(self._stream(sreq, ev, chat, model, created, bool(so.get("include_usage")),
                                               return_ids, break_after))
        while sreq.status not in (Status.FINISHED, Status.HELD, Status.ABORTED):
            await ev.wait()
        if sreq.status == Status.ABORTED:
            return _error("request aborted", 500, "InternalServerError")
        toks = [self._token_id(sreq, i) for i in range(sreq.num_output)]
        text = "".join(f" t{t}" for t in toks)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": sreq.finish_reason,
                                  "stop_reason": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if return_ids:
            choice["token_ids"] = toks
        out: dict[str, Any] = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                               "created": created, "model": model, "choices": [choice],
                               "usage": self._usage(sreq)}
        if producer and mode != "no_kv_params":
            out["kv_transfer_params"] = self._kv_params(sreq)
            if mode == "lose_kv":  # crashed after answering: the held blocks are gone
                self.engine.release_held(sreq.request_id)
        return json_response(out)

    def _token_id(self, req: SimRequest, i: int) -> int:
        return (hash((req.output_seed, i)) & 0x7FFFFFFF) % self.engine.profile.vocab_size

    def _usage(self, req: SimRequest) -> dict[str, Any]:
        return {"prompt_tokens": req.prompt_len, "total_tokens": req.prompt_len + req.num_output,
                "completion_tokens": req.num_output,
                "prompt_tokens_details": {"cached_tokens": max(0, req.num_cached_tokens)}}

    def _kv_params(self, req: SimRequest) -> dict[str, Any]:
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [list(req.blocks)],
                "remote_engine_id": self.engine.engine_id, "remote_request_id": req.request_id,
                "remote_host": self.host, "remote_port": self.port, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
                "remote_num_tokens": req.prompt_len, "transfer_mode": "pull",
                "remote_blocks_expiry_time": time.time() + self.engine.profile.kv_hold_timeout_s / max(
                    1e-9, self.engine.clock.time_scale),
                "remote_prefill_cached_tokens": max(0, req.num_cached_tokens)}

    async def _stream(self, req: SimRequest, ev: "_Signal", chat: bool, model: str, created: int,
                      include_usage: bool, return_ids: bool,
                      break_after: int | None = None) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = f'data: {{"id":"{req.request_id}","object":"{obj}","created":{created},"model":{json.dumps(model)},'
        sent = 0
        try:
            while True:
                done = req.status in (Status.FINISHED, Status.HELD, Status.ABORTED)
                n = req.num_output
                if req.status == Status.ABORTED:
                    return
                if break_after is not None and n >= break_after:
                    n = break_after
                if n > sent:
                    parts = []
                    for i in range(sent, n):
                        tid = self._token_id(req, i)
                        fin = json.dumps(req.finish_reason) if (done and i == n - 1) else "null"
                        extra = f',"token_ids":[{tid}]' if return_ids else ""
                        if chat:
                            role = '"role":"assistant",' if i == 0 else ""
                            delta = f'"delta":{{{role}"content":" t{tid}"}}'
                            parts.append(f'{head}"choices":[{{"index":0,{delta},"logprobs":null,'
                                         f'"finish_reason":{fin}{extra}}}]}}\n\n')
                        else:
                            parts.append(f'{head}"choices":[{{"index":0,"text":" t{tid}","logprobs":null,'
                                         f'"finish_reason":{fin},"stop_reason":null{extra}}}]}}\n\n')
                    sent = n
                    yield "".join(parts).encode()
                if break_after is not None and sent >= break_after:
                    raise DropConnection("instance crashed mid-stream (fault injection)")
                if done:
                    break
                await ev.wait()
            if include_usage:
                yield f'{head}"choices":[],"usage":{json.dumps(self._usage(req))}}}\n\n'.encode()
            yield b"data: [DONE]\n\n"
        finally:
            if req.status not in (Status.FINISHED, Status.HELD, Status.ABORTED):
                self.engine.abort(req)


class _Signal:
    """A sticky, re-armable wake-up for one request's handler (cheaper than a Queue):
    a ``fire`` with nobody waiting makes the next ``wait`` return at once."""

    __slots__ = ("_fut", "_pending")

    def __init__(self) -> None:
        self._fut: asyncio.Future[None] | None = None
        self._pending = False

    def fire(self, _req: SimRequest, _now: float) -> None:
        f = self._fut
        if f is not None and not f.done():
            f.set_result(None)
        else:
            self._pending = True

    async def wait(self) -> None:
        if self._pending:
            self._pending = False
            return
        self._fut = asyncio.get_running_loop().create_future()
        try:
            await self._fut
        finally:
            self._fut = None
