"""Per-grant memory windows (decision 0020) with the FAKE NIC: a client's QP reaches exactly what a valid grant
allows, with the grant's access, until it expires or is revoked - checked by the NIC, not by the client."""

from __future__ import annotations

import json
import mmap
import secrets
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvpool.common.clock import ManualClock
from kvpool.common.errors import ErrorCode
from kvpool.common.grants import Grant, GrantOp, new_secret, sign
from kvpool.transfer.rdma_responder import RdmaResponder
from kvpool.transfer.rdma_windows import WINDOW_GRACE_MS
from kvpool.transfer.rdma_wire import _encode, grant_to_json, qp_info_from_json, qp_info_to_json
from kvpool.transfer.verbs import Access, Opcode, QpInfo, QueuePair, WcStatus, WorkRequest, buffer_address
from kvpool.transfer.verbs_fake import FakeCQ, FakeFabric, FakeMR, FakeVerbs
from kvpool.transfer.verbs_native import native_built

SEG = 7
SEG_SIZE = 1 << 20
KEY = b"page-1"


class _Segment:
    def __init__(self, size: int) -> None:
        self._mm = mmap.mmap(-1, size)
        self.view = memoryview(self._mm)
        self.size = size


@dataclass
class Peer:
    """A client QP connected to the responder, and a registered local buffer."""

    qp: QueuePair
    cq: FakeCQ
    buf: bytearray
    mr: FakeMR
    next_wr: int = 0

    def post(self, opcode: Opcode, remote_addr: int, rkey: int, length: int) -> WcStatus:
        self.next_wr += 1
        self.qp.post_send(WorkRequest(self.next_wr, opcode, self.mr.addr, length, self.mr.lkey, remote_addr, rkey))
        (completion,) = self.cq.poll(4)
        return completion.status


@dataclass
class Rig:
    clock: ManualClock
    secret: bytes
    segment: _Segment
    responder: RdmaResponder
    fabric: FakeFabric
    native: bool = False

    def grant(self, op: GrantOp, offset: int, length: int, ttl_ms: int = 5000) -> Grant:
        expiry = self.clock.wall_ms() + ttl_ms
        mac = sign(self.secret, op, SEG, offset, length, expiry, KEY)
        return Grant(op, SEG, offset, length, expiry, KEY, mac)

    def connect(self, conn_id: str, grant: Grant) -> Peer:
        ctx = FakeVerbs(self.fabric).open("fake_mlx5_0")
        cq = ctx.create_cq(8)
        qp = ctx.create_qp(cq, 8)
        qp.to_init(Access.LOCAL_WRITE)
        port = ctx.port_info()
        local = QpInfo(qp.qp_num, port.lid, port.gid, secrets.randbits(24), port.mtu)
        request = {"qp": qp_info_to_json(local), "access": "rw", "grants": [grant_to_json(grant)]}
        code, body = self.responder.handle_connect(_encode(request), conn_id=conn_id)
        assert code == ErrorCode.OK, body
        doc = json.loads(body)
        assert doc["windows"] is True
        assert doc["regions"] == []  # no rkey for the whole segment
        qp.to_rtr(qp_info_from_json(doc["qp"]), port.mtu)
        qp.to_rts(local.psn)
        buf = bytearray(SEG_SIZE)
        mr = ctx.reg_mr(buffer_address(memoryview(buf)), SEG_SIZE, Access.LOCAL_WRITE)
        assert isinstance(cq, FakeCQ)
        assert isinstance(mr, FakeMR)
        return Peer(qp, cq, buf, mr)

    def window(self, conn_id: str, grant: Grant) -> tuple[int, int]:
        ((code, regions),) = self.responder.bind_windows(conn_id, [grant])
        assert code == ErrorCode.OK
        (region,) = regions
        assert (region["offset"], region["length"]) == (grant.offset, grant.length)
        return region["addr"], region["rkey"]


