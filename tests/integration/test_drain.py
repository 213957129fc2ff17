"""Drain, undrain, scale-in, scale-out + rebalance and the operator commands, with real processes.

The drain runs under a continuous read/write load: every read is checked byte for byte, no read may fail
because of the drain, and after the drained store is stopped every acknowledged object must still be
readable with its bytes.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool.tools.local_cluster import LocalCluster
from tests.support.cluster import wait_for
from tests.support.drain import Load, admin, admin_json, nodes

pytestmark = pytest.mark.integration

# Short store expiry and read leases, so a drain's last retired ranges are freed within seconds.
MASTER = ("--store-ttl-s", "3", "--eviction-interval-s", "0.02", "--lease-ttl-s", "2")
VALUE = 16 << 10


def _cluster(make: Callable[..., LocalCluster], names: list[str], size: str = "64MiB") -> LocalCluster:
    return make(stores=len(names), store_size=size, nodes=names, master_args=MASTER)


def _store(cluster: LocalCluster, node: str) -> object:
    return next(p for p in cluster.stores if p.node == node)


def _moves_in_flight(cluster: LocalCluster) -> float:
    """The master's ``kvpool_drain_moves_in_flight`` gauge."""
    metrics_url = f"http://{cluster.masters[0].endpoints['metrics']}/metrics"
    with urllib.request.urlopen(metrics_url, timeout=10) as answer:
        lines = answer.read().decode().splitlines()
    return next(float(line.split()[-1]) for line in lines if line.startswith("kvpool_drain_moves_in_flight "))


