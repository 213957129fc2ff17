"""SSD tier in the master's pure core (master/tiering.py): demote, promote, SSD eviction, task channel.

One store "s" with a DRAM segment 1 (10 pages) and an SSD segment 2 (tier 1, 20 pages); ManualClock.
The store's side is played by ``tasks()`` / ``report()`` (the TierTasks exchange).
"""

from __future__ import annotations

from typing import Any

import pytest
from master_scenario import OK, Cluster, KiB, checksum_of

from kvpool.common.errors import ErrorCode as E
from kvpool.master.objects import ReplicaStatus
from kvpool.master.tiering import TaskKind, TierTask
from kvpool.master.types import InventoryItem

PAGE = 1 * KiB
DRAM, SSD = 1, 2


def tiered(dram_pages: int = 10, ssd_pages: int = 20, **config: Any) -> Cluster:
    config.setdefault("eviction_sample_factor", 0)
    config.setdefault("eviction_high_watermark", 0.8)
    config.setdefault("eviction_target", 0.5)
    config.setdefault("lease_ttl_s", 10)
    config.setdefault("demote_max_pending", 1.0)
    c = Cluster(stores={DRAM: "s", SSD: "s"}, **config)
    assert c.mount(DRAM, dram_pages * PAGE).code == OK
    assert c.mount(SSD, ssd_pages * PAGE, tier=1, shm_path="").code == OK
    return c


def tasks(c: Cluster, store: str = "s", limit: int = 100) -> list[TierTask]:
    code, out, _pending = c.state.tiers.exchange(store, [], limit)
    assert code == OK
    return out


def report(c: Cluster, done: list[tuple[TierTask, E]], store: str = "s") -> None:
    code, _, _ = c.state.tiers.exchange(store, [(t.id, int(code)) for t, code in done], 0)
    assert code == OK


def put_pages(c: Cluster, n: int, prefix: str = "k") -> list[str]:
    keys = [f"{prefix}{i}" for i in range(n)]
    for key in keys:  # one by one: distinct last_access times, a deterministic LRU order
        assert c.put(key, size=PAGE) == [OK]
        c.advance(1)
    return keys


def tiers_of(c: Cluster, key: str) -> list[int]:
    [res] = c.get(key, lease=False)
    assert res.code == OK, res.code
    return sorted(r.tier for r in res.replicas)


def test_eviction_demotes_instead_of_dropping_and_the_store_completes_it() -> None:
    c = tiered()
    keys = put_pages(c, 9)  # 90 % > 80 %
    assert c.state.needs_eviction()
    report_ = c.state.evict()  # down to 50 %: the 4 oldest are picked
    assert (report_.objects, report_.bytes, report_.keys) == (0, 4 * PAGE, [])
    # Demoting: readable from DRAM, DRAM still used, and the watermark counts it as free already.
    assert c.present(keys) == keys
    assert tiers_of(c, "k0") == [0]
    assert (c.used(DRAM), c.used(SSD)) == (9 * PAGE, 4 * PAGE)
    assert not c.state.needs_eviction()
    # A demoting object is neither removable nor evictable again.
    assert c.remove("k0") == [E.OBJECT_NOT_READY]
    assert c.state.evict(PAGE * 100, urgent=True).keys == keys[4:]  # only the others can go
    c.check()
    demotes = tasks(c)
    assert [(t.kind, t.key) for t in demotes] == [(TaskKind.DEMOTE, k) for k in keys[:4]]
    t = demotes[0]
    assert (t.src_segment, t.dst_segment, t.length, t.checksum) == (DRAM, SSD, PAGE, checksum_of("k0"))
    report(c, [(t, E.OK) for t in demotes])
    assert c.present(keys[:4]) == keys[:4]
    assert tiers_of(c, "k0") == [1]
    assert (c.used(DRAM), c.used(SSD)) == (0, 4 * PAGE)
    stats = c.state.tiers.stats()
    assert (stats["demotions"], stats["demote_pending_bytes"], stats["dram_dropped"]) == (4, 0, 5)
    assert c.state.stats().ssd_used == 4 * PAGE
    c.check()


