"""Route policies (pd, dedicated, deflection, goodput) over fixed fleet snapshots."""

from __future__ import annotations

from pdgate.policies import create_policy
from tests.fakes import request, route_context, snapshot_fleet

#: A simple cost model: 10 ms per step, 0.1 ms per prompt token, 1 ms per decode sequence.
PRED = {"step_base_s": 0.01, "prefill_token_s": 1e-4, "prefill_attn_s": 0.0, "decode_seq_s": 1e-3,
        "decode_kv_token_s": 0.0, "kv_transfer_bandwidth_Bps": 1e12, "kv_transfer_latency_s": 0.001,
        "max_num_batched_tokens": 4096, "long_prefill_token_threshold": 0, "refit": False}


def ctx_for(fleet, **cfg):  # type: ignore[no-untyped-def]
    cfg.setdefault("predictor", PRED)
    return route_context(fleet, **cfg)


def test_pd_route_uses_prefill_policy() -> None:
    f = snapshot_fleet(2, 2)
    f.by_role("prefill")[0].add_prefill("x", 3000)
    d = create_policy("pd").decide(ctx_for(f), request(100))
    assert d.kind == "pd" and d.prefill.url == "http://p1:1" and d.decode is None
    assert d.predicted["ttft_s"] > 0


def test_no_prefill_instances_means_decode_only() -> None:
    f = snapshot_fleet(0, 2)
    for name in ("pd", "dedicated", "deflection", "goodput"):
        d = create_policy(name, config=ctx_for(f).config).decide(ctx_for(f), request(100))
        assert d.kind == "decode_only", name


POOLS = {"short": {"max_tokens": 4096}, "long": {"min_tokens": 4096}}
POOL_OF = {"p0": "short", "d0": "short", "p1": "long", "d1": "long"}


def test_dedicated_long_prompt_lands_in_long_pool() -> None:
    f = snapshot_fleet(2, 2, pools=POOLS, pool_of=POOL_OF)
    ctx = ctx_for(f, pools=POOLS)
    pol = create_policy("dedicated")
    long = pol.decide(ctx, request(9000))
    assert long.prefill.url == "http://p1:1" and long.choice == "pool:long"
    assert [i.url for i in long.decode_candidates] == ["http://d1:1"]
    short = pol.decide(ctx, request(100))
    assert short.prefill.url == "http://p0:1" and short.choice == "pool:short"
    # even when the short pool is busier, short prompts stay there
    f.by_role("prefill")[0].add_prefill("x", 50_000)
    assert pol.decide(ctx, request(100)).prefill.url == "http://p0:1"


def test_deflection_not_when_idle() -> None:
    f = snapshot_fleet(1, 2)
    d = create_policy("deflection").decide(ctx_for(f), request(1000))
    assert d.kind == "pd"


def test_deflection_under_burst_to_best_decode() -> None:
    f = snapshot_fleet(1, 2)
    p0 = f.by_role("prefill")[0]
    for i in range(5):
        p0.add_prefill(f"q{i}", 4000)           # 2 s of prefill queued
    d0, d1 = f.by_role("decode")
    d0.add_decode("busy", 500, tpot_slo_s=0.1, output_tokens=100)
    d = create_policy("deflection").decide(ctx_for(f), request(1000))
    assert d.kind == "deflect" and d.decode is d1    # d1 is idle: smallest TTFT
    assert d.predicted["ttft_s"] < d.predicted["pd_ttft_s"]


