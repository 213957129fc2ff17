"""High availability under faults: real etcd, three real master processes, real stores and clients."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import asdict

import pytest

from kvpool.common.errors import ErrorCode
from kvpool.proto import frames
from kvpool.proto import master_pb2 as pb
from kvpool.tools.bench_failover import Workload, run_failover, serving_leader, wait_for_leader
from kvpool.tools.etcd_process import etcd_binary
from kvpool.tools.local_cluster import LocalCluster
from tests.support.drain import inventories_settled
from tests.support.wait import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.etcd, pytest.mark.integration]

# Test-sized timings: leader lease 1 s (+1 s warm-up), store expiry 3 s.
HA_ARGS = ("--leader-ttl-s", "1", "--store-ttl-s", "3")


@pytest.fixture
def ha_cluster(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    if etcd_binary() is None and not os.environ.get("CI"):
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    return make_cluster(stores=2, store_size="64MiB", ha=True, master_args=HA_ARGS)


@pytest.mark.usefixtures("data_path")
def test_leader_sigkill_under_load(ha_cluster: LocalCluster) -> None:
    result = run_failover(ha_cluster, fault="sigkill")
    print(f"\nfailover after SIGKILL of the leader: {asdict(result)}")
    assert result.wrong_reads == 0
    assert result.new_leader
    assert result.new_leader != result.old_leader
    assert result.seconds_to_new_leader < 4.0, "test-sized failover must serve within 4 s"
    assert result.seconds_to_first_read < 4.0
    assert result.recovered_fraction >= 0.99


def test_all_masters_killed_and_restarted(ha_cluster: LocalCluster) -> None:
    workload = Workload(ha_cluster.master, 8 << 10)
    try:
        workload.write(300, "all")
        written = time.monotonic()
        wait_for(lambda: not inventories_settled(ha_cluster), 30, "every store inventory to match the master")
        masters = list(ha_cluster.masters)
        for master in masters:
            ha_cluster.kill(master)
        t0 = time.monotonic()
        restarted = [ha_cluster.restart(m) for m in masters]
        leader = wait_for_leader([m.address for m in restarted], 30.0)
        assert leader
        checked, good, wrong = workload.verify_until(written, 0.99, 20.0)
        print(
            f"\nall masters restarted: leader after {time.monotonic() - t0:.2f} s, "
            f"{good}/{checked} objects back, {wrong} wrong"
        )
        assert wrong == 0
        assert checked == 300
        assert good >= 0.99 * checked
    finally:
        workload.close()


def test_frozen_etcd_member_does_not_stop_the_cluster(etcd3: object, make_cluster: Callable[..., LocalCluster]) -> None:
    # The default leader lease (3 s): an etcd member that stops answering costs a client one attempt
    # timeout before it moves on, which a 1 s lease would not survive.
    cluster = make_cluster(
        stores=1,
        store_size="32MiB",
        ha=True,
        master_args=("--store-ttl-s", "3"),
        etcd_endpoints=etcd3.endpoints,
    )  # type: ignore[attr-defined]
    workload = Workload(cluster.master, 4 << 10)
    try:
        assert workload.write_until(50, "pre", 20.0) == 50
        frozen = 0  # every kvpool etcd client talks to the first endpoint until it fails
        etcd3.stop(frozen)  # type: ignore[attr-defined]
        try:
            started = time.monotonic()
            acked = workload.write_until(100, "during", 20.0)
            seconds = time.monotonic() - started
            leader = wait_for_leader([m.address for m in cluster.masters], 15.0)
            checked, good, wrong = workload.verify(time.monotonic())
            print(
                f"\netcd member frozen: 100 writes acknowledged in {seconds:.2f} s, {good}/{checked} objects "
                f"readable, {workload.failed} failed calls, leader {leader}"
            )
            assert acked == 100, "the cluster stopped serving writes while one etcd member was frozen"
            assert leader, "no serving leader while one etcd member is frozen"
            assert wrong == 0
            assert good == checked
        finally:
            etcd3.cont(frozen)  # type: ignore[attr-defined]
    finally:
        workload.close()


def _raw_call(endpoint: str, op: frames.Op, request: object) -> pb.BatchExistsResponse:
    host, port = endpoint.rsplit(":", 1)
    body = request.SerializeToString()  # type: ignore[attr-defined]
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(frames.pack_header(op, 1, len(body)) + body)
        head = frames.recv_header(sock)
        return pb.BatchExistsResponse.FromString(bytes(frames.recv_exact(sock, head.length)))


def test_deposed_leader_that_comes_back_cannot_be_acted_on(ha_cluster: LocalCluster) -> None:
    workload = Workload(ha_cluster.master, 4 << 10)
    try:
        assert workload.write_until(100, "before", 20.0) == 100
        endpoints = [m.address for m in ha_cluster.masters]
        old = wait_for_leader(endpoints, 10.0)
        old_info = next(m for m in ha_cluster.masters if m.address == old)
        old_rpc = old_info.endpoints["rpc"]
        ha_cluster.signal(old_info, signal.SIGSTOP)
        try:
            new = wait_for_leader(endpoints, 15.0, exclude=old)
            assert new
            assert workload.write_until(100, "after", 20.0) == 100  # once the stores have re-mounted
            new_view = workload.client.stats().status.view
        finally:
            ha_cluster.signal(old_info, signal.SIGCONT)
        # The resumed old leader must refuse data calls at once (its lease is locally known to be gone).
        response = _raw_call(old_rpc, frames.Op.BATCH_EXISTS, pb.BatchExistsRequest(keys=["before-0"]))
        assert response.status.code == ErrorCode.NOT_LEADER, response.status
        assert response.status.view < new_view
        # A client that has seen the new view refuses anything older; all data stays correct.
        assert not workload.client._master._accept_view(response.status.view)
        assert serving_leader(endpoints) == new
        checked, good, wrong = workload.verify_until(time.monotonic(), 1.0, 20.0)
        assert wrong == 0
        assert good == checked == 200
    finally:
        workload.close()
