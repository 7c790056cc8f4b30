"""Simulator core against hand-computed small cases (no I/O, no clock)."""

from __future__ import annotations

import pytest

from pdgate.sim.blocks import BlockPool, block_hashes
from pdgate.sim.profiles import Profile, available_profiles, load_profile
from pdgate.sim.scheduler import Scheduler, SimRequest, Status

# step = 1 + 0.1*prefill_tokens + 0.001*chunk*(offset+chunk/2) + 0.5*decodes + 0.01*kv
P = Profile(name="t", block_size=4, num_gpu_blocks=64, max_num_seqs=8, max_num_batched_tokens=16,
            long_prefill_token_threshold=0, max_model_len=1000, step_base_s=1.0, prefill_token_s=0.1,
            prefill_attn_s=0.001, decode_seq_s=0.5, decode_kv_token_s=0.01, kv_bytes_per_token=100,
            kv_transfer_bandwidth_Bps=1000.0, kv_transfer_latency_s=0.5)


def req(rid: str, n: int, out: int = 1, ids: list[int] | None = None, **kw: object) -> SimRequest:
    ids = ids if ids is not None else [hash((rid, i)) % 1000 for i in range(n)]
    return SimRequest(rid, n, out, block_hashes=block_hashes(ids, P.block_size), **kw)


def run_until_idle(s: Scheduler, limit: int = 200) -> list[list[tuple[str, int]]]:
    steps = []
    t = 0.0
    for _ in range(limit):
        plan = s.schedule(t)
        if not plan.scheduled:
            break
        t += plan.duration_s
        s.finish_step(plan, t)
        steps.append([(r.request_id, n) for r, n in plan.scheduled])
    return steps


def test_step_time_formula_by_hand() -> None:
    # one chunk of 10 tokens at offset 20, two decodes with contexts 30 and 50
    t = P.step_time([(10, 20)], [30, 50])
    assert t == pytest.approx(1 + 0.1 * 10 + 0.001 * 10 * (20 + 5) + 0.5 * 2 + 0.01 * 80)
    assert P.step_time([], []) == 0.0
    assert P.transfer_time(50) == pytest.approx(0.5 + 50 * 100 / 1000)


def test_shipped_profiles_load_with_sources(tmp_path) -> None:  # type: ignore[no-untyped-def]
    names = available_profiles()
    for required in ("a100-dsv2-lite", "h100-llama3-8b", "cpu-tiny"):
        assert required in names
    for n in names:
        p = load_profile(n)
        assert p.sources and p.num_gpu_blocks > 0 and p.step_base_s > 0
        assert isinstance(p.kv_transfer_bandwidth_Bps, float)
    bad = tmp_path / "typo.yaml"
    bad.write_text("name: typo\nstep_base: 0.1\n")  # typo of step_base_s must not pass silently
    with pytest.raises(ValueError, match="step_base"):
        load_profile(bad)


def test_chunked_prefill_within_token_budget() -> None:
    s = Scheduler(P)
    r = req("a", 40, out=3)
    s.add(r)
    steps = run_until_idle(s)
    # budget 16: 16 + 16 + 8 prompt tokens, then 2 decode steps (first token comes with the prefill)
    assert steps == [[("a", 16)], [("a", 16)], [("a", 8)], [("a", 1)], [("a", 1)]]
    assert r.status == Status.FINISHED and r.num_output == 3
    assert s.pool.num_free == s.pool.num_blocks  # all blocks back (cached, evictable)


def test_first_token_time_by_hand() -> None:
    s = Scheduler(P)
    r = req("a", 10, out=2)
    s.add(r)
    plan = s.schedule(0.0)
    assert plan.duration_s == pytest.approx(1 + 0.1 * 10 + 0.001 * 10 * 5)
    s.finish_step(plan, plan.duration_s)
    assert r.first_token_s == pytest.approx(2.05) and r.num_output == 1
    plan = s.schedule(2.05)  # one decode, context 11
    assert plan.duration_s == pytest.approx(1 + 0.5 + 0.01 * 11)


