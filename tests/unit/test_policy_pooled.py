"""The ``pooled`` route (late binding) over fixed fleet snapshots, and its gateway-wide queue."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pdgate.policies import RouteDecision, create_policy
from pdgate.state.dispatch import LateBinding
from tests.fakes import request, route_context, snapshot_fleet
from tests.unit.test_policy_route import PRED

#: 4096-token steps of 10 ms + 0.1 ms per token: 1000 tokens ~ 0.11 s, 4000 ~ 0.41 s.
POOLED = {"max_queue_s": 0.3, "max_in_flight": 4, "max_local_prefills": 2}


def setup(n_p: int = 1, n_d: int = 2, **pooled: Any) -> tuple[Any, Any, Any]:
    f = snapshot_fleet(n_p, n_d)
    ctx = route_context(f, predictor=PRED, route_policy="pooled", pooled={**POOLED, **pooled})
    return f, ctx, create_policy("pooled", config=ctx.config)


def test_idle_fleet_takes_the_prefill_path() -> None:
    f, ctx, pol = setup()
    d = pol.place(ctx, request(1000))
    assert d is not None and d.kind == "pd" and d.prefill is f.by_role("prefill")[0]
    assert d.decode in f.by_role("decode")


def test_busy_prefill_instance_is_not_free_and_a_decode_instance_deflects() -> None:
    f, ctx, pol = setup()
    p0 = f.by_role("prefill")[0]
    p0.add_prefill("q", 4000)                            # ~0.41 s queued > max_queue_s
    assert not pol.prefill_free(ctx, p0)
    d = pol.place(ctx, request(1000))
    assert d is not None and d.kind == "deflect"
    # a small queue still leaves the prefill instance free
    p0.done_prefill("q")
    p0.add_prefill("q", 1000)
    assert pol.prefill_free(ctx, p0)


def test_nothing_free_keeps_the_request_waiting() -> None:
    f, ctx, pol = setup(max_local_prefills=1)
    f.by_role("prefill")[0].add_prefill("q", 4000)
    for k, dd in enumerate(f.by_role("decode")):
        dd.add_prefill(f"local{k}", 500)                 # each decode instance prefills one prompt already
    assert not pol.has_capacity(ctx)
    assert pol.place(ctx, request(100)) is None


def test_count_limit_on_prefill_instance() -> None:
    f, ctx, pol = setup(max_in_flight=2)
    p0 = f.by_role("prefill")[0]
    p0.add_prefill("a", 10)
    assert pol.prefill_free(ctx, p0)
    p0.add_prefill("b", 10)
    assert not pol.prefill_free(ctx, p0)                # two tiny prompts: the count limit binds


def test_no_deflection_that_pushes_decoding_requests_past_their_tpot_slo() -> None:
    f, ctx, pol = setup(n_d=1)
    f.by_role("prefill")[0].add_prefill("q", 4000)
    (d0,) = f.by_role("decode")
    # decoding with a 15 ms TPOT target: a 4096-token chunk step (~0.42 s) breaks it
    d0.add_decode("tight", 100, tpot_slo_s=0.015, output_tokens=4)
    assert pol.place(ctx, request(4000)) is None
    d0.done_decode("tight")
    d = pol.place(ctx, request(4000))
    assert d is not None and d.kind == "deflect"


def test_without_prefill_or_decode_instances_it_is_decode_only_at_once() -> None:
    _, ctx, pol = setup(n_p=0)
    d = pol.place(ctx, request(100))
    assert d is not None and d.kind == "decode_only"
    f, ctx, pol = setup(n_p=1, n_d=1)
    f.by_role("prefill")[0].add_prefill("q", 4000)      # prefill instance full ...
    f.by_role("decode")[0].draining = True               # ... and no routable decode instance
    d = pol.place(ctx, request(100))
    assert d is not None and d.kind == "decode_only"     # the decode leg then answers 503, no wait


def test_pooled_refuses_a_second_admission_queue() -> None:
    from pydantic import ValidationError

    from pdgate.config import GatewayConfig

    with pytest.raises(ValidationError, match="its own admission"):
        GatewayConfig(decode=["http://d:1"], route_policy="pooled", admission_policy="priority")
    assert GatewayConfig(decode=["http://d:1"], route_policy="pooled").admission_policy == "none"


def test_order_fcfs_and_sjf_with_aging_and_starvation_bound() -> None:
    _, _, fcfs = setup(order="fcfs", aging_rate=0.0)
    short, long = request(100), request(9000)
    assert fcfs.order_key(long, 1.0, 0) < fcfs.order_key(short, 1.0, 1)      # arrival order
    _, _, sjf = setup(order="sjf", aging_rate=1.0, long_threshold_tokens=1000, max_wait_s=20.0)
    assert sjf.order_key(short, 0.0, 1) < sjf.order_key(long, 0.0, 0)        # shorter first
    assert sjf.order_key(long, 10.0, 0) < sjf.order_key(short, 0.0, 1)       # 10 s of aging beats 9 units
    assert sjf.order_key(long, 25.0, 0) < sjf.order_key(request(100, priority=-50), 0.0, 1)  # starved first
    assert sjf.order_key(request(100, priority=-1), 0.0, 1) < sjf.order_key(short, 0.0, 0)  # class first


def test_order_long_last_keeps_arrival_order_below_the_threshold_and_defers_longer_prompts() -> None:
    _, _, ll = setup(order="long_last", aging_rate=0.1, long_threshold_tokens=6000, max_wait_s=60.0)
    a, b = request(5999), request(100)
    long = request(6001)
    assert ll.order_key(a, 1.0, 0) < ll.order_key(b, 1.0, 1)              # arrival order among the shorter
    assert ll.order_key(b, 0.0, 9) < ll.order_key(long, 0.0, 0)           # a longer prompt after them
    assert ll.order_key(b, 5.0, 9) < ll.order_key(long, 9.0, 0)           # ... until it waited 1/aging = 10 s
    assert ll.order_key(long, 10.5, 0) < ll.order_key(b, 0.0, 9)          # more than the oldest of them
    assert ll.order_key(long, 61.0, 0) < ll.order_key(request(1, priority=-5), 0.0, 1)  # starved first


# -- the gateway-wide queue -------------------------------------------------------------------

def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))


def busy_1p1d(**pooled: Any) -> tuple[Any, Any, Any, Any]:
    """1P1D with both executors full: (fleet, ctx, policy, prefill instance)."""
    f, ctx, pol = setup(n_d=1, **{"max_local_prefills": 1, **pooled})
    p0 = f.by_role("prefill")[0]
    p0.add_prefill("busy-p", 4000)
    f.by_role("decode")[0].add_prefill("busy-d", 4000)
    return f, ctx, pol, p0


def test_queue_dispatches_when_capacity_frees_and_in_order() -> None:
    f, ctx, pol, p0 = busy_1p1d()

    async def go() -> list[tuple[str, RouteDecision]]:
        lb = LateBinding(ctx, pol, tick_s=5.0)            # long tick: the events must do it
        got: list[tuple[str, RouteDecision]] = []

        async def one(rid: str, n: int) -> None:
            got.append((rid, await lb.place(request(n, rid=rid))))

        tasks = [asyncio.ensure_future(one("a", 500))]
        await asyncio.sleep(0.01)
        tasks.append(asyncio.ensure_future(one("b", 500)))
        await asyncio.sleep(0.01)
        assert lb.waiting() == 2 and not got
        p0.done_prefill("busy-p")                         # the listener kicks a dispatch round
        await asyncio.sleep(0.01)
        assert [r for r, _ in got] == ["a", "b"]          # both fit the freed prefill instance, in order
        assert set(p0.prefill_jobs) == {"a", "b"}         # reserved at once
        await asyncio.gather(*tasks)
        return got

    got = run(go())
    assert all(d.kind == "pd" and d.prefill is p0 for _, d in got)


@pytest.mark.parametrize("order, first", [("fcfs", "long"), ("long_last", "short")])
def test_long_last_dispatches_a_later_shorter_prompt_before_a_queued_long_one(order: str, first: str) -> None:
    """Both executors full; a 6000-token prompt, then a 500-token one, wait. When the prefill instance frees,
    ``long_last`` (threshold 5000) sends the shorter one first; ``fcfs`` the long one."""
    f, ctx, pol, p0 = busy_1p1d(order=order, long_threshold_tokens=5000, aging_rate=0.0)

    async def go() -> list[str]:
        lb = LateBinding(ctx, pol, tick_s=5.0)
        got: list[str] = []

        async def one(rid: str, n: int) -> None:
            await lb.place(request(n, rid=rid))
            got.append(rid)

        tasks = [asyncio.ensure_future(one("long", 6000))]
        await asyncio.sleep(0.01)
        tasks.append(asyncio.ensure_future(one("short", 500)))
        await asyncio.sleep(0.01)
        assert lb.waiting() == 2 and not got
        p0.done_prefill("busy-p")
        await asyncio.sleep(0.01)
        order_seen = list(got)
        for rid in list(p0.prefill_jobs):                # let the rest through
            p0.done_prefill(rid)
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        return order_seen

    assert run(go())[0] == first


def test_ticker_dispatches_without_an_event() -> None:
    f, ctx, pol, p0 = busy_1p1d()

    async def go() -> RouteDecision:
        lb = LateBinding(ctx, pol, tick_s=0.01)
        t = asyncio.ensure_future(lb.place(request(500, rid="x")))
        await asyncio.sleep(0.03)
        assert not t.done()
        with p0._lock:                                    # capacity frees without any listener call
            p0.prefill_jobs.clear()
        return await t

    assert run(go()).prefill is p0


def test_cancelled_waiter_leaves_the_queue_and_its_reservation() -> None:
    f, ctx, pol, p0 = busy_1p1d()

    async def go() -> None:
        lb = LateBinding(ctx, pol, tick_s=5.0)
        t = asyncio.ensure_future(lb.place(request(500, rid="gone")))
        await asyncio.sleep(0.01)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert lb.waiting() == 0
        # dispatched and cancelled in the same loop turn: the reservation is released
        t2 = asyncio.ensure_future(lb.place(request(500, rid="late")))
        await asyncio.sleep(0.01)
        with p0._lock:
            p0.prefill_jobs.clear()
        lb._pump()                                        # resolves the waiter, reserving p0 ...
        assert "late" in p0.prefill_jobs
        t2.cancel()                                       # ... whose task is cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await t2
        assert "late" not in p0.prefill_jobs

    run(go())
