"""Fleet state kept by the gateway: counters, scraping, token counting, decisions."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from pdgate.config import ScrapeConfig, TokenizerConfig
from pdgate.fleet import Fleet, Instance
from pdgate.metrics import GatewayMetrics
from pdgate.state.scraper import MetricsScraper, parse_vllm_metrics
from pdgate.state.tokens import TokenCounter
from tests.unit.test_gateway import Env, req


def health(env: Env) -> dict[str, dict]:
    return {i["url"]: i for i in httpx.get(env.url + "/health").json()["instances"]}


def wait_for(cond, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def test_outstanding_prefill_tokens_and_decode_batch() -> None:
    e = Env()
    try:
        e.prefill[0].behaviour.hang_s = 0.5
        e.decode[0].behaviour.token_delay_s = 0.05
        out: list[httpx.Response] = []
        t = threading.Thread(target=lambda: out.append(e.post("/v1/completions", req(prompt=[5] * 300))))
        t.start()
        wait_for(lambda: health(e)[e.prefill[0].url]["outstanding_prefill_tokens"] == 300)
        assert health(e)[e.prefill[0].url]["prefill_jobs"] == 1
        t.join()
        with httpx.stream("POST", e.url + "/v1/completions", json=req(prompt=[5] * 40, stream=True,
                                                                       max_tokens=10)) as r:
            it = r.iter_lines()
            next(it)
            d = health(e)[e.decode[0].url]
            assert d["decode_batch"] == 1 and d["kv_tokens"] >= 40
            list(it)
        h = health(e)
        assert all(i["outstanding_prefill_tokens"] == 0 and i["decode_batch"] == 0 and i["kv_tokens"] == 0
                   and i["in_flight"] == 0 for i in h.values())
    finally:
        e.close()


def test_parse_vllm_metrics_sums_engines() -> None:
    text = ('# HELP x\nvllm:num_requests_running{engine="0"} 3\nvllm:num_requests_running{engine="1"} 2\n'
            'vllm:num_requests_waiting 7.0\nvllm:kv_cache_usage_perc{engine="0"} 0.5\nother 1\n')
    assert parse_vllm_metrics(text) == {"num_requests_running": 5.0, "num_requests_waiting": 7.0,
                                        "kv_cache_usage_perc": 0.5}


def test_scraper_fills_state_and_flags_staleness() -> None:
    e = Env(scrape={"interval_s": 0.05, "stale_after_s": 0.3})
    try:
        e.decode[0].behaviour.waiting = 4
        wait_for(lambda: health(e)[e.decode[0].url]["scraped"].get("num_requests_waiting") == 4.0)
        assert health(e)[e.decode[0].url]["scrape_age_s"] < 0.3
        assert f'pdgate_instance_scrape_stale{{instance="{e.decode[0].url}"}} 0.0' in e.metrics()
        e.decode[0].stop()
        wait_for(lambda: f'pdgate_instance_scrape_stale{{instance="{e.decode[0].url}"}} 1.0' in e.metrics())
        wait_for(lambda: health(e)[e.decode[0].url]["healthy"] is False)
        assert "pdgate_scrape_errors_total" in e.metrics()
    finally:
        e.close()


def test_instance_waiting_uses_fresh_scrape_only() -> None:
    i = Instance(url="http://x:1", role="prefill")
    i.add_prefill("a", 10)
    i.scraped, i.scraped_at = {"num_requests_waiting": 9.0}, time.monotonic()
    assert i.waiting_requests(1.0) == 9
    i.scraped_at = time.monotonic() - 5
    assert i.waiting_requests(1.0) == 1


def test_instance_running_uses_fresh_scrape_only() -> None:
    i = Instance(url="http://x:1", role="decode")
    i.acquire()
    i.scraped, i.scraped_at = {"num_requests_running": 6.0}, time.monotonic()
    assert i.running_requests(1.0) == 6        # includes requests other replicas sent
    i.scraped = {"num_requests_running": 0.0}
    assert i.running_requests(1.0) == 1        # never below the gateway's own legs
    i.scraped, i.scraped_at = {"num_requests_running": 6.0}, time.monotonic() - 5
    assert i.running_requests(1.0) == 1


async def test_token_counter_sources() -> None:
    m = GatewayMetrics()
    tc = TokenCounter(TokenizerConfig(), m)
    assert await tc.count("completions", {"prompt": [1, 2, 3]}) == 3
    assert await tc.count("completions", {"prompt": [[1, 2, 3, 4]]}) == 4
    assert await tc.count("completions", {"prompt": "abcdefgh"}) == 2   # estimate, counted
    assert 'pdgate_prompt_token_estimates_total{reason="no_tokenizer"} 1.0' in m.render()[0].decode()


def test_token_counter_uses_instance_tokenize_and_caches() -> None:
    e = Env(tokenizer={"use_instance": True}, route_policy="goodput")
    try:
        for _ in range(3):
            assert e.post("/v1/completions", req(prompt="one two three four")).status_code == 200
        assert e.decode[0].tokenize_calls == 1
        assert "pdgate_prompt_token_estimates_total{" not in e.metrics()
    finally:
        e.close()


def test_local_tokenizer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pdgate.localfleet.tiny_model import build_tiny_model

    try:
        build_tiny_model(tmp_path / "m")
    except Exception as ex:  # noqa: BLE001
        pytest.skip(f"cannot build the tiny model here: {ex!r}")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "m"))
    tc = TokenCounter(TokenizerConfig(path=str(tmp_path / "m")))
    text = "Decode is memory bound and prefill is compute bound."
    n = asyncio.run(tc.count("completions", {"prompt": text}))
    assert n == len(tok(text)["input_ids"])


def test_decisions_counted_priority_forwarded_slo_class() -> None:
    e = Env(priority={"forward_to_vllm": True}, slo={"classes": {"default": {}, "tight": {"ttft_s": 0.1}}})
    try:
        assert e.post("/v1/completions", req(slo_class="tight"), headers={"x-priority": "3"}).status_code == 200
        p, d = e.prefill[0].received[-1], e.decode[0].received[-1]
        assert p["priority"] == 3 and d["priority"] == 3
        assert "slo_class" not in p and "slo_class" not in d
        assert 'pdgate_route_decisions_total{choice="pd",policy="pd"} 1.0' in e.metrics()
        r = e.post("/v1/completions", req(), headers={"x-slo-class": "nope"})
        assert r.status_code == 400 and "SLO class" in r.json()["error"]["message"]
        r = e.post("/v1/completions", req(priority="high"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        assert len(e.prefill[0].received) == 1
    finally:
        e.close()


def test_deflected_request_skips_prefill_and_sends_no_kv_params() -> None:
    e = Env(route_policy="deflection")
    try:
        e.prefill[0].behaviour.hang_s = 1.0
        t = threading.Thread(target=lambda: e.post("/v1/completions", req(prompt=[5] * 5000)))
        t.start()
        wait_for(lambda: len(e.prefill[0].received) == 1)
        r = e.post("/v1/completions", req(prompt=[6] * 500))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "t0 t1 t2 t3 t4"
        assert len(e.prefill[0].received) == 1            # the second never reached prefill
        d = e.decode[0].received[-1]
        assert "kv_transfer_params" not in d and d["prompt"] == [6] * 500
        t.join()
        m = e.metrics()
        assert 'pdgate_route_decisions_total{choice="deflect",policy="deflection"} 1.0' in m
        assert 'pdgate_requests_total{outcome="success",route="deflect"} 1.0' in m
        assert all(i["deflected_in_flight"] == 0 and i["outstanding_prefill_tokens"] == 0
                   for i in health(e).values())
    finally:
        e.close()


def test_request_parallel_queues_and_disconnect_cancels() -> None:
    e = Env(admission_policy="request_parallel", request_parallel={"max_in_flight": 1})
    try:
        e.prefill[0].behaviour.hang_s = 0.6
        t = threading.Thread(target=lambda: e.post("/v1/completions", req()))
        t.start()
        wait_for(lambda: len(e.prefill[0].received) == 1)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(e.url + "/v1/completions", json=req(), timeout=0.2)   # queued, then gone
        assert "pdgate_admission_waiting_requests 1.0" in e.metrics() or "pdgate_admission_waiting_requests 0.0" in e.metrics()
        wait_for(lambda: "pdgate_admission_waiting_requests 0.0" in e.metrics())
        t.join()
        time.sleep(0.7)
        assert len(e.prefill[0].received) == 1              # the cancelled one never dispatched
        assert e.post("/v1/completions", req()).status_code == 200
        assert health(e)[e.prefill[0].url]["outstanding_prefill_tokens"] == 0
    finally:
        e.close()


async def test_scrape_once_direct() -> None:
    from tests.fakes import FakeInstance

    f = FakeInstance("x").start()
    try:
        fleet = Fleet([Instance(url=f.url, role="decode")])
        async with httpx.AsyncClient() as c:
            await MetricsScraper(fleet, c, ScrapeConfig()).scrape_once()
        assert fleet.instances[0].scraped["kv_cache_usage_perc"] == 0.25
        assert fleet.instances[0].scrape_fresh(1.0)
    finally:
        f.stop()


async def test_token_counter_words_mode() -> None:
    m = GatewayMetrics()
    tc = TokenCounter(TokenizerConfig(words=True), m)
    assert await tc.count("completions", {"prompt": "w1 w2  w3\nw4"}) == 4
    assert "pdgate_prompt_token_estimates_total{" not in m.render()[0].decode()


def test_fleet_add_remove_instances_at_run_time() -> None:
    from pdgate.fleet import Fleet

    fleet = Fleet([])
    a = fleet.add("http://a:1", "prefill")
    fleet.add("http://b:1", "decode", pool="long")
    assert [i.url for i in fleet.by_role("prefill")] == ["http://a:1"]
    try:
        fleet.add("http://a:1", "decode")
    except ValueError as e:
        assert "already" in str(e)
    else:
        raise AssertionError("duplicate URL accepted")
    before = fleet.instances
    assert fleet.remove("http://a:1") is a
    assert a in before and a not in fleet.instances
    assert fleet.remove("http://a:1") is None
    assert fleet.by_role("prefill") == []
