"""Shard groups under faults (decision 0080): real etcd, two groups of real masters, real stores.

Losing one group's leader leaves the other group serving without a single failed call; a dead store
or a drained node takes its segment out of every group.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator

import pytest

from kvpool.client import ClientConfig, PoolClient
from kvpool.common.groups import group_of
from kvpool.proto import master_pb2 as pb
from kvpool.tools import admin
from kvpool.tools.bench_failover import serving_leader
from kvpool.tools.etcd_process import etcd_binary
from kvpool.tools.local_cluster import LocalCluster
from tests.support.wait import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.etcd, pytest.mark.integration]

# Test-sized timings: leader lease 1 s (+1 s warm-up), store expiry 3 s.
HA_ARGS = ("--leader-ttl-s", "1", "--store-ttl-s", "3")
OBJECTS = 2000
VALUE_BYTES = 512


def _pool(master: str, **overrides: object) -> PoolClient:
    # No lease cache: every read asks its group's master, so a failed master call would show.
    settings: dict[str, object] = {
        "master": master,
        "use_shm": False,
        "timeout_s": 2.0,
        "lease_cache_entries": 0,
        "breaker_backoff_s": 0.1,
        "breaker_max_backoff_s": 0.5,
    }
    return PoolClient(config=ClientConfig(**{**settings, **overrides}))  # type: ignore[arg-type]


def _write(pool: PoolClient, prefix: str, count: int) -> dict[str, bytes]:
    written = {f"{prefix}-{i}": os.urandom(VALUE_BYTES) for i in range(count)}
    keys = list(written)
    for start in range(0, count, 250):
        part = keys[start : start + 250]
        assert pool.batch_put(part, [written[k] for k in part]) == [0] * len(part)
    return written


def _read_all(pool: PoolClient, written: dict[str, bytes]) -> tuple[int, int]:
    """(keys read back with their bytes, reads that returned other bytes)."""
    keys = list(written)
    good = wrong = 0
    for start in range(0, len(keys), 250):
        part = keys[start : start + 250]
        for key, got in zip(part, pool.batch_get(part), strict=True):
            if got == written[key]:
                good += 1
            elif got is not None:
                wrong += 1
    return good, wrong


@pytest.fixture(scope="module")
def groups_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One cluster for the module (its start is most of the cost): the tests run in file order, the
    leader kill first (a standby takes over), then the store kill."""
    if etcd_binary() is None and not os.environ.get("CI"):
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    cluster = LocalCluster(
        stores=2,
        store_size="32MiB",
        base_dir=tmp_path_factory.mktemp("groups-chaos"),
        ha=True,
        masters=2,
        groups=2,
        master_args=HA_ARGS,
    )
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


class _GroupReader:
    """Reads one group's keys back to back on its own thread; counts every failed and wrong read."""

    def __init__(self, pool: PoolClient, written: dict[str, bytes]) -> None:
        self.pool, self.written = pool, written
        self.keys = list(written)
        self.reads = self.failed = self.wrong = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="group-reader", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for start in range(0, len(self.keys), 100):
                part = self.keys[start : start + 100]
                codes = self.pool.batch_get(part)
                for key, got in zip(part, codes, strict=True):
                    self.reads += 1
                    if got is None:
                        self.failed += 1
                        self.failures.append(key)
                    elif got != self.written[key]:
                        self.wrong += 1

    def __enter__(self) -> _GroupReader:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30.0)


def test_one_groups_leader_killed_the_other_group_never_fails(groups_cluster: LocalCluster) -> None:
    cluster = groups_cluster
    group0 = [m.address for m in cluster.group_masters(0)]
    wait_for(lambda: serving_leader(group0), 30, "group 0 to have a serving leader")
    with _pool(cluster.master) as writer:
        written = _write(writer, "chaos", OBJECTS)
    group1_keys = {k: v for k, v in written.items() if group_of(k, 2) == 1}
    assert 0.4 * OBJECTS < len(group1_keys) < 0.6 * OBJECTS
    leader = serving_leader(group0)
    (victim,) = [m for m in cluster.group_masters(0) if m.address == leader]
    with _pool(cluster.master) as reader_pool, _pool(cluster.master) as checker:
        with _GroupReader(reader_pool, group1_keys) as reader:
            wait_for(lambda: reader.reads >= len(group1_keys), 30, "a first full pass over group 1's keys")
            before_kill = reader.reads
            cluster.kill(victim)
            killed_at = time.monotonic()
            took = wait_for(lambda: _read_all(checker, written)[0] == OBJECTS, 10.0, "every key back after the kill")
            # Keep reading group 1 for at least one more full pass after group 0 came back.
            target = reader.reads + len(group1_keys)
            wait_for(lambda: reader.reads >= target, 30, "another full pass over group 1's keys")
        good, wrong = _read_all(checker, written)
    print(
        f"\ngroup 0 leader SIGKILLed: every key back {took:.2f} s after the kill "
        f"({time.monotonic() - killed_at:.1f} s observed); group 1: {reader.reads - before_kill} reads "
        f"after the kill, {reader.failed} failed, {reader.wrong} wrong"
    )
    assert reader.failed == 0, f"group 1 reads failed: {reader.failures[:5]}"
    assert reader.wrong == 0
    assert reader.reads > before_kill
    assert (good, wrong) == (OBJECTS, 0)
    assert serving_leader(group0, exclude=leader)


def test_a_store_killed_with_two_groups(groups_cluster: LocalCluster) -> None:
    cluster = groups_cluster
    with _pool(cluster.master) as pool:
        written = _write(pool, "store", 200)
        cluster.kill(cluster.stores[0])
        # Both groups expire the dead store's segment (store TTL 3 s): only the survivor's two remain.
        wait_for(lambda: len(pool.stats().segments) == 2, 20, "each group to drop the dead store's segment")
        good, wrong = _read_all(pool, written)
        assert wrong == 0
        assert good > 0  # what the surviving store held still reads back
        fresh = _write(pool, "after", 100)  # both groups place new objects on the surviving store
        assert {group_of(k, 2) for k in fresh} == {0, 1}
        assert _read_all(pool, fresh) == (100, 0)


def test_drain_with_two_groups(groups_cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = groups_cluster
    cluster.add_store()  # after the store kill above: a second store to drain onto
    (survivor, fresh) = [s for s in cluster.stores if s.pid and _alive_store(s.pid)][-2:]
    with _pool(cluster.master) as pool:
        wait_for(lambda: len(pool.stats().segments) == 4, 20, "the new store to mount to both groups")
        written = _write(pool, "drain", 200)
        store_id = str(survivor.endpoints["store_id"])
        code = admin.main(["--master", cluster.master, "--json", "drain", store_id, "--wait", "--timeout", "60"])
        doc = json.loads(capsys.readouterr().out)
        assert code == 0, doc
        assert [(g["group"], g["status"]) for g in doc["groups"]] == [(0, "DRAINED"), (1, "DRAINED")]
        drained = [seg for seg in pool.stats().segments if seg.store_id == store_id]
        assert len(drained) == 2  # one segment per group
        assert all(seg.status == pb.SEGMENT_DRAINED and seg.objects == 0 for seg in drained)
        assert _read_all(pool, written) == (200, 0)
    assert fresh.endpoints["store_id"] != store_id


def _alive_store(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
