"""MasterState: puts, reads, leases, removal, pins, membership, heartbeats, grants (ManualClock, no I/O)."""

from __future__ import annotations

import random
import sys
import threading
import tracemalloc
from typing import Any

import pytest
from master_scenario import OK, Cluster, KiB, MiB, checksum_of, secret_of

from kvpool.common import grants
from kvpool.common.errors import ErrorCode as E
from kvpool.common.errors import KvPoolError
from kvpool.master.objects import ReplicaStatus
from kvpool.master.segments import SegmentStatus, StoreEntry
from kvpool.master.state import HEARTBEAT_FREED_LIMIT, RECLAIM_GRACE_S
from kvpool.master.types import InventoryItem, ReplicaGrant


def grant_of(r: ReplicaGrant, op: grants.GrantOp, key: str) -> grants.Grant:
    return grants.Grant(op, r.segment_id, r.offset, r.length, r.expiry_ms, key.encode(), r.mac)


# ====================================================================== two-phase put


def test_put_is_invisible_until_put_end() -> None:
    c = Cluster(segments={1: MiB})
    [started] = c.start("a", size=5000)
    assert started.code == OK
    assert len(started.replicas) == 1
    assert c.get_codes("a") == [E.OBJECT_NOT_READY]
    assert c.readable("a") == [False]
    assert c.state.prefix_length(["a"]) == 0
    assert c.end("a") == [OK]
    [res] = c.get("a")
    assert (res.code, res.size, res.checksum) == (OK, 5000, checksum_of("a"))
    assert res.replicas[0].offset == started.replicas[0].offset
    assert c.readable("a") == [True]
    assert c.end("a") == [OK]  # idempotent
    stats = c.state.stats()
    assert (stats.objects, stats.puts, stats.hits, stats.misses) == (1, 1, 1, 1)
    c.check()


def test_put_of_existing_or_in_flight_key() -> None:
    c = Cluster(segments={1: MiB})
    assert c.put("done") == [OK]
    c.start("busy", client="w1")
    codes = [r.code for r in c.start("done", "busy", client="w2")]
    assert codes == [E.OBJECT_ALREADY_EXISTS, E.OBJECT_NOT_READY]
    # A duplicate key inside one batch: the second sees the first's put in flight.
    assert [r.code for r in c.start("dup", "dup")] == [OK, E.OBJECT_NOT_READY]
    c.check()


def test_abandoned_put_is_taken_over_by_a_new_put_after_the_timeout() -> None:
    c = Cluster(segments={1: MiB}, put_timeout_s=30)
    [old] = c.start("k", client="dead", size=4000)
    c.advance(29)
    assert [r.code for r in c.start("k", client="w2")] == [E.OBJECT_NOT_READY]
    c.advance(2)
    [new] = c.start("k", client="w2", size=4000)
    assert new.code == OK
    assert c.end("k", client="dead") == [E.ILLEGAL_CLIENT]
    assert c.end("k", client="w2") == [OK]
    assert c.state.stats().reclaimed_puts == 1
    # The old put's range was freed, but not reused for the same key while the store has not acknowledged
    # that free (decision 0082): the late free would make the store forget the new copy.
    assert new.replicas[0].offset != old.replicas[0].offset
    assert c.used(1) == 4032
    c.check()


def test_periodic_reclaim_waits_for_timeout_plus_grace() -> None:
    c = Cluster(segments={1: MiB}, put_timeout_s=30)
    [started] = c.start("a", "b", client="gone")[:1]
    c.advance(30 + RECLAIM_GRACE_S - 1)
    assert c.state.reclaim_abandoned_puts() == 0
    c.advance(2)
    assert c.state.reclaim_abandoned_puts() == 2
    assert c.used(1) == 0
    assert c.end("a", client="gone") == [E.OBJECT_NOT_FOUND]
    assert c.state.stats().reclaimed_puts == 2
    freed = c.state.heartbeat("store1", [1], 0).freed
    assert (started.replicas[0].offset, "a") in {(off, key) for _, off, _, key in freed}
    c.check()


