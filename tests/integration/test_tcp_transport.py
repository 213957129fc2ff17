"""TcpTransport against real data-plane servers: exact bytes, striping, batches, failures, deadlines."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool.common.checksum import LazyChecksum, checksum
from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.grants import GrantOp, make_grant, new_secret
from kvpool.proto.frames import FLAG_FROM_PAGES, HEADER, HEADER_SIZE, MAGIC, Op
from kvpool.store.dataplane import DataPlaneServer, _Close
from kvpool.store.inventory import Inventory
from kvpool.store.segment import ShmSegment
from kvpool.transfer import tcp, tcp_lane
from kvpool.transfer.base import Replica, TransferRequest
from kvpool.transfer.memcopy import page_aligned
from kvpool.transfer.tcp import TcpTransport, parse_endpoint, spin_recv_into
from tests.support.wait import wait_for

pytestmark = pytest.mark.integration

SEG_SIZE = 48 << 20
SIZES = [1, 4096, 65_537, 1 << 20, (4 << 20) + 3]
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Store:
    endpoint: str
    segment_id: int
    secret: bytes
    server: DataPlaneServer | None = None
    segment: ShmSegment | None = None
    inventory: Inventory | None = None

    def replica(
        self,
        op: GrantOp,
        key: bytes,
        offset: int,
        length: int,
        expiry_ms: int | None = None,
        mac: bytes | None = None,
    ) -> Replica:
        expiry = time.time_ns() // 1_000_000 + 60_000 if expiry_ms is None else expiry_ms
        g = make_grant(self.secret, op, self.segment_id, offset, length, expiry, key)
        return Replica(
            self.segment_id, "node", self.endpoint, "", offset, length, expiry, g.mac if mac is None else mac
        )

    def request(
        self,
        op: GrantOp,
        key: bytes,
        offset: int,
        buf: memoryview,
        checksum: int = 0,
        length: int | None = None,
    ) -> TransferRequest:
        n = len(buf) if length is None else length
        return TransferRequest(op, key, self.replica(op, key, offset, n), buf, checksum)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.segment is not None:
            self.segment.close()


def start_store(tmp: Path, port: int = 0, **kwargs: object) -> Store:
    seg = ShmSegment.create(str(tmp), f"seg-{time.monotonic_ns()}", SEG_SIZE, replace=True)
    secret = new_secret()
    inventory = Inventory()
    server = DataPlaneServer("127.0.0.1", port, {seg.id: seg}, {seg.id: secret}, inventory, **kwargs)  # type: ignore[arg-type]
    server.start()
    return Store(f"127.0.0.1:{server.port}", seg.id, secret, server, seg, inventory)


@pytest.fixture(autouse=True, params=["native", "python"])
def lane_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs with the compiled READ loop (kvpool.transfer._lanes) and with the Python
    one: both must move the same bytes and answer every fault with the same codes."""
    if request.param == "python":
        monkeypatch.setattr(tcp, "native_available", lambda: False)
    elif tcp.native_lanes is None:
        pytest.skip("kvpool.transfer._lanes was not built")
    return str(request.param)


@pytest.fixture
def threads_settle() -> Iterator[None]:
    """Every thread started by the test (transport lanes, server connections) is gone afterwards."""
    before = threading.active_count()
    yield
    wait_for(lambda: threading.active_count() <= before, 5.0, "threads to end")


@pytest.fixture
def store(tmp_path: Path, threads_settle: None) -> Iterator[Store]:
    s = start_store(tmp_path)
    try:
        yield s
    finally:
        s.stop()
        assert s.server is not None
        assert s.server.statistics().connections == 0


@pytest.fixture
def transport(threads_settle: None) -> Iterator[TcpTransport]:
    t = TcpTransport(connections_per_endpoint=4, stripe_bytes=1 << 20, connect_timeout=2.0, reconnect_cooldown_s=0.0)
    try:
        yield t
    finally:
        t.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def random_bytes(n: int, seed: int = 0) -> bytearray:
    return bytearray(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes())


