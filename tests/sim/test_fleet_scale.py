"""Many streams across a dozen instances in one process; CLI; harness helpers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx

from pdgate.bench.metrics import RequestRecord
from pdgate.sim import SimFleet
from pdgate.sim.harness import slo_attainment, to_sim_time
from tests.sim.conftest import FAST


def test_hundreds_of_streams_across_twelve_instances() -> None:
    n_streams, tokens = 300, 20
    with SimFleet(0, 0, 12, profile=FAST, time_scale=2.0) as fleet:
        urls = fleet.both_urls

        async def one(c: httpx.AsyncClient, i: int) -> int:
            body = {"prompt": list(range(i, i + 64)), "max_tokens": tokens, "stream": True}
            got = 0
            async with c.stream("POST", urls[i % 12] + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    got += line.startswith("data: {")
            return got

        async def main() -> list[int]:
            limits = httpx.Limits(max_connections=n_streams)
            async with httpx.AsyncClient(timeout=60, limits=limits) as c:
                return await asyncio.gather(*[one(c, i) for i in range(n_streams)])

        t = time.perf_counter()
        got = asyncio.run(main())
        wall = time.perf_counter() - t
        stats = fleet.stats()
    assert got == [tokens] * n_streams
    assert sum(s["requests"] for s in stats) == n_streams and len(stats) == 12
    assert wall < 20


def test_cli_sim_fleet_prints_urls_and_serves(tmp_path) -> None:  # type: ignore[no-untyped-def]
    info = tmp_path / "info.json"
    p = subprocess.Popen([sys.executable, "-m", "pdgate", "sim-fleet", "--prefill", "1", "--decode", "2",
                          "--profile", "h100-llama3-8b", "--speed", "5", "--info", str(info),
                          "--set", "max_num_seqs=8"], stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()  # type: ignore[union-attr]
        desc = json.loads(line)
        assert desc["time_scale"] == 5.0 and desc["profile"] == "h100-llama3-8b"
        assert len(desc["urls"]["decode"]) == 2 and json.loads(info.read_text()) == desc
        r = httpx.post(desc["urls"]["prefill"][0] + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        p.terminate()
        assert p.wait(10) == 0


def test_to_sim_time_and_slo_attainment_by_hand() -> None:
    a = RequestRecord(send_s=0.0, chunk_times_s=[0.5, 0.6, 0.7], success=True, usage_output_tokens=3)
    b = RequestRecord(send_s=1.0, chunk_times_s=[2.5, 3.5], success=True, usage_output_tokens=2)
    c = RequestRecord(success=False)
    sim = to_sim_time([a, b, c], 2.0)
    assert sim[0].ttft_s == 1.0 and abs(sim[0].tpot_s - 0.2) < 1e-9 and a.ttft_s == 0.5
    # SLO ttft 2 s, tpot 0.5 s: a meets (1.0, 0.2); b (ttft 3.0, tpot 2.0) meets only at scale 4; c failed
    att = slo_attainment(sim, 2.0, 0.5, (1.0, 2.0, 4.0))
    assert att["1"] == 1 / 3 and att["2"] == 1 / 3 and att["4"] == 2 / 3


def test_sim_tokenizer_round_trips_and_matches_server_count(pd_fleet) -> None:  # type: ignore[no-untyped-def]
    from pdgate.bench.prompts import PromptSynthesizer
    from pdgate.bench.traces import TraceRequest
    from pdgate.sim.server import SimTokenizer

    tok = SimTokenizer(1000)
    assert tok.encode(tok.decode([5, 999, 0])) == [5, 999, 0]
    synth = PromptSynthesizer(tok, prompt_mode="text", seed=1)
    p = synth.synthesize(TraceRequest(arrival_s=0, prompt_tokens=300, output_tokens=1, hash_ids=[7]))
    assert p.token_error == 0
    r = httpx.post(pd_fleet.both_urls[0] + "/v1/completions", json={"prompt": p.prompt, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == 300