def test_only_the_writer_may_end_or_revoke() -> None:
    c = Cluster(segments={1: MiB})
    c.start("a", "b", client="w1")
    assert c.end("a", client="w2") == [E.ILLEGAL_CLIENT]
    assert c.state.put_revoke("w2", ["a"]) == [E.ILLEGAL_CLIENT]
    assert c.state.put_revoke("w1", ["a", "nope"]) == [OK, E.OBJECT_NOT_FOUND]
    assert c.get_codes("a") == [E.OBJECT_NOT_FOUND]
    assert c.end("b", client="w1") == [OK]
    assert c.state.put_revoke("w1", ["b"]) == [E.NO_PUT_IN_PROGRESS]
    # a's range stays held until its WRITE grant has surely expired (master/quarantine.py), then is freed
    assert c.used(1) == 2048
    c.check()
    c.clock.advance(c.config.put_timeout_s + 5.0)
    c.state.reclaim_abandoned_puts()
    assert c.used(1) == 1024
    c.check()


@pytest.mark.parametrize(
    ("key", "size", "code"),
    [
        ("", 10, E.INVALID_KEY),
        ("\ud800", 10, E.INVALID_KEY),
        ("k" * 513, 10, E.KEY_TOO_LONG),
        ("é" * 300, 10, E.KEY_TOO_LONG),  # 600 UTF-8 bytes
        ("k", 0, E.INVALID_ARGUMENT),  # empty values are rejected
        ("k", -5, E.INVALID_ARGUMENT),
        ("k", 2 * MiB, E.VALUE_TOO_LARGE),
        ("k" * 512, 10, OK),
    ],
)
def test_put_start_validates_keys_and_sizes(key: str, size: int, code: E) -> None:
    c = Cluster(segments={1: 4 * MiB}, max_object_bytes=MiB)
    assert [r.code for r in c.start(key, size=size)] == [code]
    c.check()


def test_batch_shape_errors() -> None:
    c = Cluster(segments={1: MiB}, max_batch=4)
    assert [r.code for r in c.state.put_start("c", ["a", "b"], [1])] == [E.INVALID_ARGUMENT] * 2
    assert [r.code for r in c.start(*"abcde")] == [E.BATCH_TOO_LARGE] * 5
    assert c.state.put_end("c", ["a"], [1, 2]) == [E.INVALID_ARGUMENT]
    assert [r.code for r in c.get(*"abcde")] == [E.BATCH_TOO_LARGE] * 5
    assert c.state.put_end("c1", ["x"], [-1]) == [E.INVALID_ARGUMENT]
    with pytest.raises(KvPoolError, match="BATCH_TOO_LARGE"):
        c.state.exists(list("abcde"))
    with pytest.raises(KvPoolError, match="BATCH_TOO_LARGE"):
        c.state.prefix_length(list("abcde"))
    c.check()


def test_no_segment_gives_no_space() -> None:
    c = Cluster()
    assert [r.code for r in c.start("a")] == [E.NO_SPACE]
    c.check()


# ====================================================================== reads


def test_grants_verify_with_the_segment_secret() -> None:
    c = Cluster(segments={1: MiB, 2: MiB})
    [started] = c.start("k", size=3000, replica_num=2)
    assert len(started.replicas) == 2
    for r in started.replicas:
        g = grant_of(r, grants.GrantOp.WRITE, "k")
        assert grants.verify(secret_of(r.segment_id), g)
        assert not grants.verify(secret_of(r.segment_id), grant_of(r, grants.GrantOp.READ, "k"))
        assert not grants.verify(secret_of(r.segment_id), grant_of(r, grants.GrantOp.WRITE, "k2"))
        assert r.expiry_ms == c.clock.wall_ms() + 30_000
    c.end("k")
    [res] = c.get("k")
    assert res.lease_expiry_ms == c.clock.wall_ms() + 10_000
    for r in res.replicas:
        assert (r.expiry_ms, r.length) == (res.lease_expiry_ms, 3000)
        assert grants.verify(secret_of(r.segment_id), grant_of(r, grants.GrantOp.READ, "k"))
    c.check()


def test_segment_sign_matches_grants_sign() -> None:
    c = Cluster(segments={7: MiB})
    seg = c.state._table.by_id[7]  # white box: the precomputed signer must equal grants.sign
    rng = random.Random(2)
    for _ in range(200):
        op = rng.choice([grants.GrantOp.READ, grants.GrantOp.WRITE])
        off, length, expiry = rng.randrange(1 << 40), rng.randrange(1, 1 << 30), rng.randrange(1 << 62)
        key = rng.randbytes(rng.randrange(1, 600))
        expected = grants.sign(secret_of(7), op, 7, off, length, expiry, key)
        assert seg.sign(op, off, length, expiry, key) == expected


