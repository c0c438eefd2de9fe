"""Prometheus metrics with vLLM's names under the `fp8serve:` prefix.

Each app gets its own `CollectorRegistry`, so two servers in one process do
not collide. Gauges and counters are read at scrape time from the engine's
snapshot (copied by the engine thread); latency histograms are observed by
the serving code as requests finish.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from fp8serve.engine.async_engine import AsyncLLMEngine

PREFIX = "fp8serve:"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0)


class _EngineCollector:
    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        spec = engine.engine.model_runner.kv_cache_spec
        self.cache_labels = {
            "num_blocks": str(engine.snapshot.num_blocks),
            "block_size": str(spec.block_size),
            "kv_cache_dtype": spec.kv_cache_dtype,
            "enable_prefix_caching": str(engine.engine.block_manager.enable_prefix_caching),
        }

    def collect(self):
        snap = self.engine.snapshot
        labels = ["model_name"]
        value = [self.model_name]

        def gauge(name, doc, v):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name, doc, v):
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge("num_requests_running", "Number of requests in the running batch.", snap.num_running)
        yield gauge("num_requests_waiting", "Number of requests waiting to be scheduled.", snap.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", snap.kv_cache_usage)
        yield counter("prompt_tokens", "Prefilled prompt tokens (recomputed ones included).",
                      snap.prompt_tokens_total)
        yield counter("generation_tokens", "Generated tokens.", snap.generation_tokens_total)
        yield counter("num_preemptions", "Preemptions by recompute.", snap.num_preemptions)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      snap.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled).",
                      snap.prefix_cache_hits)
        yield counter("spec_decode_num_drafts", "Verify passes of a sequence with draft tokens.",
                      snap.spec_decode_num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens checked.", snap.spec_decode_num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens kept.", snap.spec_decode_num_accepted_tokens)
        info = InfoMetricFamily(PREFIX + "cache_config", "KV cache configuration.")
        info.add_metric([], self.cache_labels)
        yield info


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine, model_name))
        kw = dict(labelnames=["model_name"], registry=self.registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              buckets=_TTFT_BUCKETS, **kw).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens.",
                             buckets=_ITL_BUCKETS, **kw).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             buckets=_E2E_BUCKETS, **kw).labels(model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)
