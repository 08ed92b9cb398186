"""Prometheus metrics for the server (names as vLLM's, under `omniinfer:`), and the stats line.

Gauges and token counters are read from the engine's `stats()` snapshot when scraped;
latency histograms and finished-request counters are observed by the engine thread as
outputs arrive. Each server owns its registry, so several servers can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from omniinfer.logger import init_logger

logger = init_logger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# engine.stats() key -> (metric name, kind, help)
_STATS = {
    "num_running": ("num_requests_running", "gauge", "Sequences running on the device."),
    "num_waiting": ("num_requests_waiting", "gauge", "Sequences waiting to be scheduled."),
    "num_swapped": ("num_requests_swapped", "gauge", "Sequences swapped out to host memory."),
    "kv_cache_usage": ("kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (1 = 100%)."),
    "num_prompt_tokens": ("prompt_tokens", "counter", "Prompt tokens accepted."),
    "num_generation_tokens": ("generation_tokens", "counter", "Tokens generated."),
    "num_preemptions": ("num_preemptions", "counter", "Sequences preempted."),
    "num_prefix_cache_queries": ("prefix_cache_queries", "counter",
                                 "Full KV blocks looked up in the prefix cache."),
    "num_prefix_cache_hits": ("prefix_cache_hits", "counter",
                              "Full KV blocks found in the prefix cache."),
}
# speculative decoding counters, when the engine reports them
_SPEC = {
    "num_spec_proposed_tokens": "spec_decode_num_draft_tokens",
    "num_spec_accepted_tokens": "spec_decode_num_accepted_tokens",
    "num_spec_emitted_tokens": "spec_decode_num_emitted_tokens",
}


class _StatsCollector:
    def __init__(self, stats_fn, model_name: str, health_fn):
        self.stats_fn = stats_fn
        self.model_name = model_name
        self.health_fn = health_fn

    def collect(self):
        dead = GaugeMetricFamily("omniinfer:engine_dead", "1 once the engine (or one of its "
                                 "workers) has failed and nothing can be served, else 0.",
                                 labels=["model_name"])
        dead.add_metric([self.model_name], float(self.health_fn() is not None))
        yield dead
        stats = self.stats_fn() or {}
        for key, value in stats.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if key in _STATS:
                name, kind, doc = _STATS[key]
            elif key.startswith("num_spec_"):
                name = _SPEC.get(key, "spec_decode_" + key.removeprefix("num_spec_"))
                kind, doc = "counter", f"Speculative decoding: {key}."
            elif key.startswith("spec_"):  # e.g. spec_acceptance_rate
                name = "spec_decode_" + key.removeprefix("spec_")
                kind, doc = "gauge", f"Speculative decoding: {key}."
            else:
                continue
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                f"omniinfer:{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class ServerMetrics:
    """The registry behind GET /metrics, fed by the engine thread."""

    def __init__(self, model_name: str, stats_fn=lambda: {}, health_fn=lambda: None):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(stats_fn, model_name, health_fn))
        labels = ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(f"omniinfer:{name}", doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between steps that add tokens to a "
                        "request.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish, per request.", E2E_BUCKETS)
        self.success = Counter("omniinfer:request_success", "Requests finished (stop or length).",
                               labels + ["finished_reason"], registry=self.registry)
        self.failure = Counter("omniinfer:request_failure", "Requests aborted or failed.",
                               labels + ["finished_reason"], registry=self.registry)
        for reason in ("stop", "length"):
            self.success.labels(model_name, reason)
        for reason in ("abort", "error"):
            self.failure.labels(model_name, reason)
        self._last_tokens = (0, 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- called by the engine thread ---------------------------------------------------------------
    def on_finished_reason(self, reason: str | None) -> None:
        reason = reason or "error"
        counter = self.success if reason in ("stop", "length") else self.failure
        counter.labels(self.model_name, reason).inc()

    def on_request_output(self, out, request, now: float) -> None:
        """One step's output of a request: TTFT, ITL, and at the end E2E and the reason."""
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        arrival = out.metrics.get("arrival_time")
        if num_tokens > request.num_tokens:
            if request.last_token_time is None:
                first = out.metrics.get("first_token_time") or now
                if arrival is not None:
                    self.ttft.observe(max(0.0, first - arrival))
            else:
                self.itl.observe(now - request.last_token_time)
            request.num_tokens, request.last_token_time = num_tokens, now
        if out.finished:
            if arrival is not None:
                self.e2e.observe(max(0.0, now - arrival))
            reason = "error" if out.error else (out.outputs[0].finish_reason if out.outputs else None)
            self.on_finished_reason(reason)

    def log_stats(self, stats: dict, interval_s: float) -> None:
        """The periodic stats line: throughput since the last line, queues, KV usage."""
        tokens = (stats.get("num_prompt_tokens", 0), stats.get("num_generation_tokens", 0))
        prompt_tps = (tokens[0] - self._last_tokens[0]) / max(interval_s, 1e-9)
        gen_tps = (tokens[1] - self._last_tokens[1]) / max(interval_s, 1e-9)
        busy = stats.get("num_running", 0) or stats.get("num_waiting", 0) or stats.get("num_swapped", 0)
        if tokens == self._last_tokens and not busy:
            return  # idle: nothing new to say
        self._last_tokens = tokens
        line = (f"prompt throughput: {prompt_tps:.1f} tokens/s, generation throughput: "
                f"{gen_tps:.1f} tokens/s, running: {stats.get('num_running', 0)}, waiting: "
                f"{stats.get('num_waiting', 0)}, swapped: {stats.get('num_swapped', 0)}, "
                f"KV cache usage: {100 * stats.get('kv_cache_usage', 0.0):.1f}%")
        if stats.get("num_prefix_cache_queries"):
            line += f", prefix cache hit rate: {100 * stats.get('prefix_cache_hit_rate', 0.0):.1f}%"
        if stats.get("num_spec_proposed_tokens"):
            accepted = stats.get("num_spec_accepted_tokens", 0) / stats["num_spec_proposed_tokens"]
            line += f", draft acceptance rate: {100 * accepted:.1f}%"
        logger.info(line)