def test_lease_is_extended_never_shortened() -> None:
    c = Cluster(segments={1: MiB}, lease_ttl_s=10)
    c.put("k")
    first = c.get("k")[0].lease_expiry_ms
    c.advance(4)
    second = c.get("k")[0].lease_expiry_ms
    assert second == first + 4000
    admin = c.get("k", lease=False)[0]
    assert admin.code == OK
    c.check()


def test_exists_and_prefix_length() -> None:
    c = Cluster(segments={1: MiB})
    c.put("p0", "p1", "p2", "p4")
    c.start("p3")
    assert c.readable("p0", "p3", "p4", "zz", "\ud800") == [True, False, True, False, False]
    assert c.state.prefix_length(["p0", "p1", "p2", "p3", "p4"]) == 3
    assert c.state.prefix_length(["x", "p0"]) == 0
    assert c.state.prefix_length(["p0", "p1"]) == 2
    assert c.state.prefix_length([]) == 0
    c.check()


# ====================================================================== removal and pins


def test_lease_blocks_removal_until_it_expires_or_force() -> None:
    c = Cluster(segments={1: MiB}, lease_ttl_s=10)
    c.put("a", "b", "c")
    c.get("a", "b")
    assert c.remove("a", "c", "zz") == [E.OBJECT_HAS_LEASE, OK, E.OBJECT_NOT_FOUND]
    assert c.remove("b", force=True) == [OK]
    c.advance(10.5)
    assert c.remove("a") == [OK]
    assert c.used(1) == 0
    c.check()


def test_processing_object_is_not_removable_even_with_force() -> None:
    c = Cluster(segments={1: MiB})
    c.start("a")
    assert c.remove("a", force=True) == [E.OBJECT_NOT_READY]
    c.check()


def test_hard_pin_blocks_removal_without_force() -> None:
    c = Cluster(segments={1: MiB})
    c.put("a", hard_pin=True)
    c.put("b")
    assert c.state.pin(["b", "zz"], hard=True) == [OK, E.OBJECT_NOT_FOUND]
    assert c.remove("a", "b") == [E.OBJECT_PINNED, E.OBJECT_PINNED]
    assert c.state.pin(["b"], hard=True, unpin=True) == [OK]
    assert c.remove("a", "b") == [E.OBJECT_PINNED, OK]
    assert c.remove("a", force=True) == [OK]
    c.check()


def test_remove_all_by_prefix_skips_leased_and_pinned_unless_forced() -> None:
    c = Cluster(segments={1: MiB})
    c.put("m1/a", "m1/b", "m1/c", "m2/a")
    c.put("m1/pinned", hard_pin=True)
    c.start("m1/busy")
    c.get("m1/b")
    assert c.state.remove_all(prefix="m1/") == 2
    assert c.present(["m1/a", "m1/b", "m1/c", "m2/a", "m1/pinned"]) == ["m1/b", "m2/a", "m1/pinned"]
    assert c.state.remove_all(force=True, prefix="m1/") == 2
    assert c.present(["m1/b", "m2/a", "m1/pinned"]) == ["m2/a"]
    assert c.get_codes("m1/busy") == [E.OBJECT_NOT_READY]
    assert c.state.remove_all(force=True) == 1
    c.check()


# ====================================================================== placement through the state


def test_free_ratio_first_fills_a_new_empty_segment_first() -> None:
    c = Cluster(segments={1: MiB})
    c.put(*[f"old{i}" for i in range(600)], size=1000)
    assert c.mount(2, MiB).code == OK
    placed = [r.replicas[0].segment_id for r in c.start(*[f"new{i}" for i in range(200)], size=1000)]
    assert placed == [2] * 200  # segment 2 is still much emptier after 200 KiB
    c.check()


def test_replica_num_two_uses_distinct_segments_best_effort() -> None:
    c = Cluster(segments={1: MiB, 2: MiB, 3: MiB})
    for r in c.start(*[f"k{i}" for i in range(50)], replica_num=2):
        ids = [g.segment_id for g in r.replicas]
        assert r.code == OK
        assert len(set(ids)) == len(ids) == 2
    single = Cluster(segments={1: MiB})
    [r] = single.start("x", replica_num=3)
    assert r.code == OK
    assert len(r.replicas) == 1  # best effort: one replica is enough
    c.check()
    single.check()


