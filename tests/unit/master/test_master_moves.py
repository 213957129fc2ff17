"""Moves (drain, scale-in, rebalance) on the pure master core: MoveEngine, DrainManager (ManualClock)."""

from __future__ import annotations

from typing import Any

import pytest
from master_scenario import OK, Cluster, KiB, MiB, checksum_of, secret_of

from kvpool.common import grants
from kvpool.common.errors import ErrorCode as E
from kvpool.common.errors import KvPoolError
from kvpool.master.drain import DRAINED, REMOVED, RUNNING, STALLED, WAITING, DrainManager
from kvpool.master.moves import (
    ABANDON_GRACE_S,
    MOVE_TIMEOUT_S,
    MoveEngine,
    MoveTask,
    SegmentLoad,
    rebalance_budget,
)
from kvpool.master.segments import SegmentStatus
from kvpool.master.types import ReplicaGrant


def grant_ok(r: ReplicaGrant, op: grants.GrantOp, key: str) -> bool:
    g = grants.Grant(op, r.segment_id, r.offset, r.length, r.expiry_ms, key.encode(), r.mac)
    return grants.verify(secret_of(r.segment_id), g)


def on(c: Cluster, key: str) -> list[int]:
    """Segments of the readable replicas of ``key`` (admin read: no lease)."""
    [res] = c.get(key, lease=False)
    return [r.segment_id for r in res.replicas]


def fill(c: Cluster, segment: int, n: int, size: int = 4 * KiB, prefix: str = "k") -> list[str]:
    keys = [f"{prefix}{i}" for i in range(n)]
    assert c.put(*keys, size=size, preferred_segments=[segment]) == [OK] * n
    assert all(on(c, k) == [segment] for k in keys)
    return keys


def drain(c: Cluster, *segments: int) -> None:
    assert c.state.set_segment_status(list(segments), SegmentStatus.DRAINING) == [OK] * len(segments)


def finish_all(engine: MoveEngine, tasks: list[MoveTask], ok: bool = True) -> None:
    for t in tasks:
        assert engine.finish_move(t.task_id, ok).code == (OK if ok else E.TRANSFER_FAILED)


# ====================================================================== MoveEngine


def test_plan_allocates_a_processing_target_and_the_object_stays_on_its_source() -> None:
    c = Cluster(segments={1: MiB, 2: MiB, 3: MiB})
    keys = fill(c, 1, 10)
    drain(c, 1)
    engine = MoveEngine(c.state)
    plan = engine.plan_moves(100, {1})
    assert sorted(t.key for t in plan.tasks) == sorted(keys)
    for t in plan.tasks:
        assert t.source.segment_id == 1
        assert t.target.segment_id in (2, 3)
        assert (t.size, t.checksum) == (4 * KiB, checksum_of(t.key))
        assert grant_ok(t.source, grants.GrantOp.READ, t.key)
        assert grant_ok(t.target, grants.GrantOp.WRITE, t.key)
        assert on(c, t.key) == [1]  # readers still get only the source
    # A replica in flight: neither evicted nor removed, and not planned twice.
    assert c.state.evict(10 * MiB).objects == 0
    assert c.remove(keys[0], force=True) == [E.OBJECT_NOT_READY]
    assert engine.plan_moves(100, {1}).tasks == []
    assert engine.in_flight() == 10
    c.check()


def test_finish_moves_the_object_and_frees_an_unleased_source_at_once() -> None:
    c = Cluster(segments={1: MiB, 2: MiB})
    keys = fill(c, 1, 5)
    drain(c, 1)
    engine = MoveEngine(c.state)
    plan = engine.plan_moves(100, {1})
    finish_all(engine, plan.tasks)
    assert all(on(c, k) == [2] for k in keys)
    assert c.used(1) == 0
    assert c.objects_on(2) == 5
    assert engine.finish_move(plan.tasks[0].task_id, True).code == E.JOB_NOT_FOUND  # once only
    c.check()


