"""Benchmarks: open-loop replay of production traces with vLLM-style metrics.

* :mod:`pdgate.bench.traces`: trace loaders, windowing/scaling, prompt synthesis.
* :mod:`pdgate.bench.metrics`: TTFT/TPOT/ITL/E2EL, throughput, goodput.
* :mod:`pdgate.bench.replay`: async open-loop replay client and CLI.
"""

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
