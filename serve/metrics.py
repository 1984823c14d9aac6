"""The server's Prometheus metrics (/metrics) and the periodic log line built from them.

Request latencies and token counts are recorded as outputs leave the engine thread;
scheduler gauges and counters (running / waiting, KV blocks, prefix cache, preemptions)
are read from each replica's latest stats snapshot at scrape time. Engine metrics carry
`replica` and `role` labels (docs/grafana/meshserve.json sums or splits by them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from meshserve.engine.client import COLOCATED, ReplicaState
from meshserve.engine.core.outputs import RequestOutput
from meshserve.engine.core.scheduler_output import SchedulerStats
from meshserve.engine.disagg.front import TRANSFER_BUCKETS, TransferStats

PREFIX = "meshserve"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                   0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


LABELS = ["replica", "role"]
"""Every engine metric's labels: the data-parallel replica and its role ('colocated': it
runs prefill and decode)."""


class _EngineCollector(Collector):
    """Each replica's scheduler state from its latest snapshot, read at scrape time."""

    def __init__(self, replicas: Callable[[], list[ReplicaState]]) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        replicas = self._replicas()
        gauges = {name: GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=LABELS)
                  for name, doc in GAUGES}
        counters = {name: CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=LABELS)
                    for name, doc in COUNTERS}
        per = CounterMetricFamily(f"{PREFIX}_spec_decode_num_accepted_tokens_per_pos",
                                  "Speculative decoding: accepted drafted tokens by their "
                                  "position in the draft (0: the first).",
                                  labels=[*LABELS, "position"])
        for rep in replicas:
            labels = [str(rep.index), rep.role]
            s, pc, sd = rep.stats, rep.stats.prefix_cache, rep.stats.spec
            for name, value in (
                    ("replica_up", float(rep.up)),
                    ("num_requests_running", s.num_running),
                    ("num_requests_waiting", s.num_waiting),
                    ("kv_blocks_used", s.num_used_blocks),
                    ("kv_blocks_free", s.num_free_blocks),
                    ("kv_blocks_total", rep.num_blocks),
                    ("kv_cache_usage_ratio",
                     s.num_used_blocks / rep.num_blocks if rep.num_blocks else 0.0)):
                gauges[name].add_metric(labels, value)
            for name, value in (
                    ("prefix_cache_queries", pc.num_queries),
                    ("prefix_cache_hits", pc.num_hits),
                    ("num_preemptions", s.num_preemptions),
                    ("spec_decode_num_drafts", sd.num_drafts),
                    ("spec_decode_num_draft_tokens", sd.num_draft_tokens),
                    ("spec_decode_num_accepted_tokens", sd.num_accepted_tokens)):
                counters[name].add_metric(labels, value)
            for position, value in enumerate(sd.accepted_per_position):
                per.add_metric([*labels, str(position)], value)
        yield from gauges.values()
        yield from counters.values()
        yield per


class _TransferCollector(Collector):
    """Disaggregated serving's KV transfers, from the front's counters at scrape time."""

    def __init__(self, transfers: Callable[[], TransferStats | None]) -> None:
        self._transfers = transfers

    def collect(self) -> Iterator[Metric]:
        t = self._transfers()
        if t is None:
            return
        for name, doc, value in (
                ("kv_transfers", "KV transfers from a prefill to a decode replica.",
                 t.num_transfers),
                ("kv_transfer_bytes", "Bytes of KV moved between replicas.", t.bytes),
                ("kv_transfer_bytes_streamed", "Of those, bytes read while their prompt "
                 "was still being prefilled (disagg.stream_kv).", t.bytes_streamed),
                ("kv_transfer_bytes_layered", "Of those, bytes of layers read while the "
                 "rest of their prefill step still ran.", t.bytes_layered),
                ("kv_transfers_failed", "KV transfers that failed or were refused (the "
                 "request failed or was recomputed).", t.num_failed),
                ("kv_leases_expired", "Prefill-side KV leases that lapsed unread "
                 "(disagg.kv_lease_s).", t.num_expired),
                ("kv_transfers_skipped", "Requests that prefilled on their decode replica "
                 "(short, cached, or params that need the whole run there).",
                 t.num_skipped)):
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        buckets, total = [], 0
        for bound, n in zip(TRANSFER_BUCKETS, t.bucket_counts, strict=True):
            total += n
            buckets.append((repr(bound), total))
        buckets.append(("+Inf", t.num_transfers))
        yield HistogramMetricFamily(f"{PREFIX}_kv_transfer_seconds", "From the prefill "
                                    "replica holding a prompt's KV to the decode replica "
                                    "admitting the request.", buckets=buckets,
                                    sum_value=t.seconds_sum)