def test_a_leased_source_range_is_freed_only_when_the_lease_runs_out() -> None:
    c = Cluster(segments={1: MiB, 2: MiB}, lease_ttl_s=10)
    [key] = fill(c, 1, 1)
    [res] = c.get(key)  # a reader holds the source (lease until now + 10 s)
    drain(c, 1)
    engine = MoveEngine(c.state)
    [task] = engine.plan_moves(10, {1}).tasks
    c.advance(3)
    assert engine.finish_move(task.task_id, True).code == OK
    assert on(c, key) == [2]  # new readers get the target ...
    assert c.used(1) > 0
    assert engine.retiring() == 1
    c.advance(6.9)
    assert engine.reap() == 0
    assert c.used(1) > 0
    c.advance(0.2)
    assert engine.reap() == 1
    assert c.used(1) == 0
    # The freed range went to the source store's free-notification queue (its inventory forgets it).
    assert res.replicas[0].offset in [o for _, o, _, _ in c.state.heartbeat("store1", [1]).freed]
    c.check()


def test_a_failed_move_frees_its_target_and_is_retried_after_a_backoff() -> None:
    c = Cluster(segments={1: MiB, 2: MiB})
    [key] = fill(c, 1, 1)
    drain(c, 1)
    engine = MoveEngine(c.state)
    [task] = engine.plan_moves(10, {1}).tasks
    assert c.used(2) > 0
    finish_all(engine, [task], ok=False)
    assert c.used(2) == 0
    assert on(c, key) == [1]
    assert engine.plan_moves(10, {1}).tasks == []  # backoff
    c.advance(1.1)
    [again] = engine.plan_moves(10, {1}).tasks
    finish_all(engine, [again])
    assert on(c, key) == [2]
    c.check()


def test_puts_in_flight_are_waited_for_and_leases_do_not_block_moves() -> None:
    c = Cluster(segments={1: MiB, 2: MiB})
    assert c.start("late", preferred_segments=[1])[0].code == OK
    [leased] = fill(c, 1, 1, prefix="leased")
    c.get(leased)
    drain(c, 1)
    engine = MoveEngine(c.state)
    assert [t.key for t in engine.plan_moves(10, {1}).tasks] == [leased]
    assert c.end("late") == [OK]
    assert [t.key for t in engine.plan_moves(10, {1}).tasks] == ["late"]


def test_targets_are_never_a_source_a_draining_segment_or_a_segment_holding_the_object() -> None:
    c = Cluster(segments={1: MiB, 2: MiB, 3: MiB, 4: MiB})
    keys = fill(c, 1, 20)
    assert c.put("two", replica_num=2, preferred_segments=[1, 3]) == [OK]
    drain(c, 1, 2)
    engine = MoveEngine(c.state)
    plan = engine.plan_moves(100, {1})
    assert len(plan.tasks) == 21
    assert {t.target.segment_id for t in plan.tasks if t.key in keys} <= {3, 4}
    assert [t.target.segment_id for t in plan.tasks if t.key == "two"] == [4]


def test_free_ratio_first_sends_moves_to_the_emptiest_segment() -> None:
    c = Cluster(segments={1: MiB, 2: MiB, 3: MiB})
    fill(c, 2, 100, prefix="full")
    keys = fill(c, 1, 10)
    drain(c, 1)
    plan = MoveEngine(c.state).plan_moves(100, {1})
    assert {t.target.segment_id for t in plan.tasks if t.key in keys} == {3}


def test_no_target_with_room_is_reported() -> None:
    c = Cluster(segments={1: MiB})
    fill(c, 1, 3)
    drain(c, 1)
    plan = MoveEngine(c.state).plan_moves(10, {1})
    assert (plan.tasks, plan.no_room, plan.no_room_bytes) == ([], 3, 3 * 4 * KiB)


