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


def test_drain_under_load_loses_nothing(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = _cluster(make_cluster, ["node-a", "node-b", "node-c"])
    load = Load(cluster.master, VALUE)
    try:
        load.fill(1500, "pre")
        before = nodes(cluster)["node-a"]
        assert before["objects"] > 300, before
        load.start()
        time.sleep(0.5)
        started = time.monotonic()
        result = admin(cluster, "drain", "node-a", "--wait", "--timeout", "120", "--json")
        wall = time.monotonic() - started
        time.sleep(0.5)  # reads and writes keep going after the drain too
        load.stop()
        assert result.returncode == 0, result.stderr
        doc = json.loads(result.stdout)
        assert set(doc) == {"node", "status", "objects_moved", "bytes_moved", "seconds"}
        assert doc["node"] == "node-a"
        assert doc["status"] == "DRAINED"
        assert doc["objects_moved"] >= before["objects"]
        assert doc["bytes_moved"] >= doc["objects_moved"] * VALUE
        assert "objects" in result.stderr  # the progress lines
        print(f"\ndrain of node-a under load: {doc['objects_moved']} objects, "
              f"{doc['bytes_moved'] / 2**20:.1f} MiB in {doc['seconds']:.2f} s "
              f"({doc['objects_moved'] / max(doc['seconds'], 1e-6):.0f} objects/s, "
              f"{doc['bytes_moved'] / 2**20 / max(doc['seconds'], 1e-6):.1f} MiB/s; admin wall {wall:.2f} s); "
              f"load: {load.reads} reads, {load.writes} writes during the run")
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
        time.sleep(0.5)
        checked, good, bad = load.verify()
        assert bad == [] and good == checked == 600
        objects = nodes(cluster)["node-a"]["objects"]
        wait_for(lambda: load.write([f"after-{time.monotonic_ns()}" for _ in range(8)]) and
                 nodes(cluster)["node-a"]["objects"] > objects, 20, "a put on the undrained node")
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
        assert bad == [] and good == checked == 900
        print(f"\nscale-in of node-c: {doc['objects_moved']} objects in {doc['seconds']:.2f} s")
    finally:
        load.close()


def test_scale_out_fills_the_new_store_first_then_rebalance(make_cluster: Callable[..., LocalCluster]) -> None:
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
        assert bad == [] and good == checked == 1264
        print(f"\nrebalance: {doc['objects_moved']} objects in {doc['seconds']:.2f} s, spread "
              f"{doc['spread_before']:.3f} -> {doc['spread']:.3f}")
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
        assert {"leader", "role", "stores", "segments", "capacity", "used", "objects", "hit_rate"} <= set(status)
        assert status["stores"] == 2 and status["objects"] == 50
        doc = admin_json(cluster, "nodes")
        assert [n["node"] for n in doc["nodes"]] == ["node-a", "node-b"]
        for n in doc["nodes"]:
            assert {"node", "segments", "status", "capacity", "used", "objects"} <= set(n)
        stats = admin_json(cluster, "stats")
        assert stats["objects"] == 50 and stats["puts"] == 50
        leader = admin_json(cluster, "leader")
        assert set(leader) == {"leader", "view", "followers"}
        assert leader["leader"] == cluster.masters[0].address
        human = admin(cluster, "nodes")
        assert human.returncode == 0 and "NODE" in human.stdout and "node-b" in human.stdout
        assert admin_json(cluster, "drain-status") == {"jobs": []}
        # Bad arguments and unknown names: exit 2 with a message.
        assert admin(cluster, "drain").returncode == 2
        unknown = admin(cluster, "drain", "no-such-node")
        assert unknown.returncode == 2 and "no-such-node" in unknown.stderr
        assert admin(cluster, "evict", "--prefix", "k").returncode == 0
        assert admin_json(cluster, "stats")["objects"] == 0
    finally:
        load.close()
