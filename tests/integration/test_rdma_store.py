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

from kvpool.client.engine import EngineClient
from kvpool.common.clock import SYSTEM_CLOCK, Deadline, ManualClock
from kvpool.common.errors import ErrorCode
from kvpool.common.grants import GrantOp
from kvpool.common.keys import Namespace
from kvpool.proto import frames
from kvpool.proto import master_pb2 as pb
from kvpool.tools.local_cluster import LocalCluster
from kvpool.transfer.base import Replica, TransferRequest, replica_of
from kvpool.transfer.rdma_client import RdmaTransport
from kvpool.transfer.rdma_rails import buffer_numa_node
from kvpool.transfer.rdma_wire import fetch_store_info, open_control
from kvpool.transfer.verbs import buffer_address
from kvpool.transfer.verbs_fake_ipc import IpcFakeFabric, IpcFakeVerbs
from tests.support.cluster import FAST_MASTER, client, wait_for

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


def test_prefetch_moves_its_pages_over_rdma(fake_nic: Path, make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(stores=1, store_size="32MiB")
    page = 64 << 10
    with client(cluster.master) as pool:
        engine = EngineClient(pool, Namespace(model="rdma"), page_size=16, page_bytes=page, lookup_timeout_s=5.0)
        with engine:
            keys = engine.page_keys(list(range(4 * 16)))
            values = [os.urandom(page) for _ in range(len(keys) * engine.objects_per_page)]
            before = IpcFakeFabric.total_bytes_moved
            assert engine.write_back(keys, values)
            assert engine.flush(timeout=20)
            bufs = [bytearray(page) for _ in values]
            handle = engine.prefetch(keys, bufs, deadline_s=10, policy="wait_complete")
            assert handle.wait(timeout=20) == len(keys)
            assert [bytes(b) for b in bufs] == values
        metrics = pool.metrics()
    payload = sum(len(v) for v in values)
    assert (metrics["bytes_rdma"], metrics["bytes_tcp"]) == (2 * payload, 0)  # the write-back and the prefetch
    assert IpcFakeFabric.total_bytes_moved - before == 2 * payload


def test_an_expired_grant_moves_no_byte_over_rdma(fake_nic: Path, make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(stores=1, store_size="32MiB", master_args=(*FAST_MASTER, "--lease-ttl-s", "2"))
    value = os.urandom(8192)
    with client(cluster.master) as pool:
        assert pool.put("k", value) == 0
        replica = _replica(pool, "k")  # a READ grant that lives as long as the 2 s lease
    live = RdmaTransport(IpcFakeVerbs(), discover=True)
    # A client whose clock runs 5 s behind believes the grant is still good: the store must refuse it.
    skewed = RdmaTransport(IpcFakeVerbs(), discover=True, clock=ManualClock(wall_start_ms=replica.expiry_ms - 5000))
    try:
        out = bytearray(8192)
        read = [TransferRequest(GrantOp.READ, b"k", replica, memoryview(out))]
        assert live.transfer(read, Deadline(10.0)) == [ErrorCode.OK]  # while the grant lives: over RDMA
        assert out == value
        out[:] = bytes(8192)
        wait_for(lambda: SYSTEM_CLOCK.wall_ms() > replica.expiry_ms, 10, "the grant to expire")
        before = IpcFakeFabric.total_bytes_moved
        assert live.transfer(read, Deadline(10.0)) == [ErrorCode.GRANT_EXPIRED]  # the client posts nothing
        assert skewed.can_reach(replica)
        # Admitted (a window-less QP reaches nothing), but the store binds no window for an expired grant.
        assert skewed.transfer(read, Deadline(10.0)) == [ErrorCode.GRANT_EXPIRED]
        assert skewed.stats.connects == 1
        assert IpcFakeFabric.total_bytes_moved == before
        assert out == bytes(8192)
    finally:
        live.close()
        skewed.close()


def test_a_client_without_the_token_gets_auth_failed_and_moves_no_byte_over_rdma(
    fake_nic: Path, make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    token = b"s3cret-cluster-token"
    token_file = tmp_path / "token"
    token_file.write_bytes(token)
    token_file.chmod(0o600)
    cluster = make_cluster(stores=1, store_size="32MiB", token_file=str(token_file))
    with client(cluster.master, token_file=str(token_file)) as pool:
        assert pool.put("k", b"t" * 4096) == 0
        replica = _replica(pool, "k")
    (store,) = cluster.stores
    refused_before = _data_auth_refusals(store.endpoints["metrics"])
    for presented in (b"", b"wrong-token"):
        rdma = RdmaTransport(IpcFakeVerbs(), token=presented)
        rdma.advertise(replica.tcp_endpoint, [replica.segment_id])  # what a forged STORE_INFO would say
        try:
            out = bytearray(4096)
            before = IpcFakeFabric.total_bytes_moved
            codes = rdma.transfer([TransferRequest(GrantOp.READ, b"k", replica, memoryview(out))], Deadline(10.0))
            assert codes == [ErrorCode.AUTH_FAILED], presented
            assert rdma.stats.connects == 0
            assert IpcFakeFabric.total_bytes_moved == before
            assert out == bytes(4096)
        finally:
            rdma.close()
    # No token: the store refuses the HELLO-less RDMA_CONNECT (and counts it). A wrong token: the client
    # refuses first, as the store's proof does not verify with it.
    assert _data_auth_refusals(store.endpoints["metrics"]) >= refused_before + 1
    rdma = RdmaTransport(IpcFakeVerbs(), token=token)  # the right token: the same grant moves its bytes
    rdma.advertise(replica.tcp_endpoint, [replica.segment_id])
    try:
        out = bytearray(4096)
        codes = rdma.transfer([TransferRequest(GrantOp.READ, b"k", replica, memoryview(out))], Deadline(10.0))
        assert (codes, bytes(out)) == ([ErrorCode.OK], b"t" * 4096)
    finally:
        rdma.close()


def _data_auth_refusals(metrics_endpoint: str) -> float:
    text = urllib.request.urlopen(f"http://{metrics_endpoint}/metrics", timeout=10).read().decode()
    name = 'kvpool_store_auth_refused_total{plane="data"}'
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(name)), 0.0)


def test_two_nics_stripe_large_objects_and_keep_small_ones_on_the_numa_local_nic(
    fake_nic: Path, make_cluster: Callable[..., LocalCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two fake NICs in the store and in this client; fake_mlx5_1 claims the NUMA node this machine's memory is on.
    node = buffer_numa_node(buffer_address(memoryview(bytearray(4096))))
    monkeypatch.setenv("KVPOOL_FAKE_VERBS_DEVICES", f"fake_mlx5_0:{node + 1},fake_mlx5_1:{node}")
    cluster = make_cluster(stores=1, store_size="32MiB")
    big, small = os.urandom(4 << 20), os.urandom(64 << 10)
    with client(cluster.master) as pool:
        moved = dict(IpcFakeFabric.bytes_by_device)
        assert pool.put("big", big) == 0
        assert pool.get("big") == big
        after_big = dict(IpcFakeFabric.bytes_by_device)
        assert pool.put("small", small) == 0
        assert pool.get("small") == small
        metrics = pool.metrics()
        info = fetch_store_info(_replica(pool, "big").tcp_endpoint)
    grown = {d: after_big.get(d, 0) - moved.get(d, 0) for d in ("fake_mlx5_0", "fake_mlx5_1")}
    assert grown == {"fake_mlx5_0": 4 << 20, "fake_mlx5_1": 4 << 20}  # half of the put and half of the get each
    assert IpcFakeFabric.bytes_by_device["fake_mlx5_0"] == after_big["fake_mlx5_0"]  # small: not on this one
    assert IpcFakeFabric.bytes_by_device["fake_mlx5_1"] - after_big["fake_mlx5_1"] == 2 * len(small)
    assert (metrics["bytes_rdma"], metrics["bytes_tcp"]) == (2 * (len(big) + len(small)), 0)
    assert info["rdma"]["devices"] == ["fake_mlx5_0", "fake_mlx5_1"]  # the store serves on both