def test_an_object_with_another_complete_replica_is_retired_without_a_copy() -> None:
    c = Cluster(segments={1: MiB, 2: MiB})
    assert c.put("two", replica_num=2, preferred_segments=[1, 2]) == [OK]
    drain(c, 1)
    engine = MoveEngine(c.state)
    plan = engine.plan_moves(10, {1})
    assert (plan.tasks, plan.retired) == ([], 1)
    assert on(c, "two") == [2]
    assert c.used(1) == 0
    c.check()


def test_moves_per_store_are_bounded_and_handed_out_to_their_target_store() -> None:
    c = Cluster(segments={1: MiB, 2: MiB, 3: MiB})
    fill(c, 1, 20)
    drain(c, 1)
    engine = MoveEngine(c.state, max_per_store=4)
    plan = engine.plan_moves(100, {1})
    assert len(plan.tasks) == 8  # 4 for each of the two target stores
    assert plan.busy
    assert plan.no_room == 0  # busy stores are not a lack of room (no STALLED, no retire-only)
    assert engine.pending_for("store2") == 4
    got = engine.take_tasks("store2", 3)
    assert len(got) == 3
    assert all(t.target_store == "store2" for t in got)
    assert engine.pending_for("store2") == 1
    finish_all(engine, got)
    assert len(engine.plan_moves(100, {1}).tasks) == 3  # the freed slots are used again


def test_an_abandoned_task_frees_its_target_only_after_the_grace() -> None:
    c = Cluster(segments={1: MiB, 2: MiB, 3: MiB})
    fill(c, 1, 2)
    drain(c, 1)
    engine = MoveEngine(c.state)
    plan = engine.plan_moves(10, {1})
    taken = engine.take_tasks(plan.tasks[0].target_store, 1)
    c.advance(MOVE_TIMEOUT_S + 0.1)
    outcomes = engine.expire()
    assert len(outcomes) == 2
    assert all(o.code == E.TRANSFER_FAILED for o in outcomes)
    # The never-delivered task's range is free; the delivered one waits out the grace (its store may write).
    assert engine.retiring() == 1
    seg = taken[0].target.segment_id
    assert c.used(seg) > 0
    c.advance(ABANDON_GRACE_S)
    assert engine.reap() == 1
    assert c.used(2) == c.used(3) == 0
    assert engine.finish_move(taken[0].task_id, True).code == E.JOB_NOT_FOUND  # a late report is ignored
    c.check()


def test_a_move_whose_target_store_expired_leaves_the_object_on_its_source() -> None:
    c = Cluster(segments={1: MiB, 2: MiB}, store_ttl_s=5)
    [key] = fill(c, 1, 1)
    drain(c, 1)
    engine = MoveEngine(c.state)
    [task] = engine.plan_moves(10, {1}).tasks
    c.advance(6)
    c.state.heartbeat("store1", [1])
    assert c.state.expire_stores() == ["store2"]
    assert engine.finish_move(task.task_id, True).code != OK
    assert on(c, key) == [1]
    c.check()


def test_rebalance_budget() -> None:
    loads = [SegmentLoad(1, 100, 90), SegmentLoad(2, 100, 10), SegmentLoad(3, 100, 50)]
    budget, targets, spread = rebalance_budget(loads, 0.1)
    assert budget == {1: 40}
    assert targets == {2}
    assert spread == pytest.approx(0.8)
    assert rebalance_budget(loads, 0.1, {1: 40})[0] == {}
    assert rebalance_budget([SegmentLoad(1, 100, 50), SegmentLoad(2, 100, 45)], 0.1)[0] == {}


# ====================================================================== DrainManager


