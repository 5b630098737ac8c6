"""What Prometheus reads off the server at `/metrics` (`routes/models.py`), in its text format
(`prometheus-client`, one registry per app). The counters are fed by the per-request log
(`app.RequestLog`) when a request ends, streams included; the gauges are read from the
scheduler at each scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    """The server's counters, histograms and gauges, in their own registry."""

    def __init__(self, scheduler_counts):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "powerinfer_requests",
            "HTTP requests served, by path and status",
            ["path", "status"],
            registry=r,
        )
        self.errors = Counter(
            "powerinfer_request_errors",
            "requests that ended in an error, by the error's kind",
            ["kind"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "powerinfer_prompt_tokens", "prompt tokens of finished generations", registry=r
        )
        self.cached_tokens = Counter(
            "powerinfer_prompt_cached_tokens",
            "prompt tokens taken from the prompt cache instead of evaluated",
            registry=r,
        )
        self.completion_tokens = Counter(
            "powerinfer_completion_tokens", "tokens generated", registry=r
        )
        self.seconds = Histogram(
            "powerinfer_request_seconds", "time from request to its last byte", ["path"], registry=r
        )
        self.prefill_tps = Gauge(
            "powerinfer_prefill_tokens_per_second",
            "prompt speed of the last generation",
            registry=r,
        )
        self.decode_tps = Gauge(
            "powerinfer_decode_tokens_per_second", "decode speed of the last generation", registry=r
        )
        gauge = {
            "slots_total": "generations that can run at once",
            "slots_busy": "generations running",
            "queued": "requests waiting for a slot",
            "sessions": "sessions (KV caches) held by running generations",
            "cached_sessions": "finished sessions kept for the prompt cache",
        }
        for name, doc in gauge.items():
            g = Gauge(f"powerinfer_{name}", doc, registry=r)
            g.set_function(lambda name=name: scheduler_counts().get(name, 0))

    def record(self, path: str, status: int, seconds: float, fields: dict) -> None:
        """One finished request, with what its generation logged (`scope["powerinfer.log"]`)."""
        # (paths of their own kind only: a scan of random URLs must not grow the label set)
        known = path in ("/health", "/metrics", "/slots") or path.startswith("/v1/")
        label = path if known else "other"
        self.requests.labels(label, str(status)).inc()
        self.seconds.labels(label).observe(seconds)
        if status >= 400 or "error" in fields:
            self.errors.labels(fields.get("error_kind") or str(status)).inc()
        if "prompt_tokens" in fields:
            self.prompt_tokens.inc(fields["prompt_tokens"])
            self.cached_tokens.inc(fields.get("cached_tokens", 0))
            self.completion_tokens.inc(fields["completion_tokens"])
            self.prefill_tps.set(fields["prefill_tps"])
            self.decode_tps.set(fields["decode_tps"])
