"""The compiled verbs layer (kvpool.transfer._verbs, decision 0027) through its FAKE provider: the chain of
work requests built in C and posted through ``ibv_post_send`` into the fake provider, which checks the QP state,
the send-queue room and injected refusals as a provider does, before the FAKE NIC executes what it recorded.
Each check is compared with the Python posting path on the same fake, which must behave the same.

The real-device half of the layer (NativeVerbs) cannot run here (no RDMA device): it is exercised by the
opt-in tests/integration/test_rdma_real.py only.
"""

from __future__ import annotations

import ctypes
import errno
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode
from kvpool.common.grants import GrantOp
from kvpool.transfer.rdma_batch import _Chunk
from kvpool.transfer.rdma_connection import _InFlight
from kvpool.transfer.rdma_memory import Piece
from kvpool.transfer.verbs import Access, Mtu, Opcode, QpInfo, QpState, QueuePair, WcStatus
from kvpool.transfer.verbs_fake import FakeCQ, FakeFabric, FakeQP, FakeVerbs
from kvpool.transfer.verbs_native import native_built, native_verbs
from tests.support.rdma_rig import _teardown, make_rig

pytestmark = pytest.mark.skipif(not native_built(), reason="kvpool.transfer._verbs is not built (libibverbs-dev)")

PAGE = 4096
PAGES = 8
FAR_FUTURE_MS = 4_000_000_000_000
NOW_MS = 1_000


@dataclass
class Pair:
    fabric: FakeFabric
    qp: FakeQP
    cq: FakeCQ
    peer: FakeQP
    local: bytearray
    remote: bytearray
    chunks: list[_Chunk]


