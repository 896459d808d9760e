"""Prometheus metrics of the server, vLLM-style names under the `jaxinfer:` prefix.

Request histograms and the prompt-token counter are fed by finished requests (on the engine
thread); gauges and the engine's cumulative counters (generated tokens among them) are read
from engine.stats() at each scrape.
"""

from __future__ import annotations

import threading

import jax
import prometheus_client as prom

from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.engine.startup.background_compile import on_background_thread
from jaxinfer.engine.startup.compilation_cache import COMPILE_EVENT as _COMPILE_EVENT
from jaxinfer.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.registry = prom.CollectorRegistry()
        self._lock = threading.Lock()

        def histogram(name, doc):
            return prom.Histogram(
                f"jaxinfer:{name}", doc, registry=self.registry, buckets=_LATENCY_BUCKETS
            )

        def counter(name, doc):
            return prom.Counter(f"jaxinfer:{name}", doc, registry=self.registry)

        def gauge(name, doc):
            return prom.Gauge(f"jaxinfer:{name}", doc, registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first output token.")
        self.itl = histogram("inter_token_latency_seconds", "Between consecutive tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.")
        self.running = gauge("num_requests_running", "Requests being computed.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for room.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use.")
        cache = engine.config.cache
        prom.Gauge(
            "jaxinfer:kv_cache_capacity_tokens",
            "Tokens the KV cache holds, by its format.",
            ["kv_cache_dtype"],
            registry=self.registry,
        ).labels(cache.kv_format.name).set(cache.capacity_tokens())
        self.cache_usage = prom.Gauge(
            "jaxinfer:cache_usage_perc",
            "Fraction of each kind of cache entry in use (kv_blocks; recurrent_states: a "
            "hybrid model's per-request state slots).",
            ["kind"],
            registry=self.registry,
        )
        self.cache_capacity = prom.Gauge(
            "jaxinfer:cache_capacity",
            "Entries of each kind of cache (kv_blocks: usable blocks; recurrent_states: "
            "requests' state slots).",
            ["kind"],
            registry=self.registry,
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.preemptions = counter("num_preemptions", "Requests preempted.")
        self.cache_queries = counter("prefix_cache_queries", "Tokens looked up.")
        self.cache_hits = counter("prefix_cache_hits", "Tokens found in the prefix cache.")
        self.compilations = counter(
            "compilations_after_warmup",
            "XLA compilations on the step path after warm-up (should stay 0).",
        )
        background = engine.background_compile
        gauge(
            "token_buckets_compiling",
            "Token buckets still compiling in the background (warmup background); until then "
            "a step is padded to a larger compiled bucket.",
        ).set_function(
            lambda: 0 if background is None else len(background.buckets) - len(background.compiled)
        )
        self._last = {"preemptions": 0, "queries": 0, "hits": 0, "generated": 0}
        self.spec = None
        if engine.config.speculative.method != "none":
            self.spec = {
                "drafts": counter("spec_decode_num_drafts", "Request steps with proposals."),
                "draft_tokens": counter("spec_decode_num_draft_tokens", "Tokens proposed."),
                "accepted": counter("spec_decode_num_accepted_tokens", "Proposals accepted."),
                "seconds": counter(
                    "spec_decode_proposing_seconds",
                    "Seconds spent proposing (host lookups, or the draft model's steps).",
                ),
            }
            prom.Gauge(
                "jaxinfer:spec_decode_method",
                "The speculative method (1 for the engine's).",
                ["method"],
                registry=self.registry,
            ).labels(method=engine.config.speculative.method).set(1)
            self.suffix_entries = gauge(
                "spec_decode_suffix_cache_entries",
                "Entries of suffix decoding's server index of recent outputs (0: another method).",
            )
            self.spec_per_position = prom.Counter(
                "jaxinfer:spec_decode_num_accepted_tokens_per_pos",
                "Proposals accepted, by their index among a step's proposals.",
                ["position"],
                registry=self.registry,
            )
            self._last_per_position: list[int] = []
        jax.monitoring.register_event_duration_secs_listener(self._on_compile)

    def _on_compile(self, event: str, duration: float, **kwargs) -> None:
        if on_background_thread():  # token buckets compiled while serving, off the step path
            return
        if event == _COMPILE_EVENT:
            self.compilations.inc()

    def observe_finished(self, output: RequestOutput) -> None:
        """Called once per finished request (on the engine thread)."""
        metrics = output.metrics
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        if metrics.time_to_first_token is not None:
            self.ttft.observe(metrics.time_to_first_token)
        if metrics.queue_time is not None:
            self.queue.observe(metrics.queue_time)
        if metrics.finished_time is not None:
            self.e2e.observe(metrics.finished_time - metrics.arrival_time)
        for latency in metrics.inter_token_latencies:
            self.itl.observe(latency)

    def render(self) -> bytes:
        stats = self.engine.stats()
        with self._lock:
            self.running.set(stats.num_running)
            self.waiting.set(stats.num_waiting)
            self.kv_usage.set(stats.kv_cache_usage)
            for kind, value in stats.cache_usage.items():
                self.cache_usage.labels(kind).set(value)
            for kind, value in stats.cache_capacity.items():
                self.cache_capacity.labels(kind).set(value)
            for key, value, metric in [
                ("preemptions", stats.num_preemptions, self.preemptions),
                ("queries", stats.prefix_cache_queries, self.cache_queries),
                ("hits", stats.prefix_cache_hits, self.cache_hits),
                ("generated", stats.num_generated_tokens, self.generation_tokens),
            ]:
                metric.inc(value - self._last[key])
                self._last[key] = value
            if self.spec is not None and stats.spec is not None:
                self._render_spec(stats.spec)
        return prom.generate_latest(self.registry)

    def _render_spec(self, spec) -> None:
        for key, value in [
            ("drafts", spec.num_drafts),
            ("draft_tokens", spec.num_draft_tokens),
            ("accepted", spec.num_accepted_tokens),
            ("seconds", spec.proposing_seconds),
        ]:
            self.spec[key].inc(value - self._last.get("spec_" + key, 0))
            self._last["spec_" + key] = value
        self.suffix_entries.set(spec.suffix_cache_entries)
        seen = self._last_per_position
        for position, value in enumerate(spec.accepted_per_position):
            before = seen[position] if position < len(seen) else 0
            self.spec_per_position.labels(position=str(position)).inc(value - before)
        self._last_per_position = list(spec.accepted_per_position)
