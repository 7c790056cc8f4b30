"""A transfer peer in its own process, driven over stdin/stdout (JSON lines).

Usage: python peer_proc.py ENGINE_ID TLS GEOM_JSON SEED COMPAT

Allocates the KV cache described by GEOM_JSON (filled from SEED), registers
one region per layer, serves its metadata on a local TCP port, prints
``{"port": P, "pid": PID}`` and then answers commands:
``lease`` (req, ttl) -> token hex; ``notifs``; ``expired``; ``digest``
(layer, blocks) -> sha256 of those blocks; ``exit``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from kvlayout import KVGeom, block_bytes, fill
from pdgate.transfer import create_engine


def main() -> None:
    engine_id, tls, geom_json, seed, compat = sys.argv[1:6]
    g = KVGeom.from_json(geom_json)
    raw = fill(int(seed), g.total_bytes)
    eng = create_engine(engine_id, compat, transports=tls)
    base = raw.ctypes.data
    for layer in range(g.num_layers):
        eng.register(
            base + layer * g.layer_stride,
            g.region_len(),
            g.page_bytes,
            g.block_stride,
            g.num_blocks,
        )
    port = eng.listen("127.0.0.1", 0)
    print(json.dumps({"port": port, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        c = json.loads(line)
        cmd = c["cmd"]
        if cmd == "lease":
            out: object = eng.grant_lease(c["req"], c["ttl"]).hex()
        elif cmd == "notifs":
            out = [{**n, "msg": n["msg"].decode()} for n in eng.get_notifications()]
        elif cmd == "expired":
            out = eng.expired_leases()
        elif cmd == "digest":
            h = hashlib.sha256()
            for b in c["blocks"]:
                h.update(block_bytes(raw, g, c["layer"], b).tobytes())
            out = h.hexdigest()
        elif cmd == "exit":
            eng.close()
            print(json.dumps({"ok": True}), flush=True)
            return
        else:
            out = {"error": f"unknown {cmd}"}
        print(json.dumps({"ok": True, "out": out}), flush=True)


if __name__ == "__main__":
    main()
