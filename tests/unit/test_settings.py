"""Layered settings: defaults < file < PDGATE_* env < flags; every field reachable
from all three; ``pdgate check-config``; vllm-router flag names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdgate.cli import build_parser, main
from pdgate.config import GatewayConfig
from pdgate.settings import (
    ROUTER_ALIASES,
    config_from_args,
    env_layer,
    field_docs,
    leaves,
    resolve_config,
)


def _parse(*argv: str) -> GatewayConfig:
    return config_from_args(build_parser().parse_args(["check-config", *argv]), environ={})


def test_precedence_defaults_file_env_flags(tmp_path: Path) -> None:
    f = tmp_path / "gw.yaml"
    f.write_text("decode: [http://d:1]\nport: 9000\nhost: 10.0.0.1\n"
                 "timeouts: {prefill_s: 3, connect_s: 2}\n")
    env = {"PDGATE_PORT": "9100", "PDGATE_TIMEOUTS__PREFILL_S": "4", "PDGATE_LOG_LEVEL": "debug"}
    args = build_parser().parse_args(["check-config", "--config", str(f), "--port", "9200"])
    cfg = config_from_args(args, environ=env)
    assert cfg.port == 9200                      # flag > env > file
    assert cfg.timeouts.prefill_s == 4           # env > file
    assert cfg.timeouts.connect_s == 2           # file, sibling kept (deep merge)
    assert cfg.host == "10.0.0.1"                # file > default
    assert cfg.log_level == "debug"              # env > default
    assert cfg.timeouts.decode_idle_s == 300     # default


def test_config_file_from_env(tmp_path: Path) -> None:
    f = tmp_path / "gw.json"
    f.write_text(json.dumps({"decode": ["http://d:1"], "port": 1234}))
    assert resolve_config(environ={"PDGATE_CONFIG": str(f)}).port == 1234


def test_every_leaf_settable_from_env_and_flags() -> None:
    """Each field's derived env name and flag reach the field (none hand-listed)."""
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = {s for a in serve._actions for s in a.option_strings}
    ls = leaves()
    assert len(ls) > 40 and {("port",), ("timeouts", "prefill_s"), ("discovery", "namespace")} <= {
        lf.path for lf in ls}
    for leaf in ls:
        assert leaf.flag in flags, leaf.flag
        assert leaf.env.startswith("PDGATE_")
    # a sample of every kind, through env and flags
    env = {"PDGATE_DECODE": "http://a:1, http://b:2", "PDGATE_SCRAPE__ENABLED": "false",
           "PDGATE_POOLS": '{"short": {"max_tokens": 1024}}', "PDGATE_DECODE_POOLS": '["short", null]',
           "PDGATE_PRIORITY__MAX_WAIT_S": "none", "PDGATE_SLO__CLASSES": '{"default": {"ttft_s": 1}}'}
    cfg = resolve_config(environ=env)
    assert cfg.decode == ["http://a:1", "http://b:2"] and cfg.scrape.enabled is False
    assert cfg.pools["short"].max_tokens == 1024 and cfg.decode_pools == ["short", None]
    assert cfg.priority.max_wait_s is None and cfg.slo.classes["default"].ttft_s == 1
    cfg = _parse("--decode", "http://d:1", "--no-scrape.enabled", "--pools", '{"p": {}}',
                 "--slo.classes", '{"default": {"tpot_s": 0.5}}', "--priority.max-wait-s", "2")
    assert cfg.scrape.enabled is False and "p" in cfg.pools and cfg.slo.classes["default"].tpot_s == 0.5
    assert cfg.priority.max_wait_s == 2


def test_unknown_env_names_ignored_bad_json_reported() -> None:
    assert env_layer({"PDGATE_NO_VLLM": "1", "PDGATE_KV_LEASE_TTL_S": "3"}) == {}
    with pytest.raises(ValueError, match="PDGATE_POOLS"):
        env_layer({"PDGATE_POOLS": "{nope"})


def test_vllm_router_flag_names() -> None:
    cfg = _parse("--prefill", "http://p0:8000", "9000", "--prefill", "http://p1:8000", "none",
                 "--decode", "http://d0:8000", "--decode", "http://d1:8000",
                 "--policy", "least_load", "--decode-policy", "power_of_two", "--prometheus-port", "29000")
    assert cfg.prefill == ["http://p0:8000", "http://p1:8000"]     # bootstrap ports dropped
    assert cfg.decode == ["http://d0:8000", "http://d1:8000"]
    assert (cfg.prefill_policy, cfg.decode_policy) == ("least_load", "power_of_two")
    assert cfg.prometheus_port == 29000
    cfg = _parse("--service-discovery", "--service-discovery-namespace", "llm", "--service-discovery-port", "8100",
                 "--prefill-selector", "role=prefill", "--decode-selector", "role=decode")
    d = cfg.discovery
    assert (d.type, d.namespace, d.port, d.prefill_selector, d.decode_selector) == (
        "kubernetes", "llm", 8100, "role=prefill", "role=decode")
    assert all(len(p) == 2 for p in ROUTER_ALIASES)


