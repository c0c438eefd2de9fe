"""Prometheus metrics with vLLM's names under the `fp8serve:` prefix.

Each app gets its own `CollectorRegistry`, so two servers in one process do
not collide. Gauges and counters are read at scrape time from the engine's
snapshot (copied by the engine thread). Histograms of what the client sees
(TTFT, inter-token latency, E2E) are observed by the serving code; those of
the engine's steps and finished requests (tokens, queue / prefill / decode
time, finish reasons) by `ServerMetrics.record`, a stat logger the engine
thread calls after each step. A prompt-only completion (echo with max_tokens
0) runs with one hidden sampled token: it counts as no generated token, as
its response shows none (`ServerMetrics.prompt_only`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from fp8serve.engine.async_engine import AsyncLLMEngine
from fp8serve.engine.request_stats import IterationStats

PREFIX = "fp8serve:"

# Label values vLLM creates before any request (FinishReason in vllm/v1/engine/__init__.py,
# PromptTokenStats.ALL_SOURCES in vllm/v1/metrics/stats.py), so that a dashboard written for
# vLLM finds every series it queries. Some stay 0 here: fp8serve has no repetition detection
# (finish reason "repetition") and no KV connector (source "external_kv_transfer").
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0)
# vLLM's: request phases share one set of buckets, up to two hours.
_REQUEST_TIME_BUCKETS = _E2E_BUCKETS + (7680.0,)
_N_BUCKETS = (1, 2, 5, 10, 20)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets,
    sized by the model's context)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exp
            if v > limit:
                return tuple(out)
            out.append(v)
        exp += 1


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
        yield counter("prompt_tokens", "Prompt tokens of requests that got their first token (prefix-cached ones "
                      "included, as vLLM counts them).", snap.prompt_tokens_total)
        cached = snap.prompt_tokens_cached_total
        by_source = CounterMetricFamily(PREFIX + "prompt_tokens_by_source",
                                        "Prompt tokens by where their K/V came from: computed, or the prefix cache.",
                                        labels=labels + ["source"])
        counts = {"local_compute": snap.prompt_tokens_total - cached, "local_cache_hit": cached}
        for source in PROMPT_TOKEN_SOURCES:
            by_source.add_metric(value + [source], counts.get(source, 0))
        yield by_source
        yield counter("prompt_tokens_cached", "Prompt tokens whose K/V were shared, not computed (prefix cache, or "
                      "the samples of an n > 1 request).", cached)
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
        # As vLLM: no `_created` series next to every counter and histogram (they double the page).
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine, model_name))
        kw = dict(labelnames=["model_name"], registry=self.registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              buckets=_TTFT_BUCKETS, **kw).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens.",
                             buckets=_ITL_BUCKETS, **kw).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             buckets=_E2E_BUCKETS, **kw).labels(model_name)
        max_len = engine.engine.config.model_config.max_model_len

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, buckets=buckets, **kw).labels(model_name)

        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step.",
                                          _ITERATION_TOKEN_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt length of finished requests.",
                                               buckets_1_2_5(max_len))
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens of finished requests.", buckets_1_2_5(max_len))
        self.request_params_max_tokens = histogram("request_params_max_tokens", "The max_tokens of finished "
                                                   "requests that set it.", buckets_1_2_5(max_len))
        self.request_params_n = histogram("request_params_n", "The n of finished requests.", _N_BUCKETS)
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens", "The most tokens any sample of a finished request generated.",
            buckets_1_2_5(max_len))
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                    _REQUEST_TIME_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                      _REQUEST_TIME_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to last token.",
                                     _REQUEST_TIME_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "First scheduled to last token.",
                                        _REQUEST_TIME_BUCKETS)
        self.time_per_output_token = histogram("request_time_per_output_token_seconds",
                                               "Mean time between a finished request's output tokens.", _ITL_BUCKETS)
        success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                          labelnames=["model_name", "finished_reason"], registry=self.registry)
        # Every reason from the start, as vLLM: a rate over a series that does not exist yet is empty, not 0.
        self.request_success = {r: success.labels(model_name, r) for r in FINISHED_REASONS}
        # Counted here from the steps' reports rather than read from the engine's total: a
        # prompt-only request's hidden token leaves it in the same report that counts it.
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens (a prompt-only "
                                         "completion's hidden one left out).", **kw).labels(model_name)
        # Written by the serving code (event loop), read by `record` (engine thread).
        self.prompt_only_ids: set[str] = set()
        self._prompt_only_lock = threading.Lock()
        engine.engine.stat_loggers.append(self.record)

    @contextmanager
    def prompt_only(self, request_ids: list[str]) -> Iterator[None]:
        """While the block runs, the requests with these ids (all samples of each) are
        prompt-only: echo with max_tokens 0, run with max_tokens 1 because the engine samples at
        least one token, which no response shows. They count no generated token, max_tokens 0,
        and finish "length" (what their responses say) unless aborted or failed. Their prompts,
        latencies and prompt-logprob work count as any request's. The engine reports a finish
        before the caller gets the last output, so leaving the block after the request never
        loses its report."""
        with self._prompt_only_lock:
            self.prompt_only_ids.update(request_ids)
        try:
            yield
        finally:
            with self._prompt_only_lock:
                self.prompt_only_ids.difference_update(request_ids)

    def _is_prompt_only(self, request_id: str) -> bool:
        with self._prompt_only_lock:
            return request_id in self.prompt_only_ids

    def record(self, stats: IterationStats) -> None:
        """The engine's report of one step (or abort); runs on the engine thread
        (prometheus_client's metrics take their own locks)."""
        if stats.num_batched_tokens is not None:
            self.iteration_tokens.observe(stats.num_batched_tokens)
        num_hidden_tokens = 0
        for r in stats.finished_requests:
            prompt_only = self._is_prompt_only(r.request_id)
            num_generated, max_tokens, reason = r.num_generation_tokens, r.max_tokens_param, r.finish_reason
            if prompt_only:
                # Its one token was sampled in the step that finished it: in this report's count.
                num_hidden_tokens += num_generated
                num_generated, max_tokens = 0, 0
                reason = "length" if reason == "stop" else reason
            self.request_success[reason].inc()
            self.e2e.observe(r.e2e_latency)  # aborted ones too, as vLLM
            self.request_prompt_tokens.observe(r.num_prompt_tokens)
            self.request_generation_tokens.observe(num_generated)
            if max_tokens is not None:
                self.request_params_max_tokens.observe(max_tokens)
            for hist, v in ((self.queue_time, r.queued_time), (self.prefill_time, r.prefill_time),
                            (self.decode_time, r.decode_time), (self.inference_time, r.inference_time)):
                if v is not None:
                    hist.observe(v)
            if r.decode_time is not None and num_generated > 1:
                self.time_per_output_token.observe(r.decode_time / (num_generated - 1))
        for n in stats.finished_params_n:
            self.request_params_n.observe(n)
        for request_id, most in stats.finished_max_generation_tokens:
            self.request_max_num_generation_tokens.observe(0 if self._is_prompt_only(request_id) else most)
        self.generation_tokens.inc(stats.num_generation_tokens - num_hidden_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
