"""The prefill leg's body and the JSON codec of the proxy's legs.

The prefill leg follows vLLM's NixlConnector protocol (see vLLM's
``examples/online_serving/disaggregated_serving`` proxies and
../shared/FIELD_NOTES.md): the client's body with ``max_tokens=1``, no
streaming, and ``kv_transfer_params`` asking the prefill instance to keep
the KV cache for a remote decode.
"""

from __future__ import annotations

import json
from typing import Any

try:  # orjson (when installed) encodes a long token-id prompt ~50x faster than json
    import orjson as _orjson

    def _dumps(obj: Any) -> bytes:
        try:
            return _orjson.dumps(obj)
        except TypeError:  # orjson.JSONEncodeError: e.g. integers over 64 bits
            return json.dumps(obj, separators=(",", ":")).encode()

    _loads = _orjson.loads
except ImportError:  # pragma: no cover - depends on the environment
    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    _loads = json.loads  # type: ignore[assignment]

#: The request-side ``kv_transfer_params`` that asks a prefill instance to
#: keep the KV cache for a remote decode (vLLM NixlConnector protocol).
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body derived from the client's (a new dict).

    ``max_tokens`` (and ``max_completion_tokens`` when given) become 1,
    ``stream`` false; ``stream_options`` and ``min_tokens`` are removed
    because vLLM rejects or mis-handles them on a 1-token non-stream request.
    """
    p = dict(body)
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["stream"] = False
    p.pop("stream_options", None)
    p.pop("min_tokens", None)
    p["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return p