def test_an_object_touched_while_demoting_keeps_its_dram_copy() -> None:
    c = tiered()
    put_pages(c, 9)
    c.state.evict()
    [t0, t1, *_] = tasks(c)
    c.advance(1)
    assert c.state.exists(["k0"]) == [True]  # hot again
    report(c, [(t0, E.OK), (t1, E.OK)])
    assert tiers_of(c, "k0") == [0, 1]  # both copies: the next eviction of k0 costs no write
    assert tiers_of(c, "k1") == [1]
    c.advance(20)
    # Evicting k0 now frees its DRAM copy without a new demotion.
    c.state.evict(c.used(DRAM))
    assert tiers_of(c, "k0") == [1]
    assert "k0" not in [t.key for t in tasks(c)]
    c.check()


def test_a_failed_demotion_keeps_the_dram_copy_and_frees_the_ssd_range() -> None:
    c = tiered()
    put_pages(c, 9)
    c.state.evict()
    [t0, *_] = tasks(c)
    report(c, [(t0, E.INTERNAL)])
    assert tiers_of(c, "k0") == [0]
    assert c.remove("k0") == [OK]  # evictable and removable again
    delete = [t for t in tasks(c) if t.kind == TaskKind.DELETE]
    assert [(t.dst_segment, t.dst_offset) for t in delete] == [(SSD, t0.dst_offset)]
    assert c.state.tiers.stats()["demote_failures"] == 1
    c.check()


def test_a_corrupt_dram_copy_is_dropped() -> None:
    c = tiered()
    put_pages(c, 9)
    c.state.evict()
    [t0, *_] = tasks(c)
    report(c, [(t0, E.CHECKSUM_MISMATCH)])
    assert c.present(["k0"]) == []
    c.check()


def test_a_full_pool_refuses_puts_with_backlog_while_demotions_free_dram_and_drops_nothing() -> None:
    c = tiered(eviction_high_watermark=1.0, eviction_target=0.9)
    put_pages(c, 10)
    # Full, nothing demoting yet: the put queues a demotion and is told to come back (no object dropped).
    assert c.put("new", size=PAGE) == [E.DEMOTION_BACKLOG]
    assert c.state.tiers.progress.is_set()  # the eviction thread is woken
    stats = c.state.tiers.stats()
    assert (stats["puts_backpressured"], stats["dram_dropped"], stats["demote_pending_bytes"]) == (1, 0, PAGE)
    [demote] = tasks(c)
    assert demote.key == "k0"
    report(c, [(demote, E.OK)])
    assert c.put("new", size=PAGE) == [OK]
    assert c.present(["k0", "new"]) == ["k0", "new"]
    assert tiers_of(c, "k0") == [1]
    c.check()


def test_the_drop_coldest_burst_policy_stores_the_put_at_once_and_counts_the_coldest_object_it_drops() -> None:
    c = tiered(eviction_high_watermark=1.0, eviction_target=0.9, ssd_burst_policy="drop-coldest")
    put_pages(c, 10)
    # Full: the put queues a demotion (k0, the coldest) as under backpressure, but does not wait for it:
    # the coldest object with no copy in flight (k1) is dropped to fit it.
    assert c.put("new", size=PAGE) == [OK]
    assert c.present(["k0", "k1", "k2", "new"]) == ["k0", "k2", "new"]
    stats = c.state.tiers.stats()
    assert (stats["burst_dropped"], stats["burst_dropped_bytes"], stats["puts_backpressured"]) == (1, PAGE, 0)
    assert (stats["dram_dropped"], stats["dram_dropped_urgent"]) == (1, 1)
    [demote] = tasks(c)
    assert demote.key == "k0"  # the demotion in flight goes on: k0 is kept, on SSD
    report(c, [(demote, E.OK)])
    assert tiers_of(c, "k0") == [1]
    c.check()


def test_under_backpressure_no_put_drops_an_object_while_demotions_are_in_flight() -> None:
    c = tiered(eviction_high_watermark=1.0, eviction_target=0.9)
    put_pages(c, 10)
    assert c.state.tiers.burst_policy.name == "backpressure"  # the default
    assert c.put("a", "b", "c", size=PAGE) == [E.DEMOTION_BACKLOG] * 3
    stats = c.state.tiers.stats()
    assert (stats["burst_dropped"], stats["dram_dropped"], stats["puts_backpressured"]) == (0, 0, 3)