@pytest.mark.usefixtures("data_path")
def test_drain_under_load_loses_nothing(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = _cluster(make_cluster, ["node-a", "node-b", "node-c"])
    load = Load(cluster.master, VALUE)
    try:
        load.fill(1500, "pre")
        before = nodes(cluster)["node-a"]
        assert before["objects"] > 300, before
        load.start()
        wait_for(lambda: load.reads >= 50 and load.writes >= 16, 30, "the load to be under way")
        started = time.monotonic()
        result = admin(cluster, "drain", "node-a", "--wait", "--timeout", "120", "--json")
        wall = time.monotonic() - started
        reads, writes = load.reads, load.writes  # reads and writes keep going after the drain too
        wait_for(lambda: load.reads >= reads + 50 and load.writes >= writes + 16, 30, "the load after the drain")
        load.stop()
        assert result.returncode == 0, result.stderr
        doc = json.loads(result.stdout)
        assert set(doc) == {"node", "status", "objects_moved", "bytes_moved", "seconds"}
        assert doc["node"] == "node-a"
        assert doc["status"] == "DRAINED"
        assert doc["objects_moved"] >= before["objects"]
        assert doc["bytes_moved"] >= doc["objects_moved"] * VALUE
        assert "objects" in result.stderr  # the progress lines
        print(
            f"\ndrain of node-a under load: {doc['objects_moved']} objects, "
            f"{doc['bytes_moved'] / 2**20:.1f} MiB in {doc['seconds']:.2f} s "
            f"({doc['objects_moved'] / max(doc['seconds'], 1e-6):.0f} objects/s, "
            f"{doc['bytes_moved'] / 2**20 / max(doc['seconds'], 1e-6):.1f} MiB/s; admin wall {wall:.2f} s);"
            " "
            f"load: {load.reads} reads, {load.writes} writes during the run"
        )
        assert load.wrong == 0
        assert load.read_failures == 0, f"reads failed during the drain: {load.failed_keys[:10]}"
        assert load.write_failures == 0
        after = nodes(cluster)["node-a"]
        assert (after["status"], after["objects"], after["used"]) == ("DRAINED", 0, 0)

        # The master's metrics show the drain.
        metrics_url = f"http://{cluster.masters[0].endpoints['metrics']}/metrics"
        text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
        assert f'kvpool_drain_objects_moved_total{{node="node-a"}} {float(doc["objects_moved"])}' in text
        assert 'kvpool_drain_bytes_moved_total{node="node-a"}' in text
        assert 'kvpool_drain_remaining_objects{node="node-a"} 0.0' in text

        # Stop the drained store (SIGTERM: it unmounts): nothing acknowledged is lost.
        cluster.terminate(_store(cluster, "node-a"))  # type: ignore[arg-type]
        checked, good, bad = load.verify()
        assert checked > 1500
        assert bad == [], f"{len(bad)} objects lost: {bad[:10]}"
        assert good == checked
        assert "node-a" not in nodes(cluster)
    finally:
        load.close()


def test_undrain_reopens_the_node(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = _cluster(make_cluster, ["node-a", "node-b"])
    load = Load(cluster.master, VALUE)
    try:
        load.fill(600, "pre")
        started = admin_json(cluster, "drain", "node-a")
        assert started["node"] == "node-a"
        assert started["status"] in ("RUNNING", "DRAINED")
        status = admin_json(cluster, "drain-status")
        assert [j["node"] for j in status["jobs"]] == ["node-a"]
        cancelled = admin_json(cluster, "undrain", "node-a")
        assert cancelled["status"] == "CANCELLED"
        assert nodes(cluster)["node-a"]["status"] == "OK"
        assert admin(cluster, "drain-status", "node-a").returncode == 2  # no such job
        assert admin(cluster, "undrain", "node-a").returncode == 2
        # Moves a store was running finish; everything stays readable, and the node takes puts again.
        wait_for(lambda: _moves_in_flight(cluster) == 0, 30, "the cancelled drain's moves to finish")
        checked, good, bad = load.verify()
        assert bad == []
        assert good == checked == 600
        objects = nodes(cluster)["node-a"]["objects"]
        wait_for(
            lambda: (
                load.write([f"after-{time.monotonic_ns()}" for _ in range(8)])
                and nodes(cluster)["node-a"]["objects"] > objects
            ),
            20,
            "a put on the undrained node",
        )
    finally:
        load.close()


def test_scale_in_drains_then_unmounts(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = _cluster(make_cluster, ["node-a", "node-b", "node-c"])
    load = Load(cluster.master, VALUE)
    try:
        load.fill(900, "pre")
        assert nodes(cluster)["node-c"]["objects"] > 0
        result = admin(cluster, "scale-in", "node-c", "--timeout", "120", "--json")
        assert result.returncode == 0, result.stderr
        doc = json.loads(result.stdout)
        assert doc["status"] == "REMOVED"
        assert doc["objects_moved"] > 0
        assert "may stop" in result.stderr
        # Unmounted; if the store process keeps running it re-mounts as DRAINED, never takes objects.
        node_c = nodes(cluster).get("node-c")
        assert node_c is None or (node_c["status"] in ("DRAINING", "DRAINED") and node_c["used"] == 0)
        cluster.terminate(_store(cluster, "node-c"))  # type: ignore[arg-type]
        wait_for(lambda: "node-c" not in nodes(cluster), 20, "node-c to leave")
        checked, good, bad = load.verify()
        assert bad == []
        assert good == checked == 900
        print(f"\nscale-in of node-c: {doc['objects_moved']} objects in {doc['seconds']:.2f} s")
    finally:
        load.close()


def test_scale_out_fills_the_new_store_first_then_rebalance(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = _cluster(make_cluster, ["node-a"])
    load = Load(cluster.master, VALUE)
    try:
        load.fill(1200, "pre")  # ~30% of node-a
        # Draining the only node cannot work: --wait says so (exit 1) instead of hanging.
        stuck = admin(cluster, "drain", "node-a", "--wait", "--timeout", "30")
        assert stuck.returncode == 1, stuck.stderr
        assert "no other segment takes allocations" in stuck.stderr
        admin_json(cluster, "undrain", "node-a")

        cluster.add_store(node="node-b")
        wait_for(lambda: "node-b" in nodes(cluster), 20, "node-b to mount")
        before = nodes(cluster)
        load.fill(64, "new")
        after = nodes(cluster)
        # Free-ratio-first placement: every new object went to the empty store.
        assert after["node-b"]["objects"] - before["node-b"]["objects"] == 64
        assert after["node-a"]["objects"] == before["node-a"]["objects"]

        doc = admin_json(cluster, "rebalance", "--timeout", "120")
        assert doc["status"] == "DONE", doc
        assert doc["objects_moved"] > 0
        assert doc["spread_before"] > 0.2
        assert doc["spread"] <= 0.05
        wait_for(lambda: _spread(cluster) <= 0.06, 20, "used fractions to even out (leases of moved ranges)")
        checked, good, bad = load.verify()
        assert bad == []
        assert good == checked == 1264
        print(
            f"\nrebalance: {doc['objects_moved']} objects in {doc['seconds']:.2f} s, spread "
            f"{doc['spread_before']:.3f} -> {doc['spread']:.3f}"
        )
    finally:
        load.close()


def _spread(cluster: LocalCluster) -> float:
    fractions = [n["used"] / n["capacity"] for n in nodes(cluster).values()]
    return max(fractions) - min(fractions)


def test_admin_commands_json_and_exit_codes(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = _cluster(make_cluster, ["node-a", "node-b"], size="32MiB")
    load = Load(cluster.master, 4 << 10)
    try:
        load.fill(50, "k")
        status = admin_json(cluster, "status")
        keys = {"leader", "role", "stores", "segments", "capacity", "used", "objects", "hit_rate"}
        assert keys <= set(status)
        assert status["stores"] == 2
        assert status["objects"] == 50
        doc = admin_json(cluster, "nodes")
        assert [n["node"] for n in doc["nodes"]] == ["node-a", "node-b"]
        for n in doc["nodes"]:
            assert {"node", "segments", "status", "capacity", "used", "objects"} <= set(n)
        stats = admin_json(cluster, "stats")
        assert stats["objects"] == 50
        assert stats["puts"] == 50
        leader = admin_json(cluster, "leader")
        assert set(leader) == {"leader", "view", "followers", "masters"}
        assert leader["leader"] == cluster.masters[0].address
        human = admin(cluster, "nodes")
        assert human.returncode == 0
        assert "NODE" in human.stdout
        assert "node-b" in human.stdout
        assert admin_json(cluster, "drain-status") == {"jobs": []}
        # Bad arguments and unknown names: exit 2 with a message.
        assert admin(cluster, "drain").returncode == 2
        unknown = admin(cluster, "drain", "no-such-node")
        assert unknown.returncode == 2
        assert "no-such-node" in unknown.stderr
        assert admin(cluster, "evict", "--prefix", "k").returncode == 0
        assert admin_json(cluster, "stats")["objects"] == 0
    finally:
        load.close()


def test_drain_moves_ssd_tier_objects_too(make_cluster: Callable[..., LocalCluster], tmp_path: Path) -> None:
    # A 1 MiB DRAM segment and a 16 MiB SSD tier on node-a: most objects end up SSD-only (demoted).
    master = (
        *MASTER,
        "--eviction-high-watermark",
        "0.7",
        "--eviction-target",
        "0.5",
        "--demote-max-pending",
        "0.5",
    )
    cluster = make_cluster(stores=0, master_args=master)
    cluster.add_store(size="1MiB", node="node-a", extra=("--ssd-dir", str(tmp_path / "ssd"), "--ssd-size", "16MiB"))
    load = Load(cluster.master, 4096)
    try:
        for start in range(0, 600, 32):
            load.fill(32, f"p{start}")
            wait_for(lambda: _demoted(load), 10, "demotions to catch up", interval=0.01)
        ssd_only = sum(1 for t in _tiers(load, sorted(load.acked)) if t == [1])
        assert ssd_only >= 300
        cluster.add_store(size="64MiB", node="node-b")
        wait_for(lambda: "node-b" in nodes(cluster), 20, "node-b to mount")
        doc = admin_json(cluster, "drain", "node-a", "--wait", "--timeout", "120")
        assert doc["status"] == "DRAINED"
        total = len(load.acked)
        assert doc["objects_moved"] >= total
        segments = [s for s in load.client.stats().segments if s.node == "node-a"]
        assert sorted(s.tier for s in segments) == [0, 1]
        assert all(s.used == 0 for s in segments)
        assert all(t == [0] for t in _tiers(load, sorted(load.acked)))  # now in node-b's DRAM
        cluster.terminate(_store(cluster, "node-a"))  # type: ignore[arg-type]
        checked, good, bad = load.verify()
        assert bad == []
        assert good == checked == total
        print(
            f"\ndrain with an SSD tier: {ssd_only} of {total} objects were SSD-only; "
            f"{doc['objects_moved']} moved in {doc['seconds']:.2f} s"
        )
    finally:
        load.close()


def _demoted(load: Load) -> bool:
    stats = load.client.stats()
    return stats.used <= 0.7 * stats.capacity and not stats.extra.get("tier_tasks_pending", 0)


def _tiers(load: Load, keys: list[str]) -> list[list[int]]:
    from kvpool.common.clock import Deadline
    from kvpool.proto import frames
    from kvpool.proto import master_pb2 as pb

    out: list[list[int]] = []
    for start in range(0, len(keys), 256):
        request = pb.BatchGetReplicasRequest(keys=keys[start : start + 256], no_lease=True)
        resp = load.client._master.call(frames.Op.BATCH_GET_REPLICAS, request, Deadline(10.0))
        out += [sorted(d.tier for d in r.replicas) for r in resp.results]
    return out
