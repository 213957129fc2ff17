"""Type-2 memory windows through the compiled verbs layer (decision 0020, 0027): ``ibv_alloc_mw``, an
IBV_WR_BIND_MW work request posted with ``ibv_post_send`` on the store's QP, IBV_WR_LOCAL_INV and
``ibv_dealloc_mw``, all through the extension's FAKE provider, whose FAKE NIC enforces the window as an HCA
does: its rkey reaches the bound range only, through the QP it is bound to only, with its access only.

The real-device half (the same calls into a real provider) cannot run here: tests/integration/test_rdma_real.py
has the opt-in hardware check.
"""

from __future__ import annotations

import ctypes
import errno
from dataclasses import dataclass

import pytest

from kvpool.transfer.verbs import (
    Access,
    MemoryRegion,
    Mtu,
    Opcode,
    QpInfo,
    QpState,
    VerbsError,
    WcStatus,
    WorkRequest,
)
from kvpool.transfer.verbs_fake import FakeContext, FakeCQ, FakeFabric, FakeMR, FakeQP, FakeVerbs
from kvpool.transfer.verbs_native import NativeWindow, WindowState, native_built, window_usable

pytestmark = pytest.mark.skipif(not native_built(), reason="kvpool.transfer._verbs is not built (libibverbs-dev)")

SEG = 64 << 10
LO, LEN = 8192, 4096