def test_long_prefill_threshold_only_with_competition() -> None:
    p = P.replace(long_prefill_token_threshold=4)
    s = Scheduler(p)
    s.add(req("a", 12))
    assert [(r.request_id, n) for r, n in s.schedule(0).scheduled] == [("a", 12)]  # lone request: no cap
    s = Scheduler(p)
    s.add(req("a", 12))
    s.add(req("b", 12))
    assert [(r.request_id, n) for r, n in s.schedule(0).scheduled] == [("a", 4), ("b", 4)]


def test_max_num_seqs_keeps_requests_waiting() -> None:
    s = Scheduler(P.replace(max_num_seqs=1))
    s.add(req("a", 4, out=2))
    s.add(req("b", 4, out=1))
    steps = run_until_idle(s)
    assert steps == [[("a", 4)], [("a", 1)], [("b", 4)]]


def test_running_first_then_waiting_fcfs() -> None:
    s = Scheduler(P)
    s.add(req("a", 20, out=2))
    plan = s.schedule(0)
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("a", 16)]
    s.finish_step(plan, 1)
    s.add(req("b", 30))
    plan = s.schedule(1)
    # a finishes its prefill (4), b gets the rest of the budget (12)
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("a", 4), ("b", 12)]


def test_priority_policy_orders_waiting() -> None:
    s = Scheduler(P.replace(max_num_seqs=1), policy="priority")
    s.add(req("low", 4, priority=5))
    s.add(req("high", 4, priority=-1))
    assert [r.request_id for r, _ in s.schedule(0).scheduled] == ["high"]


def test_preemption_when_blocks_run_out() -> None:
    # 4 blocks of 4 tokens = 16 token slots; two requests of 7 prompt tokens and 6 outputs each
    s = Scheduler(P.replace(num_gpu_blocks=4))
    a, b = req("a", 7, out=6), req("b", 7, out=6)
    s.add(a)
    s.add(b)
    steps = run_until_idle(s)
    assert s.num_preemptions >= 1 and b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.status == b.status == Status.FINISHED and a.num_output == b.num_output == 6
    # b was recomputed from scratch (prompt + outputs so far) after preemption
    assert any(("b", n) in st and n > 1 for st in steps[2:] for n in range(2, 20))
    assert s.pool.num_free == 4


def test_prefix_cache_hits_full_blocks_and_leaves_one_token() -> None:
    s = Scheduler(P)
    ids = list(range(12))  # 3 full blocks of 4
    s.add(req("a", 12, ids=ids))
    run_until_idle(s)
    b = req("b", 12, ids=ids)
    s.add(b)
    plan = s.schedule(0)
    # all 3 blocks cached, but one token must be computed: 2 blocks hit, 4 tokens computed
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("b", 4)]
    assert b.num_cached_tokens == 8
    c = req("c", 14, ids=ids[:8] + [900, 901, 902, 903, 904, 905])
    s.add(c)
    plan = s.schedule(0)
    assert ("c", 6) in [(r.request_id, n) for r, n in plan.scheduled] and c.num_cached_tokens == 8
    assert s.pool.hits == 16 and s.pool.queries == 12 + 12 + 14


def test_block_pool_lru_eviction_keeps_hashes_until_reuse() -> None:
    pool = BlockPool(3, 4)
    a = pool.allocate(2)
    assert a == [0, 1] and pool.usage == pytest.approx(2 / 3)
    pool.cache(0, 111)
    pool.cache(1, 222)
    pool.release(a)  # freed in reverse: 1 then 0 go to the tail
    assert pool.match_prefix([111, 222]) == [0, 1]
    assert pool.allocate(4) is None
    got = pool.allocate(2)  # head of the queue: block 2 (never cached) then 1 (evicts 222)
    assert got == [2, 1]
    assert pool.match_prefix([111, 222]) == [0]
    with pytest.raises(RuntimeError):
        pool.release([0])


