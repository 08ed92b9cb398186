"""Prometheus metrics for the server (names, types and buckets as vLLM's, under `omniinfer:`,
or `vllm:` with `--metrics-prefix vllm` for dashboards made for vLLM), and the stats line.

Gauges and token counters are read from the engine's `stats()` snapshot when scraped (the
request gauges count requests: one with n = 3 is one); histograms and finished-request
counters are observed by the engine thread as steps run and outputs arrive. Each server owns
its registry, so several servers can live in one process.
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
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
PREFIXES = ("omniinfer", "vllm")


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10

# engine.stats() key -> (metric name, kind, help)
_STATS = {
    "num_running_requests": ("num_requests_running", "gauge", "Requests running on the device."),
    "num_waiting_requests": ("num_requests_waiting", "gauge", "Requests waiting to be scheduled."),
    "num_swapped_requests": ("num_requests_swapped", "gauge", "Requests swapped out to host memory."),
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
    def __init__(self, stats_fn, model_name: str, health_fn, prefix: str):
        self.stats_fn = stats_fn
        self.model_name = model_name
        self.health_fn = health_fn
        self.prefix = prefix

    def collect(self):
        dead = GaugeMetricFamily(f"{self.prefix}:engine_dead", "1 once the engine (or one of its "
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
                f"{self.prefix}:{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class ServerMetrics:
    """The registry behind GET /metrics, fed by the engine thread. `prefix`: "omniinfer" or
    "vllm" (the series' namespace)."""

    def __init__(self, model_name: str, stats_fn=lambda: {}, health_fn=lambda: None,
                 prefix: str = "omniinfer"):
        if prefix not in PREFIXES:
            raise ValueError(f"metrics_prefix={prefix!r} is not allowed; allowed: "
                             f"{', '.join(PREFIXES)}")
        self.model_name, self.prefix = model_name, prefix
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(stats_fn, model_name, health_fn, prefix))
        labels = ["model_name"]
        self.ttft = self._hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = self._hist("inter_token_latency_seconds", "Time between steps that add tokens "
                              "to a request.", ITL_BUCKETS)
        self.tpot = self._hist("time_per_output_token_seconds", "Time per output token after the "
                               "first (a step's interval over the tokens it added).", TPOT_BUCKETS)
        self.e2e = self._hist("e2e_request_latency_seconds", "Arrival to finish, per request.",
                              E2E_BUCKETS)
        self.phases = {phase: self._hist(f"request_{phase}_time_seconds", doc, E2E_BUCKETS)
                       for phase, doc in (("queue", "Arrival to first scheduled (WAITING)."),
                                          ("prefill", "First scheduled to first token (PREFILL)."),
                                          ("decode", "First token to last token (DECODE)."),
                                          ("inference", "First scheduled to last token (RUNNING)."))}
        self.iteration_tokens = self._hist("iteration_tokens_total", "Tokens computed per engine "
                                           "step (one forward pass).", ITERATION_TOKEN_BUCKETS)
        self.params_n = self._hist("request_params_n", "The n request parameter.", N_BUCKETS)
        self.prompt_tokens = self.generation_tokens = None  # buckets need max_model_len: bind()
        self.success = Counter(f"{prefix}:request_success", "Requests finished (stop or length).",
                               labels + ["finished_reason"], registry=self.registry)
        self.failure = Counter(f"{prefix}:request_failure", "Requests aborted or failed.",
                               labels + ["finished_reason"], registry=self.registry)
        for reason in ("stop", "length"):
            self.success.labels(model_name, reason)
        for reason in ("abort", "error"):
            self.failure.labels(model_name, reason)
        self._last_tokens = (0, 0)

    def _hist(self, name: str, doc: str, buckets) -> Histogram:
        return Histogram(f"{self.prefix}:{name}", doc, ["model_name"], buckets=buckets,
                         registry=self.registry).labels(self.model_name)

    def bind(self, max_model_len: int) -> None:
        """The served model is known: the token-count histograms (buckets up to its length)."""
        if self.prompt_tokens is None:
            buckets = buckets_1_2_5(max_model_len)
            self.prompt_tokens = self._hist("request_prompt_tokens", "Prompt tokens per request.",
                                            buckets)
            self.generation_tokens = self._hist("request_generation_tokens", "Generated tokens "
                                                "per request (all n samples).", buckets)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- called by the engine thread ---------------------------------------------------------------
    def on_finished_reason(self, reason: str | None) -> None:
        reason = reason or "error"
        counter = self.success if reason in ("stop", "length") else self.failure
        counter.labels(self.model_name, reason).inc()

    def on_request_added(self, params) -> None:
        self.params_n.observe(params.n)

    def on_step(self, num_tokens: int, num_passes: int) -> None:
        """An engine step computed `num_tokens` tokens in each of `num_passes` forward passes."""
        for _ in range(num_passes if num_tokens else 0):
            self.iteration_tokens.observe(num_tokens)

    def on_request_output(self, out, request, now: float) -> None:
        """One step's output of a request: TTFT, ITL, TPOT, and at the end E2E, the phases, the
        token counts and the reason."""
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        m = out.metrics
        arrival = m.get("arrival_time")
        if num_tokens > request.num_tokens:
            if request.last_token_time is None:
                first = m.get("first_token_time") or now
                if arrival is not None:
                    self.ttft.observe(max(0.0, first - arrival))
            else:
                interval, added = now - request.last_token_time, num_tokens - request.num_tokens
                self.itl.observe(interval)
                for _ in range(added):
                    self.tpot.observe(interval / added)
            request.num_tokens, request.last_token_time = num_tokens, now
        if out.finished:
            if arrival is not None:
                self.e2e.observe(max(0.0, now - arrival))
            self._observe_phases(m)
            if self.prompt_tokens is not None:
                self.prompt_tokens.observe(len(out.prompt_token_ids))
                self.generation_tokens.observe(num_tokens)
            reason = "error" if out.error else (out.outputs[0].finish_reason if out.outputs else None)
            self.on_finished_reason(reason)

    def _observe_phases(self, m: dict) -> None:
        arrival, scheduled = m.get("arrival_time"), m.get("first_scheduled_time")
        first, last = m.get("first_token_time"), m.get("last_token_time")
        for phase, start, end in (("queue", arrival, scheduled), ("prefill", scheduled, first),
                                  ("decode", first, last), ("inference", scheduled, last)):
            if start is not None and end is not None:
                self.phases[phase].observe(max(0.0, end - start))

    def log_stats(self, stats: dict, interval_s: float) -> None:
        """The periodic stats line: throughput since the last line, queues, KV usage."""
        tokens = (stats.get("num_prompt_tokens", 0), stats.get("num_generation_tokens", 0))
        prompt_tps = (tokens[0] - self._last_tokens[0]) / max(interval_s, 1e-9)
        gen_tps = (tokens[1] - self._last_tokens[1]) / max(interval_s, 1e-9)
        running, waiting, swapped = (stats.get(f"num_{state}_requests", 0)
                                     for state in ("running", "waiting", "swapped"))
        busy = running or waiting or swapped
        if tokens == self._last_tokens and not busy:
            return  # idle: nothing new to say
        self._last_tokens = tokens
        line = (f"prompt throughput: {prompt_tps:.1f} tokens/s, generation throughput: "
                f"{gen_tps:.1f} tokens/s, running: {running}, waiting: {waiting}, swapped: "
                f"{swapped} requests, "
                f"KV cache usage: {100 * stats.get('kv_cache_usage', 0.0):.1f}%")
        if stats.get("num_prefix_cache_queries"):
            line += f", prefix cache hit rate: {100 * stats.get('prefix_cache_hit_rate', 0.0):.1f}%"
        if stats.get("num_spec_proposed_tokens"):
            accepted = stats.get("num_spec_accepted_tokens", 0) / stats["num_spec_proposed_tokens"]
            line += f", draft acceptance rate: {100 * accepted:.1f}%"
        logger.info(line)