def _address(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


@dataclass
class Link:
    """A client QP connected to its own store QP (one client of the store)."""

    qp: FakeQP
    cq: FakeCQ
    store_qp: FakeQP
    buf: bytearray
    mr: FakeMR
    wr_id: int = 0

    def post(self, opcode: Opcode, remote_addr: int, rkey: int, length: int) -> WcStatus:
        self.wr_id += 1
        wr = WorkRequest(self.wr_id, opcode, self.mr.addr, length, self.mr.lkey, remote_addr, rkey)
        self.qp.post_send(wr)
        (completion,) = self.cq.poll(4)
        return completion.status


@dataclass
class Store:
    fabric: FakeFabric
    ctx: FakeContext
    cq: FakeCQ
    segment: bytearray
    mr: MemoryRegion

    def link(self) -> Link:
        client = FakeVerbs(self.fabric, devices=("c",), native=True).open("c")
        cq = client.create_cq(8)
        qp = client.create_qp(cq, 8)
        store_qp = self.ctx.create_qp(self.cq, 8)
        qp.to_init(Access.LOCAL_WRITE)
        store_qp.to_init(Access.LOCAL_WRITE | Access.REMOTE_READ | Access.REMOTE_WRITE)
        qp.to_rtr(QpInfo(store_qp.qp_num, self.ctx.lid, self.ctx.gid, 5, Mtu.MTU_4096), Mtu.MTU_4096)
        store_qp.to_rtr(QpInfo(qp.qp_num, client.lid, client.gid, 3, Mtu.MTU_4096), Mtu.MTU_4096)
        qp.to_rts(3)
        store_qp.to_rts(5)
        buf = bytearray(SEG)
        mr = client.reg_mr(_address(buf), SEG, Access.LOCAL_WRITE)
        return Link(qp, cq, store_qp, buf, mr)

    def bind(self, link: Link, access: Access = Access.REMOTE_READ, mr: MemoryRegion | None = None) -> NativeWindow:
        window = self.ctx.bind_window(mr or self.mr, link.store_qp, self.mr.addr + LO, LEN, access)
        assert isinstance(window, NativeWindow)
        return window


def _state(window: NativeWindow) -> WindowState:
    return window.state  # read afresh: a flush changes it


def _store(mr_access: Access = Access.LOCAL_WRITE | Access.MW_BIND) -> Store:
    fabric = FakeFabric()
    ctx = FakeVerbs(fabric, devices=("s",), native=True).open("s")
    segment = bytearray(bytes(range(256)) * (SEG // 256))
    mr = ctx.reg_mr(_address(segment), SEG, mr_access)
    return Store(fabric, ctx, ctx.create_cq(64), segment, mr)


def test_a_window_is_bound_by_a_work_request_and_usable_only_after_its_completion() -> None:
    store = _store()
    link = store.link()
    window = store.bind(link)
    assert _state(window) == WindowState.BINDING
    assert not window_usable(window)
    store.ctx.flush_windows()
    assert window.usable
    assert window_usable(window)
    assert window.rkey & 0xFF == 1  # ibv_inc_rkey: the fresh window's tag moved by one
    assert link.post(Opcode.RDMA_READ, window.addr, window.rkey, LEN) == WcStatus.SUCCESS
    assert link.buf[:LEN] == store.segment[LO : LO + LEN]
    assert store.fabric.bytes_moved == LEN


@pytest.mark.parametrize(("offset", "length"), [(-1, 16), (LEN - 15, 16), (0, LEN + 1)])
def test_a_byte_outside_the_window_is_a_remote_access_error_and_nothing_moves(offset: int, length: int) -> None:
    store = _store()
    link = store.link()
    window = store.bind(link)
    store.ctx.flush_windows()
    assert link.post(Opcode.RDMA_READ, window.addr + offset, window.rkey, length) == WcStatus.REM_ACCESS_ERR
    assert store.fabric.bytes_moved == 0
    assert not any(link.buf)
    assert link.store_qp.state == QpState.ERR  # the violation kills the store's side of the connection too


def test_the_segments_own_rkey_reaches_nothing() -> None:
    store = _store()
    link = store.link()
    store.ctx.flush_windows()
    assert link.post(Opcode.RDMA_READ, store.mr.addr + LO, store.mr.rkey, LEN) == WcStatus.REM_ACCESS_ERR
    assert store.fabric.bytes_moved == 0


def test_another_clients_qp_cannot_use_the_window() -> None:
    store = _store()
    mine, theirs = store.link(), store.link()
    window = store.bind(mine)
    store.ctx.flush_windows()
    assert theirs.post(Opcode.RDMA_READ, window.addr, window.rkey, LEN) == WcStatus.REM_ACCESS_ERR
    assert store.fabric.bytes_moved == 0
    assert mine.post(Opcode.RDMA_READ, window.addr, window.rkey, LEN) == WcStatus.SUCCESS


def test_a_read_window_refuses_a_write_and_a_write_window_takes_one() -> None:
    store = _store()
    link = store.link()
    window = store.bind(link, Access.REMOTE_READ)
    store.ctx.flush_windows()
    link.buf[:LEN] = b"w" * LEN
    assert link.post(Opcode.RDMA_WRITE, window.addr, window.rkey, LEN) == WcStatus.REM_ACCESS_ERR
    assert store.segment[LO : LO + LEN] != b"w" * LEN
    other = store.link()
    writable = store.bind(other, Access.REMOTE_WRITE)
    store.ctx.flush_windows()
    other.buf[:LEN] = b"w" * LEN
    assert other.post(Opcode.RDMA_WRITE, writable.addr, writable.rkey, LEN) == WcStatus.SUCCESS
    assert store.segment[LO : LO + LEN] == b"w" * LEN


def test_an_invalidated_window_stops_working() -> None:
    store = _store()
    link = store.link()
    window = store.bind(link)
    store.ctx.flush_windows()
    assert link.post(Opcode.RDMA_READ, window.addr, window.rkey, LEN) == WcStatus.SUCCESS
    window.close()  # IBV_WR_LOCAL_INV on the store's QP
    assert _state(window) == WindowState.INVALIDATING
    store.ctx.flush_windows()
    assert window.state == WindowState.CLOSED
    assert window.mw == 0
    assert link.post(Opcode.RDMA_READ, window.addr, window.rkey, LEN) == WcStatus.REM_ACCESS_ERR
    window.close()  # twice: nothing more happens


def test_a_window_closed_before_its_bind_completed_never_becomes_usable() -> None:
    store = _store()
    link = store.link()
    window = store.bind(link)
    window.close()
    store.ctx.flush_windows()
    assert window.state == WindowState.CLOSED
    assert not window_usable(window)


def test_an_mr_without_mw_bind_access_refuses_the_bind() -> None:
    store = _store(Access.LOCAL_WRITE)
    link = store.link()
    window = store.bind(link)
    store.ctx.flush_windows()
    assert window.state == WindowState.CLOSED
    assert not window_usable(window)
    assert link.store_qp.state == QpState.ERR
    assert link.post(Opcode.RDMA_READ, window.addr, window.rkey, LEN) != WcStatus.SUCCESS
    assert store.fabric.bytes_moved == 0


def test_a_writable_window_needs_a_locally_writable_mr() -> None:
    store = _store(Access.MW_BIND)
    link = store.link()
    window = store.bind(link, Access.REMOTE_WRITE)
    store.ctx.flush_windows()
    assert not window_usable(window)


def test_bad_binds_are_clear_errors_and_post_nothing() -> None:
    store = _store()
    link = store.link()
    other = FakeVerbs(store.fabric, devices=("o",), native=True).open("o")
    foreign = other.reg_mr(store.mr.addr, SEG, Access.LOCAL_WRITE | Access.MW_BIND)
    for mr, qp, length, access in (
        (store.mr, link.store_qp, 0, Access.REMOTE_READ),  # empty
        (store.mr, link.store_qp, LEN, Access.REMOTE_READ | Access.MW_BIND),  # not a window's access
        (foreign, link.store_qp, LEN, Access.REMOTE_READ),  # another context's MR
        (store.mr, link.qp, LEN, Access.REMOTE_READ),  # another context's QP
    ):
        with pytest.raises(VerbsError) as caught:
            store.ctx.bind_window(mr, qp, store.mr.addr + LO, length, access)
        assert caught.value.errno == errno.EINVAL
    store.ctx.flush_windows()
    assert link.store_qp.state == QpState.RTS  # nothing reached the NIC


def test_a_bind_on_a_destroyed_qp_is_refused_and_closing_the_context_frees_its_windows() -> None:
    store = _store()
    link = store.link()
    pending = store.bind(link)
    link.store_qp.close()
    with pytest.raises(VerbsError):
        store.bind(link)
    store.ctx.close()  # the binder deallocates what is still pending
    assert pending.state == WindowState.CLOSED
    assert pending.mw == 0


def test_a_bind_whose_qp_is_destroyed_before_it_completes_is_flushed_not_awaited() -> None:
    store = _store()
    link = store.link()
    window = store.bind(link)
    link.store_qp.close()  # before the FAKE NIC took the request: it never completes
    store.ctx.flush_windows()  # returns at once instead of waiting out WINDOW_COMPLETION_TIMEOUT_S
    assert _state(window) == WindowState.CLOSED
    assert window.mw == 0
