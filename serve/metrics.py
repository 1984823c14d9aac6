"""The server's Prometheus metrics (/metrics) and the periodic log line built from them.

Request latencies and token counts are recorded as outputs leave the engine thread;
scheduler gauges and counters (running / waiting, KV blocks, prefix cache, preemptions)
are read from the engine's latest stats snapshot at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from meshserve.engine.outputs import RequestOutput
from meshserve.engine.scheduler_output import SchedulerStats

PREFIX = "meshserve"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                   0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class _EngineCollector(Collector):
    """Scheduler state from the latest snapshot, read at scrape time."""

    def __init__(self, stats: Callable[[], SchedulerStats], num_blocks: int) -> None:
        self._stats = stats
        self._num_blocks = num_blocks

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        pc = s.prefix_cache
        gauges = (
            ("num_requests_running", "Requests in the running batch.", s.num_running),
            ("num_requests_waiting", "Requests queued for admission.", s.num_waiting),
            ("kv_blocks_used", "KV-cache blocks held by some sequence.", s.num_used_blocks),
            ("kv_blocks_free", "Free (or cached and evictable) KV-cache blocks.",
             s.num_free_blocks),
            ("kv_blocks_total", "KV-cache blocks on this rank.", self._num_blocks),
            ("kv_cache_usage_ratio", "Share of KV-cache blocks in use.",
             s.num_used_blocks / self._num_blocks if self._num_blocks else 0.0),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        counters = (
            ("prefix_cache_queries", "Prompt blocks looked up in the prefix cache.",
             pc.num_queries),
            ("prefix_cache_hits", "Prompt blocks found in the prefix cache.", pc.num_hits),
            ("num_preemptions", "Sequences preempted (KV dropped, to be recomputed).",
             s.num_preemptions),
        )
        sd = s.spec
        counters += (
            ("spec_decode_num_drafts", "Speculative decoding: verify steps of a sequence.",
             sd.num_drafts),
            ("spec_decode_num_draft_tokens", "Speculative decoding: tokens drafted.",
             sd.num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Speculative decoding: drafted tokens "
             "accepted.", sd.num_accepted_tokens),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        per = CounterMetricFamily(f"{PREFIX}_spec_decode_num_accepted_tokens_per_pos",
                                  "Speculative decoding: accepted drafted tokens by their "
                                  "position in the draft (0: the first).", labels=["position"])
        for position, value in enumerate(sd.accepted_per_position):
            per.add_metric([str(position)], value)
        yield per


class ServerMetrics:
    """Histograms, counters and gauges of one server, in a registry of its own."""

    def __init__(self, stats: Callable[[], SchedulerStats], num_blocks: int,
                 num_open_streams: Callable[[], int]) -> None:
        self._stats = stats
        self._num_blocks = num_blocks
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Arrival to first generated token.", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of started "
                                     "requests.", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens.",
                                         registry=r)
        self.finished = Counter(f"{PREFIX}_requests_finished", "Requests that ran to the end.",
                                ["finish_reason"], registry=r)
        self.aborted = Counter(f"{PREFIX}_requests_aborted", "Requests stopped because the "
                               "client left or cancelled.", registry=r)
        self.errors = Counter(f"{PREFIX}_http_errors", "Error responses by HTTP status.",
                              ["status"], registry=r)
        self.gen_tok_s = Gauge(f"{PREFIX}_generation_tokens_per_second",
                               "Generated tokens/s over the last log interval.", registry=r)
        self.prompt_tok_s = Gauge(f"{PREFIX}_prompt_tokens_per_second",
                                  "Prompt tokens/s over the last log interval.", registry=r)
        streams = Gauge(f"{PREFIX}_open_streams", "Engine requests with a waiting HTTP "
                        "handler.", registry=r)
        streams.set_function(lambda: float(num_open_streams()))
        r.register(_EngineCollector(stats, num_blocks))
        # Plain totals for the tokens/s gauges (ints: safe to read from the loop thread).
        self._num_generated = self._num_prompt = self._num_finished = 0
        self._last = (time.monotonic(), 0, 0)

    def on_outputs(self, outs: list[RequestOutput]) -> None:
        """Count tokens and observe latencies of finished requests (engine thread)."""
        num_generated = num_prompt = 0
        for out in outs:
            num_generated += len(out.new_token_ids)
            m = out.metrics
            if len(out.token_ids) == len(out.new_token_ids):  # the request's first output
                num_prompt += m.num_prompt_tokens
            if not out.finished:
                continue
            self._num_finished += 1
            self.finished.labels(out.finish_reason or "unknown").inc()
            for hist, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.e2e, m.e2e)):
                if value is not None:
                    hist.observe(value)
        self.generation_tokens.inc(num_generated)
        self.prompt_tokens.inc(num_prompt)
        self._num_generated += num_generated
        self._num_prompt += num_prompt

    def tick(self) -> str:
        """Update the tokens/s gauges since the last tick; the log line of the same numbers."""
        now = time.monotonic()
        t0, gen0, prompt0 = self._last
        dt = max(now - t0, 1e-9)
        gen_tok_s = (self._num_generated - gen0) / dt
        prompt_tok_s = (self._num_prompt - prompt0) / dt
        self.gen_tok_s.set(gen_tok_s)
        self.prompt_tok_s.set(prompt_tok_s)
        self._last = (now, self._num_generated, self._num_prompt)
        s = self._stats()
        pc = s.prefix_cache
        return (f"running={s.num_running} waiting={s.num_waiting} "
                f"kv_blocks_used={s.num_used_blocks}/{self._num_blocks} "
                f"prefix_cache_hits={pc.num_hits}/{pc.num_queries} "
                f"preemptions={s.num_preemptions} finished={self._num_finished} "
                f"gen_tok_s={gen_tok_s:.1f} prompt_tok_s={prompt_tok_s:.1f}")

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