def test_deflection_constraints() -> None:
    f = snapshot_fleet(1, 1)
    p0 = f.by_role("prefill")[0]
    for i in range(5):
        p0.add_prefill(f"q{i}", 4000)
    (d0,) = f.by_role("decode")
    ctx = ctx_for(f)
    pol = create_policy("deflection", config=ctx.config)
    assert pol.decide(ctx, request(1000)).kind == "deflect"
    d0.deflected_in_flight = 1                    # one deflected prefill at a time
    assert pol.decide(ctx, request(1000)).kind == "pd"
    d0.deflected_in_flight = 0
    d0.add_decode("tight", 100, tpot_slo_s=0.05, output_tokens=50)  # 1000-token chunk = 0.11 s step
    assert pol.decide(ctx, request(1000)).kind == "pd"
    assert pol.decide(ctx, request(200)).kind == "deflect"          # 0.03 s step fits
    # alpha: deflected TTFT must be <= alpha x the prefill path's
    ctx2 = ctx_for(f, deflection={"alpha": 0.01})
    assert create_policy("deflection", config=ctx2.config).decide(ctx2, request(200)).kind == "pd"
    # TTFT SLO bound
    assert pol.decide(ctx, request(200, ttft_slo_s=0.001)).kind == "pd"


def test_goodput_prefers_pair_meeting_slo() -> None:
    f = snapshot_fleet(2, 2)
    p0, p1 = f.by_role("prefill")
    for i in range(10):
        p0.add_prefill(f"q{i}", 4000)              # p0: ~4 s queue, misses a 2 s TTFT SLO
    ctx = ctx_for(f, goodput={"allow_deflection": False})
    d = create_policy("goodput", config=ctx.config).decide(ctx, request(1000))
    assert d.kind == "pd" and d.prefill is p1 and d.decode is not None
    assert d.predicted["ttft_s"] < 2.0


def test_goodput_deflects_when_prefill_is_swamped_and_spares_decoders() -> None:
    f = snapshot_fleet(1, 2)
    (p0,) = f.by_role("prefill")
    for i in range(10):
        p0.add_prefill(f"q{i}", 4000)
    d0, d1 = f.by_role("decode")
    for i in range(20):                             # d0 decodes 20 requests at a 25 ms TPOT target
        d0.add_decode(f"r{i}", 100, tpot_slo_s=0.035, output_tokens=4)
    ctx = ctx_for(f)
    d = create_policy("goodput", config=ctx.config).decide(ctx, request(1000))
    assert d.kind == "deflect" and d.decode is d1
    assert d.predicted["ttft_s"] <= 2.0


def test_goodput_respects_max_deflected_per_decode() -> None:
    f = snapshot_fleet(1, 1)
    (p0,) = f.by_role("prefill")
    for i in range(10):
        p0.add_prefill(f"q{i}", 4000)
    f.by_role("decode")[0].deflected_in_flight = 1
    ctx = ctx_for(f)
    d = create_policy("goodput", config=ctx.config).decide(ctx, request(1000))
    assert d.kind == "pd"


def test_positional_pools_in_config() -> None:
    from pdgate.config import GatewayConfig
    from pdgate.fleet import Fleet

    cfg = GatewayConfig(prefill=["http://a:1", "http://b:1"], decode=["http://c:1", "http://e:1"],
                        prefill_pools=["short", "long"], decode_pools=["short"], pools=POOLS)
    assert [(i.url, i.pool) for i in Fleet.from_config(cfg).instances] == [
        ("http://a:1", "short"), ("http://b:1", "long"), ("http://c:1", "short"), ("http://e:1", None)]


def test_presets_are_valid_configs() -> None:
    from pdgate.config import GatewayConfig
    from pdgate.presets import routing_presets

    for label, cfg in routing_presets("a100-dsv2-lite", speed=2.0).items():
        c = GatewayConfig(prefill=["http://p0:1", "http://p1:1"], decode=["http://d0:1", "http://d1:1"], **cfg)
        assert c.slo.classes["default"].ttft_s == 1.0, label
    c = GatewayConfig(prefill=["http://p0:1", "http://p1:1"], decode=["http://d0:1", "http://d1:1"],
                      **routing_presets()["dedicated"])
    assert [i.pool for i in c.instances()] == ["short", "long", "short", "long"]