def _address(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _pair(native: bool, depth: int = PAGES) -> Pair:
    """Two connected fake QPs: ours READs pages of the peer's registered buffer."""
    fabric = FakeFabric()
    ours = FakeVerbs(fabric, devices=("a",), native=native).open("a")
    theirs = FakeVerbs(fabric, devices=("b",), native=native).open("b")
    local, remote = bytearray(PAGES * PAGE), bytearray(bytes(range(256)) * (PAGES * PAGE // 256))
    lmr = ours.reg_mr(_address(local), len(local), Access.LOCAL_WRITE)
    rmr = theirs.reg_mr(_address(remote), len(remote), Access.REMOTE_READ)
    cq, peer_cq = ours.create_cq(4 * depth), theirs.create_cq(4 * depth)
    qp, peer = ours.create_qp(cq, depth), theirs.create_qp(peer_cq, depth)
    qp.to_init(Access.LOCAL_WRITE)
    peer.to_init(Access.REMOTE_READ)
    qp.to_rtr(QpInfo(peer.qp_num, theirs.lid, theirs.gid, 7, Mtu.MTU_4096), Mtu.MTU_4096)
    peer.to_rtr(QpInfo(qp.qp_num, ours.lid, ours.gid, 9, Mtu.MTU_4096), Mtu.MTU_4096)
    qp.to_rts(9)
    peer.to_rts(7)
    chunks = [
        _Chunk(
            None,  # type: ignore[arg-type]  # batch and connection are not needed to post
            None,  # type: ignore[arg-type]
            i,
            Opcode.RDMA_READ,
            Piece(i * PAGE, PAGE, lmr.addr + i * PAGE, lmr.lkey, rmr.addr + i * PAGE, rmr.rkey),
            FAR_FUTURE_MS,
        )
        for i in range(PAGES)
    ]
    assert isinstance(qp, FakeQP)
    assert isinstance(peer, FakeQP)
    assert isinstance(cq, FakeCQ)
    return Pair(fabric, qp, cq, peer, local, remote, chunks)


@pytest.fixture(params=["native", "python"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = _pair(request.param == "native")
    yield p
    p.qp.close()
    p.peer.close()


def _drain(p: Pair) -> list[tuple[int, WcStatus, int]]:
    out = []
    while batch := p.cq.poll(64):
        out.extend((wc.wr_id, wc.status, wc.byte_len) for wc in batch)
    return out


def test_the_qps_post_through_the_compiled_provider() -> None:
    p = _pair(native=True)
    assert type(p.qp).__name__ == "NativeFakeQP"
    assert type(p.cq).__name__ == "NativeFakeCQ"
    assert type(_pair(native=False).qp) is FakeQP


def test_a_window_moves_exact_bytes_and_completes_in_order(pair: Pair) -> None:
    posted, refusal, expired = pair.qp.post_chunks(pair.chunks, 0, PAGES, 100, NOW_MS)
    assert (posted, refusal, expired) == (PAGES, None, False)
    assert pair.local == pair.remote
    assert _drain(pair) == [(100 + i, WcStatus.SUCCESS, PAGE) for i in range(PAGES)]
    assert [wr.wr_id for wr in pair.fabric.posted] == list(range(100, 100 + PAGES))


def test_posting_stops_before_an_expired_grant(pair: Pair) -> None:
    pair.chunks[3].expiry_ms = NOW_MS
    posted, refusal, expired = pair.qp.post_chunks(pair.chunks, 1, PAGES, 1, NOW_MS)
    assert (posted, refusal, expired) == (2, None, True)  # chunks 1 and 2; chunk 3 is the expired one
    assert pair.local[PAGE : 3 * PAGE] == pair.remote[PAGE : 3 * PAGE]
    assert not any(pair.local[3 * PAGE :])  # nothing past the expired chunk was moved
    assert len(_drain(pair)) == 2


def test_a_full_send_queue_refuses_the_rest_of_the_chain(pair: Pair) -> None:
    assert pair.qp.post_chunks(pair.chunks, 0, 5, 1, NOW_MS)[0] == 5  # 5 of 8 slots taken until polled
    posted, refusal, expired = pair.qp.post_chunks(pair.chunks, 5, PAGES, 6, NOW_MS)
    assert posted == 3
    assert refusal is None
    posted, refusal, _ = pair.qp.post_chunks(pair.chunks, 0, 2, 9, NOW_MS)
    assert posted == 0
    assert refusal is not None
    assert refusal.errno == errno.ENOMEM
    assert len(_drain(pair)) == PAGES  # polling frees the slots
    assert pair.qp.post_chunks(pair.chunks, 0, 2, 9, NOW_MS)[:2] == (2, None)


def test_an_injected_refusal_stops_the_chain_at_its_first_request(pair: Pair) -> None:
    pair.fabric.faults.post_failures = 1
    posted, refusal, _ = pair.qp.post_chunks(pair.chunks, 0, 4, 1, NOW_MS)
    assert posted == 0
    assert refusal is not None
    assert refusal.errno == errno.ENOMEM
    assert pair.fabric.posted == []
    assert _drain(pair) == []
    assert pair.qp.post_chunks(pair.chunks, 0, 4, 1, NOW_MS)[:2] == (4, None)  # consumed once


def test_posting_outside_rts_is_refused_and_in_err_flushes(pair: Pair) -> None:
    pair.qp.to_error()
    posted, refusal, _ = pair.qp.post_chunks(pair.chunks, 0, 2, 1, NOW_MS)
    assert (posted, refusal) == (2, None)  # an ERR QP accepts posts and flushes them
    assert [status for _, status, _ in _drain(pair)] == [WcStatus.WR_FLUSH_ERR] * 2
    assert not any(pair.local)
    pair.qp.close()
    posted, refusal, _ = pair.qp.post_chunks(pair.chunks, 0, 2, 1, NOW_MS)
    assert posted == 0
    assert refusal is not None
    assert refusal.errno == errno.EBADF


def test_an_rkey_outside_the_peers_region_is_a_remote_access_error(pair: Pair) -> None:
    bad = pair.chunks[0].piece
    pair.chunks[0].piece = Piece(0, PAGE, bad.local_addr, bad.lkey, bad.remote_addr + PAGES * PAGE, bad.rkey)
    assert pair.qp.post_chunks(pair.chunks, 0, 2, 1, NOW_MS)[:2] == (2, None)
    statuses = [status for _, status, _ in _drain(pair)]
    assert statuses == [WcStatus.REM_ACCESS_ERR, WcStatus.WR_FLUSH_ERR]  # the QP went to ERR
    assert pair.qp.state == QpState.ERR
    assert not any(pair.local)


def test_bad_chunks_raise_clear_errors_and_post_nothing() -> None:
    p = _pair(native=True)

    class Plain:  # not a slots class: read by attribute name
        def __init__(self, piece: Piece) -> None:
            self.opcode, self.expiry_ms, self.piece = Opcode.RDMA_READ, 0, piece

    assert p.qp.post_chunks([Plain(c.piece) for c in p.chunks], 0, 2, 1, NOW_MS)[:2] == (2, None)
    with pytest.raises(AttributeError):
        p.qp.post_chunks([object()], 0, 1, 1, NOW_MS)
    huge = Piece(0, 1 << 32, p.chunks[0].piece.local_addr, 1, 1, 1)
    with pytest.raises(ValueError, match="4 GiB"):
        p.qp.post_chunks([Plain(huge)], 0, 1, 1, NOW_MS)
    with pytest.raises(ValueError, match="range"):
        p.qp.post_chunks(list(p.chunks), 0, PAGES + 1, 1, NOW_MS)
    send = Plain(p.chunks[0].piece)
    send.opcode = 2  # type: ignore[assignment]  # IBV_WR_SEND: not a one-sided operation
    posted, refusal, _ = p.qp.post_chunks([send], 0, 1, 1, NOW_MS)
    assert posted == 0
    assert refusal is not None
    assert refusal.errno == errno.EINVAL
    assert len(p.fabric.posted) == 2


def test_post_send_list_packs_requests_for_the_compiled_chain() -> None:
    from kvpool.transfer.verbs import WorkRequest

    p = _pair(native=True)
    wrs = [
        WorkRequest(
            50 + i, c.opcode, c.piece.local_addr, c.piece.length, c.piece.lkey, c.piece.remote_addr, c.piece.rkey
        )
        for i, c in enumerate(p.chunks)
    ]
    assert p.qp.post_send_list(wrs) == PAGES
    assert p.local == p.remote
    assert [wc[0] for wc in _drain(p)] == list(range(50, 50 + PAGES))


def test_in_flight_windows_are_found_by_wr_id_and_trimmed() -> None:
    chunks = _pair(native=False).chunks
    inflight = _InFlight(1)
    inflight.add(chunks[:5])
    inflight.add(chunks[5:])
    assert len(inflight) == PAGES
    assert inflight.pop(3) is chunks[2]
    assert inflight.pop(3) is None
    assert inflight.pop(99) is None
    assert inflight.pop(1) is chunks[0]
    assert inflight.pop(2) is chunks[1]
    assert inflight.front == 3  # the completed head is skipped
    rest = inflight.take_all()
    assert rest == chunks[3:]
    assert len(inflight) == 0
    assert inflight.base == 1 + PAGES  # the next window's first wr_id


@pytest.mark.parametrize("native", [True, False])
def test_a_hicache_batch_through_the_transport_uses_the_compiled_path_when_asked(native: bool) -> None:
    r = make_rig(native=native, send_queue_depth=16)
    try:
        data = bytes(range(256)) * (64 * PAGE // 256)
        pages = [bytearray(PAGE) for _ in range(64)]
        writes = [r.request(GrantOp.WRITE, b"w%d" % i, i * PAGE, data[i * PAGE : (i + 1) * PAGE]) for i in range(64)]
        reads = [r.request(GrantOp.READ, b"w%d" % i, i * PAGE, pages[i]) for i in range(64)]
        assert r.transport.transfer(writes, Deadline(10)) == [ErrorCode.OK] * 64
        assert r.transport.transfer(reads, Deadline(10)) == [ErrorCode.OK] * 64
        assert b"".join(pages) == data
        qps = [qp for ctx in r.client_verbs.contexts for qp in ctx.qps]
        assert qps
        assert all((type(qp).__name__ == "NativeFakeQP") == native for qp in qps)
    finally:
        _teardown(r)


def test_selection_falls_back_to_pyverbs_without_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # This host has libibverbs but no RDMA device (the device list fails or is empty): the compiled layer is
    # not chosen, the pyverbs path (None) is, and "pyverbs" always means pyverbs.
    assert native_verbs("") is None
    assert native_verbs("native") is None
    assert native_verbs("pyverbs") is None
    monkeypatch.setenv("KVPOOL_NATIVE_VERBS", "0")
    assert FakeVerbs().native is False


def test_the_python_fallback_is_the_base_class_entry_point() -> None:
    assert FakeQP.post_chunks is QueuePair.post_chunks


def test_a_null_handle_is_an_error_never_a_crash() -> None:
    from kvpool.transfer import _verbs

    for call, what in (
        (lambda: _verbs.fake_set_state(0, int(QpState.RTS), 0), "fake_set_state"),
        (lambda: _verbs.fake_take(0), "fake_take"),
        (lambda: _verbs.fake_complete(0, 0, 1, 0, 0), "fake_complete"),
        (lambda: _verbs.poll(0, 4), "ibv_poll_cq"),
    ):
        with pytest.raises(OSError, match=what):
            call()
    with pytest.raises(ValueError, match="handle"):
        _verbs.post_chunks(0, [], 0, 0, 1, NOW_MS)
    with pytest.raises(ValueError, match="7 uint64"):
        _verbs.post_list(1, b"\0" * 8)


def test_kvpool_verbs_selects_the_layer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kvpool.transfer.factory import default_verbs
    from kvpool.transfer.verbs_fake_ipc import IpcFakeVerbs

    monkeypatch.setenv("KVPOOL_FAKE_VERBS_DIR", str(tmp_path))
    monkeypatch.setenv("KVPOOL_VERBS", "fake")
    fake = default_verbs()
    assert isinstance(fake, IpcFakeVerbs)
    assert fake.native
    monkeypatch.setenv("KVPOOL_NATIVE_VERBS", "0")
    python_fake = default_verbs()
    assert isinstance(python_fake, IpcFakeVerbs)
    assert not python_fake.native
    monkeypatch.setenv("KVPOOL_VERBS", "pyverbs")
    assert default_verbs() is None
    monkeypatch.setenv("KVPOOL_VERBS", "native")  # asked for, but this host lists no device: said once, pyverbs
    with caplog.at_level("WARNING"):
        assert default_verbs() is None
    assert "KVPOOL_VERBS=native" in caplog.text