def lay_out(sizes: list[int], align: int = 4096) -> list[int]:
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += -(-n // align) * align
    assert pos <= SEG_SIZE
    return offsets


def put_then_get(t: TcpTransport, s: Store, sizes: list[int], deadline_s: float = 20.0) -> None:
    offsets = lay_out(sizes)
    values = [random_bytes(n, i) for i, n in enumerate(sizes)]
    keys = [b"key-%d" % i for i in range(len(sizes))]
    puts = [
        s.request(GrantOp.WRITE, k, off, memoryview(v), checksum=i)
        for i, (k, off, v) in enumerate(zip(keys, offsets, values, strict=True))
    ]
    assert t.transfer(puts, Deadline(deadline_s)) == [ErrorCode.OK] * len(sizes)
    outs = [bytearray(n) for n in sizes]
    gets = [s.request(GrantOp.READ, k, off, memoryview(o)) for k, off, o in zip(keys, offsets, outs, strict=True)]
    assert t.transfer(gets, Deadline(deadline_s)) == [ErrorCode.OK] * len(sizes)
    for i, (v, o) in enumerate(zip(values, outs, strict=True)):
        assert v == o, f"object {i} ({len(v)} bytes) differs"


# ---------------------------------------------------------------------- round trips
@pytest.mark.parametrize("size", SIZES)
def test_round_trip_of_each_size(transport: TcpTransport, store: Store, size: int) -> None:
    put_then_get(transport, store, [size])
    assert store.inventory is not None
    assert [(e.key, e.length) for e in store.inventory.entries(store.segment_id)] == [(b"key-0", size)]


def test_round_trip_of_all_sizes_in_one_batch(transport: TcpTransport, store: Store) -> None:
    put_then_get(transport, store, SIZES * 2)
    assert store.inventory is not None
    assert len(store.inventory) == len(SIZES) * 2


def test_large_objects_are_striped_over_every_connection(store: Store, threads_settle: None) -> None:
    t = TcpTransport(connections_per_endpoint=4, stripe_bytes=64 << 10)
    try:
        put_then_get(t, store, [(4 << 20) + 3])
        assert store.server is not None
        stats = store.server.statistics()
        assert stats.connections == 4
        assert stats.requests == 2 * 65 + 4  # ceil((4 MiB + 3) / 64 KiB) parts each way, a probe per connection
    finally:
        t.close()
    assert store.inventory is not None
    assert len(store.inventory) == 1


@pytest.mark.parametrize(("values", "parts"), [(8, 8), (5, 10), (1, 2)])
def test_a_batch_of_large_values_is_striped_only_where_that_finishes_sooner(
    store: Store, threads_settle: None, values: int, parts: int
) -> None:
    """Eight values of 2 MiB keep four lanes busy whole: 8 requests each way. Five would leave one lane with
    two while the others wait, so they are striped at 1 MiB (10 parts), as is a single one (2 parts)."""
    t = TcpTransport(connections_per_endpoint=4, stripe_bytes=1 << 20)
    try:
        put_then_get(t, store, [2 << 20] * values)
        assert store.server is not None
        stats = store.server.statistics()
        assert stats.requests == 2 * parts + stats.connections  # and a READV probe per connection
    finally:
        t.close()


@pytest.mark.parametrize("length", [0, 1, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 5 << 20, (7 << 20) + 3])
def test_stripes_are_near_equal_and_cover_the_value(length: int) -> None:
    sizes = tcp._near_equal_parts(length, 1 << 20)
    assert sum(sizes) == length
    assert len(sizes) == max(1, -(-length // (1 << 20)))
    assert max(sizes) <= 1 << 20
    assert max(sizes) - min(sizes) < len(sizes)


def test_a_batch_of_256_objects(transport: TcpTransport, store: Store) -> None:
    put_then_get(transport, store, [4096] * 256)
    put_then_get(transport, store, [(i * 7919) % 150_000 + 1 for i in range(256)])


def test_256_objects_on_one_connection_with_a_small_window(store: Store, threads_settle: None) -> None:
    t = TcpTransport(connections_per_endpoint=1, window=2)
    try:
        put_then_get(t, store, [100_000] * 256)
    finally:
        t.close()


def test_a_burst_of_reads_leaves_in_few_sends(
    store: Store, threads_settle: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """64 small READs on one lane with a window of 16, one READ frame each (READV off, as towards an older
    store): refilled half a window at a time, one vectored send each (the store wakes once per burst),
    and still every byte in its place."""
    t = TcpTransport(connections_per_endpoint=1, window=16, vector_bytes=0)
    sends: list[int] = []
    real = tcp.send_vectored
    store_port = parse_endpoint(store.endpoint)[1]

    def counting(sock: socket.socket, buffers: list[object], before: Callable[[], None] | None = None) -> None:
        if buffers and sock.getsockname()[1] != store_port:  # the client's sends, not the store's answers
            sends.append(len(buffers))
        real(sock, buffers, before)

    try:
        sizes = [4096 + i for i in range(64)]
        offsets = lay_out(sizes)
        values = [random_bytes(n, i) for i, n in enumerate(sizes)]
        puts = [
            store.request(GrantOp.WRITE, b"k%d" % i, off, memoryview(v))
            for i, (off, v) in enumerate(zip(offsets, values, strict=True))
        ]
        assert t.transfer(puts, Deadline(10.0)) == [ErrorCode.OK] * 64
        monkeypatch.setattr(tcp_lane, "send_vectored", counting)
        outs = [bytearray(n) for n in sizes]
        gets = [
            store.request(GrantOp.READ, b"k%d" % i, off, memoryview(o))
            for i, (off, o) in enumerate(zip(offsets, outs, strict=True))
        ]
        assert t.transfer(gets, Deadline(10.0)) == [ErrorCode.OK] * 64
    finally:
        t.close()
    assert outs == values
    assert sum(sends) == 64  # one frame per READ, no payloads
    assert len(sends) <= 1 + (64 - 16) // 8, sends  # 16 first, then bursts of 8


def frames_sent(monkeypatch: pytest.MonkeyPatch, store: Store) -> list[int]:
    """From now on, the op of every request frame the client sends to ``store`` (payloads are skipped)."""
    ops: list[int] = []
    real = tcp.send_vectored
    store_port = parse_endpoint(store.endpoint)[1]

    def recording(sock: socket.socket, buffers: list[object], before: Callable[[], None] | None = None) -> None:
        if sock.getsockname()[1] != store_port:  # the client's sends, not the store's answers
            ops.extend(HEADER.unpack_from(b)[1] for b in buffers if isinstance(b, bytes))
        real(sock, buffers, before)

    monkeypatch.setattr(tcp_lane, "send_vectored", recording)
    return ops


def put_values(t: TcpTransport, store: Store, sizes: list[int]) -> tuple[list[int], list[bytearray]]:
    offsets = lay_out(sizes)
    values = [random_bytes(n, i) for i, n in enumerate(sizes)]
    puts = [
        store.request(GrantOp.WRITE, b"k%d" % i, off, memoryview(v), checksum=checksum(v))
        for i, (off, v) in enumerate(zip(offsets, values, strict=True))
    ]
    assert t.transfer(puts, Deadline(10.0)) == [ErrorCode.OK] * len(sizes)
    return offsets, values


def verified_reads(
    store: Store, offsets: list[int], values: list[bytearray]
) -> tuple[list[TransferRequest], list[bytearray]]:
    """READs of what ``put_values`` wrote, each checked against its value's checksum; and their buffers."""
    outs = [bytearray(len(v)) for v in values]
    requests = [
        store.request(GrantOp.READ, b"k%d" % i, off, memoryview(o), checksum=checksum(v))._replace(verify=True)
        for i, (off, o, v) in enumerate(zip(offsets, outs, values, strict=True))
    ]
    return requests, outs


def test_small_reads_go_several_to_a_readv_frame(
    store: Store, threads_settle: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small READs share READV frames (32 entries at most, 16 KiB of payload here); a part too large for
    READV goes alone in a READ; every byte lands in its place and is verified."""
    t = TcpTransport(connections_per_endpoint=1, vector_bytes=16 << 10)
    try:
        sizes = [4000] * 10 + [200_000] + [100] * 40
        offsets, values = put_values(t, store, sizes)
        ops = frames_sent(monkeypatch, store)
        requests, outs = verified_reads(store, offsets, values)
        assert t.transfer(requests, Deadline(10.0)) == [ErrorCode.OK] * len(sizes)
    finally:
        t.close()
    assert outs == values
    # 4 + 4 + 2 parts of 4000 bytes (16 KiB each at most), the large one alone, 32 + 8 of 100 bytes
    assert ops == [Op.READV, Op.READV, Op.READV, Op.READ, Op.READV, Op.READV]


def test_small_writes_go_several_to_a_writev_frame(
    store: Store, threads_settle: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small WRITEs share WRITEV frames as READs share READV frames; every value lands and is recorded."""
    t = TcpTransport(connections_per_endpoint=1, vector_bytes=16 << 10)
    try:
        ops = frames_sent(monkeypatch, store)
        sizes = [4000] * 10 + [200_000] + [100] * 40
        offsets, values = put_values(t, store, sizes)
        requests, outs = verified_reads(store, offsets, values)
        assert t.transfer(requests, Deadline(10.0)) == [ErrorCode.OK] * len(sizes)
    finally:
        t.close()
    assert outs == values
    assert ops[:6] == [Op.WRITEV, Op.WRITEV, Op.WRITEV, Op.WRITE, Op.WRITEV, Op.WRITEV]
    assert store.inventory is not None
    assert len(store.inventory) == len(sizes)


def test_readv_entries_fail_alone(store: Store, threads_settle: None) -> None:
    """In one READV frame, a forged grant, an expired one and a wrong checksum fail only their own entry."""
    t = TcpTransport(connections_per_endpoint=1)
    try:
        offsets, values = put_values(t, store, [5000] * 8)
        requests, outs = verified_reads(store, offsets, values)
        requests[2] = requests[2]._replace(replica=requests[2].replica._replace(mac=b"\0" * 16))
        requests[4] = requests[4]._replace(replica=store.replica(GrantOp.READ, b"k4", offsets[4], 5000, expiry_ms=1))
        requests[6] = requests[6]._replace(checksum=checksum(values[6]) ^ 1)
        codes = t.transfer(requests, Deadline(10.0))
        assert store.server is not None
        assert store.server.statistics().connections == 1  # one frame on one connection, still open
    finally:
        t.close()
    expected = [ErrorCode.OK] * 8
    expected[2], expected[4], expected[6] = ErrorCode.AUTH_FAILED, ErrorCode.GRANT_EXPIRED, ErrorCode.CHECKSUM_MISMATCH
    assert codes == expected
    for i in (0, 1, 3, 5, 6, 7):  # the bytes of #6 landed; only their checksum disagrees
        assert outs[i] == values[i]
    assert outs[2] == outs[4] == bytearray(5000)


def test_a_store_without_vectored_ops_gets_plain_reads_and_writes(
    store: Store, threads_settle: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A store that predates READV/WRITEV answers the connection's probe with UNKNOWN_OP and closes: the
    client says so once, reopens the connection, and sends that store plain READs and WRITEs."""

    def old_store(self: DataPlaneServer, conn: object, reader: object, req_id: int, length: int, *_: object) -> None:
        raise _Close(ErrorCode.UNKNOWN_OP, "unknown op", req_id, Op.READV)

    monkeypatch.setattr(DataPlaneServer, "_readv", old_store)
    monkeypatch.setattr(DataPlaneServer, "_writev", old_store)
    ops = frames_sent(monkeypatch, store)
    t = TcpTransport(connections_per_endpoint=2)
    try:
        sizes = [3000] * 20
        offsets, values = put_values(t, store, sizes)
        requests, outs = verified_reads(store, offsets, values)
        assert t.transfer(requests, Deadline(10.0)) == [ErrorCode.OK] * len(sizes)
        assert outs == values
    finally:
        t.close()
    assert sorted(ops) == sorted([Op.WRITE] * 20 + [Op.READ] * 20)
    assert sum("does not know READV/WRITEV" in r.getMessage() for r in caplog.records) == 1
    assert store.server is not None
    assert store.server.statistics().errors == {"UNKNOWN_OP": 2}  # one probe per connection


def test_every_connection_asks_once_whether_the_store_takes_vectored_ops(
    store: Store, threads_settle: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    probes: list[int] = []
    real = DataPlaneServer._readv

    def counting(self: DataPlaneServer, conn: Any, reader: Any, req_id: int, length: int, revalidate: int) -> None:
        if length == 2:
            probes.append(req_id)
        real(self, conn, reader, req_id, length, revalidate)

    monkeypatch.setattr(DataPlaneServer, "_readv", counting)
    t = TcpTransport(connections_per_endpoint=3)
    try:
        for _ in range(3):
            put_values(t, store, [1000] * 30)
    finally:
        t.close()
    assert len(probes) == 3


def next_request(conn: socket.socket) -> tuple[int, int]:
    """(op, req_id) of the next request on a fake store's connection, its payload consumed; the client's
    READV probe (an empty READV on every new connection) is answered OK on the way."""
    while True:
        _magic, op, _flags, _status, req_id, length = HEADER.unpack(conn.recv(28, socket.MSG_WAITALL))
        payload = conn.recv(length, socket.MSG_WAITALL) if length else b""
        if op == Op.READV and payload == b"\0\0":
            conn.sendall(HEADER.pack(MAGIC, Op.READV, 0, 0, req_id, 0))
            continue
        return op, req_id


class OneConnectionStore:
    """A fake store on a free port: ``answer`` serves the first connection (its first request read)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            _op, req_id = next_request(conn)
            self.answer(conn, req_id)

    def answer(self, conn: socket.socket, req_id: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.stop.set()
        self.listener.close()
        self.thread.join()


class LyingReadvServer(OneConnectionStore):
    """Answers the first READV with ``codes`` and ``payload`` behind a header announcing ``length``."""

    def __init__(self, codes: list[int], payload: bytes, length: int) -> None:
        self.lie = (codes, payload, length)
        super().__init__()

    def answer(self, conn: socket.socket, req_id: int) -> None:
        codes, payload, announced = self.lie
        table = struct.pack(f"<{len(codes)}i", *codes)
        conn.sendall(HEADER.pack(MAGIC, Op.READV, 0, 0, req_id, announced) + table + payload)
        conn.recv(1)  # until the client hangs up


@pytest.mark.parametrize(
    ("codes", "payload", "length"),
    [
        ([0, 0], b"x" * 200, 8 + 150),  # fewer bytes than two OK entries of 100
        ([0, int(ErrorCode.AUTH_FAILED)], b"x" * 200, 8 + 200),  # bytes for an entry that failed
        ([0], b"", 4),  # a table shorter than the frame's entries
    ],
)
def test_a_readv_answer_that_contradicts_itself_is_bad_frame(
    threads_settle: None, codes: list[int], payload: bytes, length: int
) -> None:
    liar = LyingReadvServer(codes, payload, length)
    t = TcpTransport(connections_per_endpoint=1, vector_bytes=1 << 20)
    try:
        s = Store(f"127.0.0.1:{liar.port}", 1, new_secret())
        outs = [bytearray(100), bytearray(100)]
        reqs = [s.request(GrantOp.READ, b"k%d" % i, 0, memoryview(o)) for i, o in enumerate(outs)]
        assert t.transfer(reqs, Deadline(5.0)) == [ErrorCode.BAD_FRAME] * 2
    finally:
        t.close()
        liar.close()


def test_large_parts_take_the_native_loop_with_their_own_codes(
    store: Store, threads_settle: None, monkeypatch: pytest.MonkeyPatch, lane_loop: str
) -> None:
    """Writes and reads of 1 MiB on one lane are one native job each (where built): every part gets its
    own code, a refused part does not disturb the others, and every byte lands in its place, verified."""
    calls: list[int] = []
    if lane_loop == "native":
        real = tcp.native_lanes.pipeline

        def counting(fd: int, frames: list[bytes], *args: Any) -> Any:
            calls.append(len(frames))
            return real(fd, frames, *args)

        monkeypatch.setattr(tcp.native_lanes, "pipeline", counting)
    t = TcpTransport(connections_per_endpoint=1, stripe_bytes=4 << 20)
    try:
        offsets, values = put_values(t, store, [1 << 20] * 5)
        requests, outs = verified_reads(store, offsets, values)
        past = time.time_ns() // 1_000_000 - 1
        requests[1] = requests[1]._replace(replica=requests[1].replica._replace(mac=bytes(16)))
        requests[3] = requests[3]._replace(
            replica=store.replica(GrantOp.READ, b"k3", offsets[3], 1 << 20, expiry_ms=past)
        )
        assert t.transfer(requests, Deadline(10.0)) == [
            ErrorCode.OK,
            ErrorCode.AUTH_FAILED,
            ErrorCode.OK,
            ErrorCode.GRANT_EXPIRED,
            ErrorCode.OK,
        ]
    finally:
        t.close()
    assert [outs[i] == values[i] for i in range(5)] == [True, False, True, False, True]
    assert outs[1] == outs[3] == bytearray(1 << 20)  # a refused part's buffer is never written
    assert calls == ([5, 5] if lane_loop == "native" else [])


class ScriptedServer(OneConnectionStore):
    """Answers the first READ or WRITE with ``reply(req_id)`` (header and payload bytes), then hangs up."""

    def __init__(self, reply: Callable[[int], bytes]) -> None:
        self.reply = reply
        super().__init__()

    def answer(self, conn: socket.socket, req_id: int) -> None:
        with contextlib.suppress(OSError):
            conn.sendall(self.reply(req_id))


MIB = 1 << 20


def transfer_against(reply: Callable[[int], bytes], op: GrantOp, buf: memoryview) -> list[ErrorCode]:
    """One ``op`` of ``buf`` on one lane, against a store that answers it with ``reply(req_id)``."""
    server = ScriptedServer(reply)
    t = TcpTransport(connections_per_endpoint=1, reconnect_cooldown_s=0.0)
    try:
        s = Store(f"127.0.0.1:{server.port}", 1, new_secret())
        return t.transfer([s.request(op, b"k", 0, buf)], Deadline(5.0))
    finally:
        t.close()
        server.close()


@pytest.mark.parametrize(
    ("reply", "code"),
    [
        pytest.param(
            lambda rid: HEADER.pack(MAGIC, Op.READ, 0, 0, rid, 2 * MIB) + b"x" * 2 * MIB,
            ErrorCode.BAD_FRAME,
            id="more-bytes-than-asked",
        ),
        pytest.param(
            lambda rid: HEADER.pack(MAGIC, Op.READ, 0, 0, rid, MIB // 2) + b"x" * (MIB // 2),
            ErrorCode.BAD_FRAME,
            id="fewer-bytes-than-asked",
        ),
        pytest.param(
            lambda rid: HEADER.pack(MAGIC, Op.READ, 0, 0, rid + 7, MIB) + b"x" * MIB,
            ErrorCode.BAD_FRAME,
            id="another-request-id",
        ),
        pytest.param(
            lambda rid: HEADER.pack(0x12345678, Op.READ, 0, 0, rid, MIB) + b"x" * MIB,
            ErrorCode.BAD_FRAME,
            id="bad-magic",
        ),
        pytest.param(
            lambda rid: HEADER.pack(MAGIC, Op.READ, 0, int(ErrorCode.OBJECT_NOT_FOUND), rid, 10) + b"x" * 10,
            ErrorCode.BAD_FRAME,
            id="a-payload-with-a-failure",
        ),
        pytest.param(
            lambda rid: HEADER.pack(MAGIC, Op.READ, 0, int(ErrorCode.OBJECT_NOT_FOUND), rid, 0),
            ErrorCode.OBJECT_NOT_FOUND,
            id="a-plain-failure",
        ),
        pytest.param(
            lambda rid: HEADER.pack(MAGIC, Op.READ, 0, int(ErrorCode.TOO_MANY_CONNECTIONS), rid, 0),
            ErrorCode.TOO_MANY_CONNECTIONS,
            id="a-closing-failure",
        ),
        pytest.param(
            lambda rid: HEADER.pack(MAGIC, Op.HELLO, 0, int(ErrorCode.AUTH_FAILED), rid, 0),
            ErrorCode.AUTH_FAILED,
            id="token-refused",
        ),
        pytest.param(
            lambda rid: HEADER.pack(MAGIC, Op.READ, 0, 0, rid, MIB) + b"x" * 1000,
            ErrorCode.CONNECTION_FAILED,
            id="hang-up-mid-payload",
        ),
    ],
)
@pytest.mark.parametrize("start", [0, 16], ids=["aligned", "bounced"])
def test_a_hostile_answer_to_a_large_read(
    threads_settle: None, reply: Callable[[int], bytes], code: ErrorCode, start: int
) -> None:
    """Whatever a store answers, the read gets the same code from both loops, and no byte lands in the
    buffer unless the answer is an OK of exactly the bytes asked for; also when the compiled loop
    receives through its bounce buffer (a reply flagged as sent from the segment's pages, its source at
    0, into a destination 16 bytes into its page)."""
    region = page_aligned(start + MIB)
    region[:] = b"\xee" * len(region)
    buf = region[start:]
    answer = reply if start == 0 else lambda rid: from_pages(reply(rid))
    assert transfer_against(answer, GrantOp.READ, buf) == [code]
    if code != ErrorCode.CONNECTION_FAILED:
        assert buf == b"\xee" * MIB
    else:  # the read failed and its buffer is scratch; still nothing past the bytes that came
        assert buf[1000:] == b"\xee" * (MIB - 1000)


def from_pages(reply: bytes) -> bytes:
    """The reply with FLAG_FROM_PAGES set in its header (if it has one), as a store sending by sendfile."""
    if len(reply) < HEADER_SIZE:
        return reply
    return reply[:6] + struct.pack("<H", FLAG_FROM_PAGES) + reply[8:]


@pytest.mark.parametrize(
    ("reply", "code"),
    [
        pytest.param(
            lambda rid: HEADER.pack(MAGIC, Op.WRITE, 0, 0, rid, 10) + b"x" * 10, ErrorCode.BAD_FRAME, id="a-payload"
        ),
        pytest.param(
            lambda rid: HEADER.pack(MAGIC, Op.WRITE, 0, 0, rid + 1, 0), ErrorCode.BAD_FRAME, id="another-request-id"
        ),
        pytest.param(
            lambda rid: HEADER.pack(MAGIC, Op.WRITE, 0, int(ErrorCode.OUT_OF_BOUNDS), rid, 0),
            ErrorCode.OUT_OF_BOUNDS,
            id="a-plain-failure",
        ),
        pytest.param(
            lambda rid: HEADER.pack(MAGIC, Op.WRITE, 0, int(ErrorCode.BAD_FRAME), rid, 0),
            ErrorCode.BAD_FRAME,
            id="a-closing-failure",
        ),
        pytest.param(lambda rid: b"", ErrorCode.CONNECTION_FAILED, id="hang-up-before-the-reply"),
    ],
)
def test_a_hostile_answer_to_a_large_write(
    threads_settle: None, reply: Callable[[int], bytes], code: ErrorCode
) -> None:
    assert transfer_against(reply, GrantOp.WRITE, memoryview(random_bytes(MIB))) == [code]


@pytest.mark.parametrize("buffer", [65536, 0])
def test_small_socket_buffers_do_not_deadlock(tmp_path: Path, threads_settle: None, buffer: int) -> None:
    """Tiny (or kernel-default) socket buffers on both sides: the pipeline must size itself to them."""
    s = start_store(tmp_path, socket_buffer=buffer)
    t = TcpTransport(
        connections_per_endpoint=2,
        stripe_bytes=256 << 10,
        window=64,
        socket_buffer=buffer,
        inflight_bytes=64 << 20,
    )
    try:
        put_then_get(t, s, [100_000] * 64 + [3 << 20], deadline_s=30)
    finally:
        t.close()
        s.stop()


def test_reads_and_writes_mixed_in_one_batch(transport: TcpTransport, store: Store) -> None:
    first = random_bytes(300_000, 1)
    assert transport.transfer([store.request(GrantOp.WRITE, b"a", 0, memoryview(first))], Deadline(5)) == [0]
    second = random_bytes(300_000, 2)
    out = bytearray(300_000)
    batch = []
    for i in range(10):  # alternate directions: the lane must drain between them
        batch.append(
            store.request(GrantOp.READ, b"a", 0, memoryview(out))
            if i % 2
            else store.request(GrantOp.WRITE, b"b%d" % i, (1 << 20) * (i + 1), memoryview(second))
        )
    assert transport.transfer(batch, Deadline(10)) == [ErrorCode.OK] * 10
    assert out == first


@pytest.mark.parametrize("read_sendfile", [False, True], ids=["copied", "from-pages"])
@pytest.mark.parametrize("source", [0, 64, 4032])
@pytest.mark.parametrize("start", [0, 1, 16, 63, 64, 4080])
def test_reads_land_exactly_wherever_the_destination_starts(
    tmp_path: Path, transport: TcpTransport, source: int, start: int, read_sendfile: bool
) -> None:
    """Large READs land byte for byte whatever the destination's page offset against the source's: the
    compiled loop receives a reply sent from the segment's pages (FLAG_FROM_PAGES) into a destination
    1-63 bytes past its source (mod 4 KiB) through its bounce buffer (_lanes.c), 256 KiB at a time; a
    part of 700 KiB + 5 ends in a short chunk. Nothing around the destination is touched."""
    store = start_store(tmp_path, read_sendfile=read_sendfile)
    try:
        _reads_land_exactly(transport, store, source, start)
    finally:
        store.stop()


def _reads_land_exactly(transport: TcpTransport, store: Store, source: int, start: int) -> None:
    sizes = [(700 << 10) + 5, 1 << 20]
    values = [random_bytes(n, 7 + i) for i, n in enumerate(sizes)]
    offsets = [source + off for off in lay_out([n + source for n in sizes])]
    puts = [
        store.request(GrantOp.WRITE, b"a%d" % i, off, memoryview(v))
        for i, (off, v) in enumerate(zip(offsets, values, strict=True))
    ]
    assert transport.transfer(puts, Deadline(10)) == [ErrorCode.OK] * len(sizes)
    guard = 4096
    region = page_aligned(start + sum(sizes) + guard)
    region[:] = b"\xa5" * len(region)
    dests, pos = [], start
    for n in sizes:
        dests.append(region[pos : pos + n])
        pos += n
    gets = [
        store.request(GrantOp.READ, b"a%d" % i, off, d) for i, (off, d) in enumerate(zip(offsets, dests, strict=True))
    ]
    assert transport.transfer(gets, Deadline(10)) == [ErrorCode.OK] * len(sizes)
    assert [bytes(d) for d in dests] == [bytes(v) for v in values]
    assert region[:start] == b"\xa5" * start
    assert region[pos:] == b"\xa5" * (len(region) - pos)


def test_the_compiled_loop_knows_the_reply_flag_of_the_protocol() -> None:
    if tcp.native_lanes is None:
        pytest.skip("kvpool.transfer._lanes was not built")
    assert tcp.native_lanes.FLAG_FROM_PAGES == FLAG_FROM_PAGES


def test_the_compiled_loop_refuses_bad_source_offsets() -> None:
    if tcp.native_lanes is None:
        pytest.skip("kvpool.transfer._lanes was not built")
    a, b = socket.socketpair()
    try:
        for sources, message in (([0, 0], "one source per frame"), ([4096], r"\[-1, 4096\)"), ([-2], r"\[-1, 4096\)")):
            with pytest.raises(ValueError, match=message):
                tcp.native_lanes.pipeline(
                    a.fileno(), [b"f"], [bytearray(4)], 1, 1, 1 << 20, None, None, Op.READ, Op.WRITE, [], sources
                )
    finally:
        a.close()
        b.close()


def test_reads_into_a_larger_buffer_and_numpy_views(transport: TcpTransport, store: Store) -> None:
    value = random_bytes(10_000, 3)
    assert transport.transfer([store.request(GrantOp.WRITE, b"v", 0, memoryview(value))], Deadline(5)) == [0]
    dest = np.zeros(20_000 // 4, dtype=np.float32)  # a non-byte format: cast to bytes by the transport
    req = store.request(GrantOp.READ, b"v", 0, memoryview(dest.data), length=10_000)
    assert transport.transfer([req], Deadline(5)) == [ErrorCode.OK]
    assert dest.view(np.uint8)[:10_000].tobytes() == value
    assert not dest.view(np.uint8)[10_000:].any()


def test_concurrent_batches_from_many_threads(transport: TcpTransport, store: Store) -> None:
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            value = random_bytes(200_000 + i, i)
            off = i * (1 << 20)
            for _ in range(5):
                assert transport.transfer(
                    [store.request(GrantOp.WRITE, b"t%d" % i, off, memoryview(value))], Deadline(10)
                ) == [0]
                out = bytearray(len(value))
                assert transport.transfer(
                    [store.request(GrantOp.READ, b"t%d" % i, off, memoryview(out))], Deadline(10)
                ) == [0]
                assert out == value
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors


def test_submit_returns_before_the_transfer_is_done(transport: TcpTransport, store: Store) -> None:
    value = random_bytes(8 << 20)
    batch = transport.submit([store.request(GrantOp.WRITE, b"big", 0, memoryview(value))], Deadline(10))
    assert batch.wait(Deadline(10)) == [ErrorCode.OK]
    assert batch.wait(Deadline(10)) == [ErrorCode.OK]  # waiting twice is fine


def test_empty_batch(transport: TcpTransport) -> None:
    assert transport.transfer([], Deadline(1)) == []


# ---------------------------------------------------------------------- per-request errors
def test_each_request_gets_its_own_code(transport: TcpTransport, store: Store) -> None:
    ok = random_bytes(5000)
    past = time.time_ns() // 1_000_000 - 1
    reqs = [
        store.request(GrantOp.WRITE, b"ok", 0, memoryview(ok)),
        TransferRequest(
            GrantOp.WRITE,
            b"forged",
            store.replica(GrantOp.WRITE, b"forged", 8192, 5000, mac=bytes(16)),
            memoryview(ok),
        ),
        TransferRequest(
            GrantOp.WRITE,
            b"old",
            store.replica(GrantOp.WRITE, b"old", 16384, 5000, expiry_ms=past),
            memoryview(ok),
        ),
        store.request(GrantOp.WRITE, b"oob", SEG_SIZE - 100, memoryview(ok)),
        store.request(GrantOp.WRITE, b"short", 32768, memoryview(ok), length=4000),
        store.request(GrantOp.WRITE, b"ok2", 65536, memoryview(ok)),
    ]
    assert transport.transfer(reqs, Deadline(5)) == [
        ErrorCode.OK,
        ErrorCode.AUTH_FAILED,
        ErrorCode.GRANT_EXPIRED,
        ErrorCode.OUT_OF_BOUNDS,
        ErrorCode.INVALID_ARGUMENT,
        ErrorCode.OK,
    ]
    small = bytearray(10)
    readonly = memoryview(bytes(5000))
    reads = [
        store.request(GrantOp.READ, b"ok", 0, memoryview(small), length=5000),
        store.request(GrantOp.READ, b"ok", 0, readonly),
        TransferRequest(GrantOp.READ, b"x" * 600, store.replica(GrantOp.READ, b"x", 0, 10), memoryview(bytearray(10))),
    ]
    assert transport.transfer(reads, Deadline(5)) == [
        ErrorCode.BUFFER_TOO_SMALL,
        ErrorCode.INVALID_ARGUMENT,
        ErrorCode.KEY_TOO_LONG,
    ]


def test_unknown_segment(transport: TcpTransport, store: Store) -> None:
    other = Store(store.endpoint, store.segment_id + 1, store.secret)
    buf = bytearray(100)
    assert transport.transfer([other.request(GrantOp.READ, b"k", 0, memoryview(buf))], Deadline(5)) == [
        ErrorCode.SEGMENT_NOT_FOUND
    ]


def test_bad_endpoints(transport: TcpTransport) -> None:
    s = Store("no-port-here", 1, new_secret())
    assert transport.transfer([s.request(GrantOp.READ, b"k", 0, memoryview(bytearray(5)))], Deadline(1)) == [
        ErrorCode.INVALID_ARGUMENT
    ]
    assert parse_endpoint("[::1]:80") == ("::1", 80)
    with pytest.raises(KvPoolError):
        parse_endpoint("host:99999")


# ---------------------------------------------------------------------- dead and silent peers
def test_a_dead_endpoint_fails_fast_with_connection_failed(transport: TcpTransport, store: Store) -> None:
    dead = Store(f"127.0.0.1:{free_port()}", 5, new_secret())
    value = random_bytes(100_000)
    out = bytearray(len(value))
    t0 = time.monotonic()
    reqs = [
        dead.request(GrantOp.WRITE, b"x", 0, memoryview(value)),
        store.request(GrantOp.WRITE, b"y", 0, memoryview(value)),
        dead.request(GrantOp.READ, b"x", 0, memoryview(out)),
    ]
    assert transport.transfer(reqs, Deadline(5)) == [
        ErrorCode.CONNECTION_FAILED,
        ErrorCode.OK,
        ErrorCode.CONNECTION_FAILED,
    ]
    assert time.monotonic() - t0 < 1.0
    assert transport.ping(dead.endpoint, Deadline(2)) == ErrorCode.CONNECTION_FAILED


class SilentServer:
    """Accepts connections and reads nothing, answers nothing."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join()
        for c in self.conns:
            c.close()


def test_a_server_that_never_answers_gives_timeout_by_the_deadline(
    transport: TcpTransport, threads_settle: None
) -> None:
    silent = SilentServer()
    try:
        s = Store(f"127.0.0.1:{silent.port}", 1, new_secret())
        bufs = [bytearray(64 << 10) for _ in range(8)]
        big = random_bytes(32 << 20)  # more than the socket buffers hold: the send itself blocks
        reqs = [s.request(GrantOp.READ, b"k%d" % i, 0, memoryview(b)) for i, b in enumerate(bufs)]
        reqs.append(s.request(GrantOp.WRITE, b"big", 0, memoryview(big)))
        t0 = time.monotonic()
        assert transport.transfer(reqs, Deadline(0.5)) == [ErrorCode.TIMEOUT] * 9
        elapsed = time.monotonic() - t0
        assert 0.45 < elapsed < 2.0, elapsed
        assert transport.ping(s.endpoint, Deadline(0.2)) == ErrorCode.TIMEOUT
    finally:
        silent.close()


class TricklingServer(OneConnectionStore):
    """Answers a READ with an OK header, then one payload byte every 20 ms: a peer that makes progress
    slowly must not stretch the deadline (each blocking call is re-armed to the time left)."""

    def answer(self, conn: socket.socket, req_id: int) -> None:
        conn.sendall(HEADER.pack(MAGIC, Op.READ, 0, 0, req_id, 1 << 20))
        while not self.stop.wait(0.02):
            try:
                conn.sendall(b"x")
            except OSError:
                return


def test_a_trickling_peer_cannot_stretch_the_deadline(threads_settle: None) -> None:
    server = TricklingServer()
    t = TcpTransport(connections_per_endpoint=1)
    try:
        s = Store(f"127.0.0.1:{server.port}", 1, new_secret())
        buf = bytearray(1 << 20)
        t0 = time.monotonic()
        assert t.transfer([s.request(GrantOp.READ, b"k", 0, memoryview(buf))], Deadline(0.5)) == [ErrorCode.TIMEOUT]
        assert time.monotonic() - t0 < 0.9
    finally:
        t.close()
        server.close()


def test_wait_with_a_shorter_deadline_cancels_and_leaves_the_buffer_alone(
    transport: TcpTransport, threads_settle: None
) -> None:
    silent = SilentServer()
    try:
        s = Store(f"127.0.0.1:{silent.port}", 1, new_secret())
        buf = bytearray(1 << 20)
        batch = transport.submit([s.request(GrantOp.READ, b"k", 0, memoryview(buf))], Deadline(30))
        t0 = time.monotonic()
        assert batch.wait(Deadline(0.2)) == [ErrorCode.TIMEOUT]
        assert time.monotonic() - t0 < 1.5
        # the lane has given up: the server's late bytes (none here) could not land in buf any more
        assert silent.conns, "the lane did connect"
        for c in silent.conns:
            c.setblocking(False)
        wait_for(lambda: all(_peer_closed(c) for c in silent.conns), 5.0, "cancelled connection to close")
    finally:
        silent.close()


def _peer_closed(conn: socket.socket) -> bool:
    try:
        while True:
            data = conn.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_a_restarted_store_is_reconnected_transparently(tmp_path: Path, transport: TcpTransport) -> None:
    s1 = start_store(tmp_path)
    try:
        put_then_get(transport, s1, [1000, 2 << 20])
    finally:
        s1.stop()
    # Same port, new process state: the pooled connections are dead; the next batch must not fail.
    port = int(s1.endpoint.rsplit(":", 1)[1])
    s2 = start_store(tmp_path, port=port)
    try:
        put_then_get(transport, s2, [1000, 2 << 20])
    finally:
        s2.stop()


def test_too_many_connections_is_reported(tmp_path: Path, threads_settle: None) -> None:
    s = start_store(tmp_path, max_connections=1)
    t = TcpTransport(connections_per_endpoint=4, stripe_bytes=64 << 10, reconnect_cooldown_s=0.0)
    try:
        value = random_bytes(1 << 20)
        codes = t.transfer([s.request(GrantOp.WRITE, b"k", 0, memoryview(value))], Deadline(5))
        assert codes in ([ErrorCode.TOO_MANY_CONNECTIONS], [ErrorCode.CONNECTION_FAILED])
    finally:
        t.close()
        s.stop()


# ---------------------------------------------------------------------- control ops and lifecycle
def test_ping_and_store_info(transport: TcpTransport, store: Store) -> None:
    assert transport.ping(store.endpoint, Deadline(2)) == ErrorCode.OK
    info = transport.store_info(store.endpoint, Deadline(2))
    assert info["segments"][0]["id"] == store.segment_id
    with pytest.raises(KvPoolError) as exc:
        transport.store_info(f"127.0.0.1:{free_port()}", Deadline(2))
    assert exc.value.code == ErrorCode.CONNECTION_FAILED


def test_close_ends_every_thread_and_later_submits_fail(store: Store, threads_settle: None) -> None:
    t = TcpTransport()
    put_then_get(t, store, [3 << 20])
    t.close()
    t.close()
    buf = bytearray(10)
    assert t.transfer([store.request(GrantOp.READ, b"k", 0, memoryview(buf))], Deadline(1)) == [ErrorCode.SHUTTING_DOWN]
    assert store.server is not None
    wait_for(
        lambda: store.server is not None and store.server.statistics().connections == 0,
        5.0,
        "the connection to end",
    )


# ---------------------------------------------------------------------- a store in another process
STORE_SCRIPT = """
import json, sys
from kvpool.common.grants import new_secret
from kvpool.store.dataplane import DataPlaneServer, _Close
from kvpool.store.inventory import Inventory
from kvpool.store.segment import ShmSegment
seg = ShmSegment.create(sys.argv[1], "seg", 64 << 20)
secret = new_secret()
server = DataPlaneServer("127.0.0.1", 0, {seg.id: seg}, {seg.id: secret}, Inventory())
server.start()
print(json.dumps({"port": server.port, "id": seg.id, "secret": secret.hex()}), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def store_process(tmp_path: Path) -> Iterator[tuple[Store, subprocess.Popen[str]]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    with subprocess.Popen(  # leaving the block closes the pipes (warnings are errors: ResourceWarning)
        [sys.executable, "-c", STORE_SCRIPT, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    ) as proc:
        try:
            assert proc.stdout is not None
            info = json.loads(proc.stdout.readline())
            yield Store(f"127.0.0.1:{info['port']}", info["id"], bytes.fromhex(info["secret"])), proc
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def test_a_store_killed_mid_batch_fails_only_that_batch(
    store_process: tuple[Store, subprocess.Popen[str]], store: Store, transport: TcpTransport
) -> None:
    remote, proc = store_process
    put_then_get(transport, remote, [1 << 20, 5])
    values = [random_bytes(1 << 20, i) for i in range(48)]
    reqs = [remote.request(GrantOp.WRITE, b"k%d" % i, i << 20, memoryview(v)) for i, v in enumerate(values)]
    batch = transport.submit(reqs, Deadline(20))
    proc.send_signal(signal.SIGKILL)
    codes = batch.wait(Deadline(20))
    assert set(codes) <= {ErrorCode.OK, ErrorCode.CONNECTION_FAILED}
    # another store is unaffected, and the dead one fails fast from now on
    put_then_get(transport, store, [1 << 20])
    t0 = time.monotonic()
    assert transport.transfer(reqs[:2], Deadline(5)) == [ErrorCode.CONNECTION_FAILED] * 2
    assert time.monotonic() - t0 < 1.0


# ---------------------------------------------------------------------- checksums on the lanes
@pytest.mark.parametrize("stripe", [64 << 10, 4 << 20])
def test_reads_are_verified_on_the_lane_once_every_part_landed(store: Store, threads_settle: None, stripe: int) -> None:
    """verify=True: the lane that receives a request's last part compares the bytes with the checksum
    (striped over 4 lanes with the small stripe, one part with the large one)."""
    size = (1 << 20) + 5
    value = random_bytes(size, 7)
    t = TcpTransport(connections_per_endpoint=4, stripe_bytes=stripe)
    try:
        put = store.request(GrantOp.WRITE, b"k", 0, memoryview(value), checksum=LazyChecksum(memoryview(value)))
        assert t.transfer([put], Deadline(10)) == [ErrorCode.OK]
        outs = [bytearray(size) for _ in range(2)]
        reads = [
            TransferRequest(GrantOp.READ, b"k", store.replica(GrantOp.READ, b"k", 0, size), memoryview(out), s, True)
            for out, s in zip(outs, [checksum(value), checksum(value) ^ 1], strict=True)
        ]
        assert t.transfer(reads, Deadline(10)) == [ErrorCode.OK, ErrorCode.CHECKSUM_MISMATCH]
        assert outs[0] == value
    finally:
        t.close()
    assert store.inventory is not None
    # the lazily computed checksum is the one the store recorded for its inventory
    assert [e.checksum for e in store.inventory.entries(store.segment_id)] == [checksum(value)]


def test_lazy_checksum_is_computed_once_across_threads() -> None:
    data = memoryview(random_bytes(1 << 20, 3))
    lazy = LazyChecksum(data)
    seen: list[int] = []
    threads = [threading.Thread(target=lambda: seen.append(lazy.value)) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert seen == [checksum(data)] * 8


def test_spin_recv_into_polls_then_gives_up_and_sees_eof() -> None:
    a, b = socket.socketpair()
    with a, b:
        view = memoryview(bytearray(16))
        started = time.perf_counter()
        assert spin_recv_into(a, view, 0.002) == -1  # nothing came within the spin
        assert time.perf_counter() - started >= 0.002
        b.sendall(b"hello")
        assert spin_recv_into(a, view, 1.0) == 5
        assert bytes(view[:5]) == b"hello"
        b.close()
        assert spin_recv_into(a, view, 1.0) == 0  # EOF


@pytest.mark.parametrize("spin_us", [0, 200])
def test_single_requests_with_and_without_polling(tmp_path: Path, threads_settle: None, spin_us: int) -> None:
    s = start_store(tmp_path, spin_us=spin_us)
    t = TcpTransport(connections_per_endpoint=2, spin_us=spin_us)
    try:
        for size in (1, 65_537, 300_000):  # the last is above the polling bound: it blocks
            put_then_get(t, s, [size])
    finally:
        t.close()
        s.stop()