class FakeIntents:
    def __init__(self) -> None:
        self.docs: dict[str, dict[str, Any]] = {}
        self.fail = False

    def put(self, kind: str, name: str, doc: dict[str, Any]) -> int:
        if self.fail:
            raise KvPoolError(E.ETCD_ERROR, "etcd down")
        self.docs[name] = dict(doc)
        return 1

    def list(self, kind: str) -> list[Any]:
        class Intent:
            def __init__(self, name: str, doc: dict[str, Any]) -> None:
                self.name, self.doc = name, doc

        return [Intent(n, d) for n, d in sorted(self.docs.items())]

    def delete(self, kind: str, name: str, expected_revision: int | None = None) -> bool:
        return self.docs.pop(name, None) is not None


def heartbeats(c: Cluster) -> None:
    """Every store heartbeats and acknowledges the free notifications it got (as a real store does)."""
    for store_id, store in list(c.state._table.stores.items()):
        freed = c.state.heartbeat(store_id, sorted(store.segment_ids)).freed
        if freed:
            c.state.heartbeat(store_id, sorted(store.segment_ids), max(q for _, _, q, _ in freed))


def run_stores(m: DrainManager, c: Cluster, rounds: int = 50, ok: bool = True) -> None:
    """Every store pulls its tasks and reports them done (as the store's mover would), between ticks."""
    for _ in range(rounds):
        heartbeats(c)
        m.tick()
        tasks = [t for s in ("store1", "store2", "store3", "store4") for t in m.sync(s, [], 32)]
        if not tasks and not m.engine.in_flight():
            heartbeats(c)
            m.tick()
            return
        by_store: dict[str, list[tuple[int, E]]] = {}
        for t in tasks:
            by_store.setdefault(t.target_store, []).append((t.task_id, OK if ok else E.TRANSFER_FAILED))
        for store, results in by_store.items():
            m.sync(store, results, 0)
        c.advance(0.05)


def test_drain_job_moves_everything_and_ends_drained() -> None:
    c = Cluster(segments={1: MiB, 2: MiB, 3: MiB})
    keys = fill(c, 1, 40)
    m = DrainManager(c.state)
    st = m.start("node1")
    assert (st.state, st.objects_remaining, st.segment_ids) == (RUNNING, 40, (1,))
    assert c.state.segments()[0].status == SegmentStatus.DRAINING
    run_stores(m, c)
    st = m.status("node1")
    assert (st.state, st.objects_moved, st.bytes_moved) == (DRAINED, 40, 40 * 4 * KiB)
    assert st.objects_remaining == 0
    assert next(s for s in c.state.segments() if s.id == 1).status == SegmentStatus.DRAINED
    assert all(on(c, k) in ([2], [3]) for k in keys)
    # A drained segment takes no puts and serves nothing; unmounting it loses nothing.
    assert c.state.unmount_segment(1) == (OK, 0)
    assert len(c.present(keys)) == 40
    c.check()


def test_drain_of_unknown_node_and_status_of_unknown_job() -> None:
    c = Cluster(segments={1: MiB})
    m = DrainManager(c.state)
    with pytest.raises(KvPoolError) as err:
        m.start("nowhere")
    assert err.value.code == E.SEGMENT_NOT_FOUND
    with pytest.raises(KvPoolError) as err:
        m.status("nowhere")
    assert err.value.code == E.JOB_NOT_FOUND


def test_a_drain_with_no_target_stalls() -> None:
    c = Cluster(segments={1: MiB})
    fill(c, 1, 3)
    m = DrainManager(c.state)
    m.start("node1")
    m.tick()
    assert m.status("node1").state == RUNNING
    c.advance(2.5)
    m.tick()
    st = m.status("node1")
    assert st.state == STALLED
    assert "no other segment" in st.message
    c.mount(2, MiB)  # scale-out: the drain goes on
    run_stores(m, c)
    assert m.status("node1").state == DRAINED