def test_preferred_segments_and_node() -> None:
    c = Cluster(segments={1: MiB, 2: MiB, 3: MiB}, nodes={1: "a", 2: "b", 3: "c"})
    assert c.start("x", preferred_segments=[3])[0].replicas[0].segment_id == 3
    assert c.start("y", preferred_segments=["2"])[0].replicas[0].segment_id == 2
    assert c.start("z", preferred_segments=["c"])[0].replicas[0].segment_id == 3
    assert c.start("w", preferred_node="a")[0].replicas[0].segment_id == 1
    c.check()


def test_local_first_placement() -> None:
    c = Cluster(segments={1: MiB, 2: MiB}, nodes={1: "a", 2: "b"}, placement="local_first")
    assert {r.replicas[0].segment_id for r in c.start("x", "y", "z", writer_node="b")} == {2}
    c.check()


def test_draining_segment_is_readable_but_not_allocatable() -> None:
    c = Cluster(segments={1: MiB, 2: MiB})
    c.put("a", preferred_segments=[1])
    assert c.state.set_segment_status([1, 99], SegmentStatus.DRAINING) == [OK, E.SEGMENT_NOT_FOUND]
    assert c.get_codes("a") == [OK]
    placed = c.start(*[f"k{i}" for i in range(20)], preferred_segments=[1])
    assert {r.replicas[0].segment_id for r in placed} == {2}
    assert not c.state.needs_eviction()
    assert c.state.stats().allocatable_capacity == MiB
    c.state.set_segment_status([2], SegmentStatus.DRAINING)
    assert [r.code for r in c.start("b")] == [E.NO_SPACE]
    c.state.set_segment_status([1], SegmentStatus.DRAINED)
    assert c.get_codes("a") == [E.OBJECT_NOT_FOUND]
    assert c.state.set_segment_status([1], 7) == [E.INVALID_ARGUMENT]
    c.state.set_segment_status([1, 2], SegmentStatus.OK)
    assert c.get_codes("a") == [OK]
    c.check()


# ====================================================================== membership


def test_mount_with_inventory_rebuilds_objects_and_allocator() -> None:
    c = Cluster(segments={1: MiB})
    c.put(*[f"k{i}" for i in range(20)], size=3000)
    before = {k: c.get(k, lease=False)[0] for k in (f"k{i}" for i in range(20))}
    inventory = [InventoryItem(k, r.replicas[0].offset, r.size, r.checksum) for k, r in before.items()]
    # A new master (failover) rebuilds from the store's report.
    fresh = Cluster()
    result = fresh.mount(1, MiB, inventory=list(reversed(inventory)), remount=True)
    assert (result.code, result.adopted, result.rejected) == (OK, 20, 0)
    for k, r in before.items():
        [got] = fresh.get(k, lease=False)
        assert (got.code, got.size, got.checksum, got.replicas[0].offset) == (
            OK,
            r.size,
            r.checksum,
            r.replicas[0].offset,
        )
    assert fresh.used(1) == c.used(1)
    # New puts never land on adopted ranges.
    new = fresh.start(*[f"n{i}" for i in range(50)], size=3000)
    adopted = {r.replicas[0].offset for r in before.values()}
    assert all(r.code == OK and r.replicas[0].offset not in adopted for r in new)
    fresh.check()


def test_mount_rejects_overlapping_out_of_range_and_garbage_entries() -> None:
    c = Cluster()
    inventory: list[Any] = [
        InventoryItem("good", 0, 1000, 1),
        InventoryItem("overlap", 512, 1000, 2),  # inside "good"'s block
        InventoryItem("beyond", MiB - 64, 1000, 3),
        InventoryItem("unaligned", 4097, 10, 4),
        InventoryItem("", 8192, 10, 5),
        InventoryItem("\ud800", 8192, 10, 5),
        InventoryItem("zero", 8192, 0, 5),
        InventoryItem("neg", -64, 10, 5),
        InventoryItem("badsum", 8192, 10, -1),
        InventoryItem("ssd", 8192, 10, 5, tier=1),
        InventoryItem("good", 16384, 1000, 1),  # a second copy on one segment
        InventoryItem(123, 8192, 10, 5),  # type: ignore[arg-type]
        "not an item",
        InventoryItem("b", "x", 10, 5),  # type: ignore[arg-type]
        InventoryItem("fine", 8192, 10, 5),
    ]
    result = c.mount(1, MiB, inventory=inventory)
    assert (result.code, result.adopted, result.rejected) == (OK, 2, 13)
    assert c.present(["good", "fine", "overlap"]) == ["good", "fine"]
    c.check()


