"""A real store process serving RDMA through the cross-process FAKE NIC (KVPOOL_VERBS=fake in both processes):
advertisement, every byte over RDMA, per-grant windows refusing what a grant does not allow, and TCP with one
log line where there is no RDMA."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode
from kvpool.common.grants import GrantOp
from kvpool.proto import frames
from kvpool.proto import master_pb2 as pb
from kvpool.tools.local_cluster import LocalCluster
from kvpool.transfer.base import Replica, TransferRequest, replica_of
from kvpool.transfer.rdma_client import RdmaTransport
from kvpool.transfer.rdma_wire import fetch_store_info, open_control
from kvpool.transfer.verbs_fake_ipc import IpcFakeFabric, IpcFakeVerbs
from tests.support.cluster import client

pytestmark = pytest.mark.integration


@pytest.fixture
def fake_nic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    directory = tmp_path / "fake-nic"
    monkeypatch.setenv("KVPOOL_VERBS", "fake")
    monkeypatch.setenv("KVPOOL_FAKE_VERBS_DIR", str(directory))
    return directory


def _replica(pool: object, key: str) -> Replica:
    request = pb.BatchGetReplicasRequest(keys=[key])
    resp = pool._master.call(frames.Op.BATCH_GET_REPLICAS, request, Deadline(10.0))  # type: ignore[attr-defined]
    (result,) = resp.results
    (descriptor,) = result.replicas
    return replica_of(descriptor)


def test_the_store_advertises_rdma_and_a_client_moves_every_byte_over_it(
    fake_nic: Path, make_cluster: Callable[..., LocalCluster]
) -> None:
    cluster = make_cluster(stores=1, store_size="32MiB")
    values = {f"k{i}": os.urandom(size) for i, size in enumerate((1, 4096, 65536, 1 << 20, (2 << 20) + 7))}
    with client(cluster.master) as pool:
        before = IpcFakeFabric.total_bytes_moved
        assert pool.batch_put(list(values), list(values.values())) == [0] * len(values)
        assert pool.batch_get(list(values)) == list(values.values())
        metrics = pool.metrics()
        endpoint = _replica(pool, "k0").tcp_endpoint
    payload = sum(len(v) for v in values.values())
    assert metrics["bytes_rdma"] == 2 * payload
    assert metrics["bytes_tcp"] == 0
    assert IpcFakeFabric.total_bytes_moved - before == 2 * payload
    info = fetch_store_info(endpoint)
    assert info["rdma"]["device"] == "fake_mlx5_0"
    (store,) = cluster.stores
    text = urllib.request.urlopen(f"http://{store.endpoints['metrics']}/metrics", timeout=10).read().decode()
    granted = next(line for line in text.splitlines() if line.startswith("kvpool_store_rdma_bytes_granted_total"))
    assert float(granted.split()[-1]) == 2 * payload  # one window per grant: each put and each get
    assert info["rdma"]["segments"] == [s["id"] for s in info["segments"]]


def test_a_forged_or_widened_grant_gets_no_window_and_moves_no_byte(
    fake_nic: Path, make_cluster: Callable[..., LocalCluster]
) -> None:
    cluster = make_cluster(stores=1, store_size="32MiB")
    with client(cluster.master) as pool:
        assert pool.put("victim", b"v" * 8192) == 0
        assert pool.put("mine", b"m" * 4096) == 0
        mine = _replica(pool, "mine")
    rdma = RdmaTransport(IpcFakeVerbs(), discover=True)
    try:
        out = bytearray(16384)
        assert rdma.can_reach(mine)
        ok = rdma.transfer([TransferRequest(GrantOp.READ, b"mine", mine, memoryview(out)[:4096])], Deadline(10.0))
        assert ok == [ErrorCode.OK]
        assert out[:4096] == b"m" * 4096
        out[:] = bytes(16384)
        widened = mine._replace(length=16384)  # the master granted 4096 bytes
        forged = mine._replace(mac=bytes(len(mine.mac)))
        before = IpcFakeFabric.total_bytes_moved
        codes = rdma.transfer(
            [
                TransferRequest(GrantOp.READ, b"mine", widened, memoryview(out)),
                TransferRequest(GrantOp.READ, b"mine", forged, memoryview(out)[:4096]),
                TransferRequest(GrantOp.READ, b"victim", mine, memoryview(out)[:4096]),
            ],
            Deadline(10.0),
        )
        assert codes == [ErrorCode.AUTH_FAILED] * 3  # the MAC covers key, range and op: no window for any
        write = TransferRequest(GrantOp.WRITE, b"mine", mine, memoryview(b"x" * 4096))  # with a READ grant
        assert rdma.transfer([write], Deadline(10.0)) == [ErrorCode.AUTH_FAILED]
        assert IpcFakeFabric.total_bytes_moved == before
        assert out == bytes(16384)
    finally:
        rdma.close()
    with client(cluster.master) as pool:
        assert pool.get("victim") == b"v" * 8192


def test_rdma_connect_needs_a_grant_or_the_token(fake_nic: Path, make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(stores=1, store_size="32MiB")
    with client(cluster.master) as pool:
        assert pool.put("k", b"x") == 0
        endpoint = _replica(pool, "k").tcp_endpoint
    sock = open_control(endpoint)
    try:
        request = json.dumps(
            {"v": 1, "qp": {"qp_num": 5, "lid": 1, "gid": "fe80::1", "psn": 1, "mtu": 5}, "grants": []}
        )
        sock.sendall(frames.pack_header(frames.Op.RDMA_CONNECT, 9, len(request)) + request.encode())
        head = frames.recv_header(sock)
        assert head.status == ErrorCode.AUTH_FAILED
        reply = json.loads(bytes(frames.recv_exact(sock, head.length)))
        assert "token or a master grant" in reply["error"]
    finally:
        sock.close()


def test_without_rdma_the_store_says_once_that_tcp_is_used(
    monkeypatch: pytest.MonkeyPatch, make_cluster: Callable[..., LocalCluster]
) -> None:
    monkeypatch.delenv("KVPOOL_VERBS", raising=False)
    cluster = make_cluster(stores=1, store_size="32MiB")
    with client(cluster.master) as pool:
        assert pool.put("k", b"abc") == 0
        assert pool.get("k") == b"abc"
        metrics = pool.metrics()
        endpoint = _replica(pool, "k").tcp_endpoint
    assert metrics["bytes_rdma"] == 0
    assert metrics["bytes_tcp"] == 6
    assert "rdma" not in fetch_store_info(endpoint)
    (store,) = cluster.stores
    log = Path(store.log).read_text()
    assert log.count("using TCP") == 1, log
