"""Serving metrics of a replay, defined as vLLM's ``vllm/benchmarks/serve.py``.

Per request (``calculate_metrics`` and ``async_request_openai_completions`` in
vLLM's benchmarks; all times in seconds):

* TTFT: arrival of the first streamed chunk carrying ``choices`` minus the
  send time.
* E2EL (end-to-end latency): arrival of the *last* chunk carrying ``choices``
  minus the send time (the final usage-only chunk and ``[DONE]`` not counted).
* ITL (inter-token latency): gaps between consecutive chunks carrying
  ``choices`` (a chunk may bundle several tokens).
* TPOT (time per output token, excl. the 1st): ``(E2EL - TTFT) /
  (output_tokens - 1)`` for ``output_tokens > 1``; requests with one token
  are left out of the TPOT statistics and count as TPOT 0 for goodput.
* output tokens: ``usage.completion_tokens`` when the server sends usage,
  otherwise the number of chunks carrying ``choices``.

Aggregates: mean, median, population std and linear-interpolated percentiles
(``numpy.percentile``) over successful requests; request throughput =
completed / duration; output token throughput = sum of output tokens of
completed requests / duration; goodput = requests meeting *every* given SLO
/ duration (vLLM ``--goodput``). In addition :attr:`BenchMetrics.slo_attainment`
is the share of *all* requests (failed ones count as missing) meeting the SLOs.

SLO values: this module takes seconds. :func:`parse_slo` reads CLI strings;
a bare number is milliseconds, as vLLM's ``--goodput ttft:500``; ``s``/``ms``
suffixes are accepted (``ttft:0.5s``, ``tpot:50ms``).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

SLO_NAMES = ("ttft", "tpot", "e2el")
"""SLO keys, as vLLM's ``--goodput`` (``itl`` is not an SLO there either)."""

DEFAULT_PERCENTILES = (50.0, 90.0, 95.0, 99.0)


@dataclasses.dataclass
class RequestRecord:
    """What one replayed request did. Times are seconds on the replay clock
    (0 = replay start, ``time.perf_counter`` based).

    Attributes:
        index: position in the replay plan.
        trace_index: row of the trace file.
        scheduled_s: arrival time from the plan.
        send_s: when the HTTP request was actually issued (None: never sent).
        chunk_times_s: arrival of every SSE chunk carrying ``choices``.
        end_s: when the response ended (stream closed, error or timeout).
        prompt_tokens: prompt tokens we sent (our tokenizer count).
        server_prompt_tokens: ``usage.prompt_tokens`` (None if not reported).
        max_tokens: requested output tokens.
        usage_output_tokens: ``usage.completion_tokens`` (None if not reported).
        success: HTTP 200 and at least one chunk with ``choices``, no error.
        status: HTTP status (None if no response).
        error: error text ("" on success).
    """

    index: int = 0
    trace_index: int = 0
    scheduled_s: float = 0.0
    send_s: float | None = None
    chunk_times_s: list[float] = dataclasses.field(default_factory=list)
    end_s: float | None = None
    prompt_tokens: int = 0
    server_prompt_tokens: int | None = None
    max_tokens: int = 0
    usage_output_tokens: int | None = None
    success: bool = False
    status: int | None = None
    error: str = ""

    @property
    def output_tokens(self) -> int:
        """``usage.completion_tokens`` if reported, else the chunk count."""
        if self.usage_output_tokens is not None:
            return self.usage_output_tokens
        return len(self.chunk_times_s)

    @property
    def ttft_s(self) -> float | None:
        """Time to first token (s), None without chunks."""
        if self.send_s is None or not self.chunk_times_s:
            return None
        return self.chunk_times_s[0] - self.send_s

    @property
    def e2el_s(self) -> float | None:
        """End-to-end latency (s): last content chunk minus send (vLLM's ``latency``)."""
        if self.send_s is None or not self.chunk_times_s:
            return None
        return self.chunk_times_s[-1] - self.send_s

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies (s): gaps between consecutive content chunks."""
        c = self.chunk_times_s
        return [b - a for a, b in zip(c, c[1:])]

    @property
    def tpot_s(self) -> float | None:
        """``(E2EL - TTFT) / (output_tokens - 1)``; None for <= 1 output token."""
        n = self.output_tokens
        ttft, e2el = self.ttft_s, self.e2el_s
        if n <= 1 or ttft is None or e2el is None:
            return None
        return (e2el - ttft) / (n - 1)

    @property
    def send_lag_s(self) -> float | None:
        """Actual send minus scheduled arrival (s): open-loop fidelity."""
        return None if self.send_s is None else self.send_s - self.scheduled_s

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict with derived TTFT/TPOT/E2EL."""
        d = dataclasses.asdict(self)
        d.update(
            output_tokens=self.output_tokens,
            ttft_s=self.ttft_s,
            tpot_s=self.tpot_s,
            e2el_s=self.e2el_s,
        )
        return d