def test_an_unknown_burst_policy_is_refused_with_the_known_names() -> None:
    with pytest.raises(ValueError, match="backpressure or drop-coldest"):
        tiered(ssd_burst_policy="drop-hottest")


def test_with_no_room_on_the_ssd_a_put_drops_the_coldest_object_and_never_waits() -> None:
    c = tiered(ssd_pages=1, eviction_high_watermark=1.0, eviction_target=0.9)
    put_pages(c, 10)
    c.state.evict(PAGE)
    report(c, [(t, E.OK) for t in tasks(c)])  # k0 fills the SSD
    assert c.put("x", size=PAGE) == [OK]
    # Full again and the SSD has no room (Mooncake #2187: puts must not stall): k1 is dropped.
    assert c.put("new", size=PAGE) == [OK]
    assert c.present(["k0", "k1", "new"]) == ["k0", "new"]
    assert c.state.tiers.stats()["dram_dropped"] == 1
    c.check()


def test_urgent_eviction_drops_at_once() -> None:
    c = tiered()
    put_pages(c, 9)
    assert c.state.evict(PAGE, urgent=True).keys == ["k0"]
    assert tasks(c) == []
    assert c.state.tiers.stats()["dram_dropped_urgent"] == 1
    c.check()


def test_demotions_past_the_pending_cap_wait_instead_of_dropping() -> None:
    c = tiered(demote_max_pending=0.2)  # 2 pages may wait for demotion
    keys = put_pages(c, 9)
    assert c.state.evict().keys == []  # nothing dropped: the two oldest demote, the rest wait
    first = tasks(c)
    assert [t.key for t in first] == ["k0", "k1"]
    assert c.present(keys) == keys
    report(c, [(t, E.OK) for t in first])
    c.state.evict()
    assert [t.key for t in tasks(c)] == ["k2", "k3"]
    c.check()


def test_an_object_already_on_ssd_is_evicted_from_dram_without_a_copy() -> None:
    c = tiered()
    keys = put_pages(c, 4)
    c.state.evict(4 * PAGE)
    report(c, [(t, E.OK) for t in tasks(c)])
    assert all(tiers_of(c, k) == [1] for k in keys)
    c.check()


def test_reads_of_an_ssd_only_object_promote_it_after_two_hits() -> None:
    c = tiered()
    put_pages(c, 9)
    c.state.evict()
    report(c, [(t, E.OK) for t in tasks(c)])
    assert c.get_codes("k0") == [OK]
    assert tasks(c) == []
    [res] = c.get("k0")  # second read: promote
    assert [r.tier for r in res.replicas] == [1]  # this read is still served from SSD
    [promote] = tasks(c)
    assert (promote.kind, promote.key, promote.src_segment, promote.dst_segment) == (
        TaskKind.PROMOTE,
        "k0",
        SSD,
        DRAM,
    )
    assert promote.src_offset == res.replicas[0].offset
    report(c, [(promote, E.OK)])
    assert tiers_of(c, "k0") == [0, 1]
    [res] = c.get("k0")
    assert [r.tier for r in res.replicas] == [0, 1]
    assert c.state.tiers.stats()["promotions"] == 1
    c.check()


def test_a_failed_promotion_frees_the_dram_range() -> None:
    c = tiered()
    put_pages(c, 9)
    c.state.evict()
    report(c, [(t, E.OK) for t in tasks(c)])
    used = c.used(DRAM)
    c.get("k0")
    c.get("k0")
    [promote] = tasks(c)
    assert c.used(DRAM) == used + PAGE
    report(c, [(promote, E.CHECKSUM_MISMATCH)])
    assert c.used(DRAM) == used
    assert tiers_of(c, "k0") == [1]
    c.check()


def test_no_promotion_when_disabled_or_without_lease() -> None:
    c = tiered(promote_after_hits=0)
    put_pages(c, 9)
    c.state.evict()
    report(c, [(t, E.OK) for t in tasks(c)])
    for _ in range(3):
        c.get("k0")
        c.get("k1", lease=False)
    assert tasks(c) == []


