"""StandbyIndex: a standby's index following the stores' inventory feed, and its reconcile once elected
(decision 0070). Pure core: a MasterState on a ManualClock, no sockets."""

from __future__ import annotations

import random
import sys
import tracemalloc

from master_scenario import OK, Cluster, MiB, checksum_of

from kvpool.common.errors import ErrorCode as E
from kvpool.master.segments import SegmentStatus
from kvpool.master.standby import StandbyIndex
from kvpool.master.types import InventoryItem


class Standby:
    """A standby master's state and its StandbyIndex; ``follower`` flips when it is elected."""

    def __init__(self) -> None:
        self.c = Cluster()
        self.follower = True
        self.index = StandbyIndex(self.c.state, lambda: self.follower)

    def sync(self, segment_id: int, items: list[InventoryItem], size: int = MiB) -> str:
        result = self.index.sync(self.c.spec(segment_id, size), items)
        assert result.code == OK
        return result.epoch

    def delta(self, segment_id: int, epoch: str, *changes: tuple[InventoryItem, bool]) -> E:
        return self.index.delta(f"store{segment_id}", segment_id, epoch, list(changes)).code


def item(key: str, offset: int, length: int = 1000) -> InventoryItem:
    return InventoryItem(key, offset, length, checksum_of(key))


def status_of(c: Cluster, segment_id: int) -> SegmentStatus:
    return next(s.status for s in c.state.segments() if s.id == segment_id)


def test_sync_makes_the_inventory_readable_but_never_allocatable() -> None:
    s = Standby()
    s.sync(1, [item("a", 0), item("b", 1024)])
    assert s.c.present(["a", "b", "c"]) == ["a", "b"]
    assert status_of(s.c, 1) == SegmentStatus.DRAINING
    assert s.c.state.stats().objects == 2
    # Nothing may be allocated on a warm segment: it may hold objects the feed has not shown yet.
    assert [r.code for r in s.c.start("new")] != [OK]
    assert s.index.warm_segments() == 1
    s.c.check()


def test_deltas_apply_commits_and_removals_in_order() -> None:
    s = Standby()
    epoch = s.sync(1, [item("a", 0), item("b", 1024)])
    used = s.c.used(1)
    assert s.delta(1, epoch, (item("c", 2048), False), (item("a", 0), True)) == OK
    assert s.c.present(["a", "b", "c"]) == ["b", "c"]
    assert s.c.used(1) == used  # one range freed, one taken
    # The range "a" held is free again for the feed: an overwrite there is adopted.
    assert s.delta(1, epoch, (item("d", 0, 500), False)) == OK
    assert s.c.present(["d"]) == ["d"]
    # Removing what is not there (or another key's offset) changes nothing.
    assert s.delta(1, epoch, (item("b", 4096), True), (item("zz", 1024), True)) == OK
    assert s.c.present(["b", "c", "d"]) == ["b", "c", "d"]
    s.c.check()


def test_a_reput_seen_before_the_old_copy_is_freed_is_adopted_after_the_free() -> None:
    # The store commits the new copy of "k" at once; the free of its old range reaches it a heartbeat later.
    s = Standby()
    epoch = s.sync(1, [item("k", 0)])
    new_copy = InventoryItem("k", 4096, 1000, checksum_of("k"))
    assert s.delta(1, epoch, (new_copy, False)) == OK
    [before] = s.c.get("k", lease=False)
    assert before.replicas[0].offset == 0
    assert s.delta(1, epoch, (item("k", 0), True)) == OK
    [after] = s.c.get("k", lease=False)
    assert (after.code, after.replicas[0].offset) == (OK, 4096)
    s.c.check()


def test_a_delta_for_another_epoch_or_store_asks_for_a_sync() -> None:
    s = Standby()
    epoch = s.sync(1, [item("a", 0)])
    assert s.delta(1, "not-the-epoch", (item("b", 1024), False)) == E.NEED_REMOUNT
    assert s.index.delta("store9", 1, epoch, [(item("b", 1024), False)]).code == E.NEED_REMOUNT
    assert s.delta(2, epoch, (item("b", 1024), False)) == E.NEED_REMOUNT  # never synced
    assert s.index.delta("store1", 1, "", []).code == E.NEED_REMOUNT  # the feed's question before a sync
    s.index.reset(s.c.state)  # the master forgot its index: its epoch changed
    assert s.delta(1, epoch, (item("b", 1024), False)) == E.NEED_REMOUNT
    assert s.c.present(["b"]) == []


def test_a_resync_drops_what_the_store_no_longer_lists() -> None:
    s = Standby()
    s.sync(1, [item("a", 0), item("b", 1024)])
    s.sync(1, [item("b", 1024), item("c", 2048), item("over-a", 0, 900)])
    assert s.c.present(["a", "b", "c", "over-a"]) == ["b", "c", "over-a"]
    s.c.check()


def test_the_feed_is_refused_once_elected() -> None:
    s = Standby()
    epoch = s.sync(1, [item("a", 0)])
    s.follower = False
    assert s.delta(1, epoch, (item("a", 0), True)) == E.NOT_LEADER
    assert s.index.sync(s.c.spec(2, MiB), [item("x", 0)]).code == E.NOT_LEADER
    assert s.c.present(["a", "x"]) == ["a"]


