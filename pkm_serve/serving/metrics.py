"""Prometheus metrics under TF Serving's metric names (colons included), exposed as its
prometheus_exporter.cc writes them: a counter under its own name (prometheus_client appends
`_total`, so `:tensorflow:serving:request_count` was scraped as `..._total`, which a
dashboard or alert written for TF Serving does not find) and no `_created` series.
"""
import re

import prometheus_client as prom

_LATENCY_BUCKETS_US = (50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000,
                       250000, 1000000, 10000000)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Metrics:
    def __init__(self):
        self.registry = prom.CollectorRegistry()
        r = self.registry
        self.request_count = prom.Counter(":tensorflow:serving:request_count",
                                          "Requests, by model and final status.",
                                          ["model_name", "status"], registry=r)
        self.request_latency = prom.Histogram(":tensorflow:serving:request_latency",
                                              "Request latency in microseconds.",
                                              ["model_name", "API", "entrypoint"],
                                              buckets=_LATENCY_BUCKETS_US, registry=r)
        self.runtime_latency = prom.Histogram(":tensorflow:serving:runtime_latency",
                                              "Model execution latency in microseconds.",
                                              ["model_name", "API", "runtime"],
                                              buckets=_LATENCY_BUCKETS_US, registry=r)
        self.load_attempts = prom.Counter(":tensorflow:cc:saved_model:load_attempt_count",
                                          "SavedModel load attempts.", ["model_path", "status"],
                                          registry=r)
        self.load_latency = prom.Histogram(":tensorflow:cc:saved_model:load_latency",
                                           "SavedModel load + warmup latency in microseconds.",
                                           ["model_path"], buckets=_LATENCY_BUCKETS_US, registry=r)
        self.version_state = prom.Gauge(":tensorflow:serving:model_version_available",
                                        "1 while a model version is AVAILABLE.",
                                        ["model_name", "version"], registry=r)
        self.batch_size = prom.Histogram(":tensorflow:serving:batching_session:processed_batch_size",
                                         "Rows per executed batch (before padding).",
                                         buckets=_BATCH_BUCKETS, registry=r)
        self.padding_size = prom.Histogram(":tensorflow:serving:batching_session:padding_size",
                                           "Padding rows added to reach an allowed batch size.",
                                           buckets=_BATCH_BUCKETS, registry=r)
        self.queue_latency = prom.Histogram(":tensorflow:serving:batching_session:queuing_latency",
                                            "Time a request waited for its batch, microseconds.",
                                            buckets=_LATENCY_BUCKETS_US, registry=r)

    def request(self, model, api, entrypoint, code_name, seconds):
        self.request_count.labels(model, code_name).inc()
        self.request_latency.labels(model, api, entrypoint).observe(seconds * 1e6)

    def runtime(self, model, api, seconds, runtime="TF"):
        self.runtime_latency.labels(model, api, runtime).observe(seconds * 1e6)

    def load_attempt(self, model, path, ok, seconds):
        self.load_attempts.labels(path, "success" if ok else "fail").inc()
        self.load_latency.labels(path).observe(seconds * 1e6)

    def version_available(self, model, version, available):
        self.version_state.labels(model, str(version)).set(1 if available else 0)

    def batch(self, rows, padded, waits):
        self.batch_size.observe(rows)
        self.padding_size.observe(padded - rows)
        for w in waits:
            self.queue_latency.observe(w * 1e6)

    def exposition(self):
        text = prom.generate_latest(self.registry).decode("utf-8")
        return as_tf_serving_exports(text).encode("utf-8"), prom.CONTENT_TYPE_LATEST


def as_tf_serving_exports(text: str) -> str:
    """prometheus_client's text exposition with the names TF Serving's exporter writes: each
    counter's `NAME_total` as `NAME` (HELP, TYPE and samples), the `_created` series dropped."""
    counters = set(re.findall(r"^# TYPE (\S+)_total counter$", text, re.MULTILINE))
    lines = []
    for line in text.splitlines():
        name = line.split(" ")[2] if line.startswith("# ") else re.split(r"[{ ]", line, maxsplit=1)[0]
        if name.endswith("_created"):
            continue
        if name.endswith("_total") and name[:-len("_total")] in counters:
            line = line.replace(name, name[:-len("_total")], 1)
        lines.append(line)
    return "\n".join(lines) + "\n"