def test_undrain_revokes_queued_moves_and_reopens_the_segments() -> None:
    c = Cluster(segments={1: MiB, 2: MiB})
    keys = fill(c, 1, 10)
    m = DrainManager(c.state)
    m.start("node1")
    m.tick()
    [running] = m.sync("store2", [], 1)
    assert m.engine.in_flight() == 10
    st = m.undrain("node1")
    assert st.state == "CANCELLED"
    assert m.engine.in_flight() == 1  # the task a store is running finishes normally
    assert next(s for s in c.state.segments() if s.id == 1).status == SegmentStatus.OK
    m.sync("store2", [(running.task_id, OK)], 0)
    assert on(c, running.key) == [2]
    assert sum(on(c, k) == [1] for k in keys) == 9
    assert c.put("new", preferred_segments=[1]) == [OK]
    assert on(c, "new") == [1]
    with pytest.raises(KvPoolError):
        m.status("node1")
    c.check()


def test_scale_in_unmounts_and_a_returning_store_stays_drained() -> None:
    c = Cluster(segments={1: MiB, 2: MiB})
    keys = fill(c, 1, 10)
    m = DrainManager(c.state)
    m.start("node1", remove=True)
    m.tick()
    m.sync("store2", [(t.task_id, OK) for t in m.sync("store2", [], 32)], 0)
    m.tick()
    # Drained, but store1 has not applied its free notifications yet: its inventory would come back.
    assert m.status("node1").state == DRAINED
    assert [s.id for s in c.state.segments()] == [1, 2]
    run_stores(m, c)
    st = m.status("node1")
    assert st.state == REMOVED
    assert st.segment_ids == ()
    assert [s.id for s in c.state.segments()] == [2]
    assert len(c.present(keys)) == 10
    # The same store process re-mounts (it did not stop): it comes back drained, never takes puts.
    c.mount(1, MiB)
    m.on_mount(1)
    m.tick()
    m.tick()
    assert next(s for s in c.state.segments() if s.id == 1).status == SegmentStatus.DRAINED
    m.undrain("node1")
    assert next(s for s in c.state.segments() if s.id == 1).status == SegmentStatus.OK


def test_drain_jobs_are_durable_and_resume_under_a_new_leader() -> None:
    intents = FakeIntents()
    c = Cluster(segments={1: MiB, 2: MiB})
    keys = fill(c, 1, 30)
    m = DrainManager(c.state, max_per_store=10)
    m.attach_intents(intents)
    with pytest.raises(KvPoolError) as err:
        m.start("node1")
    assert err.value.code == E.LEADER_WARMING_UP  # not loaded yet
    m.resume()
    intents.fail = True
    with pytest.raises(KvPoolError) as err:
        m.start("node1")
    assert err.value.code == E.ETCD_ERROR
    assert "node1" not in m.jobs
    intents.fail = False
    m.start("node1")
    assert intents.docs["node1"]["state"] == RUNNING
    run_stores(m, c, rounds=1)  # a third of the drain
    assert m.status("node1").objects_moved == 10

    # A new leader: an empty index rebuilt from the stores' re-mounts (segments come back OK).
    c2 = Cluster()
    inventory = [_inventory(c, sid) for sid in (1, 2)]
    m2 = DrainManager(c2.state)
    m2.attach_intents(intents)
    c2.mount(1, MiB, inventory[0])
    assert m2.resume() == 1
    assert next(s for s in c2.state.segments() if s.id == 1).status == SegmentStatus.DRAINING
    m2.tick()
    assert m2.status("node1").state == RUNNING  # segment 2 has not re-mounted yet: no target
    c2.mount(2, MiB, inventory[1])
    m2.on_mount(2)
    run_stores(m2, c2)
    assert m2.status("node1").state == DRAINED
    assert len(c2.present(keys)) == 30
    m2.tick()
    c2.advance(2)
    m2.tick()
    assert intents.docs["node1"]["state"] == DRAINED
    m2.undrain("node1")
    assert intents.docs == {}


