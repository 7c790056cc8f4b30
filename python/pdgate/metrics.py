"""Prometheus metrics of the gateway (``GET /metrics``).

Names follow ``pdgate_<what>_<unit>``. Every gateway app owns a
:class:`GatewayMetrics` with its own ``CollectorRegistry``, so several gateways
can live in one process (tests) without clashing.

TTFT and TPOT are measured as the gateway sees them, with the definitions of
vLLM's ``benchmarks/serve.py``: TTFT = first content chunk time - request
arrival; TPOT = (end - first token) / (output tokens - 1).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Seconds; spans CPU test fleets (10 ms-60 s) and GPU fleets (ms).
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)

_ERR_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)


class GatewayMetrics:
    """All metrics of one gateway instance.

    Attributes:
        requests: ``pdgate_requests_total{route,outcome}``; route is
            ``pd`` (prefill + decode), ``decode_only`` (fallback or no prefill
            pool) or ``none`` (refused before routing); outcome is ``success``,
            ``client_error``, ``upstream_error``, ``cancelled``.
        ttft: ``pdgate_time_to_first_token_seconds`` (streaming requests).
        tpot: ``pdgate_time_per_output_token_seconds`` (streaming, > 1 token).
        e2e: ``pdgate_request_duration_seconds`` (all requests).
        in_flight: ``pdgate_instance_requests_in_flight{instance,role}``.
        prefill_fallbacks: ``pdgate_prefill_fallbacks_total{reason}``: the
            decode instance computed the prompt itself.
        dropped_kv_params: ``pdgate_client_kv_transfer_params_dropped_total``.
        route_decisions: ``pdgate_route_decisions_total{policy,choice}``:
            every routing decision (choice ``pd``, ``deflect``, ``decode_only``,
            ``pool:<name>``...).
        token_estimates: ``pdgate_prompt_token_estimates_total{reason}``:
            prompts whose token count was estimated, not tokenized.
        predictor_error: ``pdgate_predictor_relative_error_ratio{what}``:
            ``|predicted - observed| / observed`` for ``ttft``, ``prefill``,
            ``decode_step``.
        predictor_bias: ``pdgate_predictor_bias_ratio{what}``: moving average of
            the signed ``(predicted - observed) / observed`` (> 0: predicts high).
        scrape_errors: ``pdgate_scrape_errors_total{instance}``.
        scrape_stale: ``pdgate_instance_scrape_stale{instance}`` (1 = stale).
        admission_waiting: ``pdgate_admission_waiting_requests`` (queued prefill legs).
        admission_wait: ``pdgate_admission_wait_seconds`` (time queued).
        rejected: ``pdgate_rejected_requests_total{reason}``: requests refused
            before reaching any instance (bad input, limits, drain, no instance).
        instance_healthy: ``pdgate_instance_healthy{instance,role}``: 1 while
            the instance's circuit breaker is closed, else 0.
        ejections: ``pdgate_instance_ejections_total{instance,role}``.
        decode_retries: ``pdgate_decode_retries_total{reason}``: decode legs
            retried on another instance before the first byte reached the client.
        api_in_flight: ``pdgate_api_requests_in_flight``: API requests being served.
        draining: ``pdgate_draining``: 1 while the gateway drains for shutdown.
        added_latency: ``pdgate_added_latency_seconds``: time the gateway adds
            before the decode leg is sent: from arrival (body read) to sending
            the decode leg, minus the prefill leg (admission wait included).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("pdgate_requests", "Requests handled, by route and outcome.",
                                ["route", "outcome"], registry=r)
        self.ttft = Histogram("pdgate_time_to_first_token_seconds",
                              "Time from request arrival to the first streamed token, seconds.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("pdgate_time_per_output_token_seconds",
                              "Mean time per output token after the first, seconds.",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("pdgate_request_duration_seconds",
                             "Time from request arrival to the end of its response, seconds.",
                             buckets=_TTFT_BUCKETS, registry=r)
        self.in_flight = Gauge("pdgate_instance_requests_in_flight",
                               "Request legs in flight per instance (until the stream ends).",
                               ["instance", "role"], registry=r)
        self.prefill_fallbacks = Counter(
            "pdgate_prefill_fallbacks",
            "Requests the decode instance served whole because the prefill leg failed.",
            ["reason"], registry=r)
        self.prefill_first_tokens = Counter(
            "pdgate_prefill_first_tokens",
            "P/D requests whose first token was streamed from the prefill leg (outcome=sent), and those "
            "whose decode stream then did not start with it (outcome=mismatch).",
            ["outcome"], registry=r)
        self.dropped_kv_params = Counter(
            "pdgate_client_kv_transfer_params_dropped",
            "Client-supplied kv_transfer_params removed before forwarding.", registry=r)

        self.route_decisions = Counter("pdgate_route_decisions", "Routing decisions by policy and choice.",
                                       ["policy", "choice"], registry=r)
        self.token_estimates = Counter("pdgate_prompt_token_estimates",
                                       "Prompts whose token count was estimated instead of tokenized.",
                                       ["reason"], registry=r)
        self.predictor_error = Histogram("pdgate_predictor_relative_error_ratio",
                                         "Latency predictor error, |predicted - observed| / observed.",
                                         ["what"], buckets=_ERR_BUCKETS, registry=r)
        self.predictor_bias = Gauge("pdgate_predictor_bias_ratio",
                                    "Moving average of (predicted - observed) / observed.", ["what"], registry=r)
        self.scrape_errors = Counter("pdgate_scrape_errors", "Failed /metrics scrapes per instance.",
                                     ["instance"], registry=r)
        self.scrape_stale = Gauge("pdgate_instance_scrape_stale",
                                  "1 when an instance's scraped metrics are older than the staleness bound.",
                                  ["instance"], registry=r)
        self.admission_waiting = Gauge("pdgate_admission_waiting_requests",
                                       "Prefill legs waiting in the admission queue.", registry=r)
        self.admission_wait = Histogram("pdgate_admission_wait_seconds",
                                        "Time a prefill leg waited in the admission queue, seconds.",
                                        buckets=_TTFT_BUCKETS, registry=r)
        self.rejected = Counter("pdgate_rejected_requests",
                                "Requests refused before reaching an instance, by reason.", ["reason"], registry=r)
        self.instance_healthy = Gauge("pdgate_instance_healthy",
                                      "1 when the instance's circuit breaker is closed (routable), else 0.",
                                      ["instance", "role"], registry=r)
        self.ejections = Counter("pdgate_instance_ejections",
                                 "Times the circuit breaker ejected the instance from routing.",
                                 ["instance", "role"], registry=r)
        self.decode_retries = Counter("pdgate_decode_retries",
                                      "Decode legs retried on another instance before any byte reached the client.",
                                      ["reason"], registry=r)
        self.api_in_flight = Gauge("pdgate_api_requests_in_flight",
                                   "Completion/chat requests being served (streams until they end).", registry=r)
        self.added_latency = Histogram(
            "pdgate_added_latency_seconds",
            "Gateway time from arrival to sending the decode leg, prefill leg excluded, seconds.",
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
            registry=r)
        self.draining = Gauge("pdgate_draining", "1 when the gateway is draining before shutting down, else 0.",
                              registry=r)

    def render(self) -> tuple[bytes, str]:
        """Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
