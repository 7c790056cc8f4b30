"""``event_loop``: which loop ``pdgate serve`` runs on, and that the gateway serves on it."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from pdgate.config import GatewayConfig
from pdgate.gateway.serve import event_loop_runner


def test_auto_and_uvloop_run_on_uvloop_asyncio_on_the_standard_loop() -> None:
    seen: dict[str, str] = {}

    async def which(name: str) -> None:
        seen[name] = type(asyncio.get_running_loop()).__module__

    for name in ("auto", "uvloop", "asyncio"):
        event_loop_runner(name)(which(name))
    assert seen["auto"].startswith("uvloop") and seen["uvloop"].startswith("uvloop")
    assert seen["asyncio"].startswith("asyncio")


def test_without_uvloop_auto_falls_back_and_uvloop_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop -> ImportError
    assert event_loop_runner("auto") is asyncio.run
    with pytest.raises(ValueError, match="uvloop is not installed"):
        event_loop_runner("uvloop")


def test_config_refuses_an_unknown_loop() -> None:
    assert GatewayConfig(decode=["http://d:1"]).event_loop == "auto"
    with pytest.raises(ValueError, match="event_loop"):
        GatewayConfig.model_validate(json.loads('{"decode": ["http://d:1"], "event_loop": "trio"}'))

