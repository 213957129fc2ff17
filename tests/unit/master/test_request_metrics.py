"""RequestMetrics exports the same families prometheus_client's Counter and Histogram did."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, generate_latest

from kvpool.master.request_metrics import RequestMetrics


def test_counts_and_cumulative_buckets_per_op() -> None:
    registry = CollectorRegistry()
    metrics = RequestMetrics()
    registry.register(metrics)
    for seconds in (0.00001, 0.0003, 0.0003, 2.0):
        metrics.observe("BatchExists", seconds)
    metrics.observe("BatchPutStart", 0.001)
    text = generate_latest(registry).decode()
    assert 'kvpool_master_requests_total{op="BatchExists"} 4.0' in text
    assert 'kvpool_master_requests_total{op="BatchPutStart"} 1.0' in text
    assert 'kvpool_master_request_seconds_bucket{le="5e-05",op="BatchExists"} 1.0' in text
    assert 'kvpool_master_request_seconds_bucket{le="0.0005",op="BatchExists"} 3.0' in text
    assert 'kvpool_master_request_seconds_bucket{le="1.0",op="BatchExists"} 3.0' in text
    assert 'kvpool_master_request_seconds_bucket{le="+Inf",op="BatchExists"} 4.0' in text
    assert 'kvpool_master_request_seconds_count{op="BatchExists"} 4.0' in text
    assert 'kvpool_master_request_seconds_sum{op="BatchExists"} 2.00061' in text
    # a value on a bucket's bound falls in that bucket (Prometheus' le semantics)
    metrics.observe("Edge", 0.001)
    assert 'kvpool_master_request_seconds_bucket{le="0.001",op="Edge"} 1.0' in generate_latest(registry).decode()


def test_no_update_is_lost_across_threads() -> None:
    registry = CollectorRegistry()
    metrics = RequestMetrics()
    registry.register(metrics)

    def hammer() -> None:
        for _ in range(20_000):
            metrics.observe("Op", 0.0001)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 'kvpool_master_requests_total{op="Op"} 80000.0' in generate_latest(registry).decode()
