"""Typed config: file + flags precedence, validation errors, CLI exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from pdgate.cli import main
from pdgate.config import GatewayConfig, load_config


def test_flags_override_file(tmp_path: Path) -> None:
    f = tmp_path / "gw.yaml"
    f.write_text("prefill: [http://p:1/v1/]\ndecode: [http://d:2]\nport: 9000\n"
                 "timeouts: {prefill_s: 3}\n")
    cfg = load_config(f, port=9100, prefill=None)
    assert cfg.port == 9100                      # flag wins
    assert cfg.prefill == ["http://p:1"]          # file kept, URL normalized
    assert cfg.decode == ["http://d:2"]
    assert cfg.timeouts.prefill_s == 3 and cfg.timeouts.decode_idle_s == 300
    assert [i.role for i in cfg.instances()] == ["prefill", "decode"]


def test_json_config(tmp_path: Path) -> None:
    f = tmp_path / "gw.json"
    f.write_text(json.dumps({"decode": ["http://d:2"]}))
    assert load_config(f).prefill == []


@pytest.mark.parametrize("data", [
    {"prefill": ["http://p:1"]},                       # no decode
    {"decode": ["ftp://d"]},                           # bad scheme
    {"decode": ["http://d"], "prefill_policy": "nope"},  # unknown policy
    {"decode": ["http://d"], "bogus": 1},              # unknown field
    {"decode": ["http://d"], "port": 70000},
])
def test_invalid_configs_rejected(data: dict) -> None:
    with pytest.raises(ValidationError):
        GatewayConfig.model_validate(data)


def test_cli_invalid_config_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--prefill", "http://p:1"]) == 2
    assert "at least one decode instance" in capsys.readouterr().err


def test_cli_version() -> None:
    out = subprocess.run([sys.executable, "-m", "pdgate", "--version"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("pdgate ")
