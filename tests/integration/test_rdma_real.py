"""Opt-in: real RDMA READ/WRITE through the real verbs layers - pyverbs, and the compiled layer
(kvpool.transfer.verbs_native over _verbs.c, decision 0027) - on a real device, in loopback.

Runs only when ``KVPOOL_TEST_RDMA_DEVICE`` names a device (``mlx5_0``, or ``mlx5_0:PORT:GID_INDEX`` for RoCE,
e.g. ``mlx5_0:1:3``); otherwise it is skipped with that reason. The store side (RdmaResponder over a
registered mmap "segment", behind a loopback TCP control channel) and the client side (RdmaTransport) open the
same device, so one machine with one NIC is enough. See docs/rdma.md for the host setup (memlock ulimit, GID
index, MTU).
"""

from __future__ import annotations

import mmap
import os
import socket
import threading
from collections.abc import Iterator

import pytest

from kvpool.common.clock import Deadline
from kvpool.common.envs import KVPOOL_TEST_RDMA_DEVICE
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.grants import GrantOp, new_secret, sign
from kvpool.proto import frames
from kvpool.proto.frames import Op
from kvpool.transfer.base import Replica, TransferRequest
from kvpool.transfer.verbs import CompletionQueue, PyverbsVerbs, QueuePair, Verbs, WcStatus

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not KVPOOL_TEST_RDMA_DEVICE.is_set(),
        reason="opt-in: set KVPOOL_TEST_RDMA_DEVICE=<device>[:port[:gid_index]] (e.g. mlx5_0) to run real RDMA",
    ),
]

MiB = 1 << 20
SEG_ID = 0x7E57
FAR_FUTURE_MS = 4_000_000_000_000


def _device() -> tuple[str, int, int]:
    name, _, rest = KVPOOL_TEST_RDMA_DEVICE.get().partition(":")
    port, _, gid = rest.partition(":")
    return name, int(port or 1), int(gid or 0)


class _Segment:
    def __init__(self, size: int) -> None:
        self.mm = mmap.mmap(-1, size)
        self.view = memoryview(self.mm)
        self.size = size


def _serve(listener: socket.socket, responder: object) -> None:
    """The data plane's RDMA_CONNECT hook, reduced to its essentials (no token)."""
    from kvpool.transfer.rdma import RdmaResponder

    assert isinstance(responder, RdmaResponder)
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        conn_id = object()
        try:
            while True:
                head = frames.recv_header(conn)
                payload = bytes(frames.recv_exact(conn, head.length))
                if head.op != Op.RDMA_CONNECT:
                    break
                status, body = responder.handle_connect(payload, conn_id=conn_id)
                conn.sendall(frames.pack_header(head.op, head.req_id, len(body), status) + body)
        except (KvPoolError, OSError):
            pass
        finally:
            responder.release(conn_id)
            conn.close()


def _verbs(kind: str) -> Verbs:
    """The real verbs layer ``kind`` names; the test fails (never skips) when the device was asked for and the
    layer cannot load."""
    if kind == "native":
        from kvpool.transfer.verbs_native import NativeVerbs, native_built

        if not native_built():
            pytest.fail(
                "KVPOOL_TEST_RDMA_DEVICE is set but kvpool.transfer._verbs is not built: install libibverbs-dev "
                "and rebuild (python setup.py build_ext --inplace)"
            )
        return NativeVerbs()
    try:
        import pyverbs  # noqa: F401
    except ImportError as exc:
        pytest.fail(
            f"KVPOOL_TEST_RDMA_DEVICE is set but pyverbs is not importable ({exc}); expose Debian's "
            "python3-pyverbs to the venv as docs/rdma.md shows"
        )
    return PyverbsVerbs()


