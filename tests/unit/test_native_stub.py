"""The hand-written ``pdgate/_native.pyi`` must match the compiled module."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdgate import _native

# The stub that ships next to the compiled module (what type checkers see).
STUB = Path(_native.__file__).resolve().parent / "_native.pyi"


def _public(names: set[str]) -> set[str]:
    return {n for n in names if not n.startswith("_") or n == "__version__"}


def _stub_names() -> set[str]:
    tree = ast.parse(STUB.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return _public(names)


def test_stub_exists_next_to_module() -> None:
    assert STUB.is_file(), STUB


def test_stub_and_module_export_the_same_names() -> None:
    runtime = _public(set(dir(_native)))
    stub = _stub_names()
    assert runtime - stub == set(), "in the module, missing from the stub"
    assert stub - runtime == set(), "in the stub, missing from the module"
    assert set(_native.__all__) == runtime


def test_stubtest_passes(tmp_path: Path) -> None:
    pytest.importorskip("mypy.stubtest")
    # Check the same pdgate that this test process imported.
    pkg_root = str(Path(_native.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([pkg_root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "pdgate._native"],
        cwd=tmp_path,  # keeps .mypy_cache out of the repo
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
