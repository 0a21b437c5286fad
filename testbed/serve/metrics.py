"""`GET /metrics`: Prometheus metrics of the served engine (prometheus-client).

Latency histograms are observed when a request finishes, on the executor's clock (so under
`executor=sim` they show the simulated cluster's TTFT/TPOT/E2EL, with the definitions of
engine/core/metrics.py). Engine state is read from the controller at scrape time by a collector:
running and waiting requests, KV usage, preemptions, and per stage the busy seconds (the
tracer's running sums, which never drop) and the bubble ratio (1 - busy / time with a
micro-batch in flight, engine/core/metrics.py's definition). Each server has its own registry.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.core.controller import Controller
from engine.core.request import Sequence

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
PREFIX = "testbed"


class _EngineCollector:
    def __init__(self, ctrl: Controller, model: str) -> None:
        self.ctrl = ctrl
        self.model = model

    def collect(self):
        c = self.ctrl
        labels = ["model_name"]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)
            g.add_metric([self.model], value)
            return g

        yield gauge("num_requests_running", "Requests admitted (prefilling or decoding).", len(c.running))
        yield gauge("num_requests_waiting", "Requests waiting for admission (incl. preempted).", len(c.waiting))
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use.", c.kv.usage)
        yield gauge("num_microbatches_inflight", "Micro-batches in the pipeline.", len(c.inflight))
        pre = CounterMetricFamily(f"{PREFIX}_num_preemptions", "Preemptions (recompute).", labels=labels)
        pre.add_metric([self.model], c.num_preemptions)
        yield pre
        tracer = c.executor.tracer
        active = c.active_time
        if c._active_since is not None:  # a micro-batch is in flight now: count the time so far
            active += max(0.0, c.executor.now() - c._active_since)
        busy = CounterMetricFamily(f"{PREFIX}_stage_busy_seconds", "Busy time per pipeline stage.",
                                   labels=labels + ["stage"])
        bubble = GaugeMetricFamily(f"{PREFIX}_stage_bubble_ratio",
                                   "1 - busy / time with a micro-batch in flight, per stage.",
                                   labels=labels + ["stage"])
        for s in range(c.pipeline_depth):
            b = tracer.busy_time(f"stage{s}")
            busy.add_metric([self.model, str(s)], b)
            bubble.add_metric([self.model, str(s)], max(0.0, 1.0 - b / active) if active > 0 else 0.0)
        yield busy
        yield bubble
        ex = c.executor
        if hasattr(ex, "lag_s"):  # the paced simulator: how far behind its clock this host ran it
            lag = CounterMetricFamily(f"{PREFIX}_clock_lag_seconds", "Simulated seconds by which completions "
                                      "reached the controller after their time (host too slow).", labels=labels)
            lag.add_metric([self.model], ex.lag_s)
            yield lag
            handed = CounterMetricFamily(f"{PREFIX}_clock_completions", "Completions handed to the controller.",
                                         labels=labels)
            handed.add_metric([self.model], ex.handed)
            yield handed


class ServeMetrics:
    def __init__(self, ctrl: Controller, model: str) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        lab = ["model_name"]
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "TTFT.", lab, buckets=LATENCY_BUCKETS,
                              registry=self.registry).labels(model)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds", "TPOT.", lab, buckets=LATENCY_BUCKETS,
                              registry=self.registry).labels(model)
        self.e2el = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "E2EL.", lab, buckets=LATENCY_BUCKETS,
                              registry=self.registry).labels(model)
        self.finished = Counter(f"{PREFIX}_request_success", "Requests finished.", lab + ["finished_reason"],
                                registry=self.registry)
        self.aborted = Counter(f"{PREFIX}_request_aborted", "Requests aborted (client gone).", lab,
                               registry=self.registry).labels(model)
        self.rejected = Counter(f"{PREFIX}_request_rejected", "Requests refused (4xx/503).", lab + ["status"],
                                registry=self.registry)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests.", lab,
                                     registry=self.registry).labels(model)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated by finished requests.",
                                         lab, registry=self.registry).labels(model)
        self.registry.register(_EngineCollector(ctrl, model))

    def on_finish(self, seq: Sequence, reason: str = "length") -> None:
        r = seq.request
        if seq.first_token_s is not None:
            self.ttft.observe(seq.first_token_s - r.arrival_s)
            if seq.num_generated > 1 and seq.finish_s is not None:
                self.tpot.observe((seq.finish_s - seq.first_token_s) / (seq.num_generated - 1))
        if seq.finish_s is not None:
            self.e2el.observe(seq.finish_s - r.arrival_s)
        self.finished.labels(self.model, reason).inc()
        self.prompt_tokens.inc(r.prompt_len)
        self.generation_tokens.inc(seq.num_generated)

    def on_abort(self) -> None:
        self.aborted.inc()

    def on_reject(self, status: int) -> None:
        self.rejected.labels(self.model, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
