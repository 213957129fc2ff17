"""Every live master is listed with its state, also a leader that was frozen past its leases and resumed.

Real etcd, three real master processes, one store; the frozen master is SIGSTOPped, not simulated.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from kvpool.master.ha import leader_summary
from kvpool.tools.bench_failover import wait_for_leader
from kvpool.tools.etcd_process import etcd_binary
from kvpool.tools.local_cluster import LocalCluster
from tests.support.cluster import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.etcd, pytest.mark.integration]

HA_ARGS = ("--leader-ttl-s", "1", "--store-ttl-s", "3")


@pytest.fixture
def ha_cluster(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    if etcd_binary() is None and not os.environ.get("CI"):
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    return make_cluster(stores=1, store_size="16MiB", ha=True, master_args=HA_ARGS)


def _states(cluster: LocalCluster) -> dict[str, str]:
    summary = leader_summary(",".join(cluster.etcd_endpoints), cluster.cluster)
    return {m["grpc"]: m["state"] for m in summary["masters"]}


def _admin_leader(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpool.tools.admin", "leader", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_resumed_frozen_leader_is_listed_again_as_standby(ha_cluster: LocalCluster) -> None:
    endpoints = sorted(m.address for m in ha_cluster.masters)
    old = wait_for_leader(endpoints, 15.0)
    assert old
    wait_for(lambda: _states(ha_cluster).get(old) == "leader" and len(_states(ha_cluster)) == 3, 10.0, "3 masters")
    frozen = next(m for m in ha_cluster.masters if m.address == old)
    ha_cluster.signal(frozen, signal.SIGSTOP)
    try:
        new = wait_for_leader(endpoints, 15.0, exclude=old)
        assert new
        # Frozen past its member lease: etcd forgets it (what the operator saw before the fix, for good).
        wait_for(lambda: old not in _states(ha_cluster), 15.0, "the frozen master's registration to expire")
    finally:
        ha_cluster.signal(frozen, signal.SIGCONT)
    expected = {e: "leader" if e == new else "standby" for e in endpoints}
    wait_for(lambda: _states(ha_cluster) == expected, 10.0, "the resumed master listed as a standby")
    states = _states(ha_cluster)
    print(f"\nmasters after the frozen leader resumed: {states}")
    assert states[old] == "standby"

    master = "etcd://" + ",".join(ha_cluster.etcd_endpoints)
    by_etcd = _admin_leader("--master", master, "--cluster", ha_cluster.cluster, "--json")
    assert by_etcd.returncode == 0, by_etcd.stderr
    doc: dict[str, Any] = json.loads(by_etcd.stdout)
    assert doc["leader"] == new
    assert sorted(doc["followers"]) == sorted(e for e in endpoints if e != new)
    assert {m["grpc"]: m["state"] for m in doc["masters"]} == states
    # The gRPC path (the leader's own view of its standbys) lists them too, in text.
    wait_for(lambda: old in _admin_leader("--master", new).stdout, 10.0, "the leader's stats to list the standby")
    text = _admin_leader("--master", new).stdout
    assert f"{old}" in text
    assert "standby" in text
    assert "leader" in text
