"""The goodput benchmark's policy-target check (pdgate.sim.report.target_checks)."""

from __future__ import annotations

from typing import Any

from pdgate.sim.report import goodput_markdown, target_checks


def _run(config: str, att: float, p95_ttft: float, p95_tpot: float, rate: float = 2.5) -> dict[str, Any]:
    return {"trace": "azure-code", "fleet": "2P2D", "rate_scale": rate, "config": config, "scaling": "s",
            "metrics": {"total_requests": 10, "failed": 0,
                        "ttft": {"p50_ms": 1.0, "p95_ms": p95_ttft, "p99_ms": p95_ttft},
                        "tpot": {"p50_ms": 1.0, "p95_ms": p95_tpot, "p99_ms": p95_tpot}},
            "slo_attainment": {"1": att, "0.5": att, "2": att}, "fleet_stats": {}}


def _doc(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"meta": {"mode": "quick", "command": "x", "started_utc": "t", "wall_s": 1.0, "profile": "p",
                     "speed": 2.0, "slo": {"ttft_s": 2.0, "tpot_s": 0.1}, "pdgate_policies": []},
            "runs": runs}


def test_target_met_and_missed_parts() -> None:
    doc = _doc([_run("vllm-router/round_robin", 0.40, 10000, 25),
                _run("pdgate/a", 0.80, 1500, 60),     # best: highest attainment
                _run("pdgate/b", 0.70, 1000, 30),
                _run("vllm-router/power_of_two", 0.99, 100, 20)])  # peers never count as "best"
    (c,) = target_checks(doc)
    assert c["best"] == "pdgate/a"
    assert abs(c["attainment_ratio"] - 2.0) < 1e-9 and abs(c["p95_ttft_cut"] - 0.85) < 1e-9
    assert c["met"] and c["missed"] == []
    doc["runs"][1] = _run("pdgate/a", 0.80, 5000, 160)
    (c,) = target_checks(doc)
    assert not c["met"] and c["missed"] == ["P95 TTFT cut", "P95 TPOT"]
    assert "Policy target" in goodput_markdown(doc) and "no: P95 TTFT cut" in goodput_markdown(doc)


def test_target_only_where_round_robin_under_half() -> None:
    doc = _doc([_run("vllm-router/round_robin", 0.60, 3000, 25, rate=1.0), _run("pdgate/a", 0.9, 500, 30, rate=1.0),
                _run("vllm-router/round_robin", 0.30, 9000, 25, rate=3.0), _run("pdgate/a", 0.5, 4000, 30, rate=3.0)])
    checks = target_checks(doc)
    assert [c["rate_scale"] for c in checks] == [3.0]
    assert checks[0]["missed"] == ["P95 TTFT cut", "attainment ratio"]


def test_readme_table_is_the_committed_benchmark_output() -> None:
    import json
    from pathlib import Path

    from pdgate.sim.report import README_BEGIN, README_END, summary_markdown

    root = Path(__file__).resolve().parents[2]
    doc = json.loads((root / "bench" / "results" / "goodput_quick.json").read_text())
    readme = (root / "README.md").read_text()
    block = readme[readme.index(README_BEGIN) + len(README_BEGIN):readme.index(README_END)]
    assert block.strip() == summary_markdown(doc).strip(), \
        "README table is stale: run bench/goodput.py --from-json bench/results/goodput_quick.json --update-readme"
