"""Limits, with real processes: key length, object size and batch size on the master (per-key codes),
connections and bytes in flight per client on a store's data plane, and memory that stays bounded when
a client floods the servers.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool.client import ClientConfig, PoolClient
from kvpool.common.errors import ErrorCode
from kvpool.common.grants import Grant, GrantOp
from kvpool.proto import frames
from kvpool.proto import master_pb2 as pb
from kvpool.tools.local_cluster import LocalCluster
from tests.support.cluster import wait_for

pytestmark = pytest.mark.integration

KiB, MiB = 1 << 10, 1 << 20


def _client(cluster: LocalCluster, **overrides: object) -> PoolClient:
    return PoolClient(
        config=ClientConfig(
            master=cluster.master,
            use_shm=False,
            timeout_s=5.0,  # type: ignore[arg-type]
            **overrides,
        )
    )


def _endpoint(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def rss_anon(pid: int) -> int:
    """Private resident memory of ``pid`` (bytes): the heap and stacks, not the shared segment."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


# ---------------------------------------------------------------------- master limits
def test_key_object_and_batch_limits_give_per_key_codes(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(
        stores=1,
        store_size="32MiB",
        master_args=("--max-key-bytes", "64", "--max-object-bytes", "64KiB", "--max-batch", "16"),
    )
    with _client(cluster) as c:
        long_key, ok_key = "k" * 65, "k" * 64
        assert c.batch_put_from(
            [ok_key, long_key, "", "big", "fits"],
            [b"a", b"b", b"c", b"x" * (64 * KiB + 1), b"y" * (64 * KiB)],
        ) == [0, ErrorCode.KEY_TOO_LONG, ErrorCode.INVALID_KEY, ErrorCode.VALUE_TOO_LARGE, 0]
        assert c.get_into(long_key, bytearray(8)) == ErrorCode.KEY_TOO_LONG
        assert c.get_into(ok_key, bytearray(8)) == 1
        keys = [f"b{i}" for i in range(17)]
        # Over max_batch the client splits the batch (client/batching.py): the caller never sees the limit.
        assert c.batch_put_from(keys, [b"v"] * 17) == [0] * 17
        assert c.batch_exists(keys) == [1] * 17
        assert c.batch_get_into(keys, [bytearray(1) for _ in keys]) == [1] * 17
        info = c._master.info
        assert info is not None
        assert (info.max_key_bytes, info.max_object_bytes, info.max_batch) == (64, 64 * KiB, 16)


# ---------------------------------------------------------------------- data-plane limits per client
def _ping(sock: socket.socket, req_id: int = 1) -> frames.Header:
    sock.sendall(frames.pack_header(frames.Op.PING, req_id, 0))
    return frames.recv_header(sock)


def test_connections_per_client(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(stores=1, store_size="32MiB", store_args=("--max-connections-per-client", "4"))
    store = _endpoint(cluster.stores[0].address)
    conns = [socket.create_connection(store, timeout=5) for _ in range(4)]
    try:
        assert [_ping(s).status for s in conns] == [0] * 4
        with socket.create_connection(store, timeout=5) as fifth:
            head = frames.recv_header(fifth)  # refused at once, before any request
            assert head.status == ErrorCode.TOO_MANY_CONNECTIONS
            assert fifth.recv(1) == b""
        conns.pop().close()

        def fifth_admitted() -> bool:
            with socket.create_connection(store, timeout=5) as sock:
                try:
                    return _ping(sock).status == 0
                except Exception:
                    return False

        wait_for(fifth_admitted, 10.0, "a slot to free up once a connection closed")
    finally:
        for s in conns:
            s.close()


def test_bytes_in_flight_per_client(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(stores=1, store_size="32MiB", store_args=("--max-inflight-bytes-per-client", "1MiB"))
    # One part per object (stripe 8 MiB): a part over the client's budget can never be served.
    with _client(cluster, stripe_bytes=8 * MiB, connections_per_store=1) as c:
        assert c.put("small", b"s" * (512 * KiB)) == 0
        assert c.put("large", b"l" * (2 * MiB)) == ErrorCode.TOO_MANY_BYTES_IN_FLIGHT
        assert c.get("small") == b"s" * (512 * KiB)
        assert c.get("large") is None  # revoked, never visible
    # Striped into 512 KiB parts over 2 connections, at most 2 parts in flight: fits the budget.
    with _client(cluster, stripe_bytes=512 * KiB, connections_per_store=2) as c:
        assert c.put("striped", b"t" * (4 * MiB)) == 0
        assert c.get("striped") == b"t" * (4 * MiB)


# ---------------------------------------------------------------------- floods
FLOOD_CONNECTIONS = 200
STORE_FLOOD_BOUND = 96 * MiB
"""A store's private memory may grow by at most this under the flood: threads (their stacks are mostly
untouched), a read-ahead buffer per connection, a WRITE scratch buffer per writing connection; request
payloads go straight to the segment or are drained through the scratch buffer, never accumulated."""


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    try:
        yield opened
    finally:
        for s in opened:
            s.close()


def _send_nowait(sock: socket.socket, data: bytes) -> None:
    """Send what the kernel takes now (a flooding client that never reads its replies)."""
    sock.setblocking(False)
    try:
        sock.send(data)
    except BlockingIOError:
        pass


def test_store_memory_stays_bounded_under_a_flood(
    make_cluster: Callable[..., LocalCluster], sockets: list[socket.socket]
) -> None:
    cluster = make_cluster(stores=1, store_size="32MiB", store_args=("--max-connections-per-client", "0"))
    store = cluster.stores[0]
    before = rss_anon(store.pid)
    # Well-formed requests under forged grants: each is refused (AUTH_FAILED) and the connection kept.
    forged = Grant(GrantOp.READ, 1, 0, 4096, 2**62, b"k", b"\0" * 16)
    forged_read = frames.TransferDesc(forged, 0, 0, 4096).pack()
    bad_read = frames.pack_header(frames.Op.READ, 1, len(forged_read)) + forged_read
    # A WRITE announcing a 16 MiB part, 256 KiB of it sent: the store drains it through its scratch buffer
    # and waits for the rest, holding nothing but its buffers.
    forged_write = frames.TransferDesc(
        Grant(GrantOp.WRITE, 1, 0, 16 * MiB, 2**62, b"k", b"\0" * 16), 0, 0, 16 * MiB
    ).pack()
    big_write = frames.pack_header(frames.Op.WRITE, 2, len(forged_write) + 16 * MiB) + forged_write
    for i in range(FLOOD_CONNECTIONS):
        sock = socket.create_connection(_endpoint(store.address), timeout=5)
        sockets.append(sock)
        _send_nowait(sock, (bad_read * 2000) if i % 2 else big_write + b"\0" * (256 * KiB))
    wait_for(lambda: _connections(store.endpoints["metrics"]) >= FLOOD_CONNECTIONS, 30.0, "every flood connection")
    peak = rss_anon(store.pid)
    print(
        f'\nRELIABILITY {{"fault": "store flood", "connections": {FLOOD_CONNECTIONS}, '
        f'"rss_anon_growth_mib": {(peak - before) / MiB:.1f}, '
        f'"bound_mib": {STORE_FLOOD_BOUND / MiB:.0f}}}'
    )
    assert peak - before < STORE_FLOOD_BOUND
    for s in sockets:
        s.close()
    with _client(cluster) as c:  # and it still serves
        assert c.put("after", b"a" * 1000) == 0


def _connections(metrics: str) -> float:
    import urllib.request

    body = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
    return next(float(line.split()[1]) for line in body.splitlines() if line.startswith("kvpool_store_connections "))


MASTER_FLOOD_BATCH = 1024


@pytest.mark.parametrize("with_token", [False, True], ids=["open", "token-no-hello"])
def test_master_memory_stays_bounded_under_a_flood(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path, sockets: list[socket.socket], with_token: bool
) -> None:
    """Open cluster: the bound is connections x the largest legal request. With a token, a flood that never
    says HELLO is refused at each frame's header: its payloads are never buffered."""
    token = tmp_path / "token"
    token.write_bytes(b"flood-token")
    cluster = make_cluster(
        stores=1,
        store_size="32MiB",
        master_args=("--max-batch", str(MASTER_FLOOD_BATCH)),
        token_file=str(token) if with_token else "",
    )
    master = cluster.masters[0]
    # A client holding a token refuses a master that cannot prove it (decision 0025): the open cluster's has none.
    with _client(cluster, token_file=str(token) if with_token else "") as c:
        c.stats()
        info = c._master.info
        assert info is not None
        rpc = _endpoint(info.rpc_endpoint)
    from kvpool.master.config import MasterConfig
    from kvpool.master.limits import max_request_payload

    per_connection = max_request_payload(MasterConfig(max_batch=MASTER_FLOOD_BATCH))
    bound = 32 * MiB if with_token else FLOOD_CONNECTIONS * per_connection + 64 * MiB
    before = rss_anon(master.pid)
    keys = [f"{i:0>500}" for i in range(MASTER_FLOOD_BATCH)]
    request = pb.BatchExistsRequest(keys=keys).SerializeToString()
    frame = frames.pack_header(frames.Op.BATCH_EXISTS, 1, len(request)) + request
    huge = frames.pack_header(frames.Op.BATCH_EXISTS, 1, per_connection + 1)  # over the cap: closed at once
    # The worst case: the largest legal request, all but its last byte (the master must buffer it whole).
    partial = frames.pack_header(frames.Op.BATCH_EXISTS, 1, per_connection) + b"\0" * (per_connection - 1)
    for i in range(FLOOD_CONNECTIONS):
        sock = socket.create_connection(rpc, timeout=5)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # never read: replies back up at once
        sockets.append(sock)
        _send_nowait(sock, (huge, frame * 8, partial)[i % 3])
    deadline = time.monotonic() + 5.0
    peak = before
    while time.monotonic() < deadline:  # the master reads what it will; sample its memory meanwhile
        peak = max(peak, rss_anon(master.pid))
        time.sleep(0.1)  # paces the memory samples over a fixed window
    print(
        f'\nRELIABILITY {{"fault": "master framed flood{" without the token" if with_token else ""}", '
        f'"connections": {FLOOD_CONNECTIONS}, '
        f'"rss_anon_growth_mib": {(peak - before) / MiB:.1f}, "bound_mib": {bound / MiB:.0f}}}'
    )
    assert peak - before < bound
    for s in sockets:
        s.close()
    with _client(cluster, token_file=str(token) if with_token else "") as c:
        assert c.batch_exists(["x"]) == [0]