def test_pd_producer_holds_blocks_until_consumer_reads() -> None:
    prod = Scheduler(P)
    r = req("p", 10, do_remote_decode=True)
    prod.add(r)
    run_until_idle(prod)
    assert r.status == Status.HELD and len(r.blocks) == 3
    assert prod.pool.num_free == 64 - 3
    cons = Scheduler(P)
    c = req("c", 10, out=3, remote_prefill={"remote_engine_id": "x", "remote_request_id": "p"})
    cons.add(c)
    plan = cons.schedule(0)
    assert plan.scheduled == [] and plan.new_loads == [c] and c.status == Status.LOADING
    assert len(c.blocks) == 3  # whole prompt allocated up front
    assert cons.schedule(0).scheduled == []  # still loading
    cons.kv_loaded(c)
    assert c.num_computed == 9
    steps = run_until_idle(cons)
    assert steps == [[("c", 1)], [("c", 1)], [("c", 1)]] and c.num_output == 3
    assert prod.release_held("p") and prod.pool.num_free == 64
    assert not prod.release_held("p")


def test_held_blocks_expire() -> None:
    s = Scheduler(P.replace(kv_hold_timeout_s=10))
    r = req("p", 10, do_remote_decode=True)
    s.add(r)
    run_until_idle(s)
    assert s.expire_held(r.finished_s + 5) == 0
    assert s.expire_held(r.finished_s + 10) == 1 and s.pool.num_free == 64


def test_abort_frees_blocks_everywhere() -> None:
    s = Scheduler(P)
    a, b = req("a", 8, out=50), req("b", 8)
    s.add(a)
    s.add(b)
    s.finish_step(s.schedule(0), 1)
    s.abort(a, 1)
    assert a.status == Status.ABORTED and a not in s.running
    assert s.pool.num_free == 64 - 0 - len(b.blocks) and not a.blocks


def test_step_noise_scales_step_time_only_when_the_profile_has_it() -> None:
    quiet, noisy = Scheduler(P), Scheduler(P.replace(step_noise_sigma=0.5, step_noise_tau_s=0.2), seed=7)
    ratios = []
    for t in range(20):
        for s in (quiet, noisy):
            s.add(req(f"r{t}-{id(s)}", 8, out=1))
        a, b = quiet.schedule(t * 1.0), noisy.schedule(t * 1.0)
        expect = P.step_time([(8, 0)], [])
        assert a.duration_s == expect                       # no noise: the formula exactly
        ratios.append(b.duration_s / expect)
        quiet.finish_step(a, t + 0.5)
        noisy.finish_step(b, t + 0.5)
    assert len({round(r, 6) for r in ratios}) == 20 and min(ratios) < 0.9 and max(ratios) > 1.1


def test_step_noise_spread_shrinks_for_steps_longer_than_its_correlation_time() -> None:
    """Each step passes its own length to the noise (pdgate.sim.noise): a ~1.8 s
    step under noise with a 50 ms correlation time spreads far less than under
    noise that stays put for 100 s."""
    import math
    import statistics

    def log_ratios(tau_s: float) -> list[float]:
        s = Scheduler(P.replace(step_noise_sigma=0.5, step_noise_tau_s=tau_s), seed=3)
        expect = P.step_time([(8, 0)], [])
        out = []
        for t in range(300):
            s.add(req(f"r{t}", 8, out=1))
            plan = s.schedule(t * 1000.0)            # steps far apart: independent draws
            out.append(math.log(plan.duration_s / expect))
            s.finish_step(plan, t * 1000.0 + 2)
        return out

    slow, fast = statistics.pstdev(log_ratios(100.0)), statistics.pstdev(log_ratios(0.05))
    assert slow == pytest.approx(0.5, rel=0.2)
    assert fast < 0.4 * slow
