"""Warm standbys (decision 0070): real etcd, three real masters, one real store, real clients.

The standbys follow the store's inventory while they wait; after a leader SIGKILL the new leader knows
every object before the store has re-mounted with it, and the re-mount then reconciles without a wrong
read.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import grpc
import pytest

from kvpool.common.clock import Deadline
from kvpool.proto import master_pb2 as pb
from kvpool.proto import master_pb2_grpc as pb_grpc
from kvpool.tools.bench_failover import Workload, wait_for_leader
from kvpool.tools.etcd_process import etcd_binary
from kvpool.tools.local_cluster import LocalCluster

pytestmark = [pytest.mark.chaos, pytest.mark.etcd, pytest.mark.integration]

OBJECTS = 300
# Leader lease 1 s (+1 s warm-up). The store expiry is long enough that the new leader keeps the frozen
# store's segment while the test looks at it.
HA_ARGS = ("--leader-ttl-s", "1", "--store-ttl-s", "15")


def _stats(endpoint: str) -> pb.StatsResponse:
    with grpc.insecure_channel(endpoint) as channel:
        stub = pb_grpc.MasterServiceStub(channel)  # type: ignore[no-untyped-call]
        return stub.GetStats(pb.StatsRequest(), timeout=2.0)


def _exists(endpoint: str, keys: list[str]) -> list[bool]:
    with grpc.insecure_channel(endpoint) as channel:
        stub = pb_grpc.MasterServiceStub(channel)  # type: ignore[no-untyped-call]
        found: list[bool] = []
        for start in range(0, len(keys), 100):
            response = stub.BatchExists(pb.BatchExistsRequest(keys=keys[start : start + 100]), timeout=5.0)
            assert response.status.code == 0, response.status
            found.extend(response.exists)
        return found


def _wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = Deadline(timeout)
    while not cond():
        if deadline.expired():
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def ha_cluster(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    if etcd_binary() is None and not os.environ.get("CI"):
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    return make_cluster(stores=1, store_size="32MiB", ha=True, master_args=HA_ARGS)


def test_new_leader_knows_every_object_before_the_store_remounts(ha_cluster: LocalCluster) -> None:
    endpoints = [m.address for m in ha_cluster.masters]
    old = wait_for_leader(endpoints, 30.0)
    assert old
    standbys = [e for e in endpoints if e != old]
    workload = Workload(ha_cluster.master, 2 << 10, ha_cluster.cluster)
    try:
        assert workload.write_until(OBJECTS, "before", 30.0) == OBJECTS
        keys = sorted(workload.acked)
        # The standbys' indexes are warm: they hold every object while the leader is still alive.
        _wait_for(lambda: all(_stats(e).objects == OBJECTS for e in standbys), 20.0, "warm standbys")
        for endpoint in standbys:
            stats = _stats(endpoint)
            assert stats.role == "follower"
            assert [s.status for s in stats.segments] == [pb.SEGMENT_DRAINING]  # warm: never allocatable

        # Freeze the store, so that it cannot re-mount with the new leader, then kill the leader.
        [store] = ha_cluster.stores
        ha_cluster.signal(store, signal.SIGSTOP)
        try:
            ha_cluster.kill(next(m for m in ha_cluster.masters if m.address == old))
            new = wait_for_leader(standbys, 20.0)
            assert new
            # Served from the warm index: every object is there although the store has not re-mounted.
            assert _exists(new, keys) == [True] * OBJECTS
            stats = _stats(new)
            assert stats.objects == OBJECTS
            assert [s.status for s in stats.segments] == [pb.SEGMENT_DRAINING]
        finally:
            ha_cluster.signal(store, signal.SIGCONT)

        # The store's re-mount reconciles the segment: allocatable again, every byte right.
        _wait_for(lambda: [s.status for s in _stats(new).segments] == [pb.SEGMENT_OK], 20.0, "the re-mount")
        checked, good, wrong = workload.verify_until(time.monotonic(), 1.0, 20.0)
        assert (checked, good, wrong) == (OBJECTS, OBJECTS, 0)
        assert workload.write_until(50, "after", 20.0) == 50
        checked, good, wrong = workload.verify_until(time.monotonic(), 1.0, 20.0)
        assert (checked, good, wrong) == (OBJECTS + 50, OBJECTS + 50, 0)
    finally:
        workload.close()


def test_deltas_follow_removals_and_new_puts(ha_cluster: LocalCluster) -> None:
    endpoints = [m.address for m in ha_cluster.masters]
    old = wait_for_leader(endpoints, 30.0)
    standbys = [e for e in endpoints if e != old]
    workload = Workload(ha_cluster.master, 2 << 10, ha_cluster.cluster)
    try:
        assert workload.write_until(100, "first", 30.0) == 100
        _wait_for(lambda: all(_stats(e).objects == 100 for e in standbys), 20.0, "the first sync")
        removed = sorted(workload.acked)[:40]
        assert all(code == 0 for code in workload.client.batch_remove(removed))
        # New objects at once: the master hands them the freed ranges before the store's next heartbeat
        # brings it the frees, which name the removed keys, so the store keeps the new objects there
        # (decision 0071) and the standbys, fed from its inventory, end with exactly the 120 live ones.
        assert workload.write_until(60, "second", 30.0) == 60
        _wait_for(lambda: all(_stats(e).objects == 120 for e in standbys), 20.0, "the removals and new objects")
        # And the failover keeps exactly that: the removed keys stay gone, the rest read back right.
        ha_cluster.kill(next(m for m in ha_cluster.masters if m.address == old))
        new = wait_for_leader(standbys, 20.0)
        assert new
        assert _exists(new, removed) == [False] * 40
        for key in removed:
            del workload.acked[key]
        checked, good, wrong = workload.verify_until(time.monotonic(), 1.0, 20.0)
        assert (checked, good, wrong) == (120, 120, 0)
    finally:
        workload.close()


def test_a_quiet_store_stays_warm_across_the_failover(make_cluster: Callable[..., LocalCluster]) -> None:
    # Nothing is written for longer than the store TTL before the kill: the feed's empty deltas must keep
    # the store alive in the standbys' view, or the new leader expires it (and its warm objects) at once.
    if etcd_binary() is None and not os.environ.get("CI"):
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    store_ttl_s = 6.0
    cluster = make_cluster(
        stores=1, store_size="32MiB", ha=True, master_args=("--leader-ttl-s", "1", "--store-ttl-s", str(store_ttl_s))
    )
    endpoints = [m.address for m in cluster.masters]
    old = wait_for_leader(endpoints, 30.0)
    standbys = [e for e in endpoints if e != old]
    workload = Workload(cluster.master, 2 << 10, cluster.cluster)
    try:
        assert workload.write_until(100, "quiet", 30.0) == 100
        keys = sorted(workload.acked)
        _wait_for(lambda: all(_stats(e).objects == 100 for e in standbys), 20.0, "warm standbys")
        time.sleep(store_ttl_s + 1.0)  # the scenario itself: a quiet pool, longer than the store TTL
        [store] = cluster.stores
        cluster.signal(store, signal.SIGSTOP)  # it cannot re-mount: only the feed kept it known
        try:
            cluster.kill(next(m for m in cluster.masters if m.address == old))
            new = wait_for_leader(standbys, 20.0)
            assert new
            serving = time.monotonic()
            # Store expiry runs at least once a second on a serving leader: give it the chance to act.
            _wait_for(lambda: time.monotonic() - serving >= 1.5, 5.0, "a maintenance pass")
            assert _stats(new).objects == 100
            assert _exists(new, keys) == [True] * 100
        finally:
            cluster.signal(store, signal.SIGCONT)
        checked, good, wrong = workload.verify_until(time.monotonic(), 1.0, 20.0)
        assert (checked, good, wrong) == (100, 100, 0)
    finally:
        workload.close()
