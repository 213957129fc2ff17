"""A drain survives the loss of the leader master: SIGKILL it mid-drain; the new leader finishes the drain
(the job is a durable intent in etcd) and nothing is lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from kvpool.client.master_client import MasterClient
from kvpool.common.errors import KvPoolError
from kvpool.master.moves import MAX_IN_FLIGHT_PER_STORE
from kvpool.proto import master_pb2 as pb
from kvpool.tools.bench_failover import wait_for_leader
from kvpool.tools.etcd_process import etcd_binary
from kvpool.tools.local_cluster import LocalCluster
from tests.support.drain import Load, inventories_settled, nodes
from tests.support.wait import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.etcd, pytest.mark.integration]

HA_ARGS = ("--leader-ttl-s", "1", "--store-ttl-s", "3")


def _drain_status(client: MasterClient, node: str) -> pb.DrainJobStatus | None:
    try:
        response = client.grpc_call("DrainStatus", pb.DrainStatusRequest(node=node), timeout=2.0)
    except KvPoolError:
        return None
    job: pb.DrainJobStatus = response.jobs[0]
    return job


def test_leader_sigkill_mid_drain(make_cluster: Callable[..., LocalCluster]) -> None:
    if etcd_binary() is None and not os.environ.get("CI"):
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    cluster = make_cluster(
        stores=3, store_size="64MiB", ha=True, master_args=HA_ARGS, nodes=["node-a", "node-b", "node-c"]
    )
    load = Load(cluster.master, 8 << 10)
    drain: subprocess.Popen[str] | None = None
    try:
        load.fill(4500, "pre")
        wait_for(lambda: not inventories_settled(cluster), 30, "every store inventory to match the master")
        on_a = nodes(cluster)["node-a"]["objects"]
        assert on_a > 800
        endpoints = [m.address for m in cluster.masters]
        old = wait_for_leader(endpoints, 10.0)
        old_info = next(m for m in cluster.masters if m.address == old)
        drain = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvpool.tools.admin",
                "--master",
                cluster.master,
                "drain",
                "node-a",
                "--wait",
                "--timeout",
                "120",
                "--json",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # Kill the leader as soon as the drain is under way (some objects moved, most not).
        probe = MasterClient(old)
        seen: list[pb.DrainJobStatus | None] = [None]

        def under_way() -> bool:
            seen[0] = _drain_status(probe, "node-a")
            return seen[0] is not None and seen[0].objects_moved > 0

        wait_for(under_way, 30, "the drain to move its first objects")
        at_kill = seen[0]
        assert at_kill is not None, "the drain did not start"
        assert at_kill.objects_moved > 0, "the drain did not start"
        cluster.kill(old_info)
        killed = time.monotonic()
        assert at_kill.state == "RUNNING", "the drain ended before the kill"
        assert at_kill.objects_remaining > 0, "the drain ended before the kill"
        new = wait_for_leader(endpoints, 20.0, exclude=old)
        assert new
        assert new != old
        out, err = drain.communicate(timeout=150)
        assert drain.returncode == 0, err[-3000:]
        doc = json.loads(out)
        assert doc["status"] == "DRAINED"
        print(
            f"\ndrain across a leader SIGKILL: {at_kill.objects_moved} objects moved before the kill, "
            f"{doc['objects_moved']} in all ({doc['bytes_moved'] / 2**20:.1f} MiB) "
            f"in {doc['seconds']:.2f} s; done {time.monotonic() - killed:.2f} s after the kill"
        )
        # Moves whose copy landed just before the kill are not moved again: the new leader re-adopts the
        # copy from the target's inventory and drops the source replica. At most the moves planned per
        # target store (MAX_IN_FLIGHT_PER_STORE, 2 targets) can be in that state; everything else is moved.
        assert doc["objects_moved"] >= on_a - 2 * MAX_IN_FLIGHT_PER_STORE
        assert nodes(cluster)["node-a"]["used"] == 0
        checked, good, bad = load.verify()
        assert bad == [], f"{len(bad)} objects lost: {bad[:10]}"
        assert good == checked == 4500
        cluster.terminate(next(p for p in cluster.stores if p.node == "node-a"))
        checked, good, bad = load.verify()
        assert bad == []
        assert good == checked == 4500
    finally:
        if drain is not None and drain.poll() is None:
            drain.send_signal(signal.SIGTERM)
            drain.wait(10)
        load.close()
