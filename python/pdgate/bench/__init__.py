"""Benchmarks: open-loop replay of production traces with vLLM-style metrics.

* :mod:`pdgate.bench.traces`: trace loaders, windowing/scaling, prompt synthesis.
* :mod:`pdgate.bench.metrics`: TTFT/TPOT/ITL/E2EL, throughput, goodput.
* :mod:`pdgate.bench.replay`: async open-loop replay client and CLI.
* :mod:`pdgate.bench.goodput`, :mod:`pdgate.bench.overhead`: router
  comparisons over simulated fleets (``pdgate bench goodput|overhead``).
"""

import os
from pathlib import Path


def bench_dir() -> str:
    """Folder for benchmark results and default trace paths: ``$PDGATE_BENCH_DIR``,
    else the source checkout's ``bench/``, else ``./bench``."""
    env = os.environ.get("PDGATE_BENCH_DIR")
    if env:
        return env
    repo_bench = Path(__file__).resolve().parents[3] / "bench"
    return str(repo_bench) if repo_bench.is_dir() else os.path.join(os.getcwd(), "bench")


from pdgate.bench.metrics import BenchMetrics, RequestRecord, compute_metrics, parse_slo, parse_slos
from pdgate.bench.traces import (
    ReplayPlan,
    TraceRequest,
    load_azure_csv,
    load_mooncake_jsonl,
    load_plan,
    load_trace,
    make_plan,
)
from pdgate.bench.prompts import (
    PromptSynthesizer,
    load_tokenizer,
)

__all__ = [
    "BenchMetrics",
    "bench_dir",
    "PromptSynthesizer",
    "ReplayPlan",
    "RequestRecord",
    "TraceRequest",
    "compute_metrics",
    "load_azure_csv",
    "load_mooncake_jsonl",
    "load_plan",
    "load_tokenizer",
    "load_trace",
    "make_plan",
    "parse_slo",
    "parse_slos",
]
