"""Typed gateway configuration (pydantic).

A config comes from, lowest precedence first: defaults, a YAML/JSON file
(``pdgate serve --config FILE``), command-line flags. :func:`load_config`
merges them and validates the result.

Routing is configured in three layers (see :mod:`pdgate.policies`):

- ``prefill_policy`` / ``decode_policy``: which instance of a role serves a
  leg (``round_robin``, ``least_load``, ``power_of_two``, ``prefix_aware``),
  as vllm-router's ``--prefill-policy`` / ``--decode-policy``;
- ``route_policy``: what shape the request takes (``pd``: prefill then
  decode; ``dedicated``: context-length pools; ``deflection``: Kairos-style
  prefill on a decode instance; ``goodput``: least predicted SLO violation);
- ``admission_policy``: whether prefill legs wait in the Rust admission
  queue first (``none``, ``request_parallel``, ``priority``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Role = Literal["prefill", "decode", "both"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InstanceConfig(_Strict):
    """One vLLM instance behind the gateway.

    Attributes:
        url: base URL, e.g. ``http://10.0.0.5:8000`` (no trailing ``/v1``).
        role: ``prefill``, ``decode`` or ``both``.
        pool: name of the context-length pool (see ``GatewayConfig.pools``)
            this instance belongs to, or ``None`` (serves every length).
    """

    url: str
    role: Role
    pool: str | None = None

    @field_validator("url")
    @classmethod
    def _normalize_url(cls, v: str) -> str:
        v = v.strip().rstrip("/")
        if v.endswith("/v1"):
            v = v[: -len("/v1")]
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"instance URL must start with http:// or https://: {v!r}")
        return v


class PoolRange(_Strict):
    """Prompt lengths a pool serves: ``min_tokens <= n < max_tokens`` (``None`` = no bound)."""

    min_tokens: int = Field(default=0, ge=0)
    max_tokens: int | None = Field(default=None, gt=0)

    def contains(self, n: int) -> bool:
        return n >= self.min_tokens and (self.max_tokens is None or n < self.max_tokens)


class TimeoutsConfig(_Strict):
    """Timeouts in seconds for the legs of a request.

    Attributes:
        connect_s: TCP connect to an instance.
        connect_attempts: tries of one decode instance whose TCP connect
            failed or timed out, when no other decode candidate is left. A
            failed connect sent nothing, so a retry is always safe; on a
            loaded host (the gateway's event loop or the instance's accept
            queue late) a connect can time out once and succeed at once after.
        prefill_s: whole prefill leg (prompt processing + KV handoff answer);
            past it the request falls back to decode-only.
        decode_first_byte_s: longest wait for a non-streamed decode leg's
            answer. vLLM sends it whole after the last token, so this bounds
            the generation; set it above the longest generation you serve.
        decode_idle_s: longest gap between two chunks of a streamed decode
            leg (the first chunk included).
    """

    connect_s: float = Field(default=5.0, gt=0)
    connect_attempts: int = Field(default=3, ge=1, le=10)
    prefill_s: float = Field(default=600.0, gt=0)
    decode_first_byte_s: float = Field(default=600.0, gt=0)
    decode_idle_s: float = Field(default=300.0, gt=0)


class UpstreamConfig(_Strict):
    """HTTP client of the request legs and the ``/metrics`` scrapes (see :mod:`pdgate.gateway.upstream`).

    Attributes:
        client: ``aiohttp`` (default; ~0.2 ms CPU per leg) or ``httpx``
            (~1-2 ms per leg: its pool is scanned on every request).
        max_connections: open connections per instance, at most.
        keepalive_s: idle connections are closed after this many seconds;
            keep it under the instances' keep-alive (uvicorn: 5 s).
    """

    client: Literal["aiohttp", "httpx"] = "aiohttp"
    max_connections: int = Field(default=4096, ge=1)
    keepalive_s: float = Field(default=4.0, gt=0)


class SloClass(_Strict):
    """Latency targets of one SLO class, seconds."""

    ttft_s: float = Field(default=2.0, gt=0)
    tpot_s: float = Field(default=0.1, gt=0)


class SloConfig(_Strict):
    """SLO classes; a request picks one with ``header`` or the ``slo_class`` body field.

    The body field is removed before forwarding (vLLM does not know it).

    Attributes:
        header: request header naming the SLO class.
        default: class of a request that names none.
        classes: class name -> targets (``ttft_s``, ``tpot_s``, seconds).
    """

    header: str = "x-slo-class"
    default: str = "default"
    classes: dict[str, SloClass] = Field(default_factory=lambda: {"default": SloClass()})

    @model_validator(mode="after")
    def _default_exists(self) -> "SloConfig":
        if self.default not in self.classes:
            raise ValueError(f"default SLO class {self.default!r} not in classes {sorted(self.classes)}")
        return self


class RequestParallelConfig(_Strict):
    """``request_parallel`` admission: per prefill instance at most
    ``max_in_flight`` prefills, at most ``max_long`` of them longer than
    ``long_threshold_tokens``; shorter ones pass queued long ones.

    Attributes:
        max_in_flight: prefill legs in flight per prefill instance.
        max_long: long prefills in flight per prefill instance.
        long_threshold_tokens: prompt tokens above which a prefill is long.
    """

    max_in_flight: int = Field(default=4, ge=1)
    max_long: int = Field(default=1, ge=1)
    long_threshold_tokens: int = Field(default=10000, ge=1)


class PriorityConfig(_Strict):
    """``priority`` admission: lower value = more urgent (vLLM's convention).

    Attributes:
        header: request header carrying the priority (the body's integer
            ``priority`` field wins when both are given).
        default_priority: priority of a request that states none.
        long_threshold_tokens / long_penalty: a prompt over the threshold
            gets ``long_penalty`` added per threshold-multiple of tokens.
        aging_rate: priority units gained per second of waiting.
        max_wait_s: entries that waited longer go first (starvation bound).
        max_in_flight: prefills in flight per prefill instance.
        forward_to_vllm: send the (unpenalized) priority to vLLM in the body
            (needs ``--scheduling-policy priority`` on the instances).
    """

    header: str = "x-priority"
    default_priority: int = 0
    long_threshold_tokens: int = Field(default=10000, ge=1)
    long_penalty: int = Field(default=1, ge=0)
    aging_rate: float = Field(default=1.0, ge=0)
    max_wait_s: float | None = Field(default=10.0, gt=0)
    max_in_flight: int = Field(default=4, ge=1)
    forward_to_vllm: bool = False


class DeflectionConfig(_Strict):
    """Kairos prefill deflection (arXiv 2607.02043).

    Attributes:
        alpha: deflect when the decode instance's predicted TTFT is at most
            ``alpha`` times the prefill path's.
        min_prefill_wait_s: consider deflection only when the prefill path's
            predicted queueing delay exceeds this (a burst); idle fleets use P/D.
        max_prompt_tokens: never deflect longer prompts.
    """

    alpha: float = Field(default=1.3, gt=0)
    min_prefill_wait_s: float = Field(default=0.0, ge=0)
    max_prompt_tokens: int = Field(default=16384, ge=1)


class GoodputConfig(_Strict):
    """``goodput`` route policy knobs.

    Attributes:
        others_weight: weight of the predicted violations inflicted on
            requests already decoding (per request slowed past its TPOT SLO).
        allow_deflection: consider deflection options.
        max_deflected_per_decode: deflected prefills in flight per decode instance.
    """

    others_weight: float = Field(default=0.5, ge=0)
    allow_deflection: bool = True
    max_deflected_per_decode: int = Field(default=1, ge=1)


class PooledConfig(_Strict):
    """``pooled`` route policy: late binding over the goodput route's options.

    Requests wait in one gateway-wide queue; each is routed when an
    executor has room for it: a prefill instance (P/D path) or a decode
    instance (deflected prefill). Kept short on purpose, the instances' own
    queues never hold work another instance could start sooner.

    Attributes:
        order: ``fcfs`` (arrival order), ``sjf`` (shorter prompts first,
            with aging; most requests on time) or ``long_last`` (arrival
            order, prompts over ``long_threshold_tokens`` after every shorter
            one, with aging: gives up the longest few percent to shorten the
            TTFT tail of the rest; `pdgate.bench.fluid`).
        max_queue_s: an instance takes more work only while the prefill work
            already there is predicted to drain within this (seconds).
        max_in_flight: prefills in flight per prefill instance.
        max_local_prefills: prompts a decode instance prefills itself at once
            (deflected and fallback prefills together), while they are
            predicted to be done within ``max_queue_s``.
        long_threshold_tokens / aging_rate: order key: the request's
            priority class, plus (``sjf``) one unit per ``long_threshold_tokens``
            prompt tokens or (``long_last``) one unit for a prompt of more than
            ``long_threshold_tokens``, minus ``aging_rate`` units per second
            waited.
        max_wait_s: entries that waited longer go first whatever the order.
        scan: queue entries tried per dispatch round (bounds the work per event).
        tick_s: while requests wait, dispatch also runs this often (seconds),
            beside the events that free capacity.
    """

    order: Literal["fcfs", "sjf", "long_last"] = "fcfs"
    max_queue_s: float = Field(default=0.2, gt=0)
    max_in_flight: int = Field(default=4, ge=1)
    max_local_prefills: int = Field(default=4, ge=1)
    long_threshold_tokens: int = Field(default=1000, ge=1)
    aging_rate: float = Field(default=0.5, ge=0)
    max_wait_s: float = Field(default=30.0, gt=0)
    scan: int = Field(default=8, ge=1)
    tick_s: float = Field(default=0.02, gt=0)


class FirstTokenConfig(_Strict):
    """Streaming a P/D request's first token from the prefill instance
    (:mod:`pdgate.gateway.first_token`; DistServe and Splitwise count TTFT
    at the end of the prefill phase).

    Attributes:
        from_prefill: send the prefill leg's sampled token to the client as
            soon as the prefill leg answers, for streamed greedy requests,
            instead of waiting for the decode instance's first token (which
            waits for the KV transfer and a step with room). The time until
            token two grows by as much, so TPOT of short answers rises.
        min_wait_s: only for requests that have waited at least this long
            (seconds since arrival) when their prefill leg answers: those at
            risk of missing the TTFT target; 0: every eligible request.
    """

    from_prefill: bool = False
    min_wait_s: float = Field(default=0.0, ge=0)


class PredictorConfig(_Strict):
    """Latency predictor coefficients (see :mod:`pdgate.predictor`).

    ``profile`` names a simulator profile (``pdgate.sim.profiles``) or a
    YAML path whose coefficients seed the model; explicit fields below
    override it. ``time_scale`` divides every time coefficient (a fleet
    simulated ``time_scale`` times faster than real time). ``refit``
    re-estimates them online from observed latencies.

    Attributes:
        profile: simulator profile name or YAML path seeding the coefficients.
        step_base_s: fixed cost of one engine step, seconds.
        prefill_token_s: prefill time per prompt token, seconds.
        prefill_attn_s: prefill attention time per token squared, seconds.
        decode_seq_s: decode step time per running sequence, seconds.
        decode_kv_token_s: decode step time per KV token held, seconds.
        kv_bytes_per_token: KV cache bytes per token (all layers).
        kv_transfer_bandwidth_Bps: KV transfer bandwidth, bytes per second.
        kv_transfer_latency_s: fixed KV transfer latency, seconds.
        max_num_batched_tokens: the instances' token budget per step.
        long_prefill_token_threshold: the instances' chunk cap for one long prefill (0 = none).
        decode_max_num_batched_tokens: the decode instances' token budget per
            step when it differs (e.g. sized so a deflected prefill chunk
            beside the decodes stays within their TPOT SLO); ``None`` = as above.
        decode_long_prefill_token_threshold: the decode instances' chunk cap
            when it differs; ``None`` = as above.
        time_scale: divides every time coefficient (simulated fleets running faster than real time).
        refit: re-estimate coefficients online from observed latencies.
        refit_window: observations kept for the refit.
    """

    profile: str | None = None
    step_base_s: float | None = Field(default=None, ge=0)
    prefill_token_s: float | None = Field(default=None, ge=0)
    prefill_attn_s: float | None = Field(default=None, ge=0)
    decode_seq_s: float | None = Field(default=None, ge=0)
    decode_kv_token_s: float | None = Field(default=None, ge=0)
    kv_bytes_per_token: int | None = Field(default=None, ge=0)
    kv_transfer_bandwidth_Bps: float | None = Field(default=None, gt=0)
    kv_transfer_latency_s: float | None = Field(default=None, ge=0)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    long_prefill_token_threshold: int | None = Field(default=None, ge=0)
    decode_max_num_batched_tokens: int | None = Field(default=None, ge=1)
    decode_long_prefill_token_threshold: int | None = Field(default=None, ge=0)
    time_scale: float = Field(default=1.0, gt=0)
    refit: bool = True
    refit_window: int = Field(default=512, ge=8)


class TokenizerConfig(_Strict):
    """How prompt tokens are counted (token-id prompts are always exact).

    Attributes:
        path: local tokenizer directory (Hugging Face format).
        words: count whitespace-separated words instead (the tokenizer of
            pdgate's vLLM simulator, ``pdgate.sim``).
        use_instance: ask an instance's ``/tokenize`` when no local tokenizer.
        cache_size: prompts whose counts are cached (LRU).
    """

    path: str | None = None
    words: bool = False
    use_instance: bool = False
    cache_size: int = Field(default=4096, ge=0)


class ScrapeConfig(_Strict):
    """Scraping of each instance's ``/metrics``.

    Attributes:
        enabled: scrape at all (off: policies use the gateway's own counters only).
        interval_s: seconds between two scrapes of an instance.
        stale_after_s: scraped values older than this are ignored (``pdgate_instance_scrape_stale``).
    """

    enabled: bool = True
    interval_s: float = Field(default=0.1, gt=0, le=60)
    stale_after_s: float = Field(default=1.0, gt=0)


class DiscoveryConfig(_Strict):
    """Where instances come from besides the static lists (see :mod:`pdgate.discovery`).

    Attributes:
        type: ``static`` (only ``prefill``/``decode``/``instances``) or
            ``kubernetes`` (watch pods; static instances are kept too).
        namespace: namespace whose pods are watched (``None``: the gateway
            pod's own namespace, else ``default``).
        prefill_selector / decode_selector: label selectors of prefill and
            decode pods (Kubernetes syntax, ``app=vllm,role=prefill``).
        role_label: when set, one ``selector`` selects every pod and this
            label's value (``prefill``, ``decode``, ``both``) gives the role.
        selector: the label selector used with ``role_label``.
        pool_label: label naming a pod's context-length pool (optional).
        port: vLLM HTTP port on each pod (URL ``http://<pod IP>:<port>``).
        port_annotation: pod annotation overriding ``port`` per pod.
        scheme: ``http`` or ``https``.
        kubeconfig: kubeconfig file (``None``: in-cluster config, else ``~/.kube/config``).
        watch_timeout_s: server-side timeout of one watch call, seconds; the
            watch is re-listed and resumed after it.
    """

    type: Literal["static", "kubernetes"] = "static"
    namespace: str | None = None
    prefill_selector: str | None = None
    decode_selector: str | None = None
    role_label: str | None = None
    selector: str | None = None
    pool_label: str | None = None
    port: int = Field(default=8000, ge=1, le=65535)
    port_annotation: str | None = "pdgate.io/port"
    scheme: Literal["http", "https"] = "http"
    kubeconfig: str | None = None
    watch_timeout_s: int = Field(default=300, ge=1)

    @model_validator(mode="after")
    def _selectors(self) -> "DiscoveryConfig":
        if self.type == "kubernetes" and not (self.prefill_selector or self.decode_selector
                                              or (self.role_label and self.selector)):
            raise ValueError("kubernetes discovery needs decode_selector (and prefill_selector), "
                             "or selector + role_label")
        return self


class LimitsConfig(_Strict):
    """Request limits; each refusal is counted in ``pdgate_rejected_requests_total{reason}``.

    Attributes:
        max_header_bytes: total size of the request headers (names, values,
            4 bytes per header of framing); above it: 431.
        max_concurrent_requests: API requests (completions, chat) handled at
            once, streams counted until they end; above it: 429 with
            ``Retry-After``. ``None`` = unlimited.
        rate_limit_rps: sustained API requests per second per client (token
            bucket refill rate); above it: 429 with ``Retry-After``. ``None`` = off.
        rate_limit_burst: bucket size (requests a client may send at once).
        rate_limit_key: ``ip`` (the TCP peer address; ``X-Forwarded-For`` is
            never trusted) or ``api_key`` (the ``Authorization`` header, the
            peer address when absent).
        max_tracked_clients: buckets kept (least recently used dropped first).
        max_tokens_cap: largest ``max_tokens`` accepted when the model's
            context length is unknown.
        reject_unknown_fields: refuse top-level body fields that neither
            vLLM's request models nor the gateway know (400), instead of
            forwarding them for vLLM to ignore.
        retry_after_s: ``Retry-After`` of 429/503 answers that have no better estimate.
    """

    max_header_bytes: int = Field(default=32 * 1024, gt=0)
    max_concurrent_requests: int | None = Field(default=None, ge=1)
    rate_limit_rps: float | None = Field(default=None, gt=0)
    rate_limit_burst: int = Field(default=10, ge=1)
    rate_limit_key: Literal["ip", "api_key"] = "ip"
    max_tracked_clients: int = Field(default=100_000, ge=1)
    max_tokens_cap: int = Field(default=1 << 20, ge=1)
    reject_unknown_fields: bool = True
    retry_after_s: int = Field(default=1, ge=0)


class HealthConfig(_Strict):
    """Active health checks and the per-instance circuit breaker.

    An instance is ejected (no new requests) after ``failures_to_eject``
    consecutive failures, active (``GET /health`` every ``interval_s``,
    ``timeout_s`` each) or passive (connect errors, timeouts, 5xx answers of
    request legs). After ``cooldown_s`` it is half-open: the next health
    probes decide, and ``successes_to_readmit`` consecutive good ones close
    it again. A busy vLLM can answer ``/health`` slowly (its event loop
    shares the CPU with the engine on small hosts): keep ``timeout_s`` well
    above that, or the only instance of a role can be ejected for being slow.
    Bounds (seconds): ejection of a dead instance within
    ``failures_to_eject * (interval_s + timeout_s)``; re-admission within
    ``cooldown_s + successes_to_readmit * (interval_s + timeout_s)`` after it recovers.

    Attributes:
        enabled: run the active health checker and the breaker.
        interval_s: seconds between two ``GET /health`` probes of an instance.
        timeout_s: timeout of one probe, seconds.
        failures_to_eject: consecutive failures that eject an instance.
        cooldown_s: seconds an ejected instance waits before it is half-open.
        successes_to_readmit: consecutive good probes that re-admit it.
    """

    enabled: bool = True
    interval_s: float = Field(default=2.0, gt=0)
    timeout_s: float = Field(default=5.0, gt=0)
    failures_to_eject: int = Field(default=3, ge=1)
    cooldown_s: float = Field(default=5.0, ge=0)
    successes_to_readmit: int = Field(default=1, ge=1)


class DrainConfig(_Strict):
    """Graceful drain on SIGTERM/SIGINT: new API requests get 503 with
    ``Retry-After: retry_after_s`` while in-flight ones finish, for at most
    ``deadline_s`` seconds; then the gateway exits 0.

    Attributes:
        deadline_s: longest drain, seconds (in-flight requests past it are closed).
        retry_after_s: ``Retry-After`` header of the 503 answers while draining, seconds.
    """

    deadline_s: float = Field(default=30.0, ge=0)
    retry_after_s: int = Field(default=5, ge=0)


class AdminConfig(_Strict):
    """The admin API (``/admin/instances``); off (not mounted) without a token.

    Attributes:
        token: bearer token every admin request must carry
            (``Authorization: Bearer <token>``).
    """

    token: str | None = Field(default=None, min_length=16)


class GatewayConfig(_Strict):
    """The whole gateway configuration.

    Attributes:
        prefill / decode: instance URLs by role.
        prefill_pools / decode_pools: pool names of those instances, in the
            same order (shorter lists leave the rest pool-less).
        instances: more instances with explicit role (``both`` allowed) and pool.
        pools: context-length pools by name (for ``dedicated``/``goodput``).
        host / port: where the gateway listens.
        prefill_policy / decode_policy / route_policy / admission_policy:
            routing policy names from :mod:`pdgate.policies`.
        first_token: whether a P/D request's first token may come from its
            prefill leg.
        timeouts: per-leg timeouts.
        upstream: HTTP client of the request legs.
        max_body_bytes: request bodies above this are refused with 413.
        policy: vllm-router's ``--policy``: the instance policy of both legs
            unless ``prefill_policy`` / ``decode_policy`` name their own.
        prometheus_port: also serve ``/metrics`` on this port (vllm-router's
            ``--prometheus-port``); ``None``: only on the main port.
        log_level: root log level.
        event_loop: the event loop ``pdgate serve`` runs on: ``uvloop``
            (libuv; a dependency on Linux), ``asyncio`` (the standard
            library's), or ``auto`` (uvloop when importable), as uvicorn's
            ``--loop``.
        log_format: ``text`` or ``json`` (one JSON object per line with
            ``request_id`` and ``trace_id`` on lines logged for a request).
        discovery: instance discovery (static lists, Kubernetes pods).
        limits: header size, concurrency and rate limits, input checks.
        health: health checks and circuit breaker per instance.
        drain: graceful drain on SIGTERM.
        admin: admin API (off without a token).
        metrics_port: if set, ``/metrics`` and ``/health`` are served only
            on this port (same ``host``), not on ``port``.
    """

    prefill: list[str] = Field(default_factory=list)
    decode: list[str] = Field(default_factory=list)
    prefill_pools: list[str | None] = Field(default_factory=list)
    decode_pools: list[str | None] = Field(default_factory=list)
    instances_: list[InstanceConfig] = Field(default_factory=list, alias="instances")
    pools: dict[str, PoolRange] = Field(default_factory=dict)
    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=0, le=65535)
    prefill_policy: str = "round_robin"
    decode_policy: str = "round_robin"
    route_policy: str = "pd"
    admission_policy: str = "none"
    request_parallel: RequestParallelConfig = Field(default_factory=RequestParallelConfig)
    priority: PriorityConfig = Field(default_factory=PriorityConfig)
    deflection: DeflectionConfig = Field(default_factory=DeflectionConfig)
    goodput: GoodputConfig = Field(default_factory=GoodputConfig)
    pooled: PooledConfig = Field(default_factory=PooledConfig)
    first_token: FirstTokenConfig = Field(default_factory=FirstTokenConfig)
    slo: SloConfig = Field(default_factory=SloConfig)
    predictor: PredictorConfig = Field(default_factory=PredictorConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    scrape: ScrapeConfig = Field(default_factory=ScrapeConfig)
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    upstream: UpstreamConfig = Field(default_factory=UpstreamConfig)
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    drain: DrainConfig = Field(default_factory=DrainConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    event_loop: Literal["auto", "asyncio", "uvloop"] = "auto"
    policy: str | None = None
    prometheus_port: int | None = Field(default=None, ge=0, le=65535)
    log_format: Literal["text", "json"] = "text"
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _general_policy(cls, data: Any) -> Any:
        """``policy`` fills ``prefill_policy`` / ``decode_policy`` where those are unset."""
        if isinstance(data, dict) and data.get("policy"):
            data = dict(data)
            data.setdefault("prefill_policy", data["policy"])
            data.setdefault("decode_policy", data["policy"])
        return data

    @field_validator("prefill", "decode")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        return [InstanceConfig(url=u, role="both").url for u in v]

    @model_validator(mode="after")
    def _check(self) -> "GatewayConfig":
        insts = self.instances()
        if self.discovery.type == "static" and not any(i.role in ("decode", "both") for i in insts):
            raise ValueError("at least one decode instance is required (--decode URL)")
        urls = [i.url for i in insts]
        if len(set(urls)) != len(urls):
            raise ValueError("an instance URL is listed twice")
        for i in insts:
            if i.pool is not None and i.pool not in self.pools:
                raise ValueError(f"instance {i.url} names unknown pool {i.pool!r}")
        from pdgate.policies import available_policies

        for field, kind in (("prefill_policy", "instance"), ("decode_policy", "instance"), ("policy", "instance"),
                            ("route_policy", "route"), ("admission_policy", "admission")):
            name = getattr(self, field)
            names = available_policies(kind)
            if name is not None and name not in names:
                raise ValueError(f"unknown {field} {name!r}; available: {sorted(names)}")
        if self.route_policy == "pooled" and self.admission_policy != "none":
            raise ValueError("route_policy 'pooled' is its own admission (one gateway-wide queue): "
                             f"admission_policy must be 'none', not {self.admission_policy!r}")
        return self

    def instances(self) -> list[InstanceConfig]:
        """All instances with their roles, prefill first, then decode, then ``instances``."""
        def pool(pools: list[str | None], k: int) -> str | None:
            return pools[k] if k < len(pools) else None

        return ([InstanceConfig(url=u, role="prefill", pool=pool(self.prefill_pools, k))
                 for k, u in enumerate(self.prefill)]
                + [InstanceConfig(url=u, role="decode", pool=pool(self.decode_pools, k))
                   for k, u in enumerate(self.decode)]
                + list(self.instances_))


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``) or JSON config file into a dict.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file does not hold a mapping.
    """
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        import yaml  # type: ignore[import-untyped]

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    return data


def load_config(file: str | Path | None = None, **overrides: Any) -> GatewayConfig:
    """Build a :class:`GatewayConfig` from a file plus overrides (flags win).

    ``None`` overrides are ignored, so unset CLI flags keep the file's values.

    Raises:
        pydantic.ValidationError: the merged config is invalid.
    """
    data: dict[str, Any] = read_config_file(file) if file else {}
    data.update({k: v for k, v in overrides.items() if v is not None})
    return GatewayConfig.model_validate(data)