def test_policy_is_the_default_of_both_legs() -> None:
    cfg = GatewayConfig(decode=["http://d:1"], policy="power_of_two")
    assert cfg.prefill_policy == cfg.decode_policy == "power_of_two"
    with pytest.raises(ValueError, match="unknown policy"):
        GatewayConfig(decode=["http://d:1"], policy="nope", prefill_policy="round_robin",
                      decode_policy="round_robin")


def test_check_config_prints_effective_config_reloadable(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", "--decode", "http://d:1", "--timeouts.prefill-s", "7"]) == 0
    out = capsys.readouterr().out
    data = yaml.safe_load(out)
    assert data["timeouts"]["prefill_s"] == 7 and data["decode"] == ["http://d:1"]
    f = tmp_path / "eff.yaml"
    f.write_text(out)
    assert resolve_config(f, environ={}) == GatewayConfig.model_validate(data)
    assert main(["check-config", "--decode", "http://d:1", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["port"] == 8000


def test_check_config_invalid_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", "--decode", "http://d:1", "--prefill-policy", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err and "unknown prefill_policy 'bogus'" in err
    with pytest.raises(SystemExit) as e:   # argparse: wrong type / bad choice
        main(["check-config", "--log-format", "xml"])
    assert e.value.code == 2


def test_docs_parsed_from_docstrings() -> None:
    from pdgate.config import TimeoutsConfig

    d = field_docs(TimeoutsConfig)
    assert d["connect_s"] == "TCP connect to an instance."
    assert field_docs(GatewayConfig)["prefill_policy"].startswith("routing policy names")


def test_bench_dispatch_and_version() -> None:
    out = subprocess.run([sys.executable, "-m", "pdgate", "bench", "replay", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "--trace" in out.stdout
    v = subprocess.run([sys.executable, "-m", "pdgate", "--version"], capture_output=True, text=True, timeout=60)
    import pdgate

    assert v.stdout.strip() == f"pdgate {pdgate.__version__}"


def test_sim_fleet_flags_from_file_and_env(tmp_path: Path) -> None:
    from pdgate.settings import apply_file_env_defaults

    f = tmp_path / "sim.yaml"
    f.write_text("time-scale: 5\nprefill: 4\nprofile: a100-dsv2-lite\nset: [max_num_seqs=8]\n")
    parser = build_parser()
    sim = parser.parse_args(["sim-fleet"])._sim_fleet_parser
    apply_file_env_defaults(sim, f, {"PDGATE_SIM_FLEET_PREFILL": "3", "PDGATE_SIM_FLEET_NO_PREFIX_CACHING": "true",
                                     "PDGATE_SIM_FLEET_SCHEDULING_POLICY": "priority"}, "PDGATE_SIM_FLEET_")
    args = parser.parse_args(["sim-fleet", "--decode", "2"])
    assert (args.time_scale, args.prefill, args.decode) == (5.0, 3, 2)      # file, env over file, flag
    assert args.no_prefix_caching is True and args.scheduling_policy == "priority"
    assert args.profile == "a100-dsv2-lite" and args.set == ["max_num_seqs=8"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefil: 2\n")
    with pytest.raises(ValueError, match="unknown keys"):
        apply_file_env_defaults(sim, bad, {}, "PDGATE_SIM_FLEET_")
    with pytest.raises(ValueError, match="not one of"):
        apply_file_env_defaults(sim, None, {"PDGATE_SIM_FLEET_SCHEDULING_POLICY": "lifo"}, "PDGATE_SIM_FLEET_")
    assert main(["sim-fleet", "--config", str(bad)]) == 2


def test_sim_fleet_refuses_bad_counts_and_speed(capsys: pytest.CaptureFixture[str]) -> None:
    """Usage errors exit 2 with one line, before any instance starts."""
    assert main(["sim-fleet", "--speed", "0"]) == 2
    assert "pdgate sim-fleet: --speed must be > 0 (got 0)" in capsys.readouterr().err
    assert main(["sim-fleet", "--time-scale", "-1"]) == 2
    assert "--speed must be > 0" in capsys.readouterr().err
    assert main(["sim-fleet", "--prefill", "0", "--decode", "0"]) == 2
    assert "at least one instance" in capsys.readouterr().err
    assert main(["sim-fleet", "--prefill", "-1", "--decode", "2"]) == 2
    assert "instance counts must be >= 0" in capsys.readouterr().err
