"""The step scheduler of one simulated vLLM instance (pure, no I/O, no clock).

Modeled on vLLM V1's ``vllm/v1/core/sched/scheduler.py`` (0.32), simplified
to what decides latency:

* Each step first schedules the RUNNING requests (in order), then WAITING
  ones (FCFS by arrival, or by ``(priority, arrival)`` with the priority
  policy), within a token budget of ``max_num_batched_tokens`` and at most
  ``max_num_seqs`` running requests.
* Chunked prefill: a request gets ``min(remaining, budget)`` tokens, capped
  at ``long_prefill_token_threshold`` when more than one request is eligible
  (vLLM 0.32 lifts the cap for a lone request).
* KV blocks (``block_size`` tokens) come from a :class:`BlockPool`; when a
  running request cannot grow, the last running request (FCFS) or the
  lowest-priority one is preempted: its blocks are freed and it is
  recomputed later (vLLM V1 preemption by recomputation). Waiting requests
  that do not fit are not scheduled (no preemption on their behalf).
* Prefix caching: a request starting from scratch takes the longest cached
  prefix of its block hashes, always leaving at least one token to compute.
* P/D: a *producer* request (``do_remote_decode``) stops after its first
  token and keeps its blocks (HELD) until the consumer has read them or a
  timeout; a *consumer* request (``do_remote_prefill``) allocates blocks for
  its whole prompt, waits in LOADING for the modeled transfer, then resumes
  with ``num_computed = prompt_len - 1`` (vLLM recomputes the last prompt
  token to sample the next one, ``_update_waiting_for_remote_kv``).

Times are seconds of simulated time; lengths are tokens.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable

from pdgate.sim.blocks import BlockPool
from pdgate.sim.noise import StepNoise
from pdgate.sim.profiles import Profile


class Status(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"      # waiting for remote KV (WAITING_FOR_REMOTE_KVS)
    RUNNING = "running"
    HELD = "held"            # producer done, blocks kept for the remote decode
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclasses.dataclass(eq=False)
class SimRequest:
    """One request inside a simulated instance.

    Attributes:
        request_id: unique id within the instance.
        prompt_len: prompt tokens.
        max_tokens: output tokens to generate (generation stops there).
        arrival_s: sim time the request joined the scheduler.
        block_hashes: chained hashes of the prompt's full blocks.
        priority: lower runs first (priority policy only).
        do_remote_decode: producer of a P/D pair (prefill instance).
        remote_prefill: consumer of a P/D pair (decode instance): the
            ``kv_transfer_params`` it was given.
        output_seed: the answer's tokens are a function of this and their
            position (the server derives it from the prompt, so two instances
            given one prompt answer the same tokens, as greedy vLLM does).
        on_token: called as ``on_token(req, now_s)`` after each new token and
            once more on finish/abort (engine hook).
    """

    request_id: str
    prompt_len: int
    max_tokens: int
    arrival_s: float = 0.0
    block_hashes: list[int] = dataclasses.field(default_factory=list)
    priority: int = 0
    do_remote_decode: bool = False
    remote_prefill: dict[str, Any] | None = None
    on_token: Callable[["SimRequest", float], None] | None = None
    status: Status = Status.WAITING
    num_computed: int = 0
    num_output: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_cached_blocks: int = 0
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    first_scheduled_s: float | None = None
    kv_loaded_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None
    hold_until_s: float | None = None
    finish_reason: str | None = None
    seq: int = 0
    output_seed: int = 0
    seen_output: int = 0
    prev_token_s: float | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens so far."""
        return self.prompt_len + self.num_output

    def sort_key(self, priority_policy: bool) -> tuple[Any, ...]:
        return (self.priority, self.arrival_s, self.seq) if priority_policy else (self.seq,)


