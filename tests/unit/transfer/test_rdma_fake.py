"""The RDMA transport against the FAKE verbs layer (kvpool.transfer.verbs_fake): two fake "nodes" on one
fabric, the store side answered by RdmaResponder behind a real loopback TCP control channel.

What this covers: the QP state machine, MR limits and chunking, READ/WRITE round trips with exact bytes,
completion errors mapped to codes, teardown and reconnect, and the RDMA_CONNECT exchange (HELLO, grants,
refusals). What it cannot cover - real NIC behaviour - is tests/integration/test_rdma_real.py (opt-in).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
from collections.abc import Iterator

import pytest

from kvpool.common import log as log_module
from kvpool.common.clock import Deadline, ManualClock
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.grants import GrantOp, new_secret, sign
from kvpool.transfer.base import Replica, TransferRequest
from kvpool.transfer.factory import make_transports
from kvpool.transfer.rdma import (
    RdmaResponder,
    RdmaTransport,
    RemoteRegion,
    completion_code,
    exchange_rdma_connect,
    plan_pieces,
    register_chunked,
)
from kvpool.transfer.tcp import TcpTransport
from kvpool.transfer.verbs import (
    LEGAL_TRANSITIONS,
    Access,
    Mtu,
    Opcode,
    QpInfo,
    QpState,
    VerbsError,
    WcStatus,
    WorkRequest,
    buffer_address,
    check_transition,
    discover_devices,
)
from kvpool.transfer.verbs_fake import FakeFabric, FakeVerbs
from tests.support.rdma_rig import (
    FAR_FUTURE_MS,
    NATIVE_MODES,
    SEG_ID,
    ControlServer,
    MiB,
    Rig,
    _deadline,
    _Segment,
    _teardown,
    make_rig,
)
from tests.support.wait import wait_for


@pytest.fixture(params=NATIVE_MODES)
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    """A rig posting through the compiled fake provider and one through the Python path (where built)."""
    r = make_rig(native=request.param == "native")
    yield r
    _teardown(r)


# ---------------------------------------------------------------------- QP state machine
ALL_STATES = list(QpState)


@pytest.mark.parametrize("current", ALL_STATES)
@pytest.mark.parametrize("target", ALL_STATES)
def test_transition_table(current: QpState, target: QpState) -> None:
    if target in LEGAL_TRANSITIONS[current]:
        check_transition(current, target)
    else:
        with pytest.raises(VerbsError) as info:
            check_transition(current, target)
        assert info.value.errno == errno.EINVAL


def test_fake_qp_refuses_illegal_transitions_and_posts() -> None:
    verbs = FakeVerbs(FakeFabric(), mtu=Mtu.MTU_1024)
    ctx = verbs.open(verbs.devices[0])
    qp = ctx.create_qp(ctx.create_cq(8), 4)
    remote = QpInfo(qp_num=99, lid=1, gid="fe80::1", psn=7, mtu=Mtu.MTU_1024)
    wr = WorkRequest(1, Opcode.RDMA_WRITE, 0x1000, 8, 1, 0x2000, 2)
    assert qp.state == QpState.RESET
    with pytest.raises(VerbsError):
        qp.to_rtr(remote, Mtu.MTU_1024)  # RESET -> RTR skips INIT
    with pytest.raises(VerbsError):
        qp.to_rts(1)  # RESET -> RTS
    with pytest.raises(VerbsError):
        qp.post_send(wr)  # nothing may be posted before RTS
    qp.to_init(Access.LOCAL_WRITE)
    with pytest.raises(VerbsError):
        qp.to_rts(1)  # INIT -> RTS skips RTR
    with pytest.raises(VerbsError):
        qp.post_send(wr)
    with pytest.raises(VerbsError):
        qp.to_rtr(remote, Mtu.MTU_4096)  # above the port's active MTU
    qp.to_rtr(remote, Mtu.MTU_1024)
    with pytest.raises(VerbsError):
        qp.to_init(Access.LOCAL_WRITE)  # RTR -> INIT
    qp.to_rts(1)
    assert qp.state == QpState.RTS
    qp.to_error()
    with pytest.raises(VerbsError):
        qp.to_rts(2)  # ERR -> RTS: only RESET leaves ERR
    qp.post_send(wr)  # posting on ERR is allowed: the request is flushed
    assert [c.status for c in qp.cq.poll(8)] == [WcStatus.WR_FLUSH_ERR]


# ---------------------------------------------------------------------- MRs and chunking
def test_mr_length_limit_and_keys() -> None:
    verbs = FakeVerbs(FakeFabric(), max_mr_bytes=4 * MiB)
    ctx = verbs.open(verbs.devices[0])
    buf = bytearray(10 * MiB)
    addr = buffer_address(memoryview(buf))
    with pytest.raises(VerbsError, match="max_mr_size"):
        ctx.reg_mr(addr, 10 * MiB, Access.LOCAL_WRITE)
    mrs = register_chunked(ctx, addr, len(buf), Access.LOCAL_WRITE, 4 * MiB)
    assert [mr.length for mr in mrs] == [4 * MiB, 4 * MiB, 2 * MiB]
    assert [mr.addr - addr for mr in mrs] == [0, 4 * MiB, 8 * MiB]
    keys = [mr.lkey for mr in mrs] + [mr.rkey for mr in mrs]
    assert len(set(keys)) == 6  # lkeys and rkeys all distinct
    for mr in mrs:
        mr.close()
    assert ctx.mr_count == 0


def test_register_chunked_is_all_or_nothing() -> None:
    verbs = FakeVerbs(FakeFabric(), max_mr_bytes=MiB)
    ctx = verbs.open(verbs.devices[0])
    buf = bytearray(3 * MiB)
    verbs.fabric.faults.reg_mr_failures = 0
    first = register_chunked(ctx, buffer_address(memoryview(buf)), MiB, Access.LOCAL_WRITE, MiB)
    # the third of three registrations fails: the first two are undone
    original = ctx.reg_mr
    calls = {"n": 0}

    def flaky(address: int, length: int, access: Access) -> object:
        calls["n"] += 1
        if calls["n"] == 3:
            raise VerbsError("no memory", errno.ENOMEM)
        return original(address, length, access)

    ctx.reg_mr = flaky  # type: ignore[method-assign, assignment]
    with pytest.raises(VerbsError):
        register_chunked(ctx, buffer_address(memoryview(buf)), 3 * MiB, Access.LOCAL_WRITE, MiB)
    assert ctx.mr_count == len(first)


def test_plan_pieces_cuts_at_every_boundary() -> None:
    base = 0x10_0000_0000
    local = [(base, 4 * MiB, 11), (base + 4 * MiB, 4 * MiB, 12)]
    regions = [RemoteRegion(SEG_ID, i * 3 * MiB, 3 * MiB, 0x7000_0000 + i * 3 * MiB, 100 + i) for i in range(4)]
    start, offset, length = base + MiB, 2 * MiB, 6 * MiB
    pieces = plan_pieces(start, local, offset, regions, length, max_chunk=2 * MiB)
    assert sum(p.length for p in pieces) == length
    assert [p.offset for p in pieces] == [sum(q.length for q in pieces[:i]) for i in range(len(pieces))]
    for p in pieces:
        assert p.length <= 2 * MiB
        span = next(s for s in local if s[2] == p.lkey)
        assert span[0] <= p.local_addr
        assert p.local_addr + p.length <= span[0] + span[1]
        region = next(r for r in regions if r.rkey == p.rkey)
        assert region.addr <= p.remote_addr
        assert p.remote_addr + p.length <= region.addr + region.length
        assert p.remote_addr - region.addr + region.offset == offset + p.offset
    with pytest.raises(KvPoolError) as info:
        plan_pieces(start, local, 11 * MiB, regions, 2 * MiB, 2 * MiB)  # past the last region
    assert info.value.code == ErrorCode.OUT_OF_BOUNDS


def test_10mib_transfer_with_4mib_mr_limit_is_three_work_requests(rig: Rig) -> None:
    data = bytearray(os.urandom(10 * MiB))
    back = bytearray(10 * MiB)
    rig.transport.register_memory(memoryview(data))
    rig.transport.register_memory(memoryview(back))
    before = len(rig.fabric.posted)
    codes = rig.transport.transfer([rig.request(GrantOp.WRITE, b"big", 0, data)], _deadline())
    assert codes == [ErrorCode.OK]
    writes = rig.fabric.posted[before:]
    assert [wr.length for wr in writes] == [4 * MiB, 4 * MiB, 2 * MiB]
    assert all(wr.opcode == Opcode.RDMA_WRITE for wr in writes)
    assert rig.segment.view[: 10 * MiB] == data
    before = len(rig.fabric.posted)
    codes = rig.transport.transfer([rig.request(GrantOp.READ, b"big", 0, back)], _deadline())
    assert codes == [ErrorCode.OK]
    assert [wr.length for wr in rig.fabric.posted[before:]] == [4 * MiB, 4 * MiB, 2 * MiB]
    assert back == data


def test_object_straddling_two_store_mrs(rig: Rig) -> None:
    data = bytearray(os.urandom(2 * MiB))
    rig.transport.register_memory(memoryview(data))
    before = len(rig.fabric.posted)
    offset = 3 * MiB  # the store's MRs are [0, 4 MiB), [4, 8 MiB), ...
    assert rig.one(rig.request(GrantOp.WRITE, b"k", offset, data)) == ErrorCode.OK
    assert [wr.length for wr in rig.fabric.posted[before:]] == [MiB, MiB]
    assert rig.segment.view[offset : offset + len(data)] == data


# ---------------------------------------------------------------------- round trips
def test_many_objects_round_trip_beyond_the_send_queue_depth() -> None:
    r = make_rig(send_queue_depth=4)
    try:
        size, n = 100 * 1024, 40
        pool = bytearray(os.urandom(size * n))
        back = bytearray(size * n)
        r.transport.register_memory(memoryview(pool))
        r.transport.register_memory(memoryview(back))
        view, back_view = memoryview(pool), memoryview(back)

        def req(op: GrantOp, i: int, buf: memoryview) -> TransferRequest:
            key = b"k%d" % i
            replica = r.replica(op, key, 64 + i * size, size)
            return TransferRequest(op, key, replica, buf[i * size : (i + 1) * size])

        writes = [req(GrantOp.WRITE, i, view) for i in range(n)]
        assert r.transport.transfer(writes, _deadline()) == [ErrorCode.OK] * n
        reads = [req(GrantOp.READ, i, back_view) for i in range(n)]
        assert r.transport.transfer(reads, _deadline()) == [ErrorCode.OK] * n
        assert back == pool
        assert r.transport.stats.connects == 1
    finally:
        _teardown(r)


def test_a_request_whose_grant_expired_before_posting_is_not_posted_and_spares_the_qp() -> None:
    clock = ManualClock(wall_start_ms=int(time.time() * 1000))
    r = make_rig(send_queue_depth=1, clock=clock)
    try:
        r.segment.view[:8192] = os.urandom(8192)
        soon = clock.wall_ms() + 1000
        first, second = bytearray(4096), bytearray(4096)
        batch = r.transport.submit(
            [r.request(GrantOp.READ, b"a", 0, first), r.request(GrantOp.READ, b"b", 4096, second, expiry_ms=soon)],
            _deadline(),
        )  # a send queue of one: the second waits for the first's completion
        clock.advance(1.5)  # ... and its grant expires meanwhile
        posted = len(r.fabric.posted)
        assert batch.wait(_deadline()) == [ErrorCode.OK, ErrorCode.GRANT_EXPIRED]
        assert len(r.fabric.posted) == posted  # never reached the NIC
        assert first == r.segment.view[:4096]
        assert second == bytes(4096)
        # The QP lives on: the next request uses the same connection.
        assert r.one(r.request(GrantOp.READ, b"c", 4096, second)) == ErrorCode.OK
        assert second == r.segment.view[4096:8192]
        assert (r.transport.stats.connects, r.transport.stats.broken_connections) == (1, 0)
    finally:
        _teardown(r)


def test_unregistered_buffers_are_registered_for_the_batch_only(rig: Rig) -> None:
    data = os.urandom(300 * 1024)  # bytes: read-only, registered without LOCAL_WRITE
    back = bytearray(len(data))
    ctx = rig.client_verbs.contexts[0]
    assert rig.one(rig.request(GrantOp.WRITE, b"u", 4096, data)) == ErrorCode.OK
    assert rig.one(rig.request(GrantOp.READ, b"u", 4096, back)) == ErrorCode.OK
    assert bytes(back) == data
    assert ctx.mr_count == 0


def test_register_memory_is_refcounted_and_unregister_frees(rig: Rig) -> None:
    buf = bytearray(9 * MiB)
    ctx = rig.client_verbs.contexts[0]
    rig.transport.register_memory(memoryview(buf))
    rig.transport.register_memory(memoryview(buf))
    assert ctx.mr_count == 3
    rig.transport.unregister_memory(memoryview(buf))
    assert ctx.mr_count == 3
    rig.transport.unregister_memory(memoryview(buf))
    assert ctx.mr_count == 0


def test_request_validation_codes(rig: Rig) -> None:
    small = bytearray(10)
    codes = rig.transport.transfer(
        [
            rig.request(GrantOp.READ, b"a", 0, small, length=100),  # destination too small
            rig.request(GrantOp.READ, b"b", 0, bytes(100)),  # read into read-only memory
            rig.request(GrantOp.WRITE, b"c", 0, small, length=20),  # source length != object length
            rig.request(GrantOp.READ, b"d", 0, bytearray(100), expiry_ms=1),  # grant long expired
            rig.request(GrantOp.READ, b"x" * 600, 0, bytearray(8)),  # key too long
            rig.request(GrantOp.READ, b"e", 16 * MiB, bytearray(8)),  # outside the segment
        ],
        _deadline(),
    )
    assert codes == [
        ErrorCode.BUFFER_TOO_SMALL,
        ErrorCode.INVALID_ARGUMENT,
        ErrorCode.INVALID_ARGUMENT,
        ErrorCode.GRANT_EXPIRED,
        ErrorCode.KEY_TOO_LONG,
        ErrorCode.OUT_OF_BOUNDS,
    ]


# ---------------------------------------------------------------------- completion errors and reconnects
@pytest.mark.parametrize(
    ("status", "code"),
    [
        (WcStatus.REM_ACCESS_ERR, ErrorCode.TRANSFER_FAILED),
        (WcStatus.LOC_PROT_ERR, ErrorCode.TRANSFER_FAILED),
        (WcStatus.FATAL_ERR, ErrorCode.TRANSFER_FAILED),
        (WcStatus.RETRY_EXC_ERR, ErrorCode.TIMEOUT),
        (WcStatus.RNR_RETRY_EXC_ERR, ErrorCode.TIMEOUT),
    ],
)
def test_completion_errors_map_to_codes_and_reconnect(rig: Rig, status: WcStatus, code: ErrorCode) -> None:
    data = bytearray(os.urandom(64 * 1024))
    rig.transport.register_memory(memoryview(data))
    assert rig.transport.transfer([rig.request(GrantOp.WRITE, b"w", 0, data)], _deadline()) == [ErrorCode.OK]
    rig.fabric.faults.completion_errors = [status]
    others = [rig.request(GrantOp.WRITE, b"w%d" % i, (i + 1) << 16, data) for i in range(3)]
    codes = rig.transport.transfer([rig.request(GrantOp.WRITE, b"w", 0, data), *others], _deadline())
    assert codes[0] == code
    assert codes[1:] == [code] * 3  # flushed behind the failed one: they report the same cause
    assert completion_code(status) == code
    # the broken QP is torn down and re-established on next use
    assert rig.transport.transfer([rig.request(GrantOp.WRITE, b"w", 0, data)], _deadline()) == [ErrorCode.OK]
    assert rig.transport.stats.connects == 2
    assert rig.transport.stats.broken_connections == 1
    wait_for(lambda: rig.responder.connections == 1, 3.0, "the store to release the old QP")


def test_reconnect_after_an_injected_qp_error(rig: Rig) -> None:
    data = bytearray(os.urandom(256 * 1024))
    back = bytearray(len(data))
    rig.transport.register_memory(memoryview(data))
    rig.transport.register_memory(memoryview(back))
    assert rig.transport.transfer([rig.request(GrantOp.WRITE, b"q", 0, data)], _deadline()) == [ErrorCode.OK]
    assert rig.fabric.break_qps() == 2  # the client's and the store's QP: a link flap
    assert rig.transport.transfer([rig.request(GrantOp.READ, b"q", 0, back)], _deadline()) == [
        ErrorCode.TRANSFER_FAILED
    ]
    assert rig.transport.transfer([rig.request(GrantOp.READ, b"q", 0, back)], _deadline()) == [ErrorCode.OK]
    assert back == data
    assert rig.transport.stats.connects == 2
    wait_for(lambda: rig.responder.connections == 1, 3.0, "the store to hold one connection")
    wait_for(lambda: rig.fabric.qp_count() == 2, 3.0, "one live pair, the broken ones destroyed")


def test_refused_post_tears_down_and_reconnects(rig: Rig) -> None:
    data = bytearray(os.urandom(64 * 1024))
    rig.fabric.faults.post_failures = 1
    assert rig.transport.transfer([rig.request(GrantOp.WRITE, b"p", 0, data)], _deadline()) == [
        ErrorCode.TRANSFER_FAILED
    ]
    assert rig.transport.transfer([rig.request(GrantOp.WRITE, b"p", 0, data)], _deadline()) == [ErrorCode.OK]
    assert rig.transport.stats.connects == 2


def test_lost_completion_times_out_and_aborts_the_qp(rig: Rig) -> None:
    data = bytearray(os.urandom(64 * 1024))
    rig.transport.register_memory(memoryview(data))
    assert rig.transport.transfer([rig.request(GrantOp.WRITE, b"t", 0, data)], _deadline()) == [ErrorCode.OK]
    rig.fabric.faults.drop_completions = 1
    start = time.monotonic()
    codes = rig.transport.transfer([rig.request(GrantOp.WRITE, b"t", 0, data)], Deadline(0.2))
    assert codes == [ErrorCode.TIMEOUT]
    assert time.monotonic() - start < 2.0
    assert rig.client_verbs.contexts[0].qps == []  # our QP is destroyed: the NIC is done with `data`
    wait_for(lambda: rig.fabric.qp_count() == 0, 3.0, "the store to release its side")
    assert rig.transport.transfer([rig.request(GrantOp.WRITE, b"t", 0, data)], _deadline()) == [ErrorCode.OK]


def test_repeatedly_broken_peer_goes_into_cooldown_and_can_reach_turns_false() -> None:
    r = make_rig(reconnect_cooldown_s=30.0)
    try:
        data = bytearray(1024)
        replica = r.replica(GrantOp.WRITE, b"c", 0, len(data))
        assert r.transport.can_reach(replica)
        for _ in range(3):
            r.fabric.faults.completion_errors = [WcStatus.RETRY_EXC_ERR]
            assert r.transport.transfer([r.request(GrantOp.WRITE, b"c", 0, data)], _deadline()) == [ErrorCode.TIMEOUT]
        # three connections in a row that never completed anything: TCP serves this store for a while
        assert r.transport.transfer([r.request(GrantOp.WRITE, b"c", 0, data)], _deadline()) == [
            ErrorCode.CONNECTION_FAILED
        ]
        assert not r.transport.can_reach(replica)
    finally:
        _teardown(r)


# ---------------------------------------------------------------------- the RDMA_CONNECT exchange
def test_can_reach_only_advertised_segments(rig: Rig) -> None:
    replica = rig.replica(GrantOp.READ, b"k", 0, 10)
    assert rig.transport.can_reach(replica)
    other_segment = Replica(SEG_ID + 1, "n", rig.server.endpoint, "", 0, 10, FAR_FUTURE_MS, b"")
    assert not rig.transport.can_reach(other_segment)
    unknown_store = Replica(SEG_ID, "n", "127.0.0.1:1", "", 0, 10, FAR_FUTURE_MS, b"")
    assert not rig.transport.can_reach(unknown_store)
    assert not rig.transport.note_store_info(rig.server.endpoint, {"store_id": "x"})  # no "rdma" entry
    assert not rig.transport.can_reach(replica)


def test_store_without_rdma_is_marked_and_left_to_tcp() -> None:
    r = make_rig()
    plain = ControlServer(None)  # answers RDMA_CONNECT with UNKNOWN_OP
    try:
        r.transport.advertise(plain.endpoint, [SEG_ID])
        replica = Replica(SEG_ID, "n", plain.endpoint, "", 0, 8, FAR_FUTURE_MS, b"\0" * 16)
        req = TransferRequest(GrantOp.READ, b"k", replica, memoryview(bytearray(8)))
        assert r.transport.can_reach(req.replica)
        assert r.transport.transfer([req], _deadline()) == [ErrorCode.UNKNOWN_OP]
        assert not r.transport.can_reach(req.replica)
    finally:
        plain.close()
        _teardown(r)


def test_unreachable_store_is_connection_failed_then_cooldown(rig: Rig) -> None:
    rig.server.close()
    req = rig.request(GrantOp.READ, b"k", 0, bytearray(8))
    assert rig.transport.transfer([req], _deadline()) == [ErrorCode.CONNECTION_FAILED]
    assert not rig.transport.can_reach(req.replica)
    assert rig.transport.stats.connect_failures == 1


def test_bad_grant_is_refused(rig: Rig) -> None:
    req = rig.request(GrantOp.READ, b"k", 0, bytearray(8), secret=b"\1" * 32)  # signed with the wrong secret
    assert rig.transport.transfer([req], _deadline()) == [ErrorCode.AUTH_FAILED]
    assert rig.responder.connections == 0
    assert rig.transport.can_reach(req.replica)  # a bad grant says nothing about the path: no cooldown
    assert rig.one(rig.request(GrantOp.READ, b"k", 0, bytearray(8))) == ErrorCode.OK


def test_read_grant_gives_a_read_only_qp_and_a_write_reconnects(rig: Rig) -> None:
    data = bytearray(os.urandom(4096))
    back = bytearray(4096)
    assert rig.transport.transfer([rig.request(GrantOp.READ, b"r", 0, back)], _deadline()) == [ErrorCode.OK]
    assert rig.transport.stats.connects == 1
    store_qp = rig.store_verbs.contexts[0].qps[0]
    assert not store_qp.access & Access.REMOTE_WRITE  # enforced by the (fake) NIC, not by trust
    assert rig.transport.transfer([rig.request(GrantOp.WRITE, b"r", 0, data)], _deadline()) == [ErrorCode.OK]
    assert rig.transport.stats.connects == 2
    assert rig.segment.view[:4096] == data


def test_write_through_a_read_only_qp_is_a_remote_access_error(rig: Rig) -> None:
    """A client that bypasses the transport and writes on a READ-admitted QP is stopped by the NIC."""
    back = bytearray(4096)
    assert rig.transport.transfer([rig.request(GrantOp.READ, b"r", 0, back)], _deadline()) == [ErrorCode.OK]
    client_qp = rig.client_verbs.contexts[0].qps[0]
    src = bytearray(b"x" * 64)
    mr = rig.client_verbs.contexts[0].reg_mr(buffer_address(memoryview(src)), 64, Access.LOCAL_WRITE)
    region = rig.responder._regions[SEG_ID][0]
    client_qp.post_send(WorkRequest(999, Opcode.RDMA_WRITE, mr.addr, 64, mr.lkey, region.addr, region.rkey))
    assert [c.status for c in client_qp.cq.poll(4)] == [WcStatus.REM_ACCESS_ERR]
    assert rig.segment.view[:64] != src
    mr.close()


def test_token_holders_connect_with_hello() -> None:
    r = make_rig(token=b"cluster-secret", client_token=b"cluster-secret")
    try:
        data = bytearray(os.urandom(8192))
        assert r.transport.transfer([r.request(GrantOp.WRITE, b"t", 0, data)], _deadline()) == [ErrorCode.OK]
    finally:
        _teardown(r)
    r = make_rig(token=b"cluster-secret", client_token=b"wrong")
    try:
        assert r.transport.transfer([r.request(GrantOp.WRITE, b"t", 0, bytearray(8))], _deadline()) == [
            ErrorCode.AUTH_FAILED
        ]
    finally:
        _teardown(r)


def test_exchange_over_loopback_and_responder_refusals(rig: Rig) -> None:
    ctx = rig.client_verbs.open(rig.client_verbs.devices[0])
    qp = ctx.create_qp(ctx.create_cq(4), 2)
    port = ctx.port_info()
    qp_doc = {"qp_num": qp.qp_num, "lid": port.lid, "gid": port.gid, "psn": 5, "mtu": int(port.mtu)}
    mac = sign(rig.secret, GrantOp.READ, SEG_ID, 0, 8, FAR_FUTURE_MS, b"k")
    grant = {
        "op": 1,
        "segment_id": SEG_ID,
        "offset": 0,
        "length": 8,
        "expiry_ms": FAR_FUTURE_MS,
        "key": b"k".hex(),
        "mac": mac.hex(),
    }

    import json

    def ask(doc: dict[str, object]) -> tuple[socket.socket, dict[str, object]]:
        sock, reply = exchange_rdma_connect(rig.server.endpoint, json.dumps(doc).encode(), timeout=2.0)
        return sock, json.loads(reply)

    sock, reply = ask({"v": 1, "qp": qp_doc, "access": "rw", "grants": [grant]})
    assert reply["access"] == "r"  # a READ grant never admits writes
    assert reply["regions"] == [r.to_json() for r in rig.responder._regions[SEG_ID]]
    assert reply["qp"]["qp_num"] == rig.store_verbs.contexts[0].qps[0].qp_num  # type: ignore[index]
    assert rig.responder.connections == 1
    sock.close()  # the store releases the QP with the connection
    wait_for(lambda: rig.responder.connections == 0, 3.0, "the store to release its connections")

    refusals = [
        ({"v": 2, "qp": qp_doc, "grants": [grant]}, ErrorCode.NOT_SUPPORTED),
        ({"v": 1, "qp": {**qp_doc, "psn": -1}, "grants": [grant]}, ErrorCode.BAD_FRAME),
        ({"v": 1, "qp": qp_doc, "grants": []}, ErrorCode.AUTH_FAILED),
        ({"v": 1, "qp": qp_doc, "grants": [{**grant, "segment_id": 1}]}, ErrorCode.SEGMENT_NOT_FOUND),
        # the mac covers the expiry: changing it breaks the signature
        ({"v": 1, "qp": qp_doc, "grants": [{**grant, "expiry_ms": 5}]}, ErrorCode.AUTH_FAILED),
    ]
    for doc, code in refusals:
        with pytest.raises(KvPoolError) as info:
            ask(doc)
        assert info.value.code == code, doc
    expired_mac = sign(rig.secret, GrantOp.READ, SEG_ID, 0, 8, 5, b"k").hex()
    with pytest.raises(KvPoolError) as info:
        ask({"v": 1, "qp": qp_doc, "grants": [{**grant, "expiry_ms": 5, "mac": expired_mac}]})
    assert info.value.code == ErrorCode.GRANT_EXPIRED
    code, body = rig.responder.handle_connect(b"not json", conn_id="x")
    assert code == ErrorCode.BAD_FRAME
    assert b"error" in body
    assert rig.responder.connections == 0


def test_responder_limits_connections() -> None:
    fabric = FakeFabric()
    segment = _Segment(MiB)
    secret = new_secret()
    responder = RdmaResponder(FakeVerbs(fabric), {SEG_ID: segment}, {SEG_ID: secret}, max_qps=1)
    client = FakeVerbs(fabric).open("fake_mlx5_0")
    try:
        import json

        def payload() -> bytes:
            qp = client.create_qp(client.create_cq(4), 2)
            port = client.port_info()
            mac = sign(secret, GrantOp.READ, SEG_ID, 0, 8, FAR_FUTURE_MS, b"k")
            qp_doc = {"qp_num": qp.qp_num, "lid": port.lid, "gid": port.gid, "psn": 1, "mtu": 5}
            grant = {
                "op": 1,
                "segment_id": SEG_ID,
                "offset": 0,
                "length": 8,
                "expiry_ms": FAR_FUTURE_MS,
                "key": "6b",
                "mac": mac.hex(),
            }
            return json.dumps({"v": 1, "qp": qp_doc, "grants": [grant]}).encode()

        assert responder.handle_connect(payload(), conn_id=1)[0] == ErrorCode.OK
        assert responder.handle_connect(payload(), conn_id=2)[0] == ErrorCode.TOO_MANY_CONNECTIONS
        assert responder.release(1) == 1
        assert responder.handle_connect(payload(), conn_id=2)[0] == ErrorCode.OK
    finally:
        responder.close()
        segment.close()


def test_revoke_cuts_off_admitted_clients_and_they_reconnect(rig: Rig) -> None:
    data = bytearray(os.urandom(8192))
    assert rig.one(rig.request(GrantOp.WRITE, b"v", 0, data)) == ErrorCode.OK
    revoked = rig.responder.revoke(SEG_ID + 1)  # another segment: nobody is cut off
    assert revoked == []
    revoked = rig.responder.revoke()
    assert len(revoked) == 1
    assert rig.responder.connections == 0
    rig.server.drop_connections(revoked)  # the data plane closes the control connections it is handed
    peer = rig.transport._peers[rig.server.endpoint]
    wait_for(lambda: peer.conn is not None and not peer.conn.usable, 3.0, "the connection to turn unusable")
    assert rig.one(rig.request(GrantOp.WRITE, b"v", 0, data)) == ErrorCode.OK  # a fresh QP, a fresh grant
    assert rig.transport.stats.connects == 2


def test_remove_and_add_segment(rig: Rig) -> None:
    assert rig.one(rig.request(GrantOp.WRITE, b"s", 0, bytearray(64))) == ErrorCode.OK
    store_ctx = rig.store_verbs.contexts[0]
    assert store_ctx.mr_count == 4  # 16 MiB in 4 MiB MRs
    assert len(rig.responder.remove_segment(SEG_ID)) == 1
    assert store_ctx.mr_count == 0
    assert rig.responder.advertisement()["segments"] == []
    rig.server.drop_connections()
    wait_for(lambda: rig.responder.connections == 0, 3.0, "the store to release its connections")
    assert rig.one(rig.request(GrantOp.WRITE, b"s", 0, bytearray(64))) == ErrorCode.SEGMENT_NOT_FOUND
    other = _Segment(2 * MiB)
    try:
        rig.responder.add_segment(SEG_ID, other, rig.secret)
        assert rig.responder.advertisement()["segments"] == [SEG_ID]
        data = bytearray(os.urandom(64))
        assert rig.one(rig.request(GrantOp.WRITE, b"s", 128, data)) == ErrorCode.OK
        assert other.view[128:192] == data
        rig.responder.remove_segment(SEG_ID)
    finally:
        other.close()


# ---------------------------------------------------------------------- discovery and the factory
@pytest.fixture
def fresh_log_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(log_module, "_once_seen", set())


class _ImportErrorVerbs(FakeVerbs):
    def list_devices(self) -> list[str]:
        raise ImportError("No module named 'pyverbs'")


@pytest.mark.usefixtures("fresh_log_once")
def test_discover_devices_treats_every_failure_as_no_rdma_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    raising = FakeVerbs(FakeFabric())
    raising.fabric.faults.list_devices_error = RuntimeError("Failed to get devices list")
    with caplog.at_level(logging.INFO, logger="kvpool"):
        assert discover_devices(raising) == []
        assert discover_devices(_ImportErrorVerbs()) == []
        assert discover_devices(FakeVerbs(FakeFabric(), devices=())) == []
    lines = [r for r in caplog.records if "RDMA unavailable" in r.getMessage()]
    assert len(lines) == 1
    assert "using TCP" in lines[0].getMessage()
    assert discover_devices(FakeVerbs(FakeFabric(), devices=("mlx5_0", "mlx5_1"))) == ["mlx5_0", "mlx5_1"]


@pytest.mark.usefixtures("fresh_log_once")
def test_factory_puts_rdma_first_only_when_a_device_exists(caplog: pytest.LogCaptureFixture) -> None:
    transports = make_transports("node-a", prefer_rdma=True, verbs=FakeVerbs(FakeFabric()))
    try:
        assert [type(t) for t in transports] == [RdmaTransport, TcpTransport]
    finally:
        for t in transports:
            t.close()
    none = FakeVerbs(FakeFabric(), devices=())
    with caplog.at_level(logging.INFO, logger="kvpool"):
        for _ in range(3):
            transports = make_transports("node-a", prefer_rdma=True, verbs=none)
            assert [type(t) for t in transports] == [TcpTransport]
            transports[0].close()
    assert len([r for r in caplog.records if "RDMA unavailable" in r.getMessage()]) == 1
    transports = make_transports("node-a", prefer_rdma=False, verbs=FakeVerbs(FakeFabric()))
    assert [type(t) for t in transports] == [TcpTransport]
    transports[0].close()


def test_close_is_idempotent_and_refuses_new_work(rig: Rig) -> None:
    rig.transport.close()
    rig.transport.close()
    assert rig.transport.transfer([rig.request(GrantOp.READ, b"k", 0, bytearray(8))], _deadline()) == [
        ErrorCode.SHUTTING_DOWN
    ]
    assert not rig.transport.can_reach(rig.replica(GrantOp.READ, b"k", 0, 8))