def test_inventory_conflicting_with_an_existing_object_is_rejected() -> None:
    c = Cluster(segments={1: MiB})
    c.put("k", size=1000)
    result = c.mount(
        2, MiB, inventory=[InventoryItem("k", 0, 999, checksum_of("k")), InventoryItem("k", 4096, 1000, 42)]
    )
    assert (result.adopted, result.rejected) == (0, 2)
    result = c.mount(3, MiB, inventory=[InventoryItem("k", 4096, 1000, checksum_of("k"))])
    assert (result.adopted, result.rejected) == (1, 0)  # a second replica of the same object
    assert sorted(g.segment_id for g in c.get("k")[0].replicas) == [1, 3]
    c.check()


def test_mount_is_idempotent_and_a_changed_spec_replaces_the_segment() -> None:
    c = Cluster(segments={1: MiB})
    c.put("a", "b")
    res = c.get("a", lease=False)[0]
    inv = [InventoryItem("a", res.replicas[0].offset, res.size, res.checksum)]
    assert c.mount(1, MiB, inventory=inv).adopted == 1  # same spec: nothing changes
    assert c.present(["a", "b"]) == ["a", "b"]
    assert c.mount(1, MiB, store_id="other").code == E.SEGMENT_ALREADY_EXISTS
    # The store restarted with a new secret: its inventory is the truth.
    assert c.mount(1, MiB, inventory=inv, secret=b"n" * 32).adopted == 1
    assert c.present(["a", "b"]) == ["a"]
    assert c.mount(1, 0).code == E.INVALID_ARGUMENT
    c.check()


def test_unmount_drops_replicas_and_objects_without_replicas_vanish() -> None:
    c = Cluster(segments={1: MiB, 2: MiB})
    c.put("both", replica_num=2)
    c.put("one", preferred_segments=[1])
    c.start("inflight", preferred_segments=[1])
    assert c.state.unmount_segment(1, "wrong-store") == (E.SEGMENT_NOT_FOUND, 0)
    assert c.state.unmount_segment(1, "store1") == (OK, 2)
    assert c.state.unmount_segment(1, "store1") == (E.SEGMENT_NOT_FOUND, 0)
    assert c.present(["both", "one"]) == ["both"]
    assert c.end("inflight") == [E.OBJECT_NOT_FOUND]
    assert [g.segment_id for g in c.get("both")[0].replicas] == [2]
    c.check()


def test_heartbeat_needs_remount_for_unknown_store_or_segment() -> None:
    c = Cluster(segments={1: MiB})
    assert c.state.heartbeat("ghost", [], 0).code == E.NEED_REMOUNT
    assert c.state.heartbeat("store1", [1, 2], 0).code == E.NEED_REMOUNT
    assert c.state.heartbeat("store1", [1], 0).code == OK
    c.check()


def test_heartbeat_delivers_and_trims_free_notifications() -> None:
    c = Cluster(segments={1: MiB})
    c.put("a", "b", "c")
    offsets = {k: c.get(k, lease=False)[0].replicas[0].offset for k in "abc"}
    assert c.state.heartbeat("store1", [1], 0).freed == []
    c.remove("a", "b")
    freed = c.state.heartbeat("store1", [1], 0).freed
    assert [(s, off, key) for s, off, _, key in freed] == [(1, offsets["a"], "a"), (1, offsets["b"], "b")]
    seqs = [seq for _, _, seq, _ in freed]
    assert seqs[1] == seqs[0] + 1
    assert c.state.heartbeat("store1", [1], seqs[0]).freed == freed[1:]  # redelivered until acked
    c.remove("c")
    assert [off for _, off, _, _ in c.state.heartbeat("store1", [1], seqs[1]).freed] == [offsets["c"]]
    c.check()