@pytest.fixture(params=["native", "python"])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    """The responder's windows bound by BIND_MW work requests through the compiled fake provider (native,
    where the extension is built), or by the Python FAKE NIC directly."""
    native = request.param == "native"
    if native and not native_built():
        pytest.skip("kvpool.transfer._verbs is not built")
    fabric = FakeFabric()
    clock = ManualClock()
    secret = new_secret()
    segment = _Segment(SEG_SIZE)
    segment.view[:] = bytes(range(256)) * (SEG_SIZE // 256)
    verbs = FakeVerbs(fabric, native=native)
    responder = RdmaResponder(verbs, {SEG: segment}, {SEG: secret}, windows=True, clock=clock)
    assert responder.windows is not None
    yield Rig(clock, secret, segment, responder, fabric, native)
    responder.close()


def test_a_window_reaches_exactly_the_granted_range(rig: Rig) -> None:
    grant = rig.grant(GrantOp.READ, 4096, 8192)
    peer = rig.connect("c1", grant)
    addr, rkey = rig.window("c1", grant)
    assert peer.post(Opcode.RDMA_READ, addr, rkey, 8192) == WcStatus.SUCCESS
    assert bytes(peer.buf[:8192]) == bytes(rig.segment.view[4096 : 4096 + 8192])


def test_a_bind_the_nic_fails_gets_no_window(rig: Rig) -> None:
    if not rig.native:
        pytest.skip("the Python FAKE NIC binds at once, without a work request that could fail")
    grant = rig.grant(GrantOp.READ, 4096, 8192)
    peer = rig.connect("c1", grant)
    addr, rkey = rig.window("c1", grant)
    assert peer.post(Opcode.RDMA_READ, addr, rkey, 8193) == WcStatus.REM_ACCESS_ERR  # the store's QP goes to ERR
    bound = rig.responder.windows.bound if rig.responder.windows else 0
    ((code, regions),) = rig.responder.bind_windows("c1", [rig.grant(GrantOp.READ, 0, 4096)])
    assert code == ErrorCode.TRANSFER_FAILED  # the bind completed with WR_FLUSH_ERR: no rkey leaves
    assert regions == []
    assert rig.responder.windows is not None
    assert rig.responder.windows.bound == bound


@pytest.mark.parametrize(("shift", "length"), [(8192, 1), (-1, 2), (0, 8193)], ids=["after", "before", "longer"])
def test_a_byte_outside_the_window_is_a_remote_access_error(rig: Rig, shift: int, length: int) -> None:
    grant = rig.grant(GrantOp.READ, 4096, 8192)
    peer = rig.connect("c1", grant)
    addr, rkey = rig.window("c1", grant)
    assert peer.post(Opcode.RDMA_READ, addr + shift, rkey, length) == WcStatus.REM_ACCESS_ERR
    assert peer.buf[:length] == bytes(length)  # nothing landed


def test_a_read_grant_window_refuses_writes(rig: Rig) -> None:
    grant = rig.grant(GrantOp.READ, 0, 4096)
    peer = rig.connect("c1", grant)
    addr, rkey = rig.window("c1", grant)
    before = bytes(rig.segment.view[:4096])
    peer.buf[:4096] = b"\xee" * 4096
    assert peer.post(Opcode.RDMA_WRITE, addr, rkey, 4096) == WcStatus.REM_ACCESS_ERR
    assert bytes(rig.segment.view[:4096]) == before


def test_the_window_dies_a_grace_after_the_grant_expires(rig: Rig) -> None:
    grant = rig.grant(GrantOp.READ, 0, 4096, ttl_ms=1000)
    peer = rig.connect("c1", grant)
    addr, rkey = rig.window("c1", grant)
    assert rig.responder.windows is not None
    # Work posted just before the expiry may still be on the NIC: the window outlives the grant by the grace.
    rig.clock.advance(1.001)
    assert rig.responder.windows.sweep() == 0
    assert peer.post(Opcode.RDMA_READ, addr, rkey, 4096) == WcStatus.SUCCESS
    rig.clock.advance(WINDOW_GRACE_MS / 1000)
    assert rig.responder.windows.sweep() == 1
    assert peer.post(Opcode.RDMA_READ, addr, rkey, 4096) == WcStatus.REM_ACCESS_ERR


def test_a_grant_that_expired_while_connecting_admits_a_qp_but_gets_no_window(rig: Rig) -> None:
    grant = rig.grant(GrantOp.READ, 0, 4096, ttl_ms=10)
    rig.clock.advance(0.02)
    peer = rig.connect("c1", grant)  # admitted: the QP reaches nothing without a window
    base = buffer_address(rig.segment.view)
    segment_mr = next(mr for mr in rig.responder._mrs[SEG])  # noqa: SLF001 - the MR a peer must not use
    assert peer.post(Opcode.RDMA_READ, base, segment_mr.rkey, 4096) == WcStatus.REM_ACCESS_ERR


def test_a_removed_segment_and_a_closed_connection_take_their_windows(rig: Rig) -> None:
    grant = rig.grant(GrantOp.READ, 0, 4096)
    peer = rig.connect("c1", grant)
    addr, rkey = rig.window("c1", grant)
    assert rig.responder.windows is not None
    assert rig.responder.windows.live() == 1
    rig.responder.release("c1")
    assert rig.responder.windows.live() == 0
    assert peer.post(Opcode.RDMA_READ, addr, rkey, 4096) != WcStatus.SUCCESS
    peer2 = rig.connect("c2", grant)
    addr, rkey = rig.window("c2", grant)
    rig.responder.remove_segment(SEG)
    assert rig.responder.windows.live() == 0
    assert peer2.post(Opcode.RDMA_READ, addr, rkey, 4096) != WcStatus.SUCCESS


def test_a_window_works_only_through_the_qp_it_was_bound_to(rig: Rig) -> None:
    grant = rig.grant(GrantOp.READ, 0, 4096)
    rig.connect("c1", grant)
    other = rig.connect("c2", grant)
    addr, rkey = rig.window("c1", grant)
    assert other.post(Opcode.RDMA_READ, addr, rkey, 4096) == WcStatus.REM_ACCESS_ERR


def test_the_whole_segment_rkey_is_not_remotely_accessible(rig: Rig) -> None:
    grant = rig.grant(GrantOp.READ, 0, 4096)
    peer = rig.connect("c1", grant)
    base = buffer_address(rig.segment.view)
    segment_mr = next(mr for mr in rig.responder._mrs[SEG])  # noqa: SLF001 - the MR a peer must not use
    assert peer.post(Opcode.RDMA_READ, base, segment_mr.rkey, 4096) == WcStatus.REM_ACCESS_ERR


def test_bind_refuses_a_write_on_a_read_only_connection_and_an_unknown_connection(rig: Rig) -> None:
    read = rig.grant(GrantOp.READ, 0, 4096)
    rig.connect("c1", read)
    write = rig.grant(GrantOp.WRITE, 0, 4096)
    assert rig.responder.bind_windows("c1", [write])[0][0] == ErrorCode.AUTH_FAILED
    assert rig.responder.bind_windows("nobody", [read])[0][0] == ErrorCode.AUTH_FAILED


def test_a_large_batch_of_long_keys_is_cut_into_frames_the_store_accepts() -> None:
    from kvpool.transfer.rdma_windows import _frames
    from kvpool.transfer.rdma_wire import MAX_CONNECT_PAYLOAD, windows_request_from_json, windows_request_to_json

    key = b"k" * 512
    items = [(Grant(GrantOp.READ, SEG, i * 4096, 4096, 2**41, key, b"\xab" * 16), 2**64 - 1) for i in range(300)]
    parts = _frames(list(range(300)), items)
    assert sorted(n for part in parts for n in part) == list(range(300))
    for part in parts:
        payload = windows_request_to_json([items[n] for n in part])
        assert len(payload) <= MAX_CONNECT_PAYLOAD
        assert len(windows_request_from_json(payload)) == len(part)
