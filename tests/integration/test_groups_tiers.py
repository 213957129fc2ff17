"""Shard groups (decision 0080) with the store's other paths: one-sided RDMA through the cross-process FAKE
NIC (KVPOOL_VERBS=fake in store and client) to every group's segment, and the SSD tier split into one share
per group (decision 0081), demoted, read back and re-adopted per group after the store is killed."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvpool.common.clock import Deadline
from kvpool.proto import frames
from kvpool.proto import master_pb2 as pb
from kvpool.tools.etcd_process import etcd_binary
from kvpool.tools.local_cluster import LocalCluster
from kvpool.transfer.rdma_wire import fetch_store_info
from kvpool.transfer.verbs_fake_ipc import IpcFakeFabric
from tests.support.cluster import FAST_MASTER, client, wait_for

pytestmark = [pytest.mark.etcd, pytest.mark.integration]

GROUP_MASTER = ("--leader-ttl-s", "1")
TIER_MASTER = (
    *FAST_MASTER,
    *GROUP_MASTER,
    "--eviction-high-watermark",
    "0.7",
    "--eviction-target",
    "0.5",
    "--demote-max-pending",
    "0.5",
)
VALUE = 16 << 10


def _two_groups(tmp_path: Path, master_args: tuple[str, ...]) -> LocalCluster:
    if etcd_binary() is None and not os.environ.get("CI"):
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    cluster = LocalCluster(
        stores=0, base_dir=tmp_path / "cluster", ha=True, masters=1, groups=2, master_args=master_args
    )
    return cluster.start()


@pytest.fixture
def fake_nic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    directory = tmp_path / "fake-nic"
    monkeypatch.setenv("KVPOOL_VERBS", "fake")
    monkeypatch.setenv("KVPOOL_FAKE_VERBS_DIR", str(directory))
    return directory


def _replica_segments(pool: Any, keys: list[str]) -> set[int]:
    resp = pool._master.call(
        frames.Op.BATCH_GET_REPLICAS, pb.BatchGetReplicasRequest(keys=keys, no_lease=True), Deadline(10.0)
    )
    return {d.segment_id for r in resp.results for d in r.replicas}


def _health(store: Any) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{store.endpoints['metrics']}/health", timeout=10) as resp:
        return dict(json.loads(resp.read()))


def test_a_two_group_store_moves_the_bytes_of_both_groups_over_rdma(fake_nic: Path, tmp_path: Path) -> None:
    cluster = _two_groups(tmp_path, GROUP_MASTER)
    try:
        store = cluster.add_store(size="16MiB")
        values = {f"rdma-{i}": os.urandom(size) for i, size in enumerate([1, 4096, 65536, 1 << 20] * 3)}
        keys = list(values)
        with client(cluster.master) as pool:
            assert {pool.group_of(k) for k in keys} == {0, 1}
            before = IpcFakeFabric.total_bytes_moved
            assert pool.batch_put(keys, list(values.values())) == [0] * len(keys)
            assert pool.batch_get(keys) == list(values.values())
            metrics = pool.metrics()
            used_segments = _replica_segments(pool, keys)
        payload = sum(len(v) for v in values.values())
        assert (metrics["bytes_rdma"], metrics["bytes_tcp"]) == (2 * payload, 0)
        assert IpcFakeFabric.total_bytes_moved - before == 2 * payload
        info = fetch_store_info(store.endpoints["tcp"])
        served = sorted(s["id"] for s in info["segments"])
        assert len(served) == 2
        assert info["rdma"]["segments"] == served  # the primary's responder registered both groups' segments
        assert used_segments == set(served)  # the keys of each group landed in (and came from) its own segment
    finally:
        cluster.stop()


def _ssd_tiers(pool: Any, keys: list[str]) -> list[list[int]]:
    resp = pool._master.call(
        frames.Op.BATCH_GET_REPLICAS, pb.BatchGetReplicasRequest(keys=keys, no_lease=True), Deadline(10.0)
    )
    return [sorted(d.tier for d in r.replicas) for r in resp.results]


def _settled(pool: Any) -> bool:
    stats = pool.stats()
    return bool(stats.used <= 0.7 * stats.capacity and not stats.extra.get("tier_tasks_pending", 0))


def test_each_group_demotes_to_its_own_ssd_share_and_re_adopts_it_after_a_kill(tmp_path: Path) -> None:
    cluster = _two_groups(tmp_path, TIER_MASTER)
    try:
        ssd = tmp_path / "ssd"
        store = cluster.add_store(size="4MiB", extra=("--ssd-dir", str(ssd), "--ssd-size", "16MiB"))
        health = _health(store)
        assert health["mounted"] is True
        assert [(g["group"], g["mounted"]) for g in health["groups"]] == [(0, True), (1, True)]
        assert all(g["ssd_segment_id"] for g in health["groups"])
        values = {f"tier-{i}": os.urandom(VALUE) for i in range(360)}  # 5.6 MiB: past the 4 MiB of DRAM
        keys = list(values)
        with client(cluster.master) as pool:
            for i in range(0, len(keys), 24):
                part = keys[i : i + 24]
                assert pool.batch_put(part, [values[k] for k in part]) == [0] * len(part)
                wait_for(lambda: _settled(pool), 20, "demotions to catch up", interval=0.02)
            on_ssd = [k for k, tiers in zip(keys, _ssd_tiers(pool, keys), strict=True) if 1 in tiers]
            assert {pool.group_of(k) for k in on_ssd} == {0, 1}  # each group demoted into its own share
            assert pool.batch_get(on_ssd) == [values[k] for k in on_ssd]
        assert sorted(p.name for p in ssd.iterdir()) == ["group-0", "group-1"]

        cluster.kill(store)
        cluster.restart(store)
        with client(cluster.master) as pool:
            wait_for(lambda: sum(pool.batch_exists(on_ssd)) == len(on_ssd), 30, "every group's SSD objects")
            assert all(1 in tiers for tiers in _ssd_tiers(pool, on_ssd))
            assert pool.batch_get(on_ssd) == [values[k] for k in on_ssd]
    finally:
        cluster.stop()