def test_ssd_watermark_drops_the_least_recently_used_ssd_replicas() -> None:
    c = tiered(dram_pages=10, ssd_pages=10, ssd_high_watermark=0.5, ssd_eviction_target=0.3)
    keys = put_pages(c, 8)
    c.state.evict(6 * PAGE)  # k0..k5 go to SSD
    demotes = tasks(c)
    report(c, [(t, E.OK) for t in demotes])
    c.advance(11)
    assert c.state.exists(["k0"]) == [True]  # k0 is now the most recently used
    assert c.state.tiers.maintain() == 3  # 6 pages > 5: down to 3 pages
    assert c.present(keys) == ["k0", "k4", "k5", "k6", "k7"]
    deletes = [t for t in tasks(c) if t.kind == TaskKind.DELETE]
    assert sorted(t.dst_offset for t in deletes) == sorted(t.dst_offset for t in demotes if t.key in ("k1", "k2", "k3"))
    c.check()


def test_ssd_eviction_keeps_an_object_that_still_has_a_dram_copy() -> None:
    c = tiered(dram_pages=10, ssd_pages=4, ssd_high_watermark=0.5, ssd_eviction_target=0.25)
    put_pages(c, 3)
    c.state.evict(3 * PAGE)
    [t0, t1, t2] = tasks(c)
    c.state.exists(["k0"])  # k0 keeps its DRAM copy too
    report(c, [(t0, E.OK), (t1, E.OK), (t2, E.OK)])
    c.advance(11)
    c.state.exists(["k1"])
    c.advance(1)
    c.state.exists(["k2"])
    assert c.state.tiers.maintain() == 2
    assert tiers_of(c, "k0") == [0]
    assert c.present(["k0", "k1", "k2"]) == ["k0", "k2"]
    c.check()


def test_a_delete_always_reaches_the_store_before_a_later_write_into_the_same_range() -> None:
    c = tiered(dram_pages=10, ssd_pages=1)
    put_pages(c, 2)
    c.state.evict(PAGE)
    [d0] = tasks(c)
    report(c, [(d0, E.OK)])
    assert c.remove("k0") == [OK]  # frees SSD range 0 -> DELETE queued
    c.state.evict(PAGE)  # k1 is demoted into the same range
    queued = tasks(c)
    assert [(t.kind, t.dst_offset) for t in queued] == [(TaskKind.DELETE, 0), (TaskKind.DEMOTE, 0)]
    c.check()


def test_overdue_tasks_are_abandoned() -> None:
    c = tiered(tier_task_timeout_s=30)
    put_pages(c, 9)
    c.state.evict()
    taken = tasks(c)
    c.advance(31)
    c.state.tiers.maintain()
    assert c.state.tiers.stats()["tier_tasks_expired"] == len(taken)
    assert all(tiers_of(c, t.key) == [0] for t in taken)
    assert c.used(SSD) == 0
    report(c, [(taken[0], E.OK)])  # too late: ignored
    assert tiers_of(c, taken[0].key) == [0]
    c.check()


def test_ssd_inventory_is_adopted_on_mount_and_readable_over_tcp_only() -> None:
    c = Cluster(stores={DRAM: "s", SSD: "s"})
    assert c.mount(DRAM, 10 * PAGE).code == OK
    inventory = [
        InventoryItem("disk", 0, PAGE, checksum_of("disk"), tier=1),
        InventoryItem("dram-entry", PAGE, PAGE, 7, tier=0),  # a DRAM entry cannot live on the SSD segment
    ]
    result = c.mount(SSD, 20 * PAGE, inventory=inventory, tier=1, shm_path="")
    assert (result.code, result.adopted, result.rejected) == (OK, 1, 1)
    [res] = c.get("disk")
    assert (res.code, res.checksum) == (OK, checksum_of("disk"))
    assert [(r.tier, r.segment_id, r.shm_path) for r in res.replicas] == [(1, SSD, "")]
    assert c.state.prefix_length(["disk", "x"]) == 1
    c.check()


def test_ssd_segments_take_no_puts_and_are_not_dram_capacity() -> None:
    c = tiered()
    for i in range(10):
        assert c.put(f"p{i}", size=PAGE) == [OK]
    assert c.used(SSD) == 0
    stats = c.state.stats()
    assert (stats.capacity, stats.ssd_capacity, stats.allocatable_capacity) == (
        10 * PAGE,
        20 * PAGE,
        10 * PAGE,
    )
    assert {s.id: s.tier for s in stats.segments} == {DRAM: 0, SSD: 1}