def test_heartbeat_delivers_at_most_ten_thousand_notifications() -> None:
    c = Cluster(segments={1: MiB})
    keys = [f"k{i}" for i in range(HEARTBEAT_FREED_LIMIT + 50)]
    for i in range(0, len(keys), 4096):
        assert set(c.put(*keys[i : i + 4096], size=64)) == {OK}
    assert c.state.remove_all() == len(keys)
    first = c.state.heartbeat("store1", [1], 0).freed
    assert len(first) == HEARTBEAT_FREED_LIMIT
    rest = c.state.heartbeat("store1", [1], first[-1][2]).freed
    assert len(rest) == 50
    assert rest[0][2] == first[-1][2] + 1
    c.check()


def test_free_queue_is_bounded_and_drops_the_oldest() -> None:
    store = StoreEntry("s", now=0.0, seq_base=100, limit=3)
    for offset in range(5):
        store.note_freed(1, offset * 64)
    assert store.take(0, 10) == [(1, 128, 103, ""), (1, 192, 104, ""), (1, 256, 105, "")]
    assert store.dropped == 2
    assert store.take(104, 10) == [(1, 256, 105, "")]


def test_expire_stores_drops_the_replicas_of_silent_stores() -> None:
    c = Cluster(segments={1: MiB, 2: MiB}, stores={1: "sA", 2: "sB"}, store_ttl_s=10)
    c.put("on1", preferred_segments=[1])
    c.put("on2", preferred_segments=[2])
    c.put("both", replica_num=2)
    c.advance(6)
    assert c.state.heartbeat("sB", [2], 0).code == OK
    c.advance(5)
    assert c.state.expire_stores() == ["sA"]
    assert c.present(["on1", "on2", "both"]) == ["on2", "both"]
    assert c.state.heartbeat("sA", [1], 0).code == E.NEED_REMOUNT
    assert [s.id for s in c.state.segments()] == [2]
    assert c.state.stats().stores == 1
    c.check()


# ====================================================================== replicas, stats, memory, threads


def test_object_meta_replica_view() -> None:
    c = Cluster(segments={1: MiB, 2: MiB})
    c.start("k", replica_num=2)
    shard = c.state._shards.shard_of(b"k")  # white box: the packed replica records
    meta = shard.objects["k"]
    assert [r.status for r in meta.replica_list()] == [ReplicaStatus.PROCESSING] * 2
    c.end("k")
    assert [r.status for r in meta.replica_list()] == [ReplicaStatus.COMPLETE] * 2
    assert sorted(r.segment_id for r in meta.replica_list()) == [1, 2]
    c.check()


def test_memory_per_object_is_under_400_bytes() -> None:
    # ~1000 objects per shard, as 1 M objects in 1024 shards; keys: 64 hex chars plus a short suffix.
    c = Cluster(segments={1: 64 * 1024 * MiB}, num_shards=8)
    n, batch = 8000, 1000
    keys = [f"{random.Random(i).getrandbits(256):064x}@tp0_r1" for i in range(n)]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(0, n, batch):
            chunk = keys[i : i + batch]
            sizes = [int(str(320 * KiB)) for _ in chunk]  # distinct int objects, as the wire gives them
            c.state.put_start("c1", chunk, sizes)
            c.state.put_end("c1", chunk, [random.getrandbits(64) for _ in chunk])
            c.get(*chunk)  # every object gets its own lease deadline (one float per batch)
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    # Keys were created before the measured window; count them in.
    per_object = used / n + sum(sys.getsizeof(k) for k in keys) / n
    print(f"master memory per object: {per_object:.0f} bytes")
    assert per_object <= 400, per_object
    c.check()


def test_concurrent_operations_keep_invariants() -> None:
    c = Cluster(segments={1: 2 * MiB, 2: 2 * MiB}, lease_ttl_s=0.001, eviction_sample_factor=4)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                keys = [f"k{rng.randrange(3000)}" for _ in range(8)]
                op = rng.random()
                if op < 0.5:
                    started = c.start(*keys, size=rng.choice([3000, 20_000]), client=f"w{seed}")
                    ok = [k for k, r in zip(keys, started, strict=True) if r.code == OK]
                    if rng.random() < 0.2:
                        c.state.put_revoke(f"w{seed}", ok)
                    else:
                        c.end(*ok, client=f"w{seed}")
                elif op < 0.8:
                    c.get(*keys)
                    c.readable(*keys)
                elif op < 0.9:
                    c.remove(*keys, force=rng.random() < 0.5)
                else:
                    c.state.evict(50_000)
                    c.state.reclaim_abandoned_puts()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    c.check()
