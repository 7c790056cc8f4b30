"""vLLM KV connector on pdgate's transfer engine (needs the ``vllm`` extra).

``--kv-transfer-config '{"kv_connector": "PdgateConnector",
"kv_connector_module_path": "pdgate.connector", ...}'``; see
:mod:`pdgate.connector.connector`.
"""

from pdgate.connector.connector import PdgateConnector

__all__ = ["PdgateConnector"]
