"""Shard groups over real processes (decision 0080): etcd, one master per group, stores that mount a
segment to each group; a client, a master or a store that disagrees on the group count is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.client import ClientConfig, PoolClient
from kvpool.client.master_client import MasterClient
from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.groups import group_of
from kvpool.proto import frames
from kvpool.proto import master_pb2 as pb
from kvpool.tools import admin
from kvpool.tools.etcd_process import etcd_binary
from kvpool.tools.local_cluster import LocalCluster
from tests.support.cluster import client

pytestmark = [pytest.mark.etcd, pytest.mark.integration]


@pytest.fixture(scope="module")
def groups2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    if etcd_binary() is None and not os.environ.get("CI"):
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    cluster = LocalCluster(
        stores=2,
        store_size="32MiB",
        base_dir=tmp_path_factory.mktemp("groups2"),
        ha=True,
        masters=1,
        groups=2,
        master_args=("--leader-ttl-s", "1"),
    )
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def test_keys_of_both_groups_are_stored_and_read_back(groups2: LocalCluster) -> None:
    keys = [f"integ-{i}" for i in range(120)]
    values = [os.urandom(100 + i) for i in range(120)]
    with client(groups2.master) as pool:
        assert pool.groups == 2
        assert {pool.group_of(k) for k in keys} == {0, 1}
        assert pool.batch_put(keys, values) == [0] * len(keys)
        assert pool.batch_get(keys) == values
        assert pool.batch_exists([*keys[:3], "integ-missing"]) == [1, 1, 1, 0]
        assert pool.prefix_length([*keys[:70], "integ-missing", *keys[70:]]) == 70
        stats = pool.stats()
        assert stats.objects >= len(keys)
        assert len(stats.segments) == 4  # each store mounted one segment to each group
        assert pool.batch_remove(keys, force=True) == [0] * len(keys)  # force: the reads above hold leases
        assert pool.batch_exists(keys) == [0] * len(keys)


def test_each_group_master_holds_only_its_keys(groups2: LocalCluster) -> None:
    keys = [f"own-{i}" for i in range(40)]
    with client(groups2.master) as pool:
        assert pool.batch_put(keys, [b"x" * 64] * len(keys)) == [0] * len(keys)
    for group in (0, 1):
        (master,) = groups2.group_masters(group)
        link = MasterClient(master.address, group=(group, 2))
        try:
            mine = [k for k in keys if group_of(k, 2) == group]
            answer = link.call(frames.Op.BATCH_EXISTS, pb.BatchExistsRequest(keys=mine), Deadline(5.0))
            assert all(answer.exists)
            other = [k for k in keys if group_of(k, 2) != group][:1]
            with pytest.raises(KvPoolError) as err:
                link.call(frames.Op.BATCH_EXISTS, pb.BatchExistsRequest(keys=other), Deadline(5.0))
            assert err.value.code == ErrorCode.WRONG_GROUP
            assert f"belongs to shard group {1 - group} of 2" in err.value.message
            # A put checks every key: one stray key at the end of a batch refuses the whole batch.
            stray = [f"stray-{group}-{i}" for i in range(40) if group_of(f"stray-{group}-{i}", 2) == group][:20]
            stray += other
            put = pb.BatchPutStartRequest(client_id="t", keys=stray, sizes=[8] * len(stray))
            with pytest.raises(KvPoolError) as err:
                link.call(frames.Op.BATCH_PUT_START, put, Deadline(5.0))
            assert err.value.code == ErrorCode.WRONG_GROUP
        finally:
            link.close()


def test_a_client_that_counts_other_groups_is_refused(groups2: LocalCluster) -> None:
    (master,) = groups2.group_masters(1)
    with client(master.address) as direct:  # one group's master, as if it were the whole cluster
        assert direct.batch_exists(["a", "b"]) == [ErrorCode.GROUP_MISMATCH] * 2
        with pytest.raises(KvPoolError) as err:
            direct.stats()
        assert err.value.code == ErrorCode.GROUP_MISMATCH
        assert "serves group 1 of 2" in err.value.message
    with pytest.raises(KvPoolError) as err:
        PoolClient(config=ClientConfig(master=groups2.master, groups=3))
    assert err.value.code == ErrorCode.GROUP_MISMATCH
    assert "has 2" in err.value.message


def test_a_master_started_with_another_group_count_exits(groups2: LocalCluster, tmp_path: Path) -> None:
    args = ["--etcd", ",".join(groups2.etcd_endpoints), "--port", "0", "--groups", "3", "--group", "0"]
    run = subprocess.run(
        [sys.executable, "-m", "kvpool.tools.cli", "master", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode != 0
    assert "GROUP_MISMATCH" in run.stderr
    assert "has 2 master group(s)" in run.stderr


def test_local_status_names_each_masters_group(groups2: LocalCluster) -> None:
    status = json.loads((groups2.base_dir / "cluster.json").read_text())
    assert status["groups"] == 2
    masters = [p for p in status["processes"] if p["role"] == "master"]
    assert sorted(p["group"] for p in masters) == [0, 1]


def test_admin_aggregates_the_groups(groups2: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    assert admin.main(["--master", groups2.master, "--json", "leader"]) == 0
    leaders = json.loads(capsys.readouterr().out)
    expected = {m.group: m.address for m in groups2.masters}
    assert [(g["group"], g["leader"]) for g in leaders["groups"]] == sorted(expected.items())
    assert all(g["view"] > 0 for g in leaders["groups"])
    assert admin.main(["--master", groups2.master, "--json", "status"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["stores"] == 2
    assert status["segments"] == 4  # each store's segment of each group
    assert admin.main(["--master", groups2.master, "--json", "nodes"]) == 0
    nodes = json.loads(capsys.readouterr().out)["nodes"]
    assert sum(n["segments"] for n in nodes) == 4
    with client(groups2.master) as pool:
        keys = [f"evict-{i}" for i in range(30)]
        assert pool.batch_put(keys, [b"e" * 32] * len(keys)) == [0] * len(keys)
    assert admin.main(["--master", groups2.master, "--json", "evict", "--prefix", "evict-"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == len(keys)  # summed over both groups


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=180, env=env, check=False
    )


def test_local_up_with_two_groups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if etcd_binary() is None and not os.environ.get("CI"):
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    monkeypatch.setenv("KVPOOL_LOCAL_CONTEXT", str(tmp_path / "context.json"))
    monkeypatch.delenv("KVPOOL_MASTER", raising=False)
    monkeypatch.delenv("KVPOOL_TOKEN_FILE", raising=False)
    env = dict(os.environ)
    base = str(tmp_path / "cluster")
    up_args = ("--ha", "--groups", "2", "--masters", "1", "--stores", "2", "--size", "32MiB", "--dir", base)
    up = _cli("kvpool.tools.cli", "local", "up", *up_args, "--json", env=env)
    try:
        assert up.returncode == 0, up.stderr
        status = json.loads(_cli("kvpool.tools.cli", "local", "status", "--dir", base, "--json", env=env).stdout)
        assert sorted(p["group"] for p in status["processes"] if p["role"] == "master") == [0, 1]
        assert [p["alive"] for p in status["processes"]] == [True] * len(status["processes"])
        with PoolClient.from_env(use_shm=False) as pool:  # the local cluster is the default context
            keys = [f"up-{i}" for i in range(50)]
            assert pool.groups == 2
            assert pool.batch_put(keys, [k.encode() * 8 for k in keys]) == [0] * len(keys)
            assert pool.batch_get(keys) == [k.encode() * 8 for k in keys]
        leader = _cli("kvpool.tools.admin", "leader", "--json", env=env)
        assert leader.returncode == 0, leader.stderr
        assert [g["group"] for g in json.loads(leader.stdout)["groups"]] == [0, 1]
    finally:
        assert _cli("kvpool.tools.cli", "local", "down", "--dir", base, env=env).returncode == 0