def _inventory(c: Cluster, segment_id: int) -> list[Any]:
    """What a store would report: its committed objects (key, offset, length, checksum)."""
    from kvpool.master.types import InventoryItem

    out = []
    for shard in c.state._shards:
        for key, meta in shard.objects.items():
            for r in meta.replica_list():
                if r.segment_id == segment_id and r.complete:
                    out.append(InventoryItem(key, r.offset, meta.size, meta.checksum))
    return out


def test_a_job_without_mounted_segments_waits() -> None:
    c = Cluster(segments={1: MiB, 2: MiB})
    m = DrainManager(c.state)
    m.start("node1")
    c.state.unmount_segment(1)
    m.tick()
    assert m.status("node1").state == WAITING


def test_rebalance_after_scale_out_evens_out_used_fractions() -> None:
    c = Cluster(segments={1: MiB})
    keys = fill(c, 1, 120, size=4 * KiB)  # ~47% of segment 1
    c.mount(2, MiB)
    m = DrainManager(c.state)
    st = m.start_rebalance(tolerance=0.05)
    assert st.state == RUNNING
    run_stores(m, c)
    st = m.rebalance_status()
    assert st.state == "DONE"
    assert st.objects_moved > 40
    used = {s.id: s.used / s.size for s in c.state.segments()}
    assert abs(used[1] - used[2]) <= 0.05 + 4 * KiB / MiB
    assert len(c.present(keys)) == 120
    assert next(s for s in c.state.segments() if s.id == 1).status == SegmentStatus.OK
    c.check()


def test_rebalance_respects_max_moves() -> None:
    c = Cluster(segments={1: MiB})
    fill(c, 1, 100)
    c.mount(2, MiB)
    m = DrainManager(c.state)
    m.start_rebalance(max_moves=7)
    run_stores(m, c)
    st = m.rebalance_status()
    assert (st.state, st.objects_moved) == ("DONE", 7)
    assert "max moves" in st.message


def test_ssd_tier_replicas_are_drained_too() -> None:
    # Mooncake's drain skips its LOCAL_DISK replicas (issue #2817); here an SSD replica is a replica.
    from kvpool.master.types import InventoryItem

    c = Cluster(segments={1: MiB, 2: MiB}, nodes={11: "node1"}, stores={11: "store1"})
    assert c.put("both", size=4 * KiB, preferred_segments=[1]) == [OK]
    ssd = [
        InventoryItem("ssd-only", 0, 4 * KiB, checksum_of("ssd-only"), tier=1),
        InventoryItem("both", 4 * KiB, 4 * KiB, checksum_of("both"), tier=1),
    ]
    assert c.mount(11, MiB, ssd, tier=1, shm_path="").adopted == 2
    assert sorted(on(c, "both")) == [1, 11]
    drain(c, 1, 11)
    engine = MoveEngine(c.state)
    plan = engine.plan_moves(10, {1, 11})
    by_key = {t.key: t for t in plan.tasks}
    assert set(by_key) == {"both", "ssd-only"}
    # The SSD-only object is read from the SSD tier (the grant says so); "both" from its DRAM copy.
    assert (by_key["ssd-only"].source.segment_id, by_key["ssd-only"].source.tier) == (11, 1)
    assert (by_key["both"].source.segment_id, by_key["both"].source.tier) == (1, 0)
    assert {t.target.segment_id for t in plan.tasks} == {2}
    finish_all(engine, plan.tasks)
    # The SSD copy of "both" is the tier's cache of an object that now lives elsewhere: retired, not copied.
    again = engine.plan_moves(10, {1, 11})
    assert (again.tasks, again.retired) == ([], 1)
    assert on(c, "both") == [2]
    assert on(c, "ssd-only") == [2]
    assert c.used(1) == c.used(11) == 0
    # Freed SSD ranges become DELETE tasks for the store's SSD files.
    deletes = [t for t in c.state.tiers.exchange("store1", [], 100)[1] if t.kind == 3]
    assert sorted(t.dst_offset for t in deletes) == [0, 4 * KiB]
    c.check()
