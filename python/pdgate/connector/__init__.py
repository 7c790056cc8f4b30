"""vLLM KV connector on pdgate's transfer engine (needs the ``vllm`` extra).

``--kv-transfer-config '{"kv_connector": "PdgateConnector",
"kv_connector_module_path": "pdgate.connector", ...}'``; see
:mod:`pdgate.connector.connector`. ``PdgateConnector`` is imported on first
access, so :mod:`pdgate.connector.sidecar` (the metrics exporter) imports
without vLLM.
"""

from typing import Any

__all__ = ["PdgateConnector"]


def __getattr__(name: str) -> Any:
    if name == "PdgateConnector":
        from pdgate.connector.connector import PdgateConnector

        return PdgateConnector
    raise AttributeError(f"module 'pdgate.connector' has no attribute {name!r}")
