"""Latency predictor: TTFT on the prefill path, TTFT if deflected, decode step time.

Cost model (seconds), the form of Sarathi-Serve (Agrawal et al., "Taming
Throughput-Latency Tradeoff in LLM Inference with Sarathi-Serve", OSDI'24)
and Kairos (arXiv 2607.02043) for chunked prefill, and of the simulator's
profiles (:mod:`pdgate.sim.profiles`), so a profile's numbers seed it:

- one engine step that prefills chunks ``c_i`` at context offsets ``o_i`` and
  decodes ``B`` sequences holding ``K`` KV tokens in all::

      t_step = step_base + prefill_token * sum c_i
             + prefill_attn * sum c_i (o_i + c_i / 2)
             + decode_seq * B + decode_kv_token * K

  (linear GEMM cost per token, attention cost in chunk x context; decode is
  memory bound: per sequence and per KV token read);
- prefilling a queue of prompts ``n_1..n_m`` is replayed step by step as
  vLLM V1's scheduler packs it (budget ``max_num_batched_tokens``, one
  prompt capped at ``long_prefill_token_threshold`` per step when several
  are eligible); summing the steps until the last prompt is done gives::

      t_prefill = step_base * S + prefill_token * sum c + prefill_attn * sum c (o + c/2)

  (for a prompt prefilled alone the attention sum is exactly ``n^2 / 2``);

- KV transfer (NixlConnector pull)::

      t_transfer = kv_transfer_latency + n * kv_bytes_per_token / bandwidth

TTFT on the P/D path = ``t_prefill(queue ahead + own) + t_transfer +
t_step(decode, B+1)``; deflected (Kairos) = the decode instance prefills the
prompt in chunks beside its ``B`` running decodes. Goodput as the fraction of
requests meeting their SLOs follows DistServe (Zhong et al., OSDI'24).

Online refit: the coefficients are written ``theta_j = theta0_j * w_j`` and
``w`` is a ridge regression toward 1 (the profile) over a sliding window of
the gateway's own observations: prefill-leg latencies (features: steps,
tokens, attention) and inter-token gaps of decode streams (features: 1, B,
K). The prior counts as ``prior_weight`` observations, so a few noisy
samples cannot swing the model. Errors are exported as
``pdgate_predictor_relative_error_ratio{what}`` (absolute, relative) and
``pdgate_predictor_bias_ratio{what}`` (signed moving average).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, Sequence

from pdgate.config import PredictorConfig


@dataclass
class Coefficients:
    """Cost-model coefficients (seconds, seconds per token, per token-pair; bytes/s)."""

    step_base_s: float = 0.005
    prefill_token_s: float = 3e-5
    prefill_attn_s: float = 1e-9
    decode_seq_s: float = 5e-5
    decode_kv_token_s: float = 5e-8
    kv_bytes_per_token: int = 131072
    kv_transfer_bandwidth_Bps: float = 25e9
    kv_transfer_latency_s: float = 0.001
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0
    decode_max_num_batched_tokens: int = 0          # 0: as max_num_batched_tokens
    decode_long_prefill_token_threshold: int = -1   # -1: as long_prefill_token_threshold

    def budget(self, on_decode: bool = False) -> tuple[int, int]:
        """(token budget per step, long-prefill chunk cap) of a prefill or a decode instance."""
        if not on_decode:
            return self.max_num_batched_tokens, self.long_prefill_token_threshold
        b = self.decode_max_num_batched_tokens or self.max_num_batched_tokens
        t = self.decode_long_prefill_token_threshold
        return b, (self.long_prefill_token_threshold if t < 0 else t)

    @classmethod
    def from_config(cls, cfg: PredictorConfig) -> "Coefficients":
        """Defaults, then the named profile, then explicit config fields.

        Raises:
            FileNotFoundError / ValueError: the profile cannot be loaded.
        """
        c = cls()
        if cfg.profile:
            from pdgate.sim.profiles import load_profile

            prof = load_profile(cfg.profile)
            for f in fields(cls):
                if hasattr(prof, f.name):
                    setattr(c, f.name, getattr(prof, f.name))
        for f in fields(cls):
            v = getattr(cfg, f.name, None)
            if v is not None:
                setattr(c, f.name, v)
        if cfg.time_scale != 1.0:
            for name in ("step_base_s", "prefill_token_s", "prefill_attn_s", "decode_seq_s",
                         "decode_kv_token_s", "kv_transfer_latency_s"):
                setattr(c, name, getattr(c, name) / cfg.time_scale)
            c.kv_transfer_bandwidth_Bps *= cfg.time_scale
        return c


class _RidgeToPrior:
    """Sliding-window ridge regression of ``y ~ sum_j w_j x_j`` toward ``w = 1``.

    Keeps the normal equations' sums (``A = sum x x^T``, ``b = sum x y``) up
    to date as observations enter and leave the window, so :meth:`add` costs
    O(d^2) and :meth:`solve` O(d^3), whatever the window (it used to rebuild
    the sums from every kept observation, O(window * d^2), ~2 ms in Python at
    512 observations: on the gateway's hot path). The sums are rebuilt from the
    window every ``window`` additions, which bounds floating-point drift.
    The estimate: ``(A + lam I) w = b + lam 1`` with ``lam = prior_weight *
    trace(A) / (d n)`` (ridge toward the profile's coefficients).
    """

    def __init__(self, dim: int, window: int, prior_weight: float = 8.0) -> None:
        self.dim = dim
        self.obs: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self.prior_weight = prior_weight
        self.w = [1.0] * dim
        self._a = [[0.0] * dim for _ in range(dim)]
        self._b = [0.0] * dim
        self._adds = 0

    def _accumulate(self, x: Sequence[float], y: float, sign: float) -> None:
        a, b = self._a, self._b
        for i in range(self.dim):
            xi = sign * x[i]
            b[i] += xi * y
            row = a[i]
            for j in range(self.dim):
                row[j] += xi * x[j]

    def _rebuild(self) -> None:
        d = self.dim
        self._a = [[0.0] * d for _ in range(d)]
        self._b = [0.0] * d
        for x, y in self.obs:
            self._accumulate(x, y, 1.0)

    def add(self, x: Sequence[float], y: float) -> None:
        if not all(math.isfinite(v) for v in x) or not math.isfinite(y) or y <= 0:
            return
        x = tuple(x)
        if self.obs.maxlen is not None and len(self.obs) == self.obs.maxlen:
            old_x, old_y = self.obs[0]
            self._accumulate(old_x, old_y, -1.0)
        self.obs.append((x, y))
        self._accumulate(x, y, 1.0)
        self._adds += 1
        if self.obs.maxlen is not None and self._adds % self.obs.maxlen == 0:
            self._rebuild()

    def solve(self) -> list[float]:
        n, d = len(self.obs), self.dim
        if n < 4:
            return self.w
        a = [row[:] for row in self._a]
        b = self._b[:]
        lam = self.prior_weight * max(sum(a[i][i] for i in range(d)) / d / n, 1e-30)
        for i in range(d):
            a[i][i] += lam
            b[i] += lam
        w = _solve(a, b)
        if w is not None:
            self.w = [min(20.0, max(0.05, v)) for v in w]
        return self.w


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; ``None`` if singular."""
    d = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(d):
        p = max(range(c, d), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-300:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, d):
            f = m[r][c] / m[c][c]
            for k in range(c, d + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * d
    for r in range(d - 1, -1, -1):
        x[r] = (m[r][d] - sum(m[r][k] * x[k] for k in range(r + 1, d))) / m[r][r]
    return x


class LatencyPredictor:
    """Predicts prefill, transfer, TTFT and decode step times (see module doc).

    Args:
        coeffs: initial coefficients (a profile's).
        refit: update them from observations.
        window: observations kept per refit model.
        metrics: optional :class:`pdgate.metrics.GatewayMetrics` for the error export.
    """

    def __init__(self, coeffs: Coefficients | None = None, *, refit: bool = True, window: int = 512,
                 metrics: Any = None) -> None:
        self.base = coeffs or Coefficients()
        self.refit = refit
        self.metrics = metrics
        self._prefill_fit = _RidgeToPrior(3, window)
        self._decode_fit = _RidgeToPrior(3, window)
        self._lock = threading.Lock()
        self._n_prefill_obs = 0
        self.bias: dict[str, float] = {}
        self._offset: dict[str, float] = {}  # route kind -> learned TTFT overhead, seconds  # what -> moving average of the signed relative error
        self._n_decode_obs = 0
        self._children: dict[str, tuple[Any, Any]] = {}  # what -> (error histogram, bias gauge) series

    @classmethod
    def from_config(cls, cfg: PredictorConfig, metrics: Any = None) -> "LatencyPredictor":
        return cls(Coefficients.from_config(cfg), refit=cfg.refit, window=cfg.refit_window,
                   metrics=metrics)

    # -- current coefficients --------------------------------------------------
    def coefficients(self) -> dict[str, float]:
        """The coefficients in use (profile x refit weights)."""
        wp, wd, c = self._prefill_fit.w, self._decode_fit.w, self.base
        return {"step_base_s": c.step_base_s * wp[0], "prefill_token_s": c.prefill_token_s * wp[1],
                "prefill_attn_s": c.prefill_attn_s * wp[2], "decode_step_base_s": c.step_base_s * wd[0],
                "decode_seq_s": c.decode_seq_s * wd[1], "decode_kv_token_s": c.decode_kv_token_s * wd[2]}

    # -- features ----------------------------------------------------------------
    def _prefill_features(self, jobs: Sequence[int], decode_batch: int = 0,
                          on_decode: bool = False) -> tuple[float, float, float]:
        """Base-, token- and attention-cost features of prefilling ``jobs`` in
        order until the last one is done, as vLLM V1's scheduler runs them:
        each step has ``max_num_batched_tokens - decode_batch`` tokens of
        budget, given to the jobs in order, each job capped at
        ``long_prefill_token_threshold`` when more than one request is
        eligible (so up to budget/threshold long prompts progress together).
        ``on_decode``: the budget of a decode instance (:meth:`Coefficients.budget`)."""
        c = self.base
        budget, threshold = c.budget(on_decode)
        if not jobs or jobs[-1] <= 0:
            return (0.0, 0.0, 0.0)
        rem = [max(0, int(n)) for n in jobs]
        first = 0
        steps = 0
        tok = 0.0
        attn = 0.0
        budget0 = max(1, budget - decode_batch)
        while rem[-1] > 0 and steps < 100_000:
            while rem[first] <= 0:
                first += 1
            active = sum(1 for r in rem[first:first + 2] if r > 0)
            thr = threshold if active + decode_batch > 1 else 0
            b = budget0
            for i in range(first, len(rem)):
                r = rem[i]
                if r <= 0:
                    continue
                if b <= 0:
                    break
                n = min(r, b, thr) if thr > 0 else min(r, b)
                o = jobs[i] - r
                tok += n
                attn += n * (o + n / 2.0)
                rem[i] = r - n
                b -= n
            steps += 1
        return (steps * c.step_base_s, tok * c.prefill_token_s, attn * c.prefill_attn_s)

    def _decode_features(self, batch: int, kv_tokens: int) -> tuple[float, float, float]:
        c = self.base
        return (c.step_base_s, batch * c.decode_seq_s, kv_tokens * c.decode_kv_token_s)

    # -- predictions -------------------------------------------------------------
    def prefill_time(self, jobs: Sequence[int], decode_batch: int = 0, on_decode: bool = False) -> float:
        """Seconds until the last of ``jobs`` (prompt tokens, in queue order) is prefilled
        (``on_decode``: by a decode instance, with its token budget)."""
        x = self._prefill_features(jobs, decode_batch, on_decode)
        return sum(w * v for w, v in zip(self._prefill_fit.w, x))

    def transfer_time(self, tokens: int) -> float:
        """Seconds to pull ``tokens`` tokens of KV cache from prefill to decode."""
        c = self.base
        return c.kv_transfer_latency_s + tokens * c.kv_bytes_per_token / c.kv_transfer_bandwidth_Bps

    def decode_step(self, batch: int, kv_tokens: int, chunk: int = 0, chunk_offset: int = 0) -> float:
        """One decode step of ``batch`` sequences holding ``kv_tokens``, plus an
        optional prefill chunk of ``chunk`` tokens at context offset ``chunk_offset``."""
        wd = self._decode_fit.w
        x = self._decode_features(batch, kv_tokens)
        t = sum(w * v for w, v in zip(wd, x)) if batch > 0 or chunk > 0 else 0.0
        if chunk > 0:
            wp, c = self._prefill_fit.w, self.base
            t += (wp[1] * c.prefill_token_s * chunk
                  + wp[2] * c.prefill_attn_s * chunk * (chunk_offset + chunk / 2.0))
        return t

    def ttft_pd(self, queue_ahead: Sequence[int], tokens: int, decode_batch: int,
                decode_kv_tokens: int) -> dict[str, float]:
        """TTFT on the P/D path: queue + own prefill, KV transfer, first decode step.

        Returns a dict with ``queue_s``, ``prefill_s``, ``transfer_s``, ``ttft_s``.
        """
        total = self.prefill_time([*queue_ahead, tokens])
        alone = self.prefill_time([tokens])
        queue = max(0.0, total - alone)  # delay the jobs ahead cause
        xfer = self.transfer_time(tokens)
        first = self.decode_step(decode_batch + 1, decode_kv_tokens + tokens)
        return {"queue_s": queue, "prefill_s": alone, "transfer_s": xfer,
                "ttft_s": total + xfer + first}

    def chunk_tokens(self, tokens: int, decode_batch: int) -> int:
        """Largest prefill chunk of a ``tokens`` prompt that fits one step of a
        decode instance beside ``decode_batch`` running sequences."""
        budget, threshold = self.base.budget(on_decode=True)
        n = min(tokens, budget - decode_batch)
        if decode_batch > 0 and 0 < threshold < n:
            n = threshold
        return max(1, n)

    def ttft_deflect(self, queue_ahead: Sequence[int], tokens: int, decode_batch: int,
                     decode_kv_tokens: int) -> dict[str, float]:
        """TTFT if a decode instance prefills the prompt itself beside its decodes.

        Returns ``ttft_s``, ``chunk_tokens``, ``prefill_steps`` and
        ``step_with_chunk_s`` (the decode step time its running requests see
        while it prefills).
        """
        x = self._prefill_features([*queue_ahead, tokens], decode_batch, on_decode=True)
        wp, wd, c = self._prefill_fit.w, self._decode_fit.w, self.base
        steps = x[0] / c.step_base_s if c.step_base_s > 0 else 0.0
        per_step_decode = wd[1] * decode_batch * c.decode_seq_s + wd[2] * decode_kv_tokens * c.decode_kv_token_s
        ttft = sum(w * v for w, v in zip(wp, x)) + steps * per_step_decode
        chunk = self.chunk_tokens(tokens, decode_batch)
        return {"ttft_s": ttft, "chunk_tokens": float(chunk), "prefill_steps": steps,
                "step_with_chunk_s": self.decode_step(decode_batch, decode_kv_tokens, chunk)}

    # -- observations --------------------------------------------------------------
    def observe_prefill(self, queue_ahead: Sequence[int], tokens: int, observed_s: float) -> None:
        """A prefill leg with ``queue_ahead`` in front took ``observed_s`` seconds."""
        jobs = [*queue_ahead, tokens]
        predicted = self.prefill_time(jobs)
        self._export("prefill", predicted, observed_s)
        if self.refit:
            with self._lock:
                self._prefill_fit.add(self._prefill_features(jobs), observed_s)
                self._n_prefill_obs += 1
                if self._n_prefill_obs % 8 == 0:
                    self._prefill_fit.solve()

    def observe_decode_gap(self, batch: int, kv_tokens: int, observed_s: float) -> None:
        """An inter-token gap of ``observed_s`` seconds at batch ``batch`` with ``kv_tokens``.

        Gaps under a fifth of the prediction are dropped: they are chunks the
        gateway read late and back to back (its own scheduling delay), not
        engine steps.
        """
        predicted = self.decode_step(batch, kv_tokens)
        if observed_s < 0.2 * predicted:
            return
        self._export("decode_step", predicted, observed_s)
        if self.refit:
            with self._lock:
                self._decode_fit.add(self._decode_features(batch, kv_tokens), observed_s)
                self._n_decode_obs += 1
                if self._n_decode_obs % 128 == 0:
                    self._decode_fit.solve()

    def ttft_offset(self, kind: str) -> float:
        """Learned fixed TTFT overhead (seconds) of a route kind (``pd``, ``deflect``)."""
        return self._offset.get(kind, 0.0)

    def observe_ttft(self, predicted_s: float, observed_s: float, kind: str | None = None,
                     model_s: float | None = None) -> None:
        """Record the error of a TTFT prediction; with ``kind`` and the model part
        ``model_s`` (the prediction without the learned offset), update that
        kind's offset: a moving average of ``observed - model`` (HTTP legs,
        API-server and queueing overheads the step model does not see)."""
        self._export("ttft", predicted_s, observed_s)
        if self.refit and kind is not None and model_s is not None and math.isfinite(observed_s):
            resid = min(10.0, max(0.0, observed_s - model_s))
            old = self._offset.get(kind)
            self._offset[kind] = resid if old is None else 0.9 * old + 0.1 * resid

    def _export(self, what: str, predicted: float, observed: float) -> None:
        if observed <= 0 or predicted <= 0:
            return
        err = (predicted - observed) / observed
        b = self.bias.get(what)
        self.bias[what] = err if b is None else 0.95 * b + 0.05 * err
        if self.metrics is not None:
            children = self._children.get(what)
            if children is None:  # prometheus_client's labels() takes a lock: once per series, not per token
                children = self._children[what] = (self.metrics.predictor_error.labels(what),
                                                   self.metrics.predictor_bias.labels(what))
            children[0].observe(abs(err))
            children[1].set(self.bias[what])