def test_after_the_election_warm_stores_must_remount_and_the_remount_reconciles() -> None:
    s = Standby()
    epoch = s.sync(1, [item("a", 0), item("b", 1024), item("gone", 2048)])
    s.sync(2, [item("other", 0)])
    assert s.delta(1, epoch, (item("c", 4096), False)) == OK
    assert not s.index.needs_remount("store1")  # a follower answers no heartbeats anyway
    s.follower = False  # elected: reads are served from the warm index at once
    assert s.c.present(["a", "b", "c", "gone", "other"]) == ["a", "b", "c", "gone", "other"]
    assert s.index.needs_remount("store1")
    assert s.index.needs_remount("store2")
    # The store re-mounts with its real inventory: "gone" was overwritten by "late" (the feed lagged).
    truth = [item("a", 0), item("b", 1024), item("c", 4096), item("late", 2048, 1500)]
    result = s.index.mount(s.c.spec(1, MiB), truth, remount=True)
    assert (result.code, result.adopted, result.rejected) == (OK, 4, 0)
    assert not s.index.needs_remount("store1")
    assert s.index.needs_remount("store2")
    assert s.c.present(["a", "b", "c", "gone", "late"]) == ["a", "b", "c", "late"]
    assert status_of(s.c, 1) == SegmentStatus.OK
    assert status_of(s.c, 2) == SegmentStatus.DRAINING
    # Now allocatable, and never over a live object's range.
    live = {0, 1024, 2048, 4096}
    started = s.c.start(*[f"n{i}" for i in range(20)], size=1000)
    assert all(r.code == OK and r.replicas[0].segment_id == 1 for r in started)
    assert not {r.replicas[0].offset for r in started} & live
    s.c.check()


def test_a_mount_of_a_segment_the_feed_never_saw_is_a_plain_mount() -> None:
    s = Standby()
    s.follower = False
    assert s.index.mount(s.c.spec(3, MiB), [item("a", 0)], remount=False).code == OK
    assert s.c.present(["a"]) == ["a"]
    assert status_of(s.c, 3) == SegmentStatus.OK
    assert [r.code for r in s.c.start("new")] == [OK]


def test_garbage_in_the_feed_is_rejected_never_raised() -> None:
    s = Standby()
    epoch = s.sync(1, [item("a", 0)])
    garbage = [
        (InventoryItem("", 1024, 10, 1), False),
        (InventoryItem("beyond", MiB - 64, 1000, 1), False),
        (InventoryItem("unaligned", 1025, 10, 1), False),
        (InventoryItem("zero", 2048, 0, 1), False),
        (InventoryItem("overlap", 512, 1000, 1), False),  # inside "a"'s block
        (InventoryItem("ssd", 4096, 10, 1, tier=1), False),
        (InventoryItem("\ud800", 4096, 10, 1), True),
        (InventoryItem("a", 2**70, 10, 1), True),
    ]
    result = s.index.delta("store1", 1, epoch, garbage)
    assert (result.code, result.adopted, result.rejected) == (OK, 0, 6)
    assert s.c.present(["a"]) == ["a"]
    assert s.index.sync(s.c.spec(2, 0), []).code == E.INVALID_ARGUMENT
    s.c.check()


def test_deltas_keep_a_quiet_store_alive_for_the_next_leader() -> None:
    # A store with nothing new still sends an empty delta each round: once elected, the standby must not
    # expire it (and drop its warm objects) for lack of news; a store that did fall silent does expire.
    s = Standby()
    epoch = s.sync(1, [item("a", 0)])
    s.sync(2, [item("b", 0)])
    ttl = s.c.config.store_ttl_s
    s.c.advance(ttl + 1)
    assert s.delta(1, epoch) == OK  # store 1 is quiet but alive; store 2 said nothing
    s.follower = False
    assert s.c.state.expire_stores() == ["store2"]
    assert s.c.present(["a", "b"]) == ["a"]


def test_a_fed_index_costs_at_most_400_bytes_per_object() -> None:
    # A warm standby holds the whole index, built by adoption (as a re-mount is): the same budget as the
    # put path (test_master_state.py::test_memory_per_object_is_under_400_bytes), keys counted in.
    s = Standby()
    epoch = s.sync(1, [], size=64 * 1024 * MiB)
    n, batch, size = 8000, 1000, 320 * 1024
    keys = [f"{random.Random(i).getrandbits(256):064x}@tp0_r1" for i in range(n)]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(0, n, batch):
            # Offsets, lengths and checksums as distinct ints, as the wire gives them.
            changes = [
                (InventoryItem(k, int(str(j * size)), int(str(size)), random.getrandbits(64)), False)
                for j, k in enumerate(keys[i : i + batch], start=i)
            ]
            assert s.delta(1, epoch, *changes) == OK
            del changes
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    per_object = used / n + sum(sys.getsizeof(k) for k in keys) / n
    print(f"fed index memory per object: {per_object:.0f} bytes")
    assert per_object <= 400, per_object
    assert s.c.state.stats().objects == n
