"""Admission policies (request_parallel, priority) through AsyncAdmission and the Rust queue."""

from __future__ import annotations

import asyncio

import pytest

from pdgate.config import GatewayConfig
from pdgate.policies import create_policy
from pdgate.state.admission import AsyncAdmission
from tests.fakes import request, snapshot_fleet


def cfg(**kw: object) -> GatewayConfig:
    return GatewayConfig(decode=["http://d:1"], **kw)


def test_request_parallel_tickets() -> None:
    f = snapshot_fleet(1, 1)
    p0 = f.by_role("prefill")[0]
    pol = create_policy("request_parallel", config=cfg())
    assert pol.ticket(request(500), p0).lanes == [(p0.url, 4)]
    assert pol.ticket(request(20_000), p0).lanes == [(p0.url, 4), (p0.url + "#long", 1)]
    pol2 = create_policy("request_parallel",
                         config=cfg(request_parallel={"max_in_flight": 2, "max_long": 2, "long_threshold_tokens": 10}))
    assert pol2.ticket(request(11), p0).lanes == [(p0.url, 2), (p0.url + "#long", 2)]


async def test_short_overtakes_queued_long() -> None:
    f = snapshot_fleet(1, 1)
    p0 = f.by_role("prefill")[0]
    pol = create_policy("request_parallel", config=cfg())
    adm = AsyncAdmission(pol.aging_rate, pol.max_wait_s)
    order: list[str] = []
    held: dict[str, int] = {}

    async def go(name: str, tokens: int) -> None:
        t = pol.ticket(request(tokens), p0)
        held[name] = await adm.wait(t.lanes, t.priority)
        order.append(name)

    long1 = asyncio.create_task(go("long1", 20_000))
    await asyncio.sleep(0)
    long2 = asyncio.create_task(go("long2", 20_000))      # blocked on the long lane
    await asyncio.sleep(0.01)
    shorts = [asyncio.create_task(go(f"s{i}", 100)) for i in range(3)]
    await asyncio.gather(*shorts)
    assert order == ["long1", "s0", "s1", "s2"] and not long2.done()
    assert adm.in_flight(p0.url) == 4 and adm.waiting() == 1
    adm.release(held["long1"])
    await asyncio.wait_for(long2, 1)
    assert order[-1] == "long2"
    await long1


async def test_cancel_while_waiting_frees_nothing_and_leaves_queue_clean() -> None:
    adm = AsyncAdmission()
    a = await adm.wait([("x", 1)])
    t = asyncio.create_task(adm.wait([("x", 1)]))
    await asyncio.sleep(0.01)
    assert adm.waiting() == 1
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert adm.waiting() == 0
    adm.release(a)
    adm.release(a)  # idempotent
    assert adm.in_flight("x") == 0
    b = await asyncio.wait_for(adm.wait([("x", 1)]), 1)
    adm.release(b)


def test_priority_effective_priority() -> None:
    pol = create_policy("priority", config=cfg(priority={"long_threshold_tokens": 1000, "long_penalty": 2}))
    p0 = snapshot_fleet(1, 1).by_role("prefill")[0]
    assert pol.ticket(request(10, priority=3), p0).priority == 3
    assert pol.ticket(request(2500, priority=3), p0).priority == 7   # 2 thresholds x 2
    assert pol.ticket(request(10), p0).lanes == [(p0.url, 4)]


async def test_priorities_order_dispatch() -> None:
    pol = create_policy("priority", config=cfg(priority={"aging_rate": 0.0, "max_in_flight": 1}))
    p0 = snapshot_fleet(1, 1).by_role("prefill")[0]
    adm = AsyncAdmission(pol.aging_rate, pol.max_wait_s)
    first = await adm.wait(pol.ticket(request(10), p0).lanes)
    order: list[int] = []

    async def go(prio: int) -> None:
        t = pol.ticket(request(10, priority=prio), p0)
        eid = await adm.wait(t.lanes, t.priority)
        order.append(prio)
        await asyncio.sleep(0.005)
        adm.release(eid)

    tasks = []
    for prio in (5, 1, 3, 0, 4):
        tasks.append(asyncio.create_task(go(prio)))
        await asyncio.sleep(0.002)
    adm.release(first)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 3, 4, 5]


async def test_aging_bounds_the_wait() -> None:
    """A low-priority entry waiting past max_wait_s goes before fresher urgent ones."""
    pol = create_policy("priority", config=cfg(priority={"aging_rate": 0.0, "max_wait_s": 0.05,
                                                          "max_in_flight": 1}))
    p0 = snapshot_fleet(1, 1).by_role("prefill")[0]
    adm = AsyncAdmission(pol.aging_rate, pol.max_wait_s)
    holder = await adm.wait([(p0.url, 1)])
    order: list[str] = []

    async def go(name: str, prio: int) -> None:
        eid = await adm.wait([(p0.url, 1)], prio)
        order.append(name)
        await asyncio.sleep(0.02)
        adm.release(eid)

    low = asyncio.create_task(go("low", 100))
    await asyncio.sleep(0.08)                       # low has waited past the bound
    urgent = [asyncio.create_task(go(f"u{i}", 0)) for i in range(3)]
    await asyncio.sleep(0.005)
    adm.release(holder)
    await asyncio.gather(low, *urgent)
    assert order[0] == "low"


async def test_deadline_defers_doomed_requests() -> None:
    pol = create_policy("deadline", config=cfg(request_parallel={"max_in_flight": 1},
                                               priority={"aging_rate": 0.0, "max_wait_s": None}))
    p0 = snapshot_fleet(1, 1).by_role("prefill")[0]
    adm = AsyncAdmission(pol.aging_rate, pol.max_wait_s)
    holder = await adm.wait(pol.ticket(request(10), p0).lanes)
    order: list[str] = []

    async def go(name: str, doomed: bool) -> None:
        t = pol.ticket(request(10, doomed=doomed), p0)
        eid = await adm.wait(t.lanes, t.priority)
        order.append(name)
        await asyncio.sleep(0.002)
        adm.release(eid)

    tasks = [asyncio.create_task(go("late1", True))]
    await asyncio.sleep(0.002)
    tasks += [asyncio.create_task(go("ok1", False)), asyncio.create_task(go("late2", True)),
              asyncio.create_task(go("ok2", False))]
    await asyncio.sleep(0.01)
    adm.release(holder)
    await asyncio.gather(*tasks)
    assert order == ["ok1", "ok2", "late1", "late2"]


def test_queue_ahead_skips_deferred() -> None:
    p0 = snapshot_fleet(1, 1).by_role("prefill")[0]
    p0.add_prefill("a", 100)
    p0.add_prefill("b", 200)
    p0.deferred.add("b")
    assert p0.queue_ahead() == [100]
    p0.done_prefill("b")
    assert p0.deferred == set() and p0.outstanding_prefill_tokens == 100
