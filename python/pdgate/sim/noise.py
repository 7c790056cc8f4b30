"""Step-time noise: a slowly varying speed factor of a simulated instance.

A GPU instance steps at a steady pace; a vLLM instance sharing CPU cores with
other work does not: its steps run slow in stretches (another process takes
the core), and a stretch spans many steps, so whole requests come out slow.
The median step stays what the step-time model says, but the TTFT and TPOT
tails spread. :class:`StepNoise` models that as a multiplicative factor
``exp(x(t))`` on every step time, with ``x`` an Ornstein-Uhlenbeck process
(mean 0, stationary standard deviation ``sigma``, correlation time ``tau_s``):
over a gap ``dt``

    x(t + dt) = x(t) * exp(-dt / tau_s) + sigma * sqrt(1 - exp(-2 dt / tau_s)) * N(0, 1)

(the exact discretization of the OU process; Gillespie, Phys. Rev. E 54, 2084,
1996). ``exp(x)`` is log-normal with median 1, so a profile fitted to median
measurements keeps its median step. :func:`fit_step_noise` estimates
``sigma`` and ``tau_s`` from a series of measured step times.

A step of length ``T`` sees the factor averaged over its span, not one sample
of it: contention comes in slices much shorter than a long prefill step, so a
1 s prefill step spreads far less, relative to its length, than a 10 ms
decode step. The time average of an OU process over ``T`` has variance
``sigma**2 * v(T / tau_s)`` with ``v(u) = 2 (u - 1 + exp(-u)) / u**2``
(:func:`averaged_variance_ratio`; e.g. Gardiner, *Stochastic Methods*, 4th
ed., sec. 3.8.4), so a step's log factor is ``x(t) * sqrt(v(T / tau_s))``.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics


def averaged_variance_ratio(u: float) -> float:
    """``v(u) = 2 (u - 1 + exp(-u)) / u**2``: the variance of an OU process's
    time average over ``u`` correlation times, over its stationary variance
    (1 at ``u = 0``, about ``2 / u`` for large ``u``).

    Raises:
        ValueError: ``u < 0``.
    """
    if u < 0:
        raise ValueError("u must be >= 0")
    if u < 1e-4:
        return 1.0 - u / 3.0
    return 2.0 * (u - 1.0 + math.exp(-u)) / (u * u)


class StepNoise:
    """The speed factor of one instance over simulated time.

    Args:
        sigma: stationary standard deviation of ``log(factor)`` (0: no noise,
            the factor is exactly 1 and no random number is drawn).
        tau_s: correlation time in simulated seconds (> 0).
        seed: seed of this instance's generator (reproducible runs).
    """

    def __init__(self, sigma: float, tau_s: float, seed: int = 0) -> None:
        if sigma < 0 or tau_s <= 0:
            raise ValueError("step noise needs sigma >= 0 and tau_s > 0")
        self.sigma = sigma
        self.tau_s = tau_s
        self._rng = random.Random(seed)
        self._x = self._rng.gauss(0.0, sigma) if sigma > 0 else 0.0
        self._t: float | None = None

    def factor(self, now_s: float, duration_s: float = 0.0) -> float:
        """The multiplier of a step starting at ``now_s`` (simulated seconds,
        non-decreasing) that would last ``duration_s`` seconds without noise:
        ``exp(x(now_s) * sqrt(v(duration_s / tau_s)))`` (module docstring)."""
        if self.sigma == 0:
            return 1.0
        if self._t is not None and now_s > self._t:
            a = math.exp(-(now_s - self._t) / self.tau_s)
            self._x = self._x * a + self.sigma * math.sqrt(1.0 - a * a) * self._rng.gauss(0.0, 1.0)
        self._t = now_s if self._t is None else max(self._t, now_s)
        if duration_s <= 0:
            return math.exp(self._x)
        return math.exp(self._x * math.sqrt(averaged_variance_ratio(duration_s / self.tau_s)))


def fit_step_noise(step_times_s: list[float]) -> tuple[float, float]:
    """``(sigma, tau_s)`` of :class:`StepNoise` from consecutive step times of one
    steady workload (e.g. the inter-token gaps of one decode stream), seconds.

    ``x_i = log(t_i / median)``; ``sigma`` is the standard deviation of ``x``;
    the lag-1 autocorrelation ``rho`` over the median gap ``d`` gives
    ``tau_s = -d / ln(rho)`` (the OU process's autocorrelation is
    ``exp(-lag / tau)``), clamped to ``[d, 100 d]``. Each measured step
    averaged the factor over its own length ``d``, so the spread seen is
    ``sigma * sqrt(v(d / tau_s))``: the returned ``sigma`` is the seen one over
    that root (with ``tau_s = d``, 1.17 times it). ``tau_s`` stays the
    point-sample estimate: the simulator draws one scaled sample per step, so
    its consecutive steps keep the lag-1 correlation ``exp(-d / tau_s)`` that
    was measured (a true running average's would be higher). Gaps under a quarter of the
    median are dropped (a stream that lags delivers tokens together). Fewer than
    8 usable times, or no spread, give ``(0.0, d)`` (no noise).
    """
    ts = [t for t in step_times_s if t > 0]
    if ts:  # a gap far under the median is two tokens delivered together, not a fast step
        floor = 0.25 * statistics.median(ts)
        ts = [t for t in ts if t >= floor]
    if len(ts) < 8:
        return 0.0, max(statistics.median(ts), 1e-3) if ts else 1e-3
    med = statistics.median(ts)
    xs = [math.log(t / med) for t in ts]
    sigma = statistics.pstdev(xs)
    if sigma == 0:
        return 0.0, med
    mean = statistics.fmean(xs)
    num = sum((a - mean) * (b - mean) for a, b in itertools.pairwise(xs))
    den = sum((a - mean) ** 2 for a in xs)
    rho = num / den if den > 0 else 0.0
    if rho <= 0:
        tau = med
    elif rho >= 1:
        tau = 100 * med
    else:
        tau = min(max(-med / math.log(rho), med), 100 * med)
    return sigma / math.sqrt(averaged_variance_ratio(med / tau)), tau
