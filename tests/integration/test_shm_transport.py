"""Same-node shared memory: memcpy through the mapped segment, the inventory still learns every write."""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Callable

import pytest

from kvpool.tools.local_cluster import LocalCluster
from kvpool.transfer.shm import ShmTransport
from tests.support.cluster import client, wait_for

pytestmark = pytest.mark.integration


def test_same_node_reads_and_writes_use_shared_memory(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(stores=1, store_size="32MiB")
    values = [os.urandom(size) for size in (1, 4096, 1 << 20, (1 << 20) + 7)]
    keys = [f"shm-{i}" for i in range(len(values))]
    with client(cluster.master, use_shm=True) as pool:
        transports = pool._transports._transports
        assert isinstance(transports[0], ShmTransport)
        tcp_bytes_before = _store_bytes(cluster)
        assert pool.batch_put_from(keys, values) == [0] * len(keys)
        assert pool.batch_get(keys) == values
        assert _store_bytes(cluster) == tcp_bytes_before, "same-node traffic must not cross the data plane"
    # The store recorded the writes (RECORD): a restarted master rebuilds them from its inventory.
    cluster.restart(cluster.masters[0])
    with client(cluster.master, use_shm=False) as tcp:
        wait_for(lambda: tcp.prefix_length(keys) == len(keys), 20, "the index to come back from the store")
        assert tcp.batch_get(keys) == values


def test_other_node_segments_fall_back_to_tcp(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(stores=1, store_size="32MiB", nodes=["elsewhere"])
    with client(cluster.master, use_shm=True) as pool:
        assert pool.put("far", b"x" * 5000) == 0
        assert pool.get("far") == b"x" * 5000
        # written and read over TCP (the store counts a READ's bytes just after sending them)
        wait_for(lambda: _store_bytes(cluster) >= 10_000, 5, "the store to count 10,000 bytes moved")


@pytest.mark.parametrize("read_sendfile", [False, True], ids=["copied", "from-pages"])
def test_tcp_reads_are_copied_unless_the_store_sends_from_its_pages(
    make_cluster: Callable[..., LocalCluster], read_sendfile: bool
) -> None:
    """`kvpool store --read-sendfile` reaches the data plane: its large reads leave from the segment's
    pages (counted apart); without it every read is copied. Either way the bytes come back exact."""
    cluster = make_cluster(stores=1, store_size="32MiB", store_args=("--read-sendfile",) if read_sendfile else ())
    values = [os.urandom(n) for n in (1 << 20, (3 << 20) + 5, 1000)]
    keys = [f"sent-{i}" for i in range(len(values))]
    with client(cluster.master, use_shm=False) as pool:
        assert pool.batch_put_from(keys, values) == [0] * len(keys)
        assert pool.batch_get(keys) == values
    large = sum(len(v) for v in values[:2])
    expected = large if read_sendfile else 0
    wait_for(lambda: _store_bytes(cluster, "read") >= large, 5, "the store to count the bytes read")
    assert _store_bytes(cluster, "read_from_pages") == expected


def _store_bytes(cluster: LocalCluster, *kinds: str) -> int:
    """Bytes the stores' TCP data planes moved (by default read + written), from their /metrics."""
    names = tuple(f"kvpool_store_bytes_{kind}_total " for kind in kinds or ("read", "written"))
    total = 0
    for store in cluster.stores:
        with urllib.request.urlopen(f"http://{store.endpoints['metrics']}/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(names):
                    total += int(float(line.split()[1]))
    return total
