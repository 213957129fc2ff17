"""Per-RPC call counts and latency histograms, cheap enough for the hot path.

``prometheus_client``'s labelled Counter and Histogram cost several Python calls and two locks per
update: about a tenth of a framed exists call on the master. Here one update is one lock and a few
integer additions; the collector builds the usual families at scrape time
(``kvpool_master_requests_total{op}`` and ``kvpool_master_request_seconds{op}``).
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.25, 1.0)


class _Op:
    __slots__ = ("buckets", "total")

    def __init__(self) -> None:
        self.buckets = [0] * (len(BUCKETS) + 1)  # the last one is +Inf
        self.total = 0.0


class RequestMetrics(Collector):
    def __init__(self) -> None:
        self._ops: dict[str, _Op] = {}
        self._lock = threading.Lock()  # gRPC handlers run on executor threads, the framed ones on the loop

    def observe(self, op: str, seconds: float) -> None:
        with self._lock:
            entry = self._ops.get(op)
            if entry is None:
                entry = self._ops[op] = _Op()
            entry.buckets[bisect_left(BUCKETS, seconds)] += 1
            entry.total += seconds

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        calls = CounterMetricFamily("kvpool_master_requests", "Master requests", labels=["op"])
        latency = HistogramMetricFamily("kvpool_master_request_seconds", "Master request latency", labels=["op"])
        with self._lock:
            snapshot = [(op, list(e.buckets), e.total) for op, e in self._ops.items()]
        for op, counts, total in snapshot:
            cumulative, running = [], 0
            for bound, n in zip((*map(str, BUCKETS), "+Inf"), counts, strict=True):
                running += n
                cumulative.append((bound, running))
            calls.add_metric([op], running)
            latency.add_metric([op], cumulative, total)
        yield calls
        yield latency