GAUGES = (
    ("replica_up", "1 while the replica serves, 0 once it is lost (its ranks died or hung)."),
    ("num_requests_running", "Requests in the running batch."),
    ("num_requests_waiting", "Requests queued for admission."),
    ("kv_blocks_used", "KV-cache blocks held by some sequence."),
    ("kv_blocks_free", "Free (or cached and evictable) KV-cache blocks."),
    ("kv_blocks_total", "KV-cache blocks of the replica (per rank)."),
    ("kv_cache_usage_ratio", "Share of KV-cache blocks in use."),
)
COUNTERS = (
    ("prefix_cache_queries", "Prompt blocks looked up in the prefix cache."),
    ("prefix_cache_hits", "Prompt blocks found in the prefix cache."),
    ("num_preemptions", "Sequences preempted (KV dropped, to be recomputed)."),
    ("spec_decode_num_drafts", "Speculative decoding: verify steps of a sequence."),
    ("spec_decode_num_draft_tokens", "Speculative decoding: tokens drafted."),
    ("spec_decode_num_accepted_tokens", "Speculative decoding: drafted tokens accepted."),
)


class ServerMetrics:
    """Histograms, counters and gauges of one server, in a registry of its own. Engine
    metrics carry `replica` and `role` labels; the front's own (HTTP errors, aborts by
    clients, open streams, tokens/s) do not."""

    def __init__(self, stats: Callable[[], SchedulerStats],
                 replicas: Callable[[], list[ReplicaState]],
                 num_open_streams: Callable[[], int],
                 transfers: Callable[[], TransferStats | None] = lambda: None) -> None:
        """`transfers`: disaggregated serving's KV transfer counters (None: colocated)."""
        self._stats = stats
        self._roles = {rep.index: rep.role for rep in replicas()}
        self._num_blocks = sum(rep.num_blocks for rep in replicas())
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Arrival to first generated token.", LABELS,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram(f"{PREFIX}_request_queue_time_seconds",
                               "Arrival to first scheduled (TTFT's wait for admission).",
                               LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram(f"{PREFIX}_request_prefill_time_seconds",
                                 "First scheduled to first token (TTFT's prefill; with "
                                 "disaggregation, on the prefill replica).", LABELS,
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Arrival to last token.",
                             LABELS, buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of started "
                                     "requests.", LABELS, registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens.",
                                         LABELS, registry=r)
        self.finished = Counter(f"{PREFIX}_requests_finished", "Requests that ran to the end.",
                                ["finish_reason", *LABELS], registry=r)
        self.failed = Counter(f"{PREFIX}_requests_failed", "Requests lost with their replica "
                              "(its ranks died or hung).", LABELS, registry=r)
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
        r.register(_EngineCollector(replicas))
        r.register(_TransferCollector(transfers))
        for index, role in self._roles.items():  # every series exists from the start
            labels = (str(index), role)
            for metric in (self.ttft, self.tpot, self.e2e, self.queue, self.prefill,
                           self.prompt_tokens,
                           self.generation_tokens, self.failed):
                metric.labels(*labels)
        # Plain totals for the tokens/s gauges (ints: safe to read from the loop thread).
        self._num_generated = self._num_prompt = self._num_finished = 0
        self._last = (time.monotonic(), 0, 0)

    def on_outputs(self, outs: list[RequestOutput]) -> None:
        """Count tokens and observe latencies of finished requests (engine thread)."""
        num_generated = num_prompt = 0
        for out in outs:
            labels = (str(out.replica), self._roles.get(out.replica, COLOCATED))
            if out.error is not None:
                self.failed.labels(*labels).inc()
                continue
            new = len(out.new_token_ids)
            m = out.metrics
            prompt = m.num_prompt_tokens if len(out.token_ids) == new else 0  # its first output
            self.generation_tokens.labels(*labels).inc(new)
            self.prompt_tokens.labels(*labels).inc(prompt)
            num_generated += new
            num_prompt += prompt
            if not out.finished:
                continue
            self._num_finished += 1
            self.finished.labels(out.finish_reason or "unknown", *labels).inc()
            queued = prefill = None
            if m.first_scheduled_time is not None:
                queued = m.first_scheduled_time - m.arrival_time
                if m.first_token_time is not None:
                    prefill = m.first_token_time - m.first_scheduled_time
            for hist, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.e2e, m.e2e),
                                (self.queue, queued), (self.prefill, prefill)):
                if value is not None:
                    hist.labels(*labels).observe(value)
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