@dataclasses.dataclass
class StepPlan:
    """What one step runs: ``(request, tokens)`` pairs, and its duration (s)."""

    scheduled: list[tuple[SimRequest, int]]
    duration_s: float
    new_loads: list[SimRequest] = dataclasses.field(default_factory=list)
    preempted: list[SimRequest] = dataclasses.field(default_factory=list)
    prefill_tokens: int = 0
    decode_seqs: int = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    """Continuous-batching scheduler of one instance.

    Args:
        profile: limits and step-time model.
        policy: ``"fcfs"`` or ``"priority"``.
        enable_prefix_caching: reuse cached blocks.
        seed: seed of the step-time noise (:mod:`pdgate.sim.noise`; unused
            when the profile has none).
    """

    def __init__(self, profile: Profile, policy: str = "fcfs", enable_prefix_caching: bool = True,
                 seed: int = 0) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError("policy must be fcfs or priority")
        self.profile = profile
        self.noise = StepNoise(profile.step_noise_sigma, profile.step_noise_tau_s, seed)
        self.policy = policy
        self.bs = profile.block_size
        self.pool = BlockPool(profile.num_gpu_blocks, profile.block_size, enable_prefix_caching)
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.held: dict[str, SimRequest] = {}
        self._seq = 0
        self.num_preemptions = 0

    # -- queue management --------------------------------------------------
    def _insert_waiting(self, req: SimRequest, front: bool = False) -> None:
        if self.policy == "priority":
            key = req.sort_key(True)
            i = 0
            while i < len(self.waiting) and self.waiting[i].sort_key(True) <= key:
                i += 1
            self.waiting.insert(i, req)
        elif front:
            self.waiting.insert(0, req)
        else:
            self.waiting.append(req)

    def add(self, req: SimRequest) -> None:
        """Queue a new request (its length must fit ``max_model_len``)."""
        self._seq += 1
        req.seq = self._seq
        req.status = Status.WAITING
        self._insert_waiting(req)

    def has_work(self) -> bool:
        """True if a step would schedule something now."""
        return bool(self.running) or any(r.status == Status.WAITING for r in self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Waiting requests, those loading remote KV included (as vLLM counts them)."""
        return len(self.waiting)

    def _free(self, req: SimRequest) -> None:
        if req.blocks:
            self.pool.release(req.blocks)
        req.blocks = []
        req.num_cached_blocks = 0

    def abort(self, req: SimRequest, now_s: float) -> None:
        """Remove ``req`` wherever it is and free its blocks (client went away)."""
        if req.status in (Status.FINISHED, Status.ABORTED):
            return
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.held.pop(req.request_id, None)
        self._free(req)
        req.status = Status.ABORTED
        req.finish_reason = "abort"
        req.finished_s = now_s
        if req.on_token:
            req.on_token(req, now_s)

    def release_held(self, request_id: str) -> bool:
        """Free a producer's held blocks (the consumer read them, or timeout)."""
        req = self.held.pop(request_id, None)
        if req is None:
            return False
        self._free(req)
        return True

    def expire_held(self, now_s: float) -> int:
        """Free held blocks whose hold timeout passed; returns how many requests."""
        gone = [k for k, r in self.held.items() if r.hold_until_s is not None and r.hold_until_s <= now_s]
        for k in gone:
            self.release_held(k)
        return len(gone)

    def kv_loaded(self, req: SimRequest) -> None:
        """The remote KV of a LOADING consumer arrived: make it schedulable."""
        if req.status != Status.LOADING:
            return
        req.num_computed = req.prompt_len - 1
        self._cache_full_blocks(req)
        req.status = Status.WAITING

    # -- blocks ------------------------------------------------------------
    def _grow(self, req: SimRequest, total_tokens: int) -> bool:
        need = _cdiv(total_tokens, self.bs) - len(req.blocks)
        if need <= 0:
            return True
        new = self.pool.allocate(need)
        if new is None:
            return False
        req.blocks.extend(new)
        return True

    def _cache_full_blocks(self, req: SimRequest) -> None:
        full = min(req.num_computed, req.prompt_len) // self.bs
        full = min(full, len(req.block_hashes), len(req.blocks))
        for i in range(req.num_cached_blocks, full):
            self.pool.cache(req.blocks[i], req.block_hashes[i])
        req.num_cached_blocks = max(req.num_cached_blocks, full)

    def _preempt(self, req: SimRequest) -> None:
        self.running.remove(req)
        self._free(req)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._insert_waiting(req, front=True)

    # -- one step ----------------------------------------------------------
    def schedule(self, now_s: float) -> StepPlan:
        """Pick the work of the next step (see module doc); mutates queues and blocks."""
        p = self.profile
        budget = p.max_num_batched_tokens
        eligible = len(self.running) + sum(1 for r in self.waiting if r.status == Status.WAITING)
        threshold = p.long_prefill_token_threshold if eligible > 1 else 0
        sched: dict[SimRequest, int] = {}
        preempted: list[SimRequest] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = req.num_tokens - req.num_computed
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget)
            if n <= 0:
                i += 1
                continue
            ok = True
            while not self._grow(req, req.num_computed + n):
                if self.policy == "priority":
                    victim = max(self.running, key=lambda r: (r.priority, r.arrival_s, r.seq))
                else:
                    victim = self.running[-1]
                if victim in sched:
                    budget += sched.pop(victim)
                if self.running.index(victim) < i:
                    i -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    ok = False
                    break
            if not ok:
                break
            sched[req] = n
            budget -= n
            i += 1
        new_loads: list[SimRequest] = []
        if not preempted:
            j = 0
            while j < len(self.waiting) and budget > 0 and len(self.running) < p.max_num_seqs:
                req = self.waiting[j]
                if req.status == Status.LOADING:
                    j += 1
                    continue
                fresh = not req.blocks
                hit_blocks: list[int] = []
                if fresh:
                    hit_blocks = self.pool.match_prefix(req.block_hashes)
                    max_hit = (req.num_tokens - 1) // self.bs
                    hit_blocks = hit_blocks[:max_hit]
                    self.pool.record_query(req.prompt_len, len(hit_blocks) * self.bs)
                if fresh and req.remote_prefill is not None and req.num_preemptions == 0:
                    # consumer: allocate blocks for the whole prompt, then load remote KV
                    self.pool.touch(hit_blocks)
                    req.blocks = list(hit_blocks)
                    if not self._grow(req, req.prompt_len):
                        self._free(req)
                        break
                    req.num_computed = len(hit_blocks) * self.bs
                    req.num_cached_blocks = len(hit_blocks)
                    if req.num_cached_tokens < 0:
                        req.num_cached_tokens = req.num_computed
                    req.status = Status.LOADING
                    new_loads.append(req)
                    j += 1
                    continue
                if fresh:
                    self.pool.touch(hit_blocks)
                    req.blocks = list(hit_blocks)
                    req.num_computed = len(hit_blocks) * self.bs
                    req.num_cached_blocks = len(hit_blocks)
                    if req.num_cached_tokens < 0:
                        req.num_cached_tokens = req.num_computed
                n = req.num_tokens - req.num_computed
                if 0 < threshold < n:
                    n = threshold
                n = min(n, budget)
                if not self._grow(req, req.num_computed + n):
                    if fresh:
                        self._free(req)
                        req.num_computed = 0
                    break
                self.waiting.pop(j)
                req.status = Status.RUNNING
                if req.first_scheduled_s is None:
                    req.first_scheduled_s = now_s
                self.running.append(req)
                sched[req] = n
                budget -= n
        chunks: list[tuple[int, int]] = []
        decodes: list[int] = []
        for req, n in sched.items():
            if n == 1 and req.num_computed > 0:
                decodes.append(req.num_computed + 1)
            else:
                chunks.append((n, req.num_computed))
        base_s = p.step_time(chunks, decodes)
        plan = StepPlan(list(sched.items()), base_s * self.noise.factor(now_s, base_s),
                        new_loads, preempted,
                        sum(c for c, _ in chunks), len(decodes))
        return plan

    def finish_step(self, plan: StepPlan, now_s: float) -> list[SimRequest]:
        """Apply a step that ended at ``now_s``: advance requests, emit tokens.

        Returns the requests that finished (or were handed to HELD) this step.
        """
        done: list[SimRequest] = []
        for req, n in plan.scheduled:
            if req.status != Status.RUNNING:
                continue  # aborted or preempted while the step ran
            req.num_computed += n
            self._cache_full_blocks(req)
            if req.num_computed < req.num_tokens:
                continue  # partial prefill chunk
            req.num_output += 1
            if req.first_token_s is None:
                req.first_token_s = now_s
            req.last_token_s = now_s
            if req.num_output >= req.max_tokens:
                req.finish_reason = "length"
                req.finished_s = now_s
                self.running.remove(req)
                if req.do_remote_decode:
                    req.status = Status.HELD
                    req.hold_until_s = now_s + self.profile.kv_hold_timeout_s
                    self.held[req.request_id] = req
                else:
                    req.status = Status.FINISHED
                    self._free(req)
                done.append(req)
            if req.on_token:
                req.on_token(req, now_s)
        return done