@pytest.fixture(params=["pyverbs", "native"])
def loopback(request: pytest.FixtureRequest) -> Iterator[tuple[object, _Segment, bytes, str]]:
    from kvpool.transfer.rdma import RdmaResponder, RdmaTransport
    from kvpool.transfer.verbs import discover_devices

    device, port, gid_index = _device()
    verbs = _verbs(request.param)
    devices = discover_devices(verbs)
    if device not in devices:
        pytest.fail(f"KVPOOL_TEST_RDMA_DEVICE={device} but the devices here are {devices or 'none'}")
    segment = _Segment(32 * MiB)
    secret = new_secret()
    responder = RdmaResponder(
        verbs,
        {SEG_ID: segment},
        {SEG_ID: secret},
        device=device,
        port=port,
        gid_index=gid_index,
        max_mr_bytes=8 * MiB,
    )
    listener = socket.create_server(("127.0.0.1", 0))
    endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
    threading.Thread(target=_serve, args=(listener, responder), daemon=True).start()
    transport = RdmaTransport(verbs, device, 4 * MiB, port=port, gid_index=gid_index)
    transport.note_store_info(endpoint, {"rdma": responder.advertisement()})
    try:
        yield transport, segment, secret, endpoint
    finally:
        transport.close()
        listener.shutdown(socket.SHUT_RDWR)  # wakes the serving thread's accept()
        listener.close()
        responder.close()


def _request(op: GrantOp, key: bytes, offset: int, buf: bytearray, secret: bytes, endpoint: str) -> TransferRequest:
    mac = sign(secret, op, SEG_ID, offset, len(buf), FAR_FUTURE_MS, key)
    replica = Replica(SEG_ID, "loopback", endpoint, "", offset, len(buf), FAR_FUTURE_MS, mac)
    return TransferRequest(op, key, replica, memoryview(buf))


def test_real_loopback_write_then_read(loopback: tuple[object, _Segment, bytes, str]) -> None:
    from kvpool.transfer.rdma import RdmaTransport

    transport, segment, secret, endpoint = loopback
    assert isinstance(transport, RdmaTransport)
    data = bytearray(os.urandom(10 * MiB))
    back = bytearray(10 * MiB)
    transport.register_memory(memoryview(data))
    transport.register_memory(memoryview(back))
    offset = 6 * MiB  # straddles the store's 8 MiB MR boundary; the client's MRs are 4 MiB
    assert transport.can_reach(_request(GrantOp.WRITE, b"k", offset, data, secret, endpoint).replica)
    before = transport.stats.work_requests
    write = _request(GrantOp.WRITE, b"k", offset, data, secret, endpoint)
    assert transport.transfer([write], Deadline(10.0)) == [ErrorCode.OK]
    assert transport.stats.work_requests - before >= 3
    assert segment.view[offset : offset + len(data)] == data  # landed in the store's memory, byte for byte
    read = _request(GrantOp.READ, b"k", offset, back, secret, endpoint)
    assert transport.transfer([read], Deadline(10.0)) == [ErrorCode.OK]
    assert back == data


def test_real_many_small_objects(loopback: tuple[object, _Segment, bytes, str]) -> None:
    from kvpool.transfer.rdma import RdmaTransport

    transport, segment, secret, endpoint = loopback
    assert isinstance(transport, RdmaTransport)
    size, n = 128 * 1024, 64
    pages = [bytearray(os.urandom(size)) for _ in range(n)]
    backs = [bytearray(size) for _ in range(n)]
    writes = [_request(GrantOp.WRITE, b"p%d" % i, i * size, pages[i], secret, endpoint) for i in range(n)]
    assert transport.transfer(writes, Deadline(10.0)) == [ErrorCode.OK] * n
    reads = [_request(GrantOp.READ, b"p%d" % i, i * size, backs[i], secret, endpoint) for i in range(n)]
    assert transport.transfer(reads, Deadline(10.0)) == [ErrorCode.OK] * n
    assert backs == pages


# ---- type-2 memory windows through the compiled layer (decision 0020): what the FAKE NIC models, on a real HCA
WINDOW_AT, WINDOW_LEN = 64 * 1024, 16 * 1024