@dataclasses.dataclass
class Distribution:
    """Summary of a sample, in the sample's unit (seconds for latencies)."""

    count: int
    mean: float
    median: float
    std: float
    max: float
    percentiles: dict[float, float]

    @classmethod
    def of(cls, values: Sequence[float], percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> Distribution:
        """Summary of ``values``; all zeros when empty (as vLLM's ``values or 0``)."""
        a = np.asarray(values if len(values) else [0.0], dtype=float)
        return cls(
            count=len(values),
            mean=float(np.mean(a)),
            median=float(np.median(a)),
            std=float(np.std(a)),
            max=float(np.max(a)),
            percentiles={float(p): float(np.percentile(a, p)) for p in percentiles},
        )

    def to_dict(self, scale: float = 1.0, unit: str = "") -> dict[str, Any]:
        """Dict with values multiplied by ``scale`` and keys suffixed by ``unit``."""
        sfx = f"_{unit}" if unit else ""
        d: dict[str, Any] = {"count": self.count}
        for k in ("mean", "median", "std", "max"):
            d[k + sfx] = getattr(self, k) * scale
        for p, v in self.percentiles.items():
            d[f"p{p:g}{sfx}"] = v * scale
        return d


@dataclasses.dataclass
class BenchMetrics:
    """Aggregate metrics of a replay (seconds, tokens, per second).

    Attributes:
        total: requests in the replay (sent or not).
        completed / failed: successful / failed requests.
        duration_s: replay duration (start to the last response end).
        total_input_tokens: prompt tokens of completed requests (server count
            when reported).
        total_output_tokens: output tokens of completed requests.
        request_throughput: completed / duration (req/s).
        output_throughput: output tokens / duration (tok/s).
        total_token_throughput: (input + output tokens) / duration (tok/s).
        ttft / tpot / itl / e2el: distributions in seconds.
        send_lag: distribution of actual-minus-scheduled send time (s).
        slos: SLOs in seconds, by name (empty: goodput not computed).
        good: requests meeting all SLOs.
        request_goodput: good / duration (req/s), None without SLOs.
        slo_attainment: good / total, None without SLOs.
        errors: error text -> count (failed requests).
    """

    total: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    send_lag: Distribution
    slos: dict[str, float]
    good: int
    request_goodput: float | None
    slo_attainment: float | None
    errors: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict; latencies in milliseconds (``*_ms`` keys)."""
        return {
            "total_requests": self.total,
            "completed": self.completed,
            "failed": self.failed,
            "duration_s": self.duration_s,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput_rps": self.request_throughput,
            "output_throughput_tps": self.output_throughput,
            "total_token_throughput_tps": self.total_token_throughput,
            "ttft": self.ttft.to_dict(1000.0, "ms"),
            "tpot": self.tpot.to_dict(1000.0, "ms"),
            "itl": self.itl.to_dict(1000.0, "ms"),
            "e2el": self.e2el.to_dict(1000.0, "ms"),
            "send_lag": self.send_lag.to_dict(1000.0, "ms"),
            "slos_ms": {k: v * 1000.0 for k, v in self.slos.items()},
            "good_requests": self.good if self.slos else None,
            "request_goodput_rps": self.request_goodput,
            "slo_attainment": self.slo_attainment,
            "errors": dict(self.errors),
        }


def parse_slo(spec: str) -> tuple[str, float]:
    """Parse ``NAME:VALUE[s|ms]`` into ``(name, seconds)``.

    A bare VALUE is milliseconds (vLLM ``--goodput`` convention): ``ttft:500``
    = 0.5 s; ``ttft:0.5s`` and ``tpot:50ms`` are explicit. NAME is one of
    ``ttft``, ``tpot``, ``e2el``.
    """
    name, sep, val = spec.partition(":")
    name = name.strip().lower()
    val = val.strip().lower()
    if not sep or name not in SLO_NAMES or not val:
        raise ValueError(f"bad SLO {spec!r}: expected NAME:VALUE with NAME in {SLO_NAMES}, e.g. ttft:500")
    scale = 1e-3
    if val.endswith("ms"):
        val = val[:-2]
    elif val.endswith("s"):
        val, scale = val[:-1], 1.0
    try:
        x = float(val)
    except ValueError:
        raise ValueError(f"bad SLO value in {spec!r}") from None
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"SLO value must be > 0: {spec!r}")
    return name, x * scale


def parse_slos(specs: Iterable[str]) -> dict[str, float]:
    """Several :func:`parse_slo` strings into ``{name: seconds}``."""
    return dict(parse_slo(s) for s in specs)


def meets_slos(rec: RequestRecord, slos: dict[str, float]) -> bool:
    """True if ``rec`` succeeded and meets every SLO (seconds, ``<=`` as vLLM).

    TPOT of a one-token request counts as 0 (vLLM ``all_tpots``).
    """
    if not rec.success:
        return False
    vals = {"ttft": rec.ttft_s, "e2el": rec.e2el_s, "tpot": rec.tpot_s or 0.0}
    for name, limit in slos.items():
        v = vals[name]
        if v is None or v > limit:
            return False
    return True


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    slos: dict[str, float] | None = None,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
) -> BenchMetrics:
    """Aggregate per-request records (see module docstring for definitions).

    Args:
        records: every request of the replay, failed ones included.
        duration_s: benchmark duration in seconds (vLLM: start of the run to
            the end of the last request).
        slos: SLOs in seconds by name (``ttft``, ``tpot``, ``e2el``).
        percentiles: percentiles to report (0-100).
    """
    slos = dict(slos or {})
    for k in slos:
        if k not in SLO_NAMES:
            raise ValueError(f"unknown SLO {k!r}")
    pcts = tuple(percentiles)
    ok = [r for r in records if r.success]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2els = [r.e2el_s for r in ok if r.e2el_s is not None]
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]
    itls = [g for r in ok for g in r.itl_s]
    lags = [r.send_lag_s for r in records if r.send_lag_s is not None]
    n_in = sum(r.server_prompt_tokens if r.server_prompt_tokens is not None else r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    dur = duration_s if duration_s > 0 else float("inf")  # rates 0 for an empty run
    good = sum(1 for r in records if meets_slos(r, slos)) if slos else 0
    errors = Counter(r.error or "unknown error" for r in records if not r.success)
    return BenchMetrics(
        total=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        request_throughput=len(ok) / dur,
        output_throughput=n_out / dur,
        total_token_throughput=(n_in + n_out) / dur,
        ttft=Distribution.of(ttfts, pcts),
        tpot=Distribution.of(tpots, pcts),
        itl=Distribution.of(itls, pcts),
        e2el=Distribution.of(e2els, pcts),
        send_lag=Distribution.of(lags, pcts),
        slos=slos,
        good=good,
        request_goodput=good / dur if slos else None,
        slo_attainment=(good / len(records) if records else 0.0) if slos else None,
        errors=dict(errors.most_common()),
    )


def format_metrics_table(m: BenchMetrics, title: str = "Serving benchmark result") -> str:
    """vLLM-style text table; latencies in milliseconds."""
    w = 64
    lines = [f" {title} ".center(w, "=")]

    def row(label: str, value: Any, fmt: str = "{:.2f}") -> None:
        v = "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)
        lines.append(f"{label:<44}{v:>20}")

    row("Requests (total):", m.total, "{}")
    row("Successful requests:", m.completed, "{}")
    row("Failed requests:", m.failed, "{}")
    row("Benchmark duration (s):", m.duration_s)
    row("Total input tokens:", m.total_input_tokens, "{}")
    row("Total generated tokens:", m.total_output_tokens, "{}")
    row("Request throughput (req/s):", m.request_throughput)
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Total token throughput (tok/s):", m.total_token_throughput)
    if m.slos:
        slo = ", ".join(f"{k}<={v * 1000:g}ms" for k, v in m.slos.items())
        lines.append(f"SLOs: {slo}")
        row("Request goodput (req/s):", m.request_goodput)
        row("SLO attainment (% of all requests):", (m.slo_attainment or 0.0) * 100)
    pct_keys = list(m.ttft.percentiles)
    head = f"{'(ms)':<8}{'mean':>9}{'median':>9}" + "".join(f"{'p' + format(p, 'g'):>9}" for p in pct_keys)
    head += f"{'max':>9}{'n':>8}"
    lines.append("-" * w)
    lines.append(head)
    for name, d in (("TTFT", m.ttft), ("TPOT", m.tpot), ("ITL", m.itl), ("E2EL", m.e2el), ("lag", m.send_lag)):
        cells = [d.mean, d.median, *d.percentiles.values(), d.max]
        lines.append(f"{name:<8}" + "".join(f"{c * 1000:>9.1f}" for c in cells) + f"{d.count:>8}")
    lines.append("(lag = actual send - scheduled arrival: open-loop fidelity)")
    if m.errors:
        lines.append("-" * w)
        lines.append("Errors (count: message, up to 5):")
        for msg, c in list(m.errors.items())[:5]:
            lines.append(f"  {c}: {msg[:200]}")
    lines.append("=" * w)
    return "\n".join(lines)
