"""The wire side of the SSD tier in the master: the ``TierTasks`` RPC and the tier metrics.

Kept apart from service.py (shared) and from tiering.py (pure, no protobuf), like convert.py.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvpool.master.state import MasterState
from kvpool.master.tiering import TierTask
from kvpool.proto import master_pb2 as pb

__all__ = ["MAX_TASKS_PER_CALL", "metric_families", "stats_extra", "tier_tasks"]

MAX_TASKS_PER_CALL = 1024
"""Most tasks one TierTasks answer carries, whatever the store asks (bounds the message)."""

_COUNTERS = {
    "demotions": "Objects copied from DRAM to an SSD tier",
    "demoted_bytes": "Bytes copied from DRAM to an SSD tier",
    "demote_failures": "Demotions that failed or timed out",
    "promotions": "Objects copied back from an SSD tier to DRAM after repeated reads",
    "promote_failures": "Promotions that failed or timed out",
    "dram_dropped": "DRAM victims dropped without an SSD copy while the pool has an SSD tier",
    "dram_dropped_urgent": "DRAM victims dropped by an eviction forced by a failed allocation",
    "burst_dropped": "DRAM victims dropped to fit a put while demotions were in flight (drop-coldest burst policy)",
    "burst_dropped_bytes": "Bytes of DRAM victims dropped to fit a put while demotions were in flight",
    "ssd_evictions": "SSD replicas dropped by the SSD tier's watermark",
    "ssd_evicted_bytes": "Bytes of SSD replicas dropped by the SSD tier's watermark",
    "tier_tasks_expired": "Tier tasks abandoned after tier_task_timeout_s",
    "puts_backpressured": "Put keys refused with DEMOTION_BACKLOG while demotions free DRAM (clients retry)",
    "ssd_read_granted_bytes": "Bytes of leased reads sent to SSD-only replicas (cached-lease re-reads not seen)",
}
_GAUGES = {
    "ssd_capacity_bytes": "Bytes of the mounted SSD tiers",
    "ssd_used_bytes": "Bytes of the SSD tiers in use",
    "demote_pending_bytes": "DRAM bytes waiting for their demotion",
    "tier_tasks_pending": "Tier tasks queued or running",
    "ssd_write_bps": "SSD tier write rate (demotions), bytes/s over the last seconds",
    "ssd_read_bps": "SSD tier read rate (granted SSD-only reads), bytes/s over the last seconds",
}


def tier_tasks(state: MasterState, req: pb.TierTasksRequest, status: pb.Status) -> pb.TierTasksResponse:
    """Apply a store's reported results and hand it its next tasks."""
    done = [(r.id, r.code) for r in req.done]
    code, tasks, pending = state.tiers.exchange(req.store_id, done, min(req.max_tasks, MAX_TASKS_PER_CALL))
    response = pb.TierTasksResponse(status=status, tasks=[_task(t) for t in tasks], pending=pending)
    if code != 0:
        response.status.code = int(code)  # the response's copy: ``status`` may be shared
    return response


def _task(t: TierTask) -> pb.TierTask:
    return pb.TierTask(
        id=t.id,
        kind=int(t.kind),  # type: ignore[arg-type]
        key=t.key,
        src_segment=t.src_segment,
        src_offset=t.src_offset,
        dst_segment=t.dst_segment,
        dst_offset=t.dst_offset,
        length=t.length,
        checksum=t.checksum,
        deadline_ms=t.deadline_ms,
    )


def stats_extra(state: MasterState) -> dict[str, float]:
    """Tier figures for ``StatsResponse.extra`` (empty when no store has an SSD tier)."""
    stats = state.tiers.stats()
    if not stats["ssd_capacity_bytes"] and not stats["demotions"] and not stats["tier_tasks_pending"]:
        return {}
    return {k: float(v) for k, v in stats.items()}


def metric_families(state: MasterState) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    stats = state.tiers.stats()
    for name, doc in _COUNTERS.items():
        yield CounterMetricFamily(f"kvpool_master_{name}", doc, value=stats[name])
    for name, doc in _GAUGES.items():
        yield GaugeMetricFamily(f"kvpool_master_{name}", doc, value=stats[name])