class _WindowRig:
    """One device, loopback: a "store" QP that binds windows over a registered segment, and "client" QPs
    connected to store QPs of their own, each reading through its CQ."""

    def __init__(self) -> None:
        from kvpool.transfer.verbs import Access
        from kvpool.transfer.verbs_native import NativeContext

        device, port, gid_index = _device()
        ctx = _verbs("native").open(device, port, gid_index)
        assert isinstance(ctx, NativeContext)
        self.ctx = ctx
        if not ctx.supports_windows:
            ctx.close()
            pytest.skip(f"{device} reports no type-2 memory windows (device_cap_flags / max_mw)")
        self.segment = _Segment(1 * MiB)
        self.segment.view[:] = bytes(range(256)) * (MiB // 256)
        from kvpool.transfer.verbs import buffer_address

        self.seg_mr = ctx.reg_mr(buffer_address(self.segment.view), MiB, Access.LOCAL_WRITE | Access.MW_BIND)
        self.local = _Segment(1 * MiB)
        self.local_mr = ctx.reg_mr(buffer_address(self.local.view), MiB, Access.LOCAL_WRITE)
        self.store_cq = ctx.create_cq(256)
        self.closing: list[QueuePair | CompletionQueue] = []

    def link(self) -> tuple[QueuePair, CompletionQueue, QueuePair]:
        """(client QP, its CQ, the store QP it is connected to), both RTS."""
        import secrets as random

        from kvpool.transfer.verbs import Access, QpInfo

        cq = self.ctx.create_cq(16)
        client = self.ctx.create_qp(cq, 16)
        store = self.ctx.create_qp(self.store_cq, 64)
        port = self.ctx.port_info()
        client.to_init(Access.LOCAL_WRITE)
        store.to_init(Access.LOCAL_WRITE | Access.REMOTE_READ | Access.REMOTE_WRITE)
        client_psn, store_psn = random.randbits(24), random.randbits(24)
        client.to_rtr(QpInfo(store.qp_num, port.lid, port.gid, store_psn, port.mtu), port.mtu)
        store.to_rtr(QpInfo(client.qp_num, port.lid, port.gid, client_psn, port.mtu), port.mtu)
        client.to_rts(client_psn)
        store.to_rts(store_psn)
        self.closing += [client, store, cq]
        return client, cq, store

    def read(self, client: QueuePair, cq: CompletionQueue, addr: int, rkey: int, length: int) -> WcStatus:
        from kvpool.transfer.verbs import Opcode, WorkRequest

        client.post_send(WorkRequest(1, Opcode.RDMA_READ, self.local_mr.addr, length, self.local_mr.lkey, addr, rkey))
        deadline = Deadline(10.0)
        while not deadline.expired():
            polled = cq.poll(1)
            if polled:
                return polled[0].status
        pytest.fail("no completion within 10 s")

    def close(self) -> None:
        for obj in self.closing:
            obj.close()
        self.seg_mr.close()
        self.local_mr.close()
        self.store_cq.close()
        self.ctx.close()


@pytest.fixture
def windows() -> Iterator[_WindowRig]:
    rig = _WindowRig()
    try:
        yield rig
    finally:
        rig.close()


def test_real_window_reaches_its_range_through_its_qp_only(windows: _WindowRig) -> None:
    from kvpool.transfer.verbs import Access
    from kvpool.transfer.verbs_native import window_usable

    rig = windows
    client, cq, store = rig.link()
    at = rig.seg_mr.addr + WINDOW_AT
    window = rig.ctx.bind_window(rig.seg_mr, store, at, WINDOW_LEN, Access.REMOTE_READ)
    rig.ctx.flush_windows()
    assert window_usable(window)
    assert rig.read(client, cq, at, window.rkey, WINDOW_LEN) == WcStatus.SUCCESS
    assert rig.local.view[:WINDOW_LEN] == rig.segment.view[WINDOW_AT : WINDOW_AT + WINDOW_LEN]
    other, other_cq, _ = rig.link()  # another client's QP: the window is not bound to its store QP
    assert rig.read(other, other_cq, at, window.rkey, WINDOW_LEN) == WcStatus.REM_ACCESS_ERR
    beyond, beyond_cq, _ = rig.link()
    assert rig.read(beyond, beyond_cq, at, rig.seg_mr.rkey, WINDOW_LEN) == WcStatus.REM_ACCESS_ERR  # no remote MR
    window.close()  # IBV_WR_LOCAL_INV
    rig.ctx.flush_windows()
    assert rig.read(client, cq, at, window.rkey, WINDOW_LEN) == WcStatus.REM_ACCESS_ERR


def test_real_window_refuses_a_byte_past_its_range(windows: _WindowRig) -> None:
    from kvpool.transfer.verbs import Access

    rig = windows
    client, cq, store = rig.link()
    at = rig.seg_mr.addr + WINDOW_AT
    window = rig.ctx.bind_window(rig.seg_mr, store, at, WINDOW_LEN, Access.REMOTE_READ)
    rig.ctx.flush_windows()
    assert rig.read(client, cq, at, window.rkey, WINDOW_LEN + 1) == WcStatus.REM_ACCESS_ERR
