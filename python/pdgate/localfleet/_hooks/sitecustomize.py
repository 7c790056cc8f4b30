"""Start-up hook for the local fleet's vLLM processes (on their PYTHONPATH only).

NIXL's Python agent hard-codes a zero delay for its progress thread
(``agent_config.pthrDelay = 0`` in ``nixl_cu1x/_api.py``), so every vLLM
instance using NixlConnector keeps one thread spinning at a full core, idle or
not. On a 2-core machine running three instances those spinners starved the
model workers: NixlConnector pulls and even plain prefills stalled for
minutes. With ``PDGATE_NIXL_PROGRESS_DELAY_US`` set (the local fleet sets it),
this hook gives the progress thread that delay, in microseconds, between its
polls. Nothing else is changed; without the variable this file does nothing.
Being a ``sitecustomize``, it shadows any other one on the path in those
processes (the local fleet needs none).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_BINDINGS = ("nixl_cu13._bindings", "nixl_cu12._bindings", "nixl_rocm._bindings")


def _patch(bindings: ModuleType, delay_us: int) -> None:
    base = bindings.nixlAgentConfig  # type: ignore[attr-defined]
    if getattr(base, "_pdgate_delay_us", None) is not None:
        return

    class _DelayedProgressConfig(base):  # type: ignore[misc, valid-type]
        _pdgate_delay_us = delay_us

        def __setattr__(self, name: str, value: object) -> None:
            if name == "pthrDelay" and isinstance(value, int) and value < delay_us:
                value = delay_us
            super().__setattr__(name, value)

    bindings.nixlAgentConfig = _DelayedProgressConfig  # type: ignore[attr-defined]


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, delay_us: int) -> None:
        self.inner, self.delay_us = inner, delay_us

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        try:
            _patch(module, self.delay_us)
        except Exception as e:  # noqa: BLE001 - a changed NIXL runs unpatched; never fail its import
            print(f"pdgate local fleet: NIXL progress delay not applied ({e!r})", file=sys.stderr)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches NIXL's bindings module when (and only when) it gets imported."""

    def __init__(self, delay_us: int) -> None:
        self.delay_us = delay_us

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _BINDINGS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, self.delay_us)
        return spec


_delay = os.environ.get("PDGATE_NIXL_PROGRESS_DELAY_US", "")
if _delay.isdigit() and int(_delay) > 0:
    sys.meta_path.insert(0, _Finder(int(_delay)))
