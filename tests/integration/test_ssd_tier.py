"""The SSD tier with real processes: demotion past the DRAM size, reads from SSD with the right bytes,
promotion after repeated reads, and re-adoption of the SSD objects when the store restarts."""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvpool.client import PoolClient
from kvpool.common import failpoints
from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode
from kvpool.proto import frames
from kvpool.proto import master_pb2 as pb
from kvpool.tools.local_cluster import LocalCluster
from tests.support.cluster import FAST_MASTER, client, wait_for
from tests.support.drain import admin, admin_json

pytestmark = pytest.mark.integration

PAGE = 4096
DRAM = 1 << 20  # 256 pages
TIER_MASTER = (
    *FAST_MASTER,
    "--eviction-high-watermark",
    "0.7",
    "--eviction-target",
    "0.5",
    "--demote-max-pending",
    "0.5",
)


def tier_stats(pool: PoolClient) -> dict[str, float]:
    return dict(pool.stats().extra)


def replica_tiers(pool: PoolClient, keys: list[str]) -> list[list[int]]:
    """The tiers of each key's readable replicas (an admin read: no lease, no promotion)."""
    request = pb.BatchGetReplicasRequest(keys=keys, no_lease=True)
    resp = pool._master.call(frames.Op.BATCH_GET_REPLICAS, request, Deadline(10.0))
    return [sorted(d.tier for d in r.replicas) for r in resp.results]


def below_watermark(pool: PoolClient) -> bool:
    stats = pool.stats()
    return stats.used <= 0.7 * stats.capacity and not stats.extra.get("tier_tasks_pending", 0)


def fill(pool: PoolClient, values: dict[str, bytes], batch: int = 32) -> None:
    """Put in batches, each after the demotions of the last (so the figures the tests read are settled; the
    burst test below puts at full speed)."""
    keys = list(values)
    for i in range(0, len(keys), batch):
        part = keys[i : i + batch]
        assert pool.batch_put(part, [values[k] for k in part]) == [0] * len(part)
        wait_for(lambda: below_watermark(pool), 10, "demotions to catch up", interval=0.01)


@pytest.fixture
def tiered(make_cluster: Callable[..., LocalCluster], tmp_path: Path) -> tuple[LocalCluster, Any]:
    cluster = make_cluster(stores=0, master_args=TIER_MASTER)
    ssd = ("--ssd-dir", str(tmp_path / "ssd"), "--ssd-size", "16MiB")
    store = cluster.add_store(size=str(DRAM), extra=ssd)
    return cluster, store


def test_objects_past_the_dram_size_are_demoted_read_from_ssd_and_promoted(
    tiered: tuple[LocalCluster, Any],
) -> None:
    cluster, _ = tiered
    values = {f"obj-{i}": os.urandom(PAGE) for i in range(600)}  # 2.3x the DRAM
    keys = list(values)
    with client(cluster.master) as pool:
        fill(pool, values)
        stats = tier_stats(pool)
        assert stats["demotions"] >= 300
        assert stats["dram_dropped"] == 0
        assert stats["ssd_used_bytes"] >= 300 * PAGE
        assert pool.batch_exists(keys) == [1] * len(keys)  # nothing lost
        cold = [k for k, tiers in zip(keys, replica_tiers(pool, keys), strict=True) if tiers == [1]]
        assert len(cold) >= 300
        # Reads of SSD-only objects: the right bytes, over TCP from the SSD file.
        sample = cold[:40]
        assert pool.batch_get(sample) == [values[k] for k in sample]
        assert tier_stats(pool)["promotions"] == 0
        # The second read promotes them back to DRAM (still served from SSD meanwhile).
        assert pool.batch_get(sample) == [values[k] for k in sample]
        wait_for(lambda: tier_stats(pool)["promotions"] >= len(sample), 10, "promotions")
        assert all(0 in tiers for tiers in replica_tiers(pool, sample))
        assert pool.batch_get(sample) == [values[k] for k in sample]
        assert pool.metrics()["checksum_mismatches"] == 0


def test_a_restarted_store_re_adopts_its_ssd_objects(tiered: tuple[LocalCluster, Any]) -> None:
    cluster, store = tiered
    values = {f"keep-{i}": os.urandom(PAGE) for i in range(500)}
    keys = list(values)
    with client(cluster.master) as pool:
        fill(pool, values)
        on_ssd = [k for k, tiers in zip(keys, replica_tiers(pool, keys), strict=True) if 1 in tiers]
        assert len(on_ssd) >= 250
    cluster.terminate(store)  # SIGTERM: clean shutdown, unmounts both segments
    with client(cluster.master) as pool:
        wait_for(lambda: pool.batch_exists(on_ssd[:1]) == [0], 10, "the store's objects to vanish")
    started = time.monotonic()
    cluster.restart(store)
    with client(cluster.master) as pool:
        wait_for(lambda: sum(pool.batch_exists(on_ssd)) == len(on_ssd), 20, "the SSD objects to come back")
        assert pool.batch_get(on_ssd) == [values[k] for k in on_ssd]
        assert all(1 in tiers for tiers in replica_tiers(pool, on_ssd))
        # The new process serves new puts and keeps demoting.
        more = {f"after-{i}": os.urandom(PAGE) for i in range(300)}
        fill(pool, more)
        assert pool.batch_exists(list(more)) == [1] * len(more)
        assert pool.batch_get(on_ssd[:20]) == [values[k] for k in on_ssd[:20]]
    assert time.monotonic() - started < 30


