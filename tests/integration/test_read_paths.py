"""The plain read path (values the caller owns) and reads that meet a hung replica."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest

from kvpool.client import PoolClient
from kvpool.common.clock import Deadline
from kvpool.tools.local_cluster import LocalCluster, ProcInfo
from tests.support.cluster import client

pytestmark = pytest.mark.integration


def test_values_returned_by_get_stay_as_they_were_after_later_reads(cluster: LocalCluster) -> None:
    """get/batch_get land objects in a buffer reused from call to call: what they return must be the
    caller's own bytes, which later reads (of other sizes and keys) do not change."""
    values = {f"own-{i}": os.urandom(size) for i, size in enumerate((70_000, 1 << 20, 3, 300_001))}
    with client(cluster.master) as pool:
        assert pool.batch_put(list(values), list(values.values())) == [0] * len(values)
        first = pool.get("own-0")
        batch = pool.batch_get(["own-1", "missing", "own-2"])
        later = pool.batch_get(list(values)[::-1]) + [pool.get("own-3"), pool.get("own-1")]
        assert first == values["own-0"]
        assert batch == [values["own-1"], None, values["own-2"]]
        assert later == [values[k] for k in list(values)[::-1]] + [values["own-3"], values["own-1"]]
        assert all(type(v) is bytes for v in [first, *batch, *later] if v is not None)


def test_a_batch_larger_than_the_kept_landing_buffer_reads_whole(cluster: LocalCluster) -> None:
    """A batch_get whose values exceed what a thread keeps between calls lands in a buffer of its own;
    the small reads after it still use (and do not disturb) what the big one returned."""
    big = {f"big-{i}": os.urandom((4 << 20) + i) for i in range(5)}
    with client(cluster.master) as pool:
        assert pool.batch_put(list(big), list(big.values())) == [0] * len(big)
        assert pool.put("small", b"s" * 1000) == 0
        got = pool.batch_get(list(big))
        assert pool.get("small") == b"s" * 1000
        assert got == list(big.values())


def _first_replica_store(pool: PoolClient, cluster: LocalCluster, key: str) -> ProcInfo:
    """The store this client reads ``key`` from first (the head of its read order)."""
    results, _, _ = pool._get_replicas([key], Deadline(5.0), use_cache=False)
    endpoint = pool._transports.order(results[0].replicas)[0].tcp_endpoint
    assert len(results[0].replicas) == 2
    return next(s for s in cluster.stores if s.address == endpoint or endpoint.endswith(s.address))


def test_a_read_falls_back_to_another_replica_when_the_first_hangs(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """replica_num 2, the store of the first replica SIGSTOPped (its sockets still accept, nothing
    answers): every read still returns the value within its deadline, from the other replica, where it
    used to spend the whole deadline on the hung one and fail with TIMEOUT."""
    cluster = make_cluster(stores=2, store_size="32MiB", master_args=("--store-ttl-s", "60"))
    keys = [f"hang-{i}" for i in range(6)]
    values = [os.urandom(100_000 + i) for i in range(len(keys))]
    with client(cluster.master, replica_num=2, timeout_s=3.0, lease_cache_entries=0) as pool:
        assert pool.batch_put(keys, values) == [0] * len(keys)
        hung = _first_replica_store(pool, cluster, keys[0])
        cluster.signal(hung, signal.SIGSTOP)
        try:
            started = time.monotonic()
            got = pool.get(keys[0], timeout=2.0)
            first_read_s = time.monotonic() - started
            assert got == values[0], "the read gave up on the hung replica instead of reading the other one"
            assert pool.batch_get(keys, timeout=2.0) == values
            assert [pool.get(k, timeout=2.0) for k in keys] == values
            print(f"first read past the hung store took {first_read_s:.2f} s of its 2 s deadline")
        finally:
            cluster.signal(hung, signal.SIGCONT)
