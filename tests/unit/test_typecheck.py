"""The Python package type-checks: ``mypy python/pdgate`` reports no error.

Runs mypy with its default settings against the installed dependencies
(vLLM, transformers, prometheus_client, ...), so a change that passes a wrong
type across the gateway, policies, simulator or connector fails here. A cold
run takes about 1.5 min on 2 cores; the cache goes to a temporary folder.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_reports_no_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "python/pdgate"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "Success: no issues found" in proc.stdout
