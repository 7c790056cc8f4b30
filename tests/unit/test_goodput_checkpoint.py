"""The goodput suite's checkpoint (``--resume``): finished runs survive a stopped suite."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdgate.bench import goodput as gp

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {"speed": 2.0, "profile": "a100-dsv2-lite", "slo_ttft": 2.0, "slo_tpot": 0.1,
            "decode_set": list(gp.DEFAULT_DECODE_SET), "window_s": None, "window_start_s": None, "seed": 0}


def _committed_run(config: str) -> dict[str, Any]:
    doc = json.loads((ROOT / "bench" / "results" / "goodput_quick.json").read_text())
    return next(r for r in doc["runs"] if r["config"] == config and r["trace"] == "azure-code")


def test_checkpoint_keeps_finished_runs_and_drops_failed_ones(tmp_path: Path) -> None:
    path = str(tmp_path / "goodput.partial.jsonl")
    runs, done = gp.checkpoint_open(path, SETTINGS, resume=True)  # nothing there yet: a new one
    assert runs == [] and done == set()
    ok = {"trace": "azure-code", "fleet": "2P2D", "rate_scale": 3.0, "config": "a", "metrics": {}}
    gp.checkpoint_add(path, ok)
    gp.checkpoint_add(path, {"trace": "azure-code", "fleet": "2P2D", "rate_scale": 3.0, "config": "b",
                             "error": "boom"})
    runs, done = gp.checkpoint_open(path, SETTINGS, resume=True)
    assert runs == [ok] and done == {("azure-code", "2P2D", 3.0, "a")}
    with pytest.raises(ValueError, match="other settings"):
        gp.checkpoint_open(path, {**SETTINGS, "speed": 1.0}, resume=True)
    runs, done = gp.checkpoint_open(path, SETTINGS, resume=False)  # without --resume: afresh
    assert runs == [] and len(Path(path).read_text().splitlines()) == 1


def test_resume_runs_only_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A suite stopped after its first run: ``--resume`` keeps it, runs the second only, writes the
    whole JSON and drops the checkpoint; other settings are refused."""
    if gp.vllm_router_bin() is None:
        pytest.skip("vllm-router not installed (bench extra)")
    kept = _committed_run("vllm-router/round_robin")
    fresh = _committed_run("pdgate/pooled+sjf")
    ran: list[str] = []

    def fake_run_one(spec: Any, *a: Any, **k: Any) -> dict[str, Any]:
        ran.append(spec.label)
        return fresh

    monkeypatch.setattr(gp, "run_one", fake_run_one)
    path = tmp_path / "goodput_quick.partial.jsonl"
    path.write_text(json.dumps({"settings": SETTINGS}) + "\n" + json.dumps(kept) + "\n")
    argv = ["--quick", "--traces", "azure-code", "--rates", "3", "--configs", "vllm-router/round_robin",
            "pooled+sjf", "--out", str(tmp_path), "--resume"]
    assert gp.main(argv) == 0
    assert ran == ["pdgate/pooled+sjf"]
    doc = json.loads((tmp_path / "goodput_quick.json").read_text())
    assert sorted(r["config"] for r in doc["runs"]) == ["pdgate/pooled+sjf", "vllm-router/round_robin"]
    assert doc["meta"]["resumed_runs"] == 1 and not path.exists()
    path.write_text(json.dumps({"settings": {**SETTINGS, "speed": 4.0}}) + "\n")
    assert gp.main(argv) == 2 and ran == ["pdgate/pooled+sjf"]
