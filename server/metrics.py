"""Prometheus metrics of one server, on its own ``CollectorRegistry`` (no global registry).

Names follow SGLang's (``sglang:`` prefix) so existing dashboards work. Health probes and the
warm-up request are never recorded. Latencies are in seconds.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                0.75, 1.0, 2.0, 5.0)


class ServerMetrics:
    """Counters (per finished sequence), latency histograms and engine gauges."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry
        self.num_requests = Counter("sglang:num_requests", "Finished requests (sequences).",
                                    labels, registry=r)
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens of finished requests.",
                                     labels, registry=r)
        self.generation_tokens = Counter("sglang:generation_tokens",
                                         "Generated tokens of finished requests.", labels,
                                         registry=r)
        self.cached_tokens = Counter("sglang:cached_tokens", "Prompt tokens served from the "
                                     "prefix cache.", labels, registry=r)
        self.num_aborted = Counter("sglang:num_aborted_requests", "Requests that ended aborted.",
                                   labels, registry=r)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Time to first token (s).",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("sglang:inter_token_latency_seconds", "Inter-token latency (s).",
                             labels, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "End-to-end latency (s).",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.num_running = Gauge("sglang:num_running_reqs", "Running requests in the engine.",
                                 labels, registry=r)
        self.num_waiting = Gauge("sglang:num_queue_reqs", "Waiting requests in the engine.",
                                 labels, registry=r)
        self.token_usage = Gauge("sglang:token_usage", "KV cache usage (fraction of tokens).",
                                 labels, registry=r)
        self.cache_hit_rate = Gauge("sglang:cache_hit_rate", "Prefix-cache hit rate (cumulative "
                                    "cached / prompt tokens).", labels, registry=r)
        self._label = {"model_name": model_name}
        self._itl = self.itl.labels(**self._label)  # observed once per token: resolve once

    def observe_first_token(self, ttft: float) -> None:
        self.ttft.labels(**self._label).observe(ttft)

    def observe_tokens(self, gap: float, num_tokens: int) -> None:
        """One streamed delta of ``num_tokens`` tokens ``gap`` seconds after the previous one;
        the gap is spread evenly over its tokens."""
        if num_tokens > 0:
            per_token = gap / num_tokens
            for _ in range(num_tokens):
                self._itl.observe(per_token)

    def observe_finished(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                         e2e: float, aborted: bool) -> None:
        lb = self._label
        self.num_requests.labels(**lb).inc()
        self.prompt_tokens.labels(**lb).inc(prompt_tokens)
        self.generation_tokens.labels(**lb).inc(completion_tokens)
        self.cached_tokens.labels(**lb).inc(cached_tokens)
        self.e2e.labels(**lb).observe(e2e)
        if aborted:
            self.num_aborted.labels(**lb).inc()

    def set_engine_stats(self, stats: dict[str, float]) -> None:
        """Copy the latest ``BatchOutput.stats`` gauges (see ``engine.io_struct.BatchOutput``)."""
        lb = self._label
        self.num_running.labels(**lb).set(stats.get("num_running_reqs", 0))
        self.num_waiting.labels(**lb).set(stats.get("num_waiting_reqs", 0))
        total = stats.get("kv_total_tokens", 0)
        self.token_usage.labels(**lb).set(stats.get("kv_used_tokens", 0) / total if total else 0)
        prompt = stats.get("prompt_tokens", 0)
        self.cache_hit_rate.labels(**lb).set(
            stats.get("cache_hit_tokens", 0) / prompt if prompt else 0)

    def render(self) -> bytes:
        """Text exposition format (``text/plain; version=0.0.4``)."""
        return generate_latest(self.registry)
