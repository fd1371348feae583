"""Prometheus metrics of one server, in a registry of its own (two servers in one process, as in
the tests, never collide in prometheus_client's global registry).

Two sources: latency histograms and request counters observed by the engine thread and the HTTP
handlers (prometheus_client metrics are thread-safe), and engine state (running/waiting requests,
KV pages, token, preemption and prefix-cache totals) read at scrape time from the last ``LLMEngine.stats()``
snapshot the engine thread published (the HTTP thread never calls the engine).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class TokenHistogram(Collector):
    """A histogram observed once per generated token, by one writer (the thread or event loop
    that delivers the engine's steps): ``observe(value, count)`` records ``count`` equal
    observations with one bisect and two additions. prometheus_client's ``Histogram`` takes a
    lock per call and was a fifth of the server's per-step delivery time at 64 streams. A scrape
    from another thread reads the counts as they are (no update is ever lost: one writer)."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]):
        self.name, self.doc, self.bounds = name, doc, tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last is +Inf
        self.total = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        # le semantics: an observation equal to a bound falls in that bucket
        self.counts[bisect_left(self.bounds, value)] += count
        self.total += value * count

    def collect(self):
        counts, total = list(self.counts), self.total
        cum, buckets = 0, []
        for bound, c in zip((*map(str, self.bounds), "+Inf"), counts):
            cum += c
            buckets.append((bound, cum))
        h = HistogramMetricFamily(self.name, self.doc)
        h.add_metric([], buckets, total)
        yield h


class _EngineCollector(Collector):
    """Engine gauges/counters from the latest stats snapshot (None before the engine is up)."""

    def __init__(self, snapshot: Callable[[], Optional[dict]], alive: Callable[[], bool]):
        self._snapshot, self._alive = snapshot, alive

    def collect(self):
        up = GaugeMetricFamily("kvfit_engine_up", "1 while the engine loop runs, else 0")
        up.add_metric([], 1.0 if self._alive() else 0.0)
        yield up
        s = self._snapshot()
        if not s:
            return
        gauges = (("kvfit_num_requests_running", "requests in the running batch", "num_running"),
                  ("kvfit_num_requests_waiting", "requests waiting for admission", "num_waiting"),
                  ("kvfit_kv_pages_used", "KV-cache pages in use", "pages_used"),
                  ("kvfit_kv_pages_free", "KV-cache pages free (incl. evictable cached ones)",
                   "pages_free"),
                  ("kvfit_kv_pages_cached", "KV-cache pages holding a cached prefix",
                   "pages_cached"),
                  ("kvfit_kv_pages_total", "KV-cache pages allocated at start", "pages_total"))
        for name, doc, key in gauges:
            if key in s:
                g = GaugeMetricFamily(name, doc)
                g.add_metric([], float(s[key]))
                yield g
        info = GaugeMetricFamily("kvfit_kv_cache_info", "KV-cache element type (value is 1)",
                                 labels=["kv_dtype"])
        info.add_metric([str(s.get("kv_dtype", "unknown"))], 1.0)
        yield info
        counters = (("kvfit_prompt_tokens", "prompt tokens processed", "prompt_tokens_total"),
                    ("kvfit_generation_tokens", "tokens generated", "generation_tokens_total"),
                    ("kvfit_num_preemptions", "requests preempted (recompute)", "num_preemptions"),
                    ("kvfit_prefix_cache_queries", "prompt tokens looked up in the prefix cache "
                     "(vLLM's prefix_cache_queries)", "prefix_cache_queries"),
                    ("kvfit_prefix_cache_hits", "of those, tokens whose KV was found cached "
                     "(vLLM's prefix_cache_hits)", "prefix_cache_hits"))
        for name, doc, key in counters:
            if key in s:
                c = CounterMetricFamily(name, doc)
                c.add_metric([], float(s[key]))
                yield c


class ServerMetrics:
    """Owns the registry; the engine thread and the handlers call the ``observe_*`` methods."""

    def __init__(self, snapshot: Callable[[], Optional[dict]], alive: Callable[[], bool]):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram("kvfit_time_to_first_token_seconds",
                              "arrival to first generated token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.itl = TokenHistogram("kvfit_inter_token_latency_seconds",
                                  "gap between consecutive generated tokens of a request",
                                  _LATENCY_BUCKETS)
        r.register(self.itl)
        self.e2e = Histogram("kvfit_e2e_request_latency_seconds", "arrival to finish",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("kvfit_request_queue_time_seconds",
                                    "engine arrival to the first step that ran the request "
                                    "(observed when it finishes)", buckets=_LATENCY_BUCKETS,
                                    registry=r)
        self.finished = Counter("kvfit_requests_finished", "engine requests finished, by reason",
                                ["finish_reason"], registry=r)
        self.disconnects = Counter("kvfit_client_disconnects",
                                   "engine requests aborted because the client went away",
                                   registry=r)
        self.http_requests = Counter("kvfit_http_requests", "HTTP API requests by status code",
                                     ["endpoint", "status"], registry=r)
        r.register(_EngineCollector(snapshot, alive))

    def render(self) -> bytes:
        return generate_latest(self.registry)
