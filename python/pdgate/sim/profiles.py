"""Instance profiles: scheduler limits and the step-time model of a simulated vLLM.

A profile is a YAML data file under ``pdgate/sim/profiles/`` (or any path)
holding the scheduler configuration of one vLLM instance and the coefficients
of its step-time model. Every file states where its numbers come from.

Step-time model (seconds of simulated time), for one engine step that runs
prefill chunks ``c_i`` (tokens) at context offsets ``o_i`` (tokens already in
the KV cache before the chunk) and ``B`` decode sequences with contexts
``k_j`` (tokens)::

    t_step = step_base_s
           + prefill_token_s * sum_i c_i                     (linear, GEMMs)
           + prefill_attn_s  * sum_i c_i * (o_i + c_i / 2)   (attention, chunk x context)
           + decode_seq_s    * B                             (per sequence)
           + decode_kv_token_s * sum_j k_j                   (KV cache read)

The prefill part is the form used by Kairos (arXiv 2607.02043) and
Sarathi-Serve (Agrawal et al., OSDI'24): a chunk's cost is linear in its
tokens plus an attention term in chunk x context; the decode part is linear
in batch size and in KV tokens read (memory-bound attention). A step with
both prefill chunks and decodes (chunked prefill, vLLM V1's default) pays
one ``step_base_s``.

KV transfer between a prefill and a decode instance (NixlConnector pull)::

    t_transfer = kv_transfer_latency_s + tokens * kv_bytes_per_token / kv_transfer_bandwidth_Bps

``request_overhead_s`` models the API server's per-request cost (parsing,
tokenization, scheduling hand-off) added before a request joins the queue.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

PROFILE_DIR = Path(__file__).parent / "profiles"


@dataclasses.dataclass(frozen=True)
class Profile:
    """One simulated instance type (hardware + model + vLLM config).

    Attributes:
        name: profile name (file stem).
        description: hardware, model, and where the coefficients come from.
        block_size: KV block size in tokens (vLLM default 16).
        num_gpu_blocks: KV cache capacity in blocks.
        max_num_seqs: cap on running requests per step.
        max_num_batched_tokens: token budget per step.
        long_prefill_token_threshold: cap on one request's prefill tokens per
            step when more than one request is eligible (0 = off).
        max_model_len: context limit (prompt + output tokens).
        step_base_s ... decode_kv_token_s: step-time coefficients (seconds,
            seconds per token, seconds per token-pair; see module doc).
        kv_bytes_per_token: KV cache bytes per token (all layers, K and V).
        kv_transfer_bandwidth_Bps: P->D transfer bandwidth, bytes/s.
        kv_transfer_latency_s: fixed cost per transfer, seconds.
        request_overhead_s: per-request API overhead, seconds.
        kv_hold_timeout_s: how long a prefill instance keeps blocks for a
            remote decode that never reads them (vLLM
            ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, default 480 s).
        step_noise_sigma, step_noise_tau_s: a slowly varying speed factor on
            every step, log-normal with median 1 (0: none; see
            :mod:`pdgate.sim.noise`): ``cpu-tiny`` on a shared host has it, a
            GPU profile does not.
        vocab_size: token ids emitted are in ``[0, vocab_size)``.
        sources: citations for the numbers.
    """

    name: str
    description: str = ""
    block_size: int = 16
    num_gpu_blocks: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0
    max_model_len: int = 32768
    step_base_s: float = 0.005
    prefill_token_s: float = 3e-5
    prefill_attn_s: float = 1e-9
    decode_seq_s: float = 5e-5
    decode_kv_token_s: float = 5e-8
    kv_bytes_per_token: int = 131072
    kv_transfer_bandwidth_Bps: float = 25e9
    kv_transfer_latency_s: float = 0.001
    request_overhead_s: float = 0.0
    kv_hold_timeout_s: float = 480.0
    step_noise_sigma: float = 0.0
    step_noise_tau_s: float = 1.0
    vocab_size: int = 32000
    sources: tuple[str, ...] = ()

    def step_time(self, prefill_chunks: list[tuple[int, int]], decode_contexts: list[int]) -> float:
        """Duration in seconds of one step (see module doc).

        Args:
            prefill_chunks: ``(chunk_tokens, context_offset_tokens)`` per
                request that computes prompt tokens this step.
            decode_contexts: context length in tokens of each decoding request.
        """
        if not prefill_chunks and not decode_contexts:
            return 0.0
        t = self.step_base_s
        for c, o in prefill_chunks:
            t += self.prefill_token_s * c + self.prefill_attn_s * c * (o + c / 2.0)
        if decode_contexts:
            t += self.decode_seq_s * len(decode_contexts) + self.decode_kv_token_s * sum(decode_contexts)
        return t

    def transfer_time(self, tokens: int) -> float:
        """Seconds to move ``tokens`` tokens of KV cache from prefill to decode."""
        return self.kv_transfer_latency_s + tokens * self.kv_bytes_per_token / self.kv_transfer_bandwidth_Bps

    def replace(self, **changes: Any) -> "Profile":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["sources"] = list(self.sources)
        return d


def available_profiles() -> list[str]:
    """Names of the profiles shipped in ``pdgate/sim/profiles/``."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(name_or_path: str | os.PathLike[str], **overrides: Any) -> Profile:
    """Load a profile by shipped name (``a100-dsv2-lite``) or YAML path.

    Unknown keys are an error (a typo must not silently fall back to a default).
    """
    p = Path(name_or_path)
    if not p.suffix:
        p = PROFILE_DIR / f"{name_or_path}.yaml"
    with open(p) as f:
        data = yaml.safe_load(f) or {}
    data.setdefault("name", p.stem)
    data["sources"] = tuple(data.get("sources") or ())
    fields = {f.name for f in dataclasses.fields(Profile)}
    unknown = set(data) - fields
    if unknown:
        raise ValueError(f"profile {p}: unknown keys {sorted(unknown)}")
    data.update(overrides)
    for fld in dataclasses.fields(Profile):  # YAML reads "2.5e10" as a string
        if fld.name in data and fld.type in ("int", "float"):
            data[fld.name] = (int if fld.type == "int" else float)(data[fld.name])
    return Profile(**data)