def test_an_unknown_store_is_told_to_remount_and_a_departed_store_releases_its_tasks() -> None:
    c = tiered(store_ttl_s=5)
    assert c.state.tiers.exchange("nobody", [], 10)[0] == E.NEED_REMOUNT
    put_pages(c, 9)
    c.state.evict()
    assert c.state.tiers.stats()["demote_pending_bytes"] == 4 * PAGE
    c.advance(6)
    assert c.state.expire_stores() == ["s"]
    c.state.tiers.maintain()
    stats = c.state.tiers.stats()
    assert (stats["demote_pending_bytes"], stats["tier_tasks_pending"]) == (0, 0)
    c.check()


def test_the_replica_status_of_a_demoting_copy_is_processing() -> None:
    c = tiered()
    put_pages(c, 9)
    c.state.evict()
    shard = c.state._shards.shard_of(b"k0")
    replicas = shard.objects["k0"].replica_list()
    assert [(r.segment_id, r.status) for r in replicas] == [
        (DRAM, ReplicaStatus.COMPLETE),
        (SSD, ReplicaStatus.PROCESSING),
    ]


def test_an_abandoned_promotion_holds_its_dram_range_until_the_store_cannot_write_it() -> None:
    c = tiered(tier_task_timeout_s=30)
    put_pages(c, 9)
    c.state.evict()
    report(c, [(t, E.OK) for t in tasks(c)])
    c.get("k0")
    c.get("k0")
    [promote] = tasks(c)
    # The store may not start it after half the timeout (its deadline), so the master can give up later.
    assert promote.deadline_ms == c.clock.wall_ms() + 15_000
    used = c.used(DRAM)
    c.advance(31)
    c.state.tiers.maintain()
    assert tiers_of(c, "k0") == [1]
    assert c.used(DRAM) == used  # still held: a copy started just before the deadline may be writing it
    c.check()
    c.advance(10)
    c.state.reclaim_abandoned_puts()  # the maintenance pass that releases held ranges
    assert c.used(DRAM) == used - PAGE
    c.check()


def test_a_store_takes_at_most_a_byte_budget_of_copies_per_exchange_and_deletes_ride_along() -> None:
    from kvpool.master.tiering import TierChannel

    channel = TierChannel("s")
    with channel.lock:
        for i in range(4):
            channel.push_locked(TaskKind.DEMOTE, f"k{i}", (DRAM, i * PAGE), (SSD, i * PAGE), PAGE, 0, 0.0)
            channel.push_locked(TaskKind.DELETE, "", (0, 0), (SSD, 100 * PAGE + i), PAGE, 0, 0.0)
    first, left = channel.take(100, max_bytes=2 * PAGE)
    assert [(t.kind, t.key) for t in first] == [
        (TaskKind.DEMOTE, "k0"),
        (TaskKind.DELETE, ""),
        (TaskKind.DEMOTE, "k1"),
        (TaskKind.DELETE, ""),
    ]
    assert (left, sorted(channel.inflight)) == (4, [t.id for t in first if t.kind == TaskKind.DEMOTE])
    huge, _ = channel.take(100, max_bytes=1)  # one copy always goes, whatever its size
    assert [t.key for t in huge] == ["k2", ""]


def test_stats_give_the_ssd_write_and_read_rates_over_the_last_seconds() -> None:
    c = tiered()
    keys = put_pages(c, 4)
    c.state.tiers.maintain()  # first sample: nothing demoted yet
    c.state.evict(4 * PAGE)
    report(c, [(t, E.OK) for t in tasks(c)])
    [res] = c.get(keys[0])  # a leased read of an SSD-only object
    assert res.code == OK
    c.advance(2)
    c.state.tiers.maintain()
    stats = c.state.tiers.stats()
    assert (stats["demoted_bytes"], stats["ssd_read_granted_bytes"]) == (4 * PAGE, PAGE)
    assert (stats["ssd_write_bps"], stats["ssd_read_bps"]) == (2 * PAGE, PAGE // 2)
