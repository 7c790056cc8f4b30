"""The local fleet's start-up hook gives NIXL's progress thread a pause.

NIXL's Python agent sets ``pthrDelay = 0`` (a progress thread spinning a whole
core per vLLM instance); ``pdgate/localfleet/_hooks/sitecustomize.py`` raises
it to ``PDGATE_NIXL_PROGRESS_DELAY_US`` in the processes the local fleet
starts, and does nothing elsewhere.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pdgate.localfleet.vllm_server as vs
import pytest
from pdgate.localfleet import VllmServerSpec

HOOKS = Path(vs.__file__).parent / "_hooks"

PROBE = """
import sys
from nixl._api import nixl_agent_config  # imports the bindings through the hook
mod = next(m for n, m in sys.modules.items() if n.endswith("._bindings") and n.startswith("nixl_"))
cfg = mod.nixlAgentConfig()
cfg.pthrDelay = 0          # what nixl's agent does
print(cfg.pthrDelay)
"""


def run_probe(env_delay: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "PDGATE_NIXL_PROGRESS_DELAY_US"}
    env["PYTHONPATH"] = str(HOOKS)
    if env_delay is not None:
        env["PDGATE_NIXL_PROGRESS_DELAY_US"] = env_delay
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl comes with the vllm extra")
def test_hook_raises_the_progress_delay_only_when_asked() -> None:
    assert run_probe("500") == 500
    assert run_probe(None) == 0        # no variable: NIXL's own zero
    assert run_probe("0") == 0


def test_nixl_servers_get_the_hook_and_others_do_not() -> None:
    nixl = VllmServerSpec(model_dir="m", port=1, role="prefill", connector="NixlConnector").env()
    assert nixl["PDGATE_NIXL_PROGRESS_DELAY_US"] == str(vs.NIXL_PROGRESS_DELAY_US)
    assert str(HOOKS) in nixl["PYTHONPATH"].split(os.pathsep)
    assert (HOOKS / "sitecustomize.py").is_file()
    plain = VllmServerSpec(model_dir="m", port=1, role="both").env()
    assert str(HOOKS) not in plain.get("PYTHONPATH", "").split(os.pathsep)


def test_a_nixl_without_the_expected_bindings_still_imports(capsys: pytest.CaptureFixture[str]) -> None:
    """If NIXL renamed or sealed its config class, the hook must not break vLLM's import."""
    import importlib.util
    import types

    spec = importlib.util.spec_from_file_location("pdgate_hook_probe", HOOKS / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)

    class Inner:
        def create_module(self, spec: object) -> None:
            return None

        def exec_module(self, module: types.ModuleType) -> None:
            module.something_else = 1  # no nixlAgentConfig

    mod = types.ModuleType("nixl_cu13._bindings")
    hook._PatchingLoader(Inner(), 500).exec_module(mod)
    assert mod.something_else == 1
    assert "NIXL progress delay not applied" in capsys.readouterr().err
