"""Generation metrics on the metrics port, beside Triton's own.

Triton's Prometheus endpoint counts requests and their queue and compute times, but a streamed
generation is one request however many tokens it makes, so what LLM users watch is not there:
tokens generated, time to first token, the gap between tokens, and how many sequences run and
wait. `GenerationMetrics` keeps those (prometheus_client, a registry of its own), fed by the
stream model as it sends each token and read from the in-flight scheduler for the gauges.
`MetricsFront` serves the user's metrics port: Triton's metrics (from its private loopback
port) followed by these, one Prometheus text page at /metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from moedeploy.serving.front import LoopServer, app_runner

#: seconds: from a request's arrival to its first token, and between two tokens of one request
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class GenerationMetrics:
    """Counters, histograms and gauges of the served generations, labelled by model."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        self.tokens = Counter("moedeploy_generated_tokens", "Tokens generated and sent by the stream models",
                              ["model"], registry=self.registry)
        self.requests = Counter("moedeploy_stream_requests", "Stream requests by outcome: finished (stop or length), "
                                "cancelled, refused (a bad request, busy or draining) or failed",
                                ["model", "outcome"], registry=self.registry)
        self.ttft = Histogram("moedeploy_time_to_first_token_seconds", "From a stream request's arrival to its first "
                              "token", ["model"], buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("moedeploy_inter_token_latency_seconds", "Between two successive tokens of one stream",
                             ["model"], buckets=ITL_BUCKETS, registry=self.registry)
        self.running = Gauge("moedeploy_running_sequences", "Sequences being generated", ["model"],
                             registry=self.registry)
        self.queued = Gauge("moedeploy_queued_sequences", "Sequences waiting for a free row (in-flight batching)",
                            ["model"], registry=self.registry)

    def watch(self, model: str, running: Callable[[], float], queued: Callable[[], float]) -> None:
        """Read the running and queued counts from their owner at every scrape."""
        self.running.labels(model).set_function(running)
        self.queued.labels(model).set_function(queued)

    def request(self, model: str) -> RequestTimer:
        return RequestTimer(self, model)

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class RequestTimer:
    """One stream request's clock: `tokens(n)` as each response goes out, `done(outcome)` at the end."""

    def __init__(self, metrics: GenerationMetrics, model: str) -> None:
        self.metrics, self.model = metrics, model
        self.last = self.start = time.perf_counter()
        self.sent = 0

    def tokens(self, n: int = 1) -> None:
        """A response of `n` tokens goes out: the latencies a client sees, a token at a time (the
        first token of a response after the time since the last response, the others after 0)."""
        now = time.perf_counter()
        itl = self.metrics.itl.labels(self.model)
        if self.sent == 0:
            self.metrics.ttft.labels(self.model).observe(now - self.start)
        else:
            itl.observe(now - self.last)
        for _ in range(n - 1):
            itl.observe(0.0)
        self.last = now
        self.sent += n
        self.metrics.tokens.labels(self.model).inc(n)

    def done(self, outcome: str) -> None:
        self.metrics.requests.labels(self.model, outcome).inc()


class MetricsFront(LoopServer):
    """The user's metrics port: Triton's Prometheus page, then moedeploy's generation metrics."""

    what = "metrics"
    flag = "--metrics-port"
    thread_name = "moedeploy-metrics-front"

    def __init__(self, host: str, port: int, upstream: str, metrics: GenerationMetrics) -> None:
        super().__init__(host, port, upstream)
        self.metrics = metrics

    async def _start(self) -> None:
        import aiohttp
        from aiohttp import web

        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = app_runner(app, self.port)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()

    async def _metrics(self, _request):
        from aiohttp import web

        try:
            async with self._session.get(f"{self.upstream}/metrics") as upstream:
                triton = await upstream.read() if upstream.status == 200 else b""
        except Exception:  # Triton stopping: our own metrics still answer
            triton = b""
        if triton and not triton.endswith(b"\n"):
            triton += b"\n"
        return web.Response(body=triton + self.metrics.exposition(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
