"""The transfer benchmark's bookkeeping (no UCX): alternating rounds of
ucx_perftest and pdgate, best-vs-best ceiling ratio as the target basis."""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import pytest
from pdgate.bench import transfer as tb


def _row(op_bytes: int, nbytes: int, nt: int = 1) -> dict[str, Any]:
    return {
        "transport": "tcp",
        "kind": "raw",
        "case": "bandwidth",
        "tokens": None,
        "msg_bytes": op_bytes,
        "bytes_per_rep": nbytes,
        "transfers_per_rep": nt,
        "ops_per_rep": nbytes // op_bytes,
        "op_bytes": op_bytes,
        "load_avg_1m": 0.0,
    }


def test_rounds_alternate_and_ratios_use_best_and_median(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    pt_gbps = iter([1.0, 2.0, 0.5])
    pd_time = iter([0.5, 1.0, 0.25])  # seconds per rep: 2, 1 and 4 GB/s for 1e9 bytes

    def fake_perftest(tls: str, size: int, port: int, window: int = 16) -> dict[str, Any]:
        order.append("perftest")
        assert window == 16
        return {"gbps": next(pt_gbps), "lat_us": 10.0}

    def fake_pdgate(eng: Any, peer: str, case: dict[str, Any], reps: int) -> list[float]:
        order.append("pdgate")
        if len(order) == 1:  # warm-up
            return [1.0]
        return [next(pd_time)] * reps

    monkeypatch.setattr(tb, "perftest_round", fake_perftest)
    monkeypatch.setattr(tb, "run_pdgate", fake_pdgate)
    row = _row(op_bytes=10**9, nbytes=10**9)
    args = argparse.Namespace(rounds=3, skip=set())
    tb.alternate("tcp", None, "p", {"transfers": [([0], [0])]}, row, args, itertools.count(1))
    assert order == ["pdgate"] + ["perftest", "pdgate"] * 3
    assert row["perftest"]["gbps_best"] == 2.0 and row["perftest"]["gbps_median"] == 1.0
    assert row["pdgate"]["gbps_best"] == pytest.approx(4.0)
    assert row["pdgate"]["gbps_median"] == pytest.approx(2.0)
    assert row["pdgate_over_ceiling_best"] == 2.0
    assert row["pdgate_over_ceiling_median"] == 2.0
    assert row["pdgate"]["rounds"] == row["perftest"]["rounds"] == 3


def test_summary_target_uses_best_vs_best() -> None:
    pd = {"lat_ms_per_transfer": 0.2}
    big = _row(1 << 20, 16 << 20) | {"pdgate": pd, "pdgate_over_ceiling_best": 0.95, "pdgate_over_ceiling_median": 0.7}
    small = _row(4 << 10, 64 << 10) | {"pdgate": pd, "pdgate_over_ceiling_best": 0.1, "pdgate_over_ceiling_median": 0.1}
    res: dict[str, Any] = {"runs": [{"transport": "tcp", "kv": [], "raw": [big, small]}]}
    tb.add_summary(res)
    s = res["summary"]["tcp"]
    assert s["target_ceiling_90pct_met"] is True  # the 4 KiB op is below the 256 KiB threshold
    assert s["pdgate_over_ceiling_ops_ge_256KiB_best_vs_best"]["min"] == 0.95
    assert s["pdgate_over_ceiling_ops_ge_256KiB_median_vs_median"]["min"] == 0.7
    slow_bw = big | {"msg_bytes": 4 << 20, "op_bytes": 4 << 20, "pdgate_over_ceiling_best": 0.85}
    res["runs"][0]["raw"].append(slow_bw)
    tb.add_summary(res)
    s = res["summary"]["tcp"]
    assert s["target_ceiling_90pct_met"] is False
    assert s["below_90pct_best_vs_best"] == {"raw 4096KiB bandwidth": 0.85}


def test_one_at_a_time_latency_case_is_summarized_as_latency_not_bandwidth() -> None:
    """The raw latency case (perftest -O 1) is a latency figure: it is reported as the microseconds pdgate
    adds per transfer, apart from the bandwidth target."""
    bw = _row(1 << 20, 16 << 20) | {"pdgate": {"lat_ms_per_transfer": 0.2}, "pdgate_over_ceiling_best": 0.95,
                                     "pdgate_over_ceiling_median": 0.9}
    lat = _row(256 << 10, 256 << 10) | {"case": "latency", "pdgate": {"lat_ms_per_transfer": 0.040},
                                         "perftest": {"lat_us_per_msg": 31.5},
                                         "pdgate_over_ceiling_best": 0.7, "pdgate_over_ceiling_median": 0.7}
    res: dict[str, Any] = {"runs": [{"transport": "sm", "kv": [], "raw": [bw, lat]}]}
    tb.add_summary(res)
    s = res["summary"]["sm"]
    assert s["target_ceiling_90pct_met"] is True and s["below_90pct_best_vs_best"] == {}
    assert s["pdgate_over_ceiling_ops_ge_256KiB_best_vs_best"]["n"] == 1
    cell = s["one_at_a_time_latency_ops_ge_256KiB"]["raw 256KiB latency"]
    assert cell == {"pdgate_us": 40.0, "perftest_us": 31.5, "added_us": 8.5, "pdgate_over_ceiling_best": 0.7}


class _FakeEngine:
    """Completes transfers in order when waited for; records the most in flight after each post."""

    def __init__(self) -> None:
        self.in_flight: list[int] = []
        self.posted = 0
        self.max_seen: list[int] = []

    def read_blocks(self, peer: str, l: list[int], r: list[int], timeout_s: float) -> int:
        self.posted += 1
        self.in_flight.append(self.posted)
        self.max_seen.append(len(self.in_flight))
        return self.posted

    def wait(self, xid: int, timeout_s: float) -> None:
        assert self.in_flight[0] == xid, "waits oldest first"
        self.in_flight.pop(0)


@pytest.mark.parametrize("reps", [1, 3])
def test_bandwidth_case_streams_like_perftests_window(reps: int) -> None:
    """pdgate's raw bandwidth case keeps WINDOW transfers in flight across reps (perftest -O 16 never lets
    its window drain); KV and latency cases still post a rep, then wait for all of it."""
    bw, lat = tb.make_cases("raw", 1)
    eng = _FakeEngine()
    times = tb.run_pdgate(eng, "p", bw, reps)
    assert eng.posted == reps * tb.WINDOW and not eng.in_flight
    assert len(times) == reps and all(t >= 0 for t in times)
    # after the window filled, every later post found WINDOW - 1 in flight (the one just waited for left)
    assert eng.max_seen[: tb.WINDOW] == list(range(1, tb.WINDOW + 1))
    assert all(m == tb.WINDOW for m in eng.max_seen[tb.WINDOW:])
    eng2 = _FakeEngine()
    assert len(tb.run_pdgate(eng2, "p", lat, reps)) == reps
    assert eng2.posted == reps and max(eng2.max_seen) == 1


@pytest.mark.parametrize("nbytes", [4096, 65536, 262144, 4 << 20])
@pytest.mark.parametrize("fill", [True, False])
def test_bench_buffers_are_page_aligned_like_perftests(nbytes: int, fill: bool) -> None:
    """ucx_perftest moves page-aligned buffers (UCP_MEM_MAP_ALLOCATE); numpy's large
    buffers start 16 bytes into a page, so the bench aligns its own."""
    import mmap

    from pdgate.bench.transfer_peers import PAGE, alloc

    a = alloc(nbytes, fill)
    assert a.ctypes.data % mmap.PAGESIZE == 0
    assert a.nbytes == nbytes and a.flags["C_CONTIGUOUS"] and a.flags["WRITEABLE"]
    if fill:  # the per-64-KiB-page pattern the byte checks rely on
        assert a[0] == 1 and (nbytes <= PAGE or a[PAGE] == 2)
    else:
        assert not a.any()


def test_raw_cases_read_one_block_as_perftests_window_reads_one_buffer() -> None:
    """ucx_perftest's window of GETs reads one message buffer; the raw cases match
    its footprint (a distinct-block window would be a DRAM-bound figure beside a
    cache-resident ceiling)."""
    bw, lat = tb.make_cases("raw", 1)
    assert bw["name"] == "bandwidth" and lat["name"] == "latency"
    assert bw["transfers"] == [([0], [0])] * tb.WINDOW
    assert lat["transfers"] == [([0], [0])]
    contiguous, fragmented = tb.make_cases("kv", 64)
    assert contiguous["transfers"] == [(list(range(64)), list(range(64)))]
    loc, rem = fragmented["transfers"][0]
    assert sorted(loc) == sorted(rem) == list(range(64))   # every block of the prompt once


def test_missing_peer_is_one_line_and_an_error_entry(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A peer that is not installed costs one stderr line and an error entry, not a child's traceback;
    an installed one fills its column; a skipped one is left out."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(tb.importlib.util, "find_spec",
                        lambda name, *a: None if name == "ucxx" else (object() if name == "nixl" else real(name, *a)))
    monkeypatch.setattr(tb, "run_nixl", lambda tls, layers, n, blen, cases: {c["name"]: [0.5, 0.25] for c in cases})
    monkeypatch.setattr(tb, "run_ucxx", lambda *a: pytest.fail("ucxx is not installed: it must not run"))
    rows = [_row(op_bytes=10**9, nbytes=10**9)]
    tb.run_peers("tcp", 1, 1, 10**9, [{"name": "c0"}], rows, set())
    assert rows[0]["ucxx"] == {"error": "ucxx not installed"}
    assert rows[0]["nixl"]["gbps_best"] == pytest.approx(4.0)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ucxx is not installed" in err and "pip install" in err
    rows = [_row(op_bytes=10**9, nbytes=10**9)]
    tb.run_peers("tcp", 1, 1, 10**9, [{"name": "c0"}], rows, {"nixl", "ucxx"})
    assert "nixl" not in rows[0] and "ucxx" not in rows[0]
