"""Instance policies over fixed fleet snapshots."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from pdgate.policies import available_policies, create_policy
from tests.fakes import request, snapshot_fleet


def test_registry_kinds() -> None:
    assert set(available_policies("instance")) >= {"round_robin", "least_load", "power_of_two", "prefix_aware"}
    assert set(available_policies("route")) == {"pd", "dedicated", "deflection", "goodput", "pooled"}
    assert set(available_policies("admission")) == {"none", "request_parallel", "priority", "deadline"}


@pytest.mark.parametrize("name", ["round_robin", "least_load", "power_of_two", "prefix_aware"])
def test_empty_candidates_raise(name: str) -> None:
    with pytest.raises(ValueError):
        create_policy(name).select([], request(10))


def test_round_robin_cycles() -> None:
    f = snapshot_fleet(3, 1)
    pol = create_policy("round_robin")
    got = [pol.select(f.by_role("prefill"), request(5)).url for _ in range(6)]
    assert got == ["http://p0:1", "http://p1:1", "http://p2:1"] * 2


def test_least_load_uses_outstanding_tokens() -> None:
    f = snapshot_fleet(3, 1)
    p0, p1, p2 = f.by_role("prefill")
    p0.add_prefill("a", 5000)
    p1.add_prefill("b", 100)
    p2.add_prefill("c", 3000)
    pol = create_policy("least_load")
    assert pol.select([p0, p1, p2], request(10)) is p1
    p1.add_prefill("d", 9000)
    assert pol.select([p0, p1, p2], request(10)) is p2
    p2.done_prefill("c")
    assert p2.outstanding_prefill_tokens == 0
    assert pol.select([p0, p1, p2], request(10)) is p2


def test_least_load_counts_decode_kv_and_spreads_ties() -> None:
    f = snapshot_fleet(0, 3)
    d0, d1, d2 = f.by_role("decode")
    d0.add_decode("x", 4000)
    pol = create_policy("least_load")
    picks = Counter(pol.select([d0, d1, d2], request(5)).url for _ in range(10))
    assert "http://d0:1" not in picks and len(picks) == 2  # ties alternate between d1 and d2


def test_least_load_ties_go_by_scraped_running_requests() -> None:
    """Own counters equal (another gateway replica sent the load): the scraped
    batch decides; a stale scrape does not."""
    f = snapshot_fleet(0, 2)
    d0, d1 = f.by_role("decode")
    d0.scraped, d0.scraped_at = {"num_requests_running": 4.0}, time.monotonic()
    d1.scraped, d1.scraped_at = {"num_requests_running": 0.0}, time.monotonic()
    pol = create_policy("least_load")
    assert all(pol.select([d0, d1], request(5)) is d1 for _ in range(6))
    d0.scraped_at = time.monotonic() - 60
    picks = Counter(pol.select([d0, d1], request(5)).url for _ in range(6))
    assert picks == {"http://d0:1": 3, "http://d1:1": 3}


def test_power_of_two_never_takes_the_worse_of_its_pair() -> None:
    f = snapshot_fleet(2, 1)
    p0, p1 = f.by_role("prefill")
    p0.add_prefill("a", 10_000)
    pol = create_policy("power_of_two", seed=1)
    assert all(pol.select([p0, p1], request(3)) is p1 for _ in range(20))


def test_prefix_aware_affinity_then_balance() -> None:
    f = snapshot_fleet(2, 1)
    p0, p1 = f.by_role("prefill")
    pol = create_policy("prefix_aware", balance_tokens=1000, balance_ratio=0.0)
    shared = list(range(3, 3 + 64))
    first = pol.select([p0, p1], request(80, prompt=shared + [1] * 16))
    # same 64-token prefix, different tail: same instance despite a small load gap
    first.add_prefill("r1", 500)
    again = pol.select([p0, p1], request(80, prompt=shared + [2] * 16))
    assert again is first
    # heavy imbalance beats affinity
    first.add_prefill("r2", 5000)
    other = pol.select([p0, p1], request(80, prompt=shared + [3] * 16))
    assert other is not first
    # text prompts hash by characters
    t = pol.select([p0, p1], request(40, prompt="x" * 400))
    assert pol.match(t, __import__("pdgate.policies.prefix_aware", fromlist=["x"]).block_hashes(
        "completions", {"prompt": "x" * 400})) > 0