def test_a_store_killed_during_a_burst_re_adopts_every_completed_demotion(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    value_bytes = 4 * PAGE
    cluster = make_cluster(stores=0, master_args=TIER_MASTER)
    ssd = ("--ssd-dir", str(tmp_path / "ssd"), "--ssd-size", "16MiB")
    store = cluster.add_store(size=str(DRAM), extra=ssd)
    values = {f"burst-{i}": os.urandom(value_bytes) for i in range(900)}  # 14x the DRAM, within the SSD
    keys = list(values)
    stop = threading.Event()
    put_codes: list[int] = []

    def burst() -> None:  # full speed: no waiting for demotions, the pool's backpressure paces it
        with client(cluster.master) as writer:
            for i in range(0, len(keys), 16):
                if stop.is_set():
                    return
                part = keys[i : i + 16]
                put_codes.extend(writer.batch_put(part, [values[k] for k in part], timeout=5.0))

    writer = threading.Thread(target=burst)
    writer.start()
    try:
        with client(cluster.master) as pool:
            wait_for(lambda: tier_stats(pool).get("demotions", 0) >= 100, 30, "100 demotions")
            assert writer.is_alive()  # the kill lands during the burst
            # Every object the master holds on SSD now had its demotion completed (and reported).
            demoted = [k for k, tiers in zip(keys, replica_tiers(pool, keys), strict=True) if 1 in tiers]
            cluster.kill(store)  # SIGKILL: no unmount, no flush
    finally:
        stop.set()
        writer.join(30)
    assert len(demoted) >= 100
    cluster.restart(store)
    with client(cluster.master) as pool:
        wait_for(lambda: sum(pool.batch_exists(demoted)) == len(demoted), 30, "the demoted objects to come back")
        assert pool.batch_get(demoted) == [values[k] for k in demoted]
        # Every other read is a miss or the right bytes (a cache may lose objects, never serve wrong bytes;
        # the dead process's DRAM objects stay listed until the master expires its segment).
        wrong = [k for k, got in zip(keys, pool.batch_get(keys), strict=True) if got is not None and got != values[k]]
        assert wrong == []


def test_admin_and_metrics_show_dram_and_ssd_apart_and_the_tier_counters(tiered: tuple[LocalCluster, Any]) -> None:
    cluster, store_info = tiered
    values = {f"seen-{i}": os.urandom(PAGE) for i in range(400)}
    with client(cluster.master) as pool:
        fill(pool, values)
        demoted = int(tier_stats(pool)["demotions"])
    assert demoted >= 100
    status = admin_json(cluster, "status")
    assert (status["capacity"], status["ssd_capacity_bytes"]) == (DRAM, 16 << 20)
    assert status["ssd_used_bytes"] >= demoted * PAGE
    assert status["used"] <= DRAM
    [node] = admin_json(cluster, "nodes")["nodes"]
    assert (node["capacity"], node["ssd_capacity"]) == (DRAM, 16 << 20)
    assert node["ssd_used"] == status["ssd_used_bytes"]
    stats = admin_json(cluster, "stats")
    assert stats["demotions"] == demoted
    assert (stats["dram_dropped"], stats["demote_pending_bytes"]) == (0, 0)
    human = admin(cluster, "status").stdout
    assert "SSD       16.0 MiB" in human
    assert f"{demoted} demoted" in human
    # Prometheus: what the dashboard's tier panels plot (k8s/grafana/kvpool-dashboard.json).
    master = scrape(cluster.masters[0].endpoints["metrics"])
    assert master["kvpool_master_demotions_total"] == demoted
    assert master["kvpool_master_ssd_capacity_bytes"] == 16 << 20
    for name in ("dram_dropped_total", "puts_backpressured_total", "promotions_total", "demote_pending_bytes"):
        assert f"kvpool_master_{name}" in master
    store = scrape(store_info.endpoints["metrics"])
    assert store["kvpool_store_ssd_written_bytes_total"] >= demoted * PAGE
    assert "kvpool_store_ssd_read_bytes_total" in store


def scrape(endpoint: str) -> dict[str, float]:
    """The unlabelled samples of a /metrics page."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as resp:
        body = resp.read().decode()
    samples: dict[str, float] = {}
    for line in body.splitlines():
        name, _, value = line.partition(" ")
        if line and not line.startswith("#") and "{" not in name:
            samples[name] = float(value)
    return samples


def test_a_burst_at_full_speed_is_held_back_not_dropped(tiered: tuple[LocalCluster, Any]) -> None:
    cluster, _ = tiered
    values = {f"fast-{i}": os.urandom(4 * PAGE) for i in range(256)}  # 4x the DRAM, no pause between puts
    keys = list(values)
    with client(cluster.master) as pool:
        for i in range(0, len(keys), 16):
            part = keys[i : i + 16]
            assert pool.batch_put(part, [values[k] for k in part], timeout=30.0) == [0] * len(part)
        stats = tier_stats(pool)
        assert stats["puts_backpressured"] > 0  # the puts outran the disk and were held back
        assert (stats["dram_dropped"], stats["dram_dropped_urgent"]) == (0, 0)
        assert pool.metrics()["put_backlog_retries"] > 0
        assert pool.batch_exists(keys) == [1] * len(keys)
        assert pool.batch_get(keys) == [values[k] for k in keys]


def test_a_put_held_back_by_a_slow_disk_fails_at_its_deadline_and_drops_nothing(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    slow_disk = {"KVPOOL_FAILPOINTS": f"{failpoints.STORE_TIER_BEFORE_WRITE}=sleep:3"}
    cluster = make_cluster(stores=0, master_args=TIER_MASTER, env=slow_disk)
    cluster.add_store(size=str(DRAM), extra=("--ssd-dir", str(tmp_path / "ssd"), "--ssd-size", "16MiB"))
    values = {f"slow-{i}": os.urandom(4 * PAGE) for i in range(160)}  # 2.5x the DRAM
    keys = list(values)
    with client(cluster.master) as pool:
        accepted: list[str] = []
        refused: list[str] = []
        for i in range(0, len(keys), 8):
            part = keys[i : i + 8]
            started = time.monotonic()
            codes = pool.batch_put(part, [values[k] for k in part], timeout=0.5)
            elapsed = time.monotonic() - started
            # Held back to its deadline: DEMOTION_BACKLOG, or TIMEOUT when the deadline cut a master call short
            # (a loaded CI machine); never a drop or another failure.
            assert set(codes) <= {0, ErrorCode.DEMOTION_BACKLOG, ErrorCode.TIMEOUT}
            accepted += [k for k, c in zip(part, codes, strict=True) if c == 0]
            refused = [k for k, c in zip(part, codes, strict=True) if c != 0]
            if refused:
                break
        assert refused  # held back while the disk sleeps...
        assert elapsed < 0.5 + 1.0  # ...but no longer than the put's deadline (+ slack)
        assert tier_stats(pool)["dram_dropped"] == 0
        # Once the batch reaches the disk, the same puts go through; nothing was dropped meanwhile.
        wait_for(
            lambda: pool.batch_put(refused, [values[k] for k in refused], timeout=0.5) == [0] * len(refused),
            30,
            "the held-back puts to go through",
        )
        stored = accepted + refused
        # Every acknowledged put reads back at once, with its bytes: a put whose start timed out at the client
        # but ran at the master is revoked and asked again, never acknowledged on that orphaned start
        # (tests/integration/test_put_unanswered.py), and a read after a put with a spent deadline gets its
        # own full timeout (tests/unit/test_client_unanswered.py).
        assert pool.batch_get(stored) == [values[k] for k in stored]
        assert tier_stats(pool)["dram_dropped"] == 0


def test_the_drop_coldest_burst_policy_never_holds_a_put_back_and_counts_every_drop(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    slow_disk = {"KVPOOL_FAILPOINTS": f"{failpoints.STORE_TIER_BEFORE_WRITE}=sleep:1"}
    policy = ("--ssd-burst-policy", "drop-coldest")
    cluster = make_cluster(stores=0, master_args=(*TIER_MASTER, *policy), env=slow_disk)
    cluster.add_store(size=str(DRAM), extra=("--ssd-dir", str(tmp_path / "ssd"), "--ssd-size", "16MiB"))
    values = {f"cold-{i}": os.urandom(4 * PAGE) for i in range(160)}  # 2.5x the DRAM, faster than the disk
    keys = list(values)
    with client(cluster.master) as pool:
        for i in range(0, len(keys), 8):
            part = keys[i : i + 8]
            assert pool.batch_put(part, [values[k] for k in part], timeout=5.0) == [0] * len(part)
        assert pool.metrics()["put_backlog_retries"] == 0  # never held back...
        stats = tier_stats(pool)
        assert stats["burst_dropped"] > 0  # ...the coldest objects were dropped instead, and counted
        assert stats["puts_backpressured"] == 0
        got = pool.batch_get(keys)
        assert [k for k, g in zip(keys, got, strict=True) if g is not None and g != values[k]] == []
        lost = sum(1 for g in got if g is None)
        assert lost == tier_stats(pool)["dram_dropped"]  # every object lost is a counted drop
        assert got[-8:] == [values[k] for k in keys[-8:]]  # the newest survive: the coldest go first
    assert admin_json(cluster, "stats")["burst_dropped"] == stats["burst_dropped"]
    assert (
        scrape(cluster.masters[0].endpoints["metrics"])["kvpool_master_burst_dropped_total"] == stats["burst_dropped"]
    )
