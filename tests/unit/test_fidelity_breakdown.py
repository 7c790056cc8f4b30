"""bench/fidelity_breakdown.py's per-request figures and spread (no fleet)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
from pdgate.bench.metrics import RequestRecord

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "fidelity_breakdown.py"


@pytest.fixture(scope="module")
def fb():
    spec = importlib.util.spec_from_file_location("pdgate_fidelity_breakdown", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rec(send: float, chunks: list[float], max_tokens: int) -> dict:
    """A record as the tool stores it: ``RequestRecord.to_dict`` (with derived ttft_s/tpot_s)."""
    return RequestRecord(scheduled_s=send, send_s=send, chunk_times_s=chunks, end_s=chunks[-1] if chunks else None,
                         prompt_tokens=100, max_tokens=max_tokens, success=bool(chunks)).to_dict()


def run(summary: dict, records: list[dict]) -> dict:
    return {"summary": summary, "records": records}


def test_per_request_figures_are_the_records_own(fb) -> None:
    """The table shows RequestRecord's TTFT/TPOT (the summary's definitions), in ms."""
    r = rec(1.0, [1.25, 1.30, 1.35, 1.45], 4)
    assert fb.ms(r["ttft_s"]) == pytest.approx(250.0)
    assert fb.ms(r["tpot_s"]) == pytest.approx(200.0 / 3)
    assert fb.ms(rec(1.0, [], 4)["ttft_s"]) is None       # failed request: no figure, no crash
    assert fb.ms(rec(1.0, [1.2], 1)["tpot_s"]) is None     # one output token: no TPOT
    line = fb.table([{"records": [r]}], [{"records": [r]}]).splitlines()[1].split("|")
    assert line[1].split() == ["250"] and line[3].split() == ["67"]


def test_spread_is_against_the_real_median(fb) -> None:
    keys = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")
    real = [run(dict.fromkeys(keys, v), []) for v in (0.2, 0.4, 0.3)]
    sim = [run(dict.fromkeys(keys, v), []) for v in (0.2, 0.4)]
    s = fb.spread(real, sim)
    assert set(s) == set(keys)
    assert s["ttft_p50"]["real_min"] == 0.2 and s["ttft_p50"]["real_max"] == 0.4
    assert s["ttft_p50"]["real_median"] == pytest.approx(0.3)
    assert s["ttft_p50"]["sim_vs_real_median"] == pytest.approx(0.0)
    sim_slow = [run(dict.fromkeys(keys, 0.45), [])]
    assert fb.spread(real, sim_slow)["tpot_p90"]["sim_vs_real_median"] == pytest.approx(0.5)


def test_table_has_a_row_per_request_and_a_column_per_replay(fb) -> None:
    real = [run({}, [rec(0.0, [0.1, 0.2], 3), rec(1.0, [], 3)]) for _ in range(3)]
    sim = [run({}, [rec(0.0, [0.05, 0.1], 3), rec(1.0, [1.05, 1.1], 3)]) for _ in range(2)]
    lines = fb.table(real, sim).splitlines()
    assert len(lines) == 3
    row0 = lines[1].split("|")
    assert row0[1].split() == ["100", "100", "100"]    # real TTFT ms, 3 replays
    assert row0[2].split() == ["50", "50"]             # simulated TTFT ms, 2 replays
    assert lines[2].split("|")[1].split() == ["-", "-", "-"]  # a failed request shows '-'
