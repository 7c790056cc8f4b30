"""bench/fidelity_breakdown.py's per-request figures and spread (no fleet)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "fidelity_breakdown.py"


@pytest.fixture(scope="module")
def fb():
    spec = importlib.util.spec_from_file_location("pdgate_fidelity_breakdown", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rec(send: float, chunks: list[float], max_tokens: int) -> dict:
    return {"index": 0, "prompt_tokens": 100, "max_tokens": max_tokens, "scheduled_s": send, "send_s": send,
            "chunk_times_s": chunks, "end_s": chunks[-1] if chunks else None, "success": bool(chunks)}


def run(summary: dict, records: list[dict]) -> dict:
    return {"summary": summary, "records": records}


def test_ttft_and_tpot_per_request(fb) -> None:
    r = rec(1.0, [1.25, 1.30, 1.35, 1.45], 4)
    assert fb.ttft_ms(r) == pytest.approx(250.0)
    assert fb.tpot_ms(r) == pytest.approx(200.0 / 3)
    assert fb.ttft_ms(rec(1.0, [], 4)) is None          # failed request: no figure, no crash
    assert fb.tpot_ms(rec(1.0, [1.2], 1)) is None        # one output token: no TPOT


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
