"""Production request traces: loading, windowing, scaling and prompt synthesis.

Two trace formats are supported (see ``shared/traces/README.md``):

* Azure LLM inference trace 2023 (``.csv``): ``TIMESTAMP`` (wall clock with
  7 fractional digits), ``ContextTokens``, ``GeneratedTokens``.
* Mooncake FAST'25 trace (``.jsonl``): ``timestamp`` (ms), ``input_length``,
  ``output_length``, ``hash_ids`` (one id per 512-token prompt block).
  Timestamps are quantized to ~3 s slots; :func:`load_mooncake_jsonl` spreads
  the requests of a slot uniformly inside it (deterministically, per ``seed``)
  so that a replay does not send artificial bursts.

:func:`make_plan` windows, time-scales and caps a trace into a
:class:`ReplayPlan`, whose ``describe()`` line must be printed next to every
result. :mod:`pdgate.bench.prompts` makes prompts of the traced token counts.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as _dt
import hashlib
import json
import os
import statistics
from typing import Any

MOONCAKE_BLOCK_TOKENS = 512
"""Prompt tokens covered by one Mooncake ``hash_id``."""


@dataclasses.dataclass
class TraceRequest:
    """One request of a trace.

    Attributes:
        arrival_s: arrival time in seconds (trace time after loading; relative
            to the window start and multiplied by the time scale in a plan).
        prompt_tokens: prompt length in tokens (after caps, in a plan).
        output_tokens: output length in tokens, sent as ``max_tokens``.
        hash_ids: Mooncake prefix-block ids (one per 512 prompt tokens), or None.
        index: row index in the trace file (0-based); seeds prompt synthesis.
        orig_prompt_tokens: prompt length in the trace, before any cap.
        orig_output_tokens: output length in the trace, before any cap.
    """

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: list[int] | None = None
    index: int = 0
    orig_prompt_tokens: int = 0
    orig_output_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.orig_prompt_tokens:
            self.orig_prompt_tokens = self.prompt_tokens
        if not self.orig_output_tokens:
            self.orig_output_tokens = self.output_tokens


@dataclasses.dataclass
class LoadedTrace:
    """A whole (or first-N-rows) trace, arrivals in seconds from the first row.

    Attributes:
        name: file name of the trace.
        format: ``"azure"`` or ``"mooncake"``.
        requests: requests sorted by arrival.
        notes: how arrivals were derived (e.g. Mooncake slot spreading).
    """

    name: str
    format: str
    requests: list[TraceRequest]
    notes: list[str] = dataclasses.field(default_factory=list)


def _parse_azure_timestamp(text: str) -> float:
    """Seconds since the epoch (naive, UTC assumed) of ``2023-11-16 18:17:03.9799600``.

    Parsed by hand because the trace has 7 fractional digits (100 ns), more
    than ``datetime`` keeps.
    """
    text = text.strip()
    base, _, frac = text.partition(".")
    whole = _dt.datetime.fromisoformat(base).replace(tzinfo=_dt.timezone.utc)
    return whole.timestamp() + (float("0." + frac) if frac else 0.0)


def load_azure_csv(path: str | os.PathLike[str], limit_rows: int | None = None) -> LoadedTrace:
    """Load the Azure 2023 trace (CSV). Arrivals are seconds after the first row.

    Args:
        path: CSV file with ``TIMESTAMP,ContextTokens,GeneratedTokens``.
        limit_rows: read only the first N data rows (for tests / quick runs).
    """
    requests: list[TraceRequest] = []
    t0: float | None = None
    with open(path, newline="") as f:
        for i, row in enumerate(csv.DictReader(f)):
            if limit_rows is not None and i >= limit_rows:
                break
            t = _parse_azure_timestamp(row["TIMESTAMP"])
            if t0 is None:
                t0 = t
            requests.append(
                TraceRequest(
                    arrival_s=round(t - t0, 7),
                    prompt_tokens=int(row["ContextTokens"]),
                    output_tokens=int(row["GeneratedTokens"]),
                    index=i,
                )
            )
    requests.sort(key=lambda r: (r.arrival_s, r.index))
    return LoadedTrace(os.path.basename(os.fspath(path)), "azure", requests)


def _unit(*key: object) -> float:
    """Deterministic pseudo-random number in [0, 1) from ``key`` (BLAKE2b)."""
    h = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2.0**64


def _slot_offset(seed: int, index: int, slot_s: float) -> float:
    """Deterministic uniform offset in [0, slot_s) for trace row ``index``."""
    return _unit("slot", seed, index) * slot_s


def load_mooncake_jsonl(
    path: str | os.PathLike[str],
    limit_rows: int | None = None,
    *,
    spread_slots: bool = True,
    slot_s: float | None = None,
    seed: int = 0,
) -> LoadedTrace:
    """Load the Mooncake FAST'25 trace (JSONL). Arrivals are seconds after row 0.

    Timestamps in this trace are quantized to ~3 s slots (up to 28 requests
    share one). With ``spread_slots`` each request gets ``slot start + U[0,
    slot_s)``, drawn from a generator seeded by ``(seed, row index)`` so the
    result does not depend on ``limit_rows`` or on other rows.

    Args:
        path: JSONL file with ``timestamp`` (ms), ``input_length``,
            ``output_length``, ``hash_ids``.
        limit_rows: read only the first N rows.
        spread_slots: spread arrivals inside their slot (recommended).
        slot_s: slot width in seconds; default: the median gap between
            consecutive distinct timestamps (3.0 s for the released trace).
        seed: seed of the spreading.
    """
    rows: list[dict[str, Any]] = []
    with open(path) as f:
        for line in f:
            if limit_rows is not None and len(rows) >= limit_rows:
                break
            if line.strip():
                rows.append(json.loads(line))
    stamps = sorted({float(r["timestamp"]) / 1000.0 for r in rows})
    if slot_s is None:
        gaps = [b - a for a, b in zip(stamps, stamps[1:]) if b > a]
        slot_s = statistics.median(gaps) if gaps else 0.0
    t0 = stamps[0] if stamps else 0.0
    notes: list[str] = []
    requests = []
    for i, r in enumerate(rows):
        t = float(r["timestamp"]) / 1000.0 - t0
        if spread_slots and slot_s > 0:
            t += _slot_offset(seed, i, slot_s)
        requests.append(
            TraceRequest(
                arrival_s=t,
                prompt_tokens=int(r["input_length"]),
                output_tokens=int(r["output_length"]),
                hash_ids=[int(h) for h in r.get("hash_ids", [])],
                index=i,
            )
        )
    requests.sort(key=lambda q: (q.arrival_s, q.index))
    if spread_slots and slot_s > 0:
        notes.append(f"arrivals spread uniformly in {slot_s:g} s slots (seed {seed})")
    else:
        notes.append("arrivals at quantized slot timestamps (bursty)")
    return LoadedTrace(os.path.basename(os.fspath(path)), "mooncake", requests, notes)


def detect_format(path: str | os.PathLike[str]) -> str:
    """``"azure"`` for ``.csv``, ``"mooncake"`` for ``.jsonl``/``.json``."""
    p = os.fspath(path).lower()
    if p.endswith(".csv"):
        return "azure"
    if p.endswith(".jsonl") or p.endswith(".json"):
        return "mooncake"
    raise ValueError(f"cannot tell trace format from extension: {path}")


def load_trace(
    path: str | os.PathLike[str], fmt: str | None = None, limit_rows: int | None = None, seed: int = 0
) -> LoadedTrace:
    """Load a trace, format by extension unless ``fmt`` is given."""
    fmt = fmt or detect_format(path)
    if fmt == "azure":
        return load_azure_csv(path, limit_rows)
    if fmt == "mooncake":
        return load_mooncake_jsonl(path, limit_rows, seed=seed)
    raise ValueError(f"unknown trace format {fmt!r}")


@dataclasses.dataclass
class ReplayPlan:
    """The requests to replay plus how the trace was windowed and scaled.

    Attributes:
        trace_name: trace file name.
        trace_format: ``"azure"`` or ``"mooncake"``.
        requests: requests; ``arrival_s`` is seconds after the replay start
            (window start, times ``time_scale``).
        start_s: window start in trace seconds.
        duration_s: window length in trace seconds (None: up to the end or
            ``max_requests``).
        max_requests: request cap of the window (None: none).
        time_scale: factor on inter-arrival gaps (2.0 = twice slower).
        max_prompt_tokens / max_output_tokens: caps (None: none).
        n_prompt_capped / n_output_capped: how many requests the caps changed.
        trace_rows: requests in the loaded trace.
        truncated: ``max_requests`` ended the window before ``duration_s``.
        notes: further notes (slot spreading, ...).
    """

    trace_name: str
    trace_format: str
    requests: list[TraceRequest]
    start_s: float = 0.0
    duration_s: float | None = None
    max_requests: int | None = None
    time_scale: float = 1.0
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    n_prompt_capped: int = 0
    n_output_capped: int = 0
    trace_rows: int = 0
    truncated: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def window_trace_s(self) -> float:
        """Window length in trace seconds: ``duration_s``, or the last arrival
        when no duration was set or ``max_requests`` ended the window early."""
        if self.duration_s is not None and not self.truncated:
            return self.duration_s
        if not self.requests:
            return 0.0
        return self.requests[-1].arrival_s / self.time_scale

    @property
    def window_replay_s(self) -> float:
        """Window length in replay (wall-clock) seconds."""
        return self.window_trace_s * self.time_scale

    def offered_rate(self) -> float:
        """Offered load in requests per wall-clock second (0 if undefined)."""
        w = self.window_replay_s
        return len(self.requests) / w if w > 0 else 0.0

    def scaling_dict(self) -> dict[str, Any]:
        """Machine-readable scaling parameters (for JSON reports)."""
        return {
            "trace": self.trace_name,
            "format": self.trace_format,
            "trace_rows": self.trace_rows,
            "window_start_s": self.start_s,
            "window_duration_s": self.duration_s,
            "window_trace_s": self.window_trace_s,
            "window_replay_s": self.window_replay_s,
            "max_requests": self.max_requests,
            "requests": len(self.requests),
            "time_scale": self.time_scale,
            "offered_rate_rps": self.offered_rate(),
            "max_prompt_tokens": self.max_prompt_tokens,
            "max_output_tokens": self.max_output_tokens,
            "prompt_capped": self.n_prompt_capped,
            "output_capped": self.n_output_capped,
            "total_prompt_tokens": sum(r.prompt_tokens for r in self.requests),
            "total_output_tokens": sum(r.output_tokens for r in self.requests),
            "notes": list(self.notes),
        }

    def describe(self) -> str:
        """One line stating how the trace was scaled; print it with every result."""
        n = len(self.requests)
        end = f"{self.start_s + self.duration_s:g}" if self.duration_s is not None else "end"
        parts = [
            f"trace {self.trace_name} ({self.trace_format})",
            f"window [{self.start_s:g}, {end}) s of trace time"
            + (f", first {self.max_requests} requests" if self.max_requests is not None else ""),
            f"{n} of {self.trace_rows} requests",
            f"time scale x{self.time_scale:g} on inter-arrival gaps"
            + (" (slower)" if self.time_scale > 1 else " (faster)" if self.time_scale < 1 else " (real time)"),
            f"offered {self.offered_rate():.3g} req/s over a {self.window_replay_s:.4g} s window"
            + (f" (last arrival at {self.requests[-1].arrival_s:.4g} s)"
               if self.requests and self.requests[-1].arrival_s < 0.95 * self.window_replay_s else ""),
        ]
        for what, cap, k in (("prompt", self.max_prompt_tokens, self.n_prompt_capped),
                             ("output", self.max_output_tokens, self.n_output_capped)):
            parts.append(f"{what} cap {cap} tok ({k}/{n} capped)" if cap is not None else f"{what} lengths as traced")
        parts.extend(self.notes)
        return "; ".join(parts)


def make_plan(
    trace: LoadedTrace,
    *,
    start_s: float = 0.0,
    duration_s: float | None = None,
    max_requests: int | None = None,
    time_scale: float = 1.0,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
) -> ReplayPlan:
    """Cut a window out of a trace, scale its arrivals and cap token lengths.

    The window holds requests with ``start_s <= arrival < start_s +
    duration_s`` (trace seconds), then the first ``max_requests`` of them.
    Replay arrival = ``(arrival - start_s) * time_scale``, i.e. every
    inter-arrival gap is multiplied by ``time_scale``. Caps clamp
    ``prompt_tokens``/``output_tokens`` (and truncate ``hash_ids`` to the
    blocks the capped prompt still covers); lengths below 1 are raised to 1.
    """
    if time_scale <= 0:
        raise ValueError("time_scale must be > 0")
    for name, cap in (("max_prompt_tokens", max_prompt_tokens), ("max_output_tokens", max_output_tokens)):
        if cap is not None and cap < 1:
            raise ValueError(f"{name} must be >= 1")
    end = start_s + duration_s if duration_s is not None else float("inf")
    picked = [r for r in trace.requests if start_s <= r.arrival_s < end]
    truncated = max_requests is not None and len(picked) > max_requests
    if max_requests is not None:
        picked = picked[:max_requests]
    out: list[TraceRequest] = []
    n_pc = n_oc = 0
    for r in picked:
        p = max(1, r.prompt_tokens)
        o = max(1, r.output_tokens)
        if max_prompt_tokens is not None and p > max_prompt_tokens:
            p, n_pc = max_prompt_tokens, n_pc + 1
        if max_output_tokens is not None and o > max_output_tokens:
            o, n_oc = max_output_tokens, n_oc + 1
        hashes = None
        if r.hash_ids is not None:
            nblocks = -(-p // MOONCAKE_BLOCK_TOKENS)
            hashes = list(r.hash_ids[:nblocks])
        out.append(
            TraceRequest(
                arrival_s=(r.arrival_s - start_s) * time_scale,
                prompt_tokens=p,
                output_tokens=o,
                hash_ids=hashes,
                index=r.index,
                orig_prompt_tokens=r.orig_prompt_tokens,
                orig_output_tokens=r.orig_output_tokens,
            )
        )
    return ReplayPlan(
        trace_name=trace.name,
        trace_format=trace.format,
        requests=out,
        start_s=start_s,
        duration_s=duration_s,
        max_requests=max_requests,
        time_scale=time_scale,
        max_prompt_tokens=max_prompt_tokens,
        max_output_tokens=max_output_tokens,
        n_prompt_capped=n_pc,
        n_output_capped=n_oc,
        trace_rows=len(trace.requests),
        truncated=truncated,
        notes=list(trace.notes),
    )


def load_plan(path: str | os.PathLike[str], *, fmt: str | None = None, seed: int = 0, **window: Any) -> ReplayPlan:
    """:func:`load_trace` then :func:`make_plan` (keyword args as in make_plan)."""
    return make_plan(load_trace(path, fmt, seed=seed), **window)


# --------------------------------------------------------------------------
# Prompt synthesis
# --------------------------------------------------------------------------
