"""Prometheus metrics of a simulated instance, named and defined as vLLM's.

Rendered by hand in the Prometheus text format (one registry per instance,
several instances per process). Names and meanings follow vLLM 0.32's
``vllm/v1/metrics/loggers.py``; all times are **simulated** seconds. Extra
``pdgate_sim_*`` series describe the simulation itself.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdgate.sim.scheduler import Scheduler, SimRequest

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
LAG_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)


class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def render(self, name: str, labels: str) -> list[str]:
        out = []
        acc = 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{{labels},le="{b}"}} {acc}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out.append(f"{name}_sum{{{labels}}} {self.sum}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


class EngineMetrics:
    """Counters and histograms of one engine (simulated seconds, tokens)."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.queue = Histogram(E2E_BUCKETS)
        self.loop_lag = Histogram(LAG_BUCKETS)
        self.kv_transfer_time = Histogram(TTFT_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: dict[str, int] = {}
        self.preemptions = 0
        self.aborted = 0
        self.kv_transfers = 0
        self.kv_transfer_tokens = 0
        self.kv_load_failures = 0
        self.arrivals = 0

    def on_arrival(self, req: "SimRequest") -> None:
        self.arrivals += 1

    def on_tokens(self, req: "SimRequest", now: float) -> None:
        new = req.num_output - req.seen_output
        self.generation_tokens += new
        if req.seen_output == 0:
            self.ttft.observe(now - req.arrival_s)
        elif req.prev_token_s is not None:
            self.itl.observe(now - req.prev_token_s)

    def on_finish(self, req: "SimRequest") -> None:
        self.prompt_tokens += req.prompt_len
        self.success[req.finish_reason or "length"] = self.success.get(req.finish_reason or "length", 0) + 1
        if req.finished_s is not None:
            self.e2e.observe(req.finished_s - req.arrival_s)
        if req.first_scheduled_s is not None:
            self.queue.observe(req.first_scheduled_s - req.arrival_s)

    def render(self, sched: "Scheduler", model: str, engine: str, time_scale: float) -> str:
        """The ``/metrics`` text (Prometheus exposition format 0.0.4)."""
        lab = f'engine="{engine}",model_name="{model}"'
        L: list[str] = []

        def head(name: str, kind: str, help_: str) -> None:
            L.append(f"# HELP {name} {help_}")
            L.append(f"# TYPE {name} {kind}")

        head("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.")
        L.append(f"vllm:num_requests_running{{{lab}}} {sched.num_running}")
        head("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.")
        L.append(f"vllm:num_requests_waiting{{{lab}}} {sched.num_waiting}")
        head("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.")
        L.append(f"vllm:kv_cache_usage_perc{{{lab}}} {sched.pool.usage}")
        for name, v, h in (
            ("vllm:prefix_cache_queries_total", sched.pool.queries, "Prefix cache queries, in tokens."),
            ("vllm:prefix_cache_hits_total", sched.pool.hits, "Prefix cache hits, in tokens."),
            ("vllm:num_preemptions_total", self.preemptions, "Cumulative number of preemptions."),
            ("vllm:prompt_tokens_total", self.prompt_tokens, "Number of prefill tokens processed."),
            ("vllm:generation_tokens_total", self.generation_tokens, "Number of generation tokens processed."),
        ):
            head(name, "counter", h)
            L.append(f"{name}{{{lab}}} {float(v)}")
        head("vllm:request_success_total", "counter", "Count of successfully processed requests.")
        for reason, n in sorted(self.success.items()):
            L.append(f'vllm:request_success_total{{{lab},finished_reason="{reason}"}} {float(n)}')
        for name, hist, h in (
            ("vllm:time_to_first_token_seconds", self.ttft, "Histogram of time to first token in seconds."),
            ("vllm:inter_token_latency_seconds", self.itl, "Histogram of inter-token latency in seconds."),
            ("vllm:e2e_request_latency_seconds", self.e2e, "Histogram of e2e request latency in seconds."),
            ("vllm:request_queue_time_seconds", self.queue, "Histogram of time spent in WAITING phase."),
            ("pdgate_sim_loop_lag_seconds", self.loop_lag, "Wall lateness of simulated steps, sim seconds."),
            ("pdgate_sim_kv_transfer_seconds", self.kv_transfer_time, "Modeled KV transfer time, sim seconds."),
        ):
            head(name, "histogram", h)
            L.extend(hist.render(name, lab))
        extras: tuple[tuple[str, float, str], ...] = (
            ("pdgate_sim_time_scale", time_scale, "Simulated seconds per wall second."),
            ("pdgate_sim_kv_transfers_total", self.kv_transfers, "KV transfers into this instance."),
            ("pdgate_sim_kv_load_failures_total", self.kv_load_failures, "KV loads that fell back to recompute."),
            ("pdgate_sim_aborted_requests_total", self.aborted, "Requests aborted (client disconnect)."),
            ("pdgate_sim_held_requests", len(sched.held), "Producer requests holding blocks for a decode."),
        )
        for ename, ev, eh in extras:
            head(ename, "gauge" if "total" not in ename else "counter", eh)
            L.append(f"{ename}{{{lab}}} {float(ev)}")
        return "\n".join(L) + "\n"
