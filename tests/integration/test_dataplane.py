"""The store's data plane against raw sockets: every check, every malformed frame, no stray byte moved.

A real DataPlaneServer runs in-process on 127.0.0.1 port 0 over a small ShmSegment filled with a pattern;
the tests sign grants themselves (playing the master) and speak the frame protocol by hand, so malformed
frames can be built byte by byte. After each test the segment outside the ranges the test was granted is
compared with the pattern, and the server must be back to zero connections and no extra threads.
"""

from __future__ import annotations

import functools
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.common.checksum import checksum
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.grants import Grant, GrantOp, make_grant, new_secret
from kvpool.proto.frames import (
    DESC,
    FLAG_FROM_PAGES,
    FLAG_REVALIDATE,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_VECTOR_DESCS,
    MAX_VECTOR_ENTRIES,
    VECTOR_COUNT,
    Op,
    TransferDesc,
)
from kvpool.store.dataplane import DataPlaneServer
from kvpool.store.inventory import Inventory, InventoryEntry
from kvpool.store.segment import ShmSegment
from tests.support.wait import wait_for

pytestmark = pytest.mark.integration

SEG_SIZE = 8 << 20


# ---------------------------------------------------------------------- helpers
@functools.cache
def pattern(size: int) -> np.ndarray:
    """A fixed, non-repeating-looking fill (computed once per size; callers must not modify it)."""
    return np.tile(np.random.default_rng(7).integers(0, 256, 65536, dtype=np.uint8), size // 65536 + 1)[:size]


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass
class Store:
    server: DataPlaneServer
    segment: ShmSegment
    secret: bytes
    inventory: Inventory
    expected: np.ndarray  # what the segment must hold: the pattern, plus what the tests wrote
    granted: list[tuple[int, int]] = field(default_factory=list)  # ranges a test may have changed

    @property
    def port(self) -> int:
        return self.server.port

    def grant(
        self,
        op: GrantOp,
        offset: int,
        length: int,
        key: bytes = b"key",
        expiry_ms: int | None = None,
        segment_id: int | None = None,
    ) -> Grant:
        if op == GrantOp.WRITE:
            self.granted.append((offset, length))
        expiry = now_ms() + 60_000 if expiry_ms is None else expiry_ms
        seg = self.segment.id if segment_id is None else segment_id
        return make_grant(self.secret, op, seg, offset, length, expiry, key)

    def seg_bytes(self) -> np.ndarray:
        return np.frombuffer(self.segment.view, dtype=np.uint8)

    def assert_untouched_outside_grants(self) -> None:
        actual = self.seg_bytes()
        mask = np.ones(len(actual), dtype=bool)
        for off, n in self.granted:
            mask[off : off + n] = False
        bad = np.nonzero((actual != self.expected) & mask)[0]
        assert bad.size == 0, f"{bad.size} bytes changed outside any granted range, first at {bad[0]}"


def make_store(tmp: Path, **kwargs: object) -> Store:
    seg = ShmSegment.create(str(tmp), f"seg-{os.getpid()}-{time.monotonic_ns()}", SEG_SIZE)
    expected = pattern(SEG_SIZE)
    np.frombuffer(seg.view, dtype=np.uint8)[:] = expected
    secret = new_secret()
    inventory = Inventory()
    server = DataPlaneServer("127.0.0.1", 0, {seg.id: seg}, {seg.id: secret}, inventory, **kwargs)  # type: ignore[arg-type]
    server.start()
    return Store(server, seg, secret, inventory, expected.copy())


def close_store(store: Store, threads_before: int) -> None:
    store.server.stop()
    assert store.server.statistics().connections == 0
    wait_for(lambda: threading.active_count() <= threads_before, 5.0, "server threads to end")
    store.segment.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    before = threading.active_count()
    s = make_store(tmp_path, stall_timeout_s=1.0)
    try:
        yield s
        wait_for(lambda: s.server.statistics().connections == 0, 5.0, "connections to close")
        s.assert_untouched_outside_grants()
    finally:
        close_store(s, before)


class Raw:
    """A hand-driven client connection."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.req_id = 0
        self.last_flags = 0  # the header flags of the last reply

    def send(self, data: bytes | bytearray | memoryview) -> None:
        self.sock.sendall(data)

    def header(self, op: int, length: int, req_id: int | None = None, magic: int = MAGIC, flags: int = 0) -> bytes:
        self.req_id += 1
        return HEADER.pack(magic, op, flags, 0, self.req_id if req_id is None else req_id, length)

    def recv_exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError(f"closed after {len(out)} of {n} bytes")
            out += chunk
        return bytes(out)

    def response(self) -> tuple[int, int, int, bytes]:
        """(op, status, req_id, payload) of the next response."""
        magic, op, self.last_flags, status, req_id, length = HEADER.unpack(self.recv_exact(HEADER_SIZE))
        assert magic == MAGIC
        return op, status, req_id, self.recv_exact(length)

    def write(self, grant: Grant, data: bytes, part_offset: int = 0, checksum: int = 0, flags: int = 0) -> int:
        desc = TransferDesc(grant, checksum, part_offset, len(data)).pack()
        self.send(self.header(Op.WRITE, len(desc) + len(data), flags=flags) + desc + data)
        _op, status, req_id, payload = self.response()
        assert req_id == self.req_id
        assert payload == b""
        return status

    def read(
        self, grant: Grant, part_offset: int = 0, part_length: int | None = None, checksum: int = 0, flags: int = 0
    ) -> tuple[int, bytes]:
        n = grant.length - part_offset if part_length is None else part_length
        desc = TransferDesc(grant, checksum, part_offset, n).pack()
        self.send(self.header(Op.READ, len(desc), flags=flags) + desc)
        _op, status, req_id, payload = self.response()
        assert req_id == self.req_id
        return status, payload

    def readv(
        self, entries: list[tuple[Grant, int, int]], checksum: int = 0, flags: int = 0
    ) -> tuple[int, list[int], bytes]:
        """One READV of (grant, part_offset, part_length) entries: (frame status, entry codes, data)."""
        descs = b"".join(TransferDesc(g, checksum, o, n).pack() for g, o, n in entries)
        body = VECTOR_COUNT.pack(len(entries)) + descs
        self.send(self.header(Op.READV, len(body), flags=flags) + body)
        op, status, req_id, payload = self.response()
        assert (op, req_id) == (Op.READV, self.req_id)
        codes = list(struct.unpack_from(f"<{len(entries)}i", payload)) if status == 0 else []
        return status, codes, payload[4 * len(codes) :]

    def ping(self) -> int:
        self.send(self.header(Op.PING, 0))
        return self.response()[1]

    def is_closed_by_peer(self, timeout: float = 5.0) -> bool:
        """True once the server has closed: EOF (after any pending reply) or a reset."""
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(65536):
                pass
            return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fresh_round_trip(store: Store, offset: int = SEG_SIZE - 4096, n: int = 4096) -> None:
    """A new client can still write and read back exactly."""
    data = os.urandom(n)
    with Raw(store.port) as c:
        assert c.write(store.grant(GrantOp.WRITE, offset, n, b"fresh"), data) == ErrorCode.OK
        status, got = c.read(store.grant(GrantOp.READ, offset, n, b"fresh"))
    assert status == ErrorCode.OK
    assert got == data
    store.expected[offset : offset + n] = np.frombuffer(data, dtype=np.uint8)


# ---------------------------------------------------------------------- happy paths
def test_ping_and_store_info(store: Store) -> None:
    with Raw(store.port) as c:
        assert c.ping() == ErrorCode.OK
        c.send(c.header(Op.STORE_INFO, 0))
        op, status, _, payload = c.response()
    assert op == Op.STORE_INFO
    assert status == ErrorCode.OK
    assert b'"segments"' in payload
    assert str(store.segment.id).encode() in payload


def test_store_info_comes_from_the_callback(tmp_path: Path) -> None:
    before = threading.active_count()
    s = make_store(tmp_path, store_info=lambda: {"node": "n1", "objects": 3})
    try:
        with Raw(s.port) as c:
            c.send(c.header(Op.STORE_INFO, 0))
            assert c.response()[3] == b'{"node": "n1", "objects": 3}'
    finally:
        close_store(s, before)


@pytest.mark.parametrize("size", [1, 4096, 65_537, 1 << 20, (4 << 20) + 3])
def test_write_then_read_round_trips_exactly(store: Store, size: int) -> None:
    data = os.urandom(size)
    offset = 12345
    with Raw(store.port) as c:
        assert c.write(store.grant(GrantOp.WRITE, offset, size, b"obj"), data, checksum=77) == ErrorCode.OK
        status, got = c.read(store.grant(GrantOp.READ, offset, size, b"obj"))
    assert status == ErrorCode.OK
    assert got == data
    assert bytes(store.segment.view[offset : offset + size]) == data
    store.expected[offset : offset + size] = np.frombuffer(data, dtype=np.uint8)
    seg = store.segment.id
    assert store.inventory.entries(seg) == [InventoryEntry(seg, b"obj", offset, size, 77)]


@pytest.mark.parametrize("read_sendfile", [False, True], ids=["copied", "from-pages"])
def test_large_reads_are_copied_or_sent_from_the_segment_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, read_sendfile: bool
) -> None:
    """A READ is copied from the mapping by default; with ``read_sendfile`` a large one leaves from the
    segment's file and its reply says so (FLAG_FROM_PAGES), a small one is still copied. Parts that start
    and end mid-page come back exact either way, and a tmpfs segment never takes the copy fallback."""
    before = threading.active_count()
    store = make_store(tmp_path, read_sendfile=read_sendfile)
    try:
        assert store.segment.fd >= 0
        for start, n, spliced in ((4096 * 3 + 17, (1 << 20) + 4093, read_sendfile), (5, 1000, False)):
            with Raw(store.port) as c:
                status, got = c.read(store.grant(GrantOp.READ, start, n))
                assert (status, c.last_flags) == (ErrorCode.OK, FLAG_FROM_PAGES if spliced else 0)
            assert got == store.expected[start : start + n].tobytes()
    finally:
        close_store(store, before)
    assert "sendfile refused" not in caplog.text


def test_a_segment_file_that_refuses_sendfile_is_copied_instead(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file system without splice (sendfile says EINVAL, as from a directory) falls back to copying the
    mapped bytes after the header already went out; the fallback is logged once per segment."""
    before = threading.active_count()
    store = make_store(tmp_path, read_sendfile=True)
    real_fd = store.segment.fd
    store.segment.fd = os.open(tmp_path, os.O_RDONLY)  # sendfile from a directory: EINVAL
    try:
        with Raw(store.port) as c:
            for start, n in ((0, 1 << 20), (SEG_SIZE - (256 << 10), 256 << 10)):
                status, got = c.read(store.grant(GrantOp.READ, start, n))
                assert status == ErrorCode.OK
                assert got == store.expected[start : start + n].tobytes()
    finally:
        os.close(store.segment.fd)
        store.segment.fd = real_fd
        close_store(store, before)
    assert caplog.text.count("sendfile refused") == 1


def test_parts_of_a_striped_object_on_several_connections(store: Store) -> None:
    size, part = 1 << 20, 256 << 10
    data = os.urandom(size)
    grant = store.grant(GrantOp.WRITE, 0, size, b"striped")
    conns = [Raw(store.port) for _ in range(4)]
    try:
        for i in (2, 0, 3):  # out of order, one part missing
            assert conns[i].write(grant, data[i * part : (i + 1) * part], part_offset=i * part) == ErrorCode.OK
        assert store.inventory.entries(store.segment.id) == []
        assert conns[1].write(grant, data[part : 2 * part], part_offset=part) == ErrorCode.OK
        assert [e.key for e in store.inventory.entries(store.segment.id)] == [b"striped"]
        status, got = conns[0].read(
            store.grant(GrantOp.READ, 0, size, b"striped"), part_offset=part, part_length=2 * part
        )
        assert status == ErrorCode.OK
        assert got == data[part : 3 * part]
    finally:
        for c in conns:
            c.close()
    store.expected[:size] = np.frombuffer(data, dtype=np.uint8)


def test_overwriting_drops_overlapped_inventory_entries(store: Store) -> None:
    with Raw(store.port) as c:
        for i in range(3):
            assert c.write(store.grant(GrantOp.WRITE, i * 100, 100, b"k%d" % i), bytes(100)) == ErrorCode.OK
        assert c.write(store.grant(GrantOp.WRITE, 150, 100, b"new"), b"\x01" * 100) == ErrorCode.OK
    entries = store.inventory.entries(store.segment.id)
    assert [(e.key, e.offset) for e in entries] == [(b"k0", 0), (b"new", 150)]
    store.expected[:300] = 0
    store.expected[150:250] = 1


def test_pipelined_requests_are_answered_in_order(store: Store) -> None:
    datas = [os.urandom(1000 + i) for i in range(50)]
    frames = bytearray()
    with Raw(store.port) as c:
        for i, d in enumerate(datas):
            desc = TransferDesc(store.grant(GrantOp.WRITE, i * 4096, len(d), b"p%d" % i), 0, 0, len(d)).pack()
            frames += c.header(Op.WRITE, len(desc) + len(d), req_id=i) + desc + d
        c.send(frames)
        assert [c.response()[1:3] for _ in datas] == [(0, i) for i in range(50)]
        frames = bytearray()
        for i, d in enumerate(datas):
            desc = TransferDesc(store.grant(GrantOp.READ, i * 4096, len(d), b"p%d" % i), 0, 0, len(d)).pack()
            frames += c.header(Op.READ, len(desc), req_id=100 + i) + desc
        c.send(frames)
        for i, d in enumerate(datas):
            _, status, rid, payload = c.response()
            assert (status, rid, payload) == (0, 100 + i, d)
            store.expected[i * 4096 : i * 4096 + len(d)] = np.frombuffer(d, dtype=np.uint8)


def test_held_replies_keep_request_order_across_ops(store: Store) -> None:
    """Bare replies to pipelined requests may be held back and sent together; whatever op comes next (a
    READ with its payload, a PING, STORE_INFO), the answers still arrive in request order."""
    data = os.urandom(300_000)
    with Raw(store.port) as c:
        wdesc = TransferDesc(store.grant(GrantOp.WRITE, 0, len(data), b"h"), 0, 0, len(data)).pack()
        rdesc = TransferDesc(store.grant(GrantOp.READ, 0, len(data), b"h"), 0, 0, len(data)).pack()
        small = TransferDesc(store.grant(GrantOp.WRITE, 1 << 20, 10, b"s"), 0, 0, 10).pack()
        c.send(
            c.header(Op.WRITE, len(wdesc) + len(data), req_id=1)
            + wdesc
            + data
            + c.header(Op.WRITE, len(small) + 10, req_id=2)
            + small
            + b"0123456789"
            + c.header(Op.PING, 0, req_id=3)
            + c.header(Op.READ, len(rdesc), req_id=4)
            + rdesc
            + c.header(Op.PING, 0, req_id=5)
            + c.header(Op.STORE_INFO, 0, req_id=6)
        )
        answers = [c.response() for _ in range(6)]
    assert [(op, status, rid) for op, status, rid, _ in answers] == [
        (Op.WRITE, 0, 1),
        (Op.WRITE, 0, 2),
        (Op.PING, 0, 3),
        (Op.READ, 0, 4),
        (Op.PING, 0, 5),
        (Op.STORE_INFO, 0, 6),
    ]
    assert answers[3][3] == data
    store.expected[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    store.expected[1 << 20 : (1 << 20) + 10] = np.frombuffer(b"0123456789", dtype=np.uint8)


def test_answers_held_before_a_malformed_frame_are_delivered_before_the_close(store: Store) -> None:
    with Raw(store.port) as c:
        c.send(c.header(Op.PING, 0, req_id=1) + c.header(Op.PING, 0, req_id=2) + c.header(Op.PING, 0, magic=7))
        assert [c.response()[1:3] for _ in range(2)] == [(0, 1), (0, 2)]
        expect_closed_with(c, ErrorCode.BAD_FRAME)
    fresh_round_trip(store)


# -------------------------------------------------------------- rejected requests (connection stays usable)
def test_bad_mac_is_auth_failed_and_the_payload_is_drained(store: Store) -> None:
    good = store.grant(GrantOp.WRITE, 0, 4096)
    forged = Grant(good.op, good.segment_id, good.offset, good.length, good.expiry_ms, good.key, bytes(16))
    store.granted.clear()  # nothing may change
    with Raw(store.port) as c:
        assert c.write(forged, b"\xff" * 4096) == ErrorCode.AUTH_FAILED
        # a grant for another range, a key or an op that was not signed
        tampered = Grant(good.op, good.segment_id, 8192, good.length, good.expiry_ms, good.key, good.mac)
        assert c.write(tampered, b"\xff" * 4096) == ErrorCode.AUTH_FAILED
        other_key = Grant(good.op, good.segment_id, 0, good.length, good.expiry_ms, b"other", good.mac)
        assert c.write(other_key, b"\xff" * 4096) == ErrorCode.AUTH_FAILED
        as_read = Grant(GrantOp.READ, good.segment_id, 0, good.length, good.expiry_ms, good.key, good.mac)
        assert c.read(as_read)[0] == ErrorCode.AUTH_FAILED
        assert c.ping() == ErrorCode.OK  # still in sync
    assert store.inventory.entries(store.segment.id) == []
    assert store.server.statistics().errors.get("AUTH_FAILED") == 4


def test_read_grant_cannot_write(store: Store) -> None:
    read_grant = store.grant(GrantOp.READ, 0, 100)
    replayed = Grant(GrantOp.WRITE, read_grant.segment_id, 0, 100, read_grant.expiry_ms, read_grant.key, read_grant.mac)
    with Raw(store.port) as c:
        # The op is inside the MAC: a READ grant replayed in a WRITE frame does not verify.
        assert c.write(replayed, b"x" * 100) == ErrorCode.AUTH_FAILED


def test_expired_grant(store: Store) -> None:
    store.granted.clear()
    with Raw(store.port) as c:
        assert (
            c.write(store.grant(GrantOp.WRITE, 0, 100, expiry_ms=now_ms() - 1), b"x" * 100) == ErrorCode.GRANT_EXPIRED
        )
        store.granted.clear()
        old = store.grant(GrantOp.READ, 0, 100, expiry_ms=now_ms() - 1000)
        assert c.read(old)[0] == ErrorCode.GRANT_EXPIRED
        assert c.ping() == ErrorCode.OK


def test_a_revalidated_read_is_served_only_while_the_store_holds_exactly_that_object(store: Store) -> None:
    """FLAG_REVALIDATE (decision 0014): an ended but authentic READ grant is served from the inventory."""
    data, other = os.urandom(4096), os.urandom(4096)
    held = checksum(data)
    past = now_ms() - 1
    with Raw(store.port) as c:
        assert c.write(store.grant(GrantOp.WRITE, 0, 4096, b"obj"), data, checksum=held) == ErrorCode.OK
        ended = store.grant(GrantOp.READ, 0, 4096, b"obj", expiry_ms=past)
        assert c.read(ended, checksum=held)[0] == ErrorCode.GRANT_EXPIRED  # not asked: refused as always
        assert c.read(ended, checksum=held, flags=FLAG_REVALIDATE) == (ErrorCode.OK, data)
        assert c.read(ended, 1000, 100, checksum=held, flags=FLAG_REVALIDATE) == (ErrorCode.OK, data[1000:1100])
        assert c.readv([(ended, 0, 4096)], checksum=held, flags=FLAG_REVALIDATE) == (ErrorCode.OK, [0], data)
        # Not another key, range or checksum than the one held; a forged grant stays forged.
        not_held = [
            (store.grant(GrantOp.READ, 0, 4096, b"other", expiry_ms=past), held),
            (store.grant(GrantOp.READ, 0, 2048, b"obj", expiry_ms=past), held),
            (ended, held ^ 1),
        ]
        for grant, csum in not_held:
            assert c.read(grant, checksum=csum, flags=FLAG_REVALIDATE)[0] == ErrorCode.GRANT_EXPIRED
        forged = Grant(GrantOp.READ, store.segment.id, 0, 4096, past, b"obj", b"\0" * 16)
        assert c.read(forged, checksum=held, flags=FLAG_REVALIDATE)[0] == ErrorCode.AUTH_FAILED
        # Never a write.
        late = store.grant(GrantOp.WRITE, 0, 4096, b"obj", expiry_ms=past)
        assert c.write(late, data, checksum=held, flags=FLAG_REVALIDATE) == ErrorCode.GRANT_EXPIRED
        # Not once another object has begun to land over it, nor a half-written one.
        assert c.write(store.grant(GrantOp.WRITE, 0, 4096, b"next"), other[:2048], checksum=checksum(other)) == 0
        assert c.read(ended, checksum=held, flags=FLAG_REVALIDATE)[0] == ErrorCode.GRANT_EXPIRED
        half = store.grant(GrantOp.READ, 0, 4096, b"next", expiry_ms=past)
        assert c.read(half, checksum=checksum(other), flags=FLAG_REVALIDATE)[0] == ErrorCode.GRANT_EXPIRED
        # Nor once the master has freed it.
        assert c.write(store.grant(GrantOp.WRITE, 8192, 4096, b"obj2"), data, checksum=held) == ErrorCode.OK
        ended2 = store.grant(GrantOp.READ, 8192, 4096, b"obj2", expiry_ms=past)
        assert c.read(ended2, checksum=held, flags=FLAG_REVALIDATE)[0] == ErrorCode.OK
        assert store.inventory.drop(store.segment.id, 8192)
        assert c.read(ended2, checksum=held, flags=FLAG_REVALIDATE)[0] == ErrorCode.GRANT_EXPIRED
    stats = store.server.statistics()
    assert stats.reads_revalidated == 4
    assert stats.errors == {"GRANT_EXPIRED": 8, "AUTH_FAILED": 1}
    store.expected[:2048] = np.frombuffer(other[:2048], dtype=np.uint8)
    store.expected[2048:4096] = np.frombuffer(data[2048:], dtype=np.uint8)
    store.expected[8192 : 8192 + 4096] = np.frombuffer(data, dtype=np.uint8)


def test_unknown_segment(store: Store) -> None:
    with Raw(store.port) as c:
        g = store.grant(GrantOp.WRITE, 0, 100, segment_id=store.segment.id + 1)
        store.granted.clear()
        assert c.write(g, b"x" * 100) == ErrorCode.SEGMENT_NOT_FOUND
        assert c.read(store.grant(GrantOp.READ, 0, 100, segment_id=123))[0] == ErrorCode.SEGMENT_NOT_FOUND
        assert c.ping() == ErrorCode.OK


def test_ranges_outside_the_grant_or_the_segment(store: Store) -> None:
    with Raw(store.port) as c:
        g = store.grant(GrantOp.WRITE, 0, 4096)
        store.granted.clear()
        # a part that runs past the end of the grant
        assert c.write(g, b"x" * 100, part_offset=4000) == ErrorCode.OUT_OF_BOUNDS
        assert c.write(g, b"x" * 4097) == ErrorCode.OUT_OF_BOUNDS
        # validly signed grants that run past the end of the segment
        assert c.write(store.grant(GrantOp.WRITE, SEG_SIZE - 10, 20), b"x" * 20) == ErrorCode.OUT_OF_BOUNDS
        store.granted.clear()
        huge = (1 << 64) - 1
        assert c.read(store.grant(GrantOp.READ, huge, 1))[0] == ErrorCode.OUT_OF_BOUNDS
        assert c.read(store.grant(GrantOp.READ, 0, huge), part_length=10)[0] == ErrorCode.OUT_OF_BOUNDS
        assert c.read(store.grant(GrantOp.READ, 0, 100), part_offset=50, part_length=51)[0] == ErrorCode.OUT_OF_BOUNDS
        assert c.read(store.grant(GrantOp.READ, 0, 100), part_offset=huge, part_length=2)[0] == ErrorCode.OUT_OF_BOUNDS
        assert c.ping() == ErrorCode.OK
    assert store.inventory.entries(store.segment.id) == []


@pytest.mark.parametrize("key_bytes", [3, 400])  # 400: the frame is longer than the read-ahead buffer
def test_readv_checks_every_entry_on_its_own(store: Store, key_bytes: int) -> None:
    data = os.urandom(3 * 4096)
    with Raw(store.port) as c:
        for i in range(3):
            key = b"%d" % i * key_bytes
            assert c.write(store.grant(GrantOp.WRITE, i * 4096, 4096, key), data[i * 4096 : (i + 1) * 4096]) == 0
        keys = [b"%d" % i * key_bytes for i in range(3)]
        good = [store.grant(GrantOp.READ, i * 4096, 4096, keys[i]) for i in range(3)]
        forged = Grant(GrantOp.READ, store.segment.id, 0, 4096, now_ms() + 60_000, keys[0], b"\0" * 16)
        expired = store.grant(GrantOp.READ, 4096, 4096, keys[1], expiry_ms=now_ms() - 1)
        entries = [(good[0], 0, 4096), (forged, 0, 4096), (good[2], 100, 50), (expired, 0, 4096), (good[1], 0, 0)]
        entries += [(good[1], 0, 4096)] * (MAX_VECTOR_ENTRIES - len(entries))
        status, codes, got = c.readv(entries)
        assert status == ErrorCode.OK
        tail = [ErrorCode.OK] * (MAX_VECTOR_ENTRIES - 5)
        assert codes == [ErrorCode.OK, ErrorCode.AUTH_FAILED, ErrorCode.OK, ErrorCode.GRANT_EXPIRED, 0, *tail]
        assert got == data[:4096] + data[8192 + 100 : 8192 + 150] + data[4096:8192] * len(tail)
        assert c.ping() == ErrorCode.OK  # refused entries leave the connection usable
    stats = store.server.statistics()
    assert stats.errors == {"AUTH_FAILED": 1, "GRANT_EXPIRED": 1}


def test_writev_checks_every_entry_on_its_own(store: Store) -> None:
    data = [os.urandom(4096), os.urandom(1000), os.urandom(2000), os.urandom(300)]
    good = store.grant(GrantOp.WRITE, 0, 4096, b"a")
    read_only = store.grant(GrantOp.READ, 8192, 1000, b"b")  # a READ grant cannot write
    expired = store.grant(GrantOp.WRITE, 16384, 2000, b"c", expiry_ms=now_ms() - 1)
    second = store.grant(GrantOp.WRITE, 24576, 1000, b"d")
    entries = [(good, 0, data[0]), (read_only, 0, data[1]), (expired, 0, data[2]), (second, 700, data[3])]
    body = VECTOR_COUNT.pack(len(entries)) + b"".join(TransferDesc(g, 5, o, len(d)).pack() for g, o, d in entries)
    body += b"".join(d for _, _, d in entries)
    with Raw(store.port) as c:
        c.send(c.header(Op.WRITEV, len(body)) + body)
        op, status, req_id, payload = c.response()
        assert (op, status, req_id) == (Op.WRITEV, 0, c.req_id)
        assert list(struct.unpack("<4i", payload)) == [0, ErrorCode.AUTH_FAILED, ErrorCode.GRANT_EXPIRED, 0]
        assert c.read(store.grant(GrantOp.READ, 0, 4096, b"a")) == (ErrorCode.OK, data[0])
        assert c.ping() == ErrorCode.OK  # the refused entries' bytes were consumed: still in sync
    seg = store.seg_bytes()
    assert bytes(seg[24576 + 700 : 24576 + 1000]) == data[3]
    store.expected[0:4096] = np.frombuffer(data[0], dtype=np.uint8)
    store.expected[24576 + 700 : 24576 + 1000] = np.frombuffer(data[3], dtype=np.uint8)
    assert np.array_equal(seg[16384 : 16384 + 2000], store.expected[16384 : 16384 + 2000])  # the expired one
    assert sorted((e.key, e.length) for e in store.inventory.entries(store.segment.id)) == [(b"a", 4096)]
    assert store.server.statistics().errors == {"AUTH_FAILED": 1, "GRANT_EXPIRED": 1}


def test_malformed_writev_frames_close_the_connection(store: Store) -> None:
    big = store.grant(GrantOp.WRITE, 0, 128 << 10, b"big")
    small = store.grant(GrantOp.WRITE, 1 << 20, 100, b"small")
    store.granted.clear()  # none of these may land
    bodies = {
        "a part of 128 KiB": readv_body([write_desc(big, 128 << 10)]) + bytes(128 << 10),
        "fewer bytes than the parts": readv_body([write_desc(small, 100)]) + bytes(99),
        "more bytes than the parts": readv_body([write_desc(small, 100)]) + bytes(101),
        "descriptors past the payload": readv_body([write_desc(small, 100)])[:-2],
    }
    for name, body in bodies.items():
        with Raw(store.port) as c:
            c.send(c.header(Op.WRITEV, len(body)) + body)
            assert c.response()[1] == ErrorCode.BAD_FRAME, name
            assert c.is_closed_by_peer(), name
    fresh_round_trip(store)


def test_an_empty_readv_is_answered_ok_and_an_empty_writev_is_malformed(store: Store) -> None:
    with Raw(store.port) as c:
        c.send(c.header(Op.READV, 2) + readv_body([]))
        assert c.response() == (Op.READV, 0, c.req_id, b"")  # "yes, this store takes READV/WRITEV"
        assert c.ping() == ErrorCode.OK
        c.send(c.header(Op.WRITEV, 2) + readv_body([]))
        expect_closed_with(c, ErrorCode.BAD_FRAME)


def readv_body(entries: list[bytes], count: int | None = None) -> bytes:
    return VECTOR_COUNT.pack(len(entries) if count is None else count) + b"".join(entries)


def test_malformed_readv_frames_close_the_connection(store: Store) -> None:
    g = store.grant(GrantOp.READ, 0, 100, key=b"abc")
    entry = write_desc(g, 100)
    bodies = {
        "count 0 with an entry": readv_body([entry], 0),
        "more entries than allowed": readv_body([entry] * (MAX_VECTOR_ENTRIES + 1)),
        "count above the entries": readv_body([entry], 2),
        "bytes left over": readv_body([entry]) + b"x",
        "truncated entry": readv_body([entry])[:-1],
        "key too long": readv_body([write_desc(g, 100, key_len=513) + b"k" * 510]),
        "key past the payload": readv_body([write_desc(g, 100, key_len=200)]),
    }
    for name, body in bodies.items():
        with Raw(store.port) as c:
            c.send(c.header(Op.READV, len(body)) + body)
            assert c.response()[1] == ErrorCode.BAD_FRAME, name
            assert c.is_closed_by_peer(), name
    with Raw(store.port) as c:  # longer than any valid READV: refused before it is read
        c.send(c.header(Op.READV, MAX_VECTOR_DESCS + 1) + readv_body([entry]))
        expect_closed_with(c, ErrorCode.BAD_FRAME)
    fresh_round_trip(store)


def test_zero_length_parts(store: Store) -> None:
    with Raw(store.port) as c:
        assert c.write(store.grant(GrantOp.WRITE, 100, 0, b"empty"), b"") == ErrorCode.OK
        assert c.read(store.grant(GrantOp.READ, 100, 0, b"empty")) == (ErrorCode.OK, b"")


# ---------------------------------------------------------------------- malformed frames (connection closed)
def expect_closed_with(c: Raw, code: ErrorCode | None) -> None:
    if code is not None:
        assert c.response()[1] == code
    assert c.is_closed_by_peer()


def write_desc(grant: Grant, part_length: int, key_len: int | None = None, part_offset: int = 0) -> bytes:
    key_len = len(grant.key) if key_len is None else key_len
    g = grant
    return DESC.pack(g.segment_id, g.offset, g.length, g.expiry_ms, 0, part_offset, part_length, key_len, g.mac) + g.key


def test_bad_magic_closes_the_connection(store: Store) -> None:
    with Raw(store.port) as c:
        c.send(c.header(Op.PING, 0, magic=0x12345678))
        expect_closed_with(c, ErrorCode.BAD_FRAME)
    fresh_round_trip(store)


def test_oversize_key_length(store: Store) -> None:
    g = store.grant(GrantOp.WRITE, 0, 100)
    store.granted.clear()
    with Raw(store.port) as c:
        desc = write_desc(g, 100, key_len=513)
        c.send(c.header(Op.WRITE, len(desc) + 513 - len(g.key) + 100) + desc + b"k" * (513 - len(g.key)))
        expect_closed_with(c, ErrorCode.BAD_FRAME)
    with Raw(store.port) as c:
        desc = write_desc(g, 0, key_len=0xFFFF)
        c.send(c.header(Op.READ, len(desc)) + desc)
        expect_closed_with(c, ErrorCode.BAD_FRAME)
    fresh_round_trip(store)


@pytest.mark.parametrize("part_length", [(1 << 64) - 1, (1 << 63), SEG_SIZE + 1])
def test_huge_part_lengths(store: Store, part_length: int) -> None:
    g = store.grant(GrantOp.WRITE, 0, 100)
    store.granted.clear()
    with Raw(store.port) as c:
        desc = write_desc(g, part_length)
        length = (len(desc) + part_length) % (1 << 64)
        c.send(c.header(Op.WRITE, length) + desc + b"x" * 100)
        expect_closed_with(c, ErrorCode.BAD_FRAME)
    fresh_round_trip(store)


@pytest.mark.parametrize("delta", [-1, 1, 1 << 40])
def test_write_header_length_inconsistent_with_descriptor(store: Store, delta: int) -> None:
    g = store.grant(GrantOp.WRITE, 0, 100)
    store.granted.clear()
    with Raw(store.port) as c:
        desc = write_desc(g, 100)
        c.send(c.header(Op.WRITE, len(desc) + 100 + delta) + desc + b"x" * 100)
        expect_closed_with(c, ErrorCode.BAD_FRAME)
    fresh_round_trip(store)


@pytest.mark.parametrize("length", [0, DESC.size - 1, DESC.size + 3 + 1, DESC.size + 600, (1 << 64) - 1])
def test_read_payload_lengths_out_of_bounds(store: Store, length: int) -> None:
    g = store.grant(GrantOp.READ, 0, 100, key=b"abc")
    with Raw(store.port) as c:
        desc = write_desc(g, 100)
        body = (desc + bytes(1024))[: min(length, 1024)]  # as many bytes as the header announces (or 1 KiB)
        c.send(c.header(Op.READ, length) + body)
        expect_closed_with(c, ErrorCode.BAD_FRAME)
    fresh_round_trip(store)


def test_ping_with_a_payload_is_malformed(store: Store) -> None:
    with Raw(store.port) as c:
        c.send(c.header(Op.PING, 5) + b"hello")
        expect_closed_with(c, ErrorCode.BAD_FRAME)


@pytest.mark.parametrize("op", [0, 5, 64, 999, 0xFFFF])
def test_unknown_op_gets_unknown_op_then_close(store: Store, op: int) -> None:
    with Raw(store.port) as c:
        c.send(c.header(op, 10) + b"0123456789")
        _op, status, req_id, _ = c.response()
        assert status == ErrorCode.UNKNOWN_OP
        assert req_id == c.req_id
        assert c.is_closed_by_peer()
    fresh_round_trip(store)


def test_truncated_frame_then_disconnect(store: Store) -> None:
    g = store.grant(GrantOp.WRITE, 0, 1000)
    for cut in (1, HEADER_SIZE - 1, HEADER_SIZE + 10, HEADER_SIZE + DESC.size + 1):
        with Raw(store.port) as c:
            desc = write_desc(g, 1000)
            c.send((c.header(Op.WRITE, len(desc) + 1000) + desc)[:cut])
    wait_for(lambda: store.server.statistics().connections == 0, 5.0, "truncated connections to close")
    fresh_round_trip(store)


def test_random_garbage_after_a_valid_request(store: Store) -> None:
    with Raw(store.port) as c:
        assert c.ping() == ErrorCode.OK
        c.send(os.urandom(4096))
        assert c.is_closed_by_peer()
    fresh_round_trip(store)


# ---------------------------------------------------------------------- peers that go away or stall
def test_client_disconnects_mid_write(store: Store) -> None:
    size = 2 << 20
    g = store.grant(GrantOp.WRITE, 0, size, b"half")
    with Raw(store.port) as c:
        desc = write_desc(g, size)
        c.send(c.header(Op.WRITE, len(desc) + size) + desc + os.urandom(size // 2))
    wait_for(lambda: store.server.statistics().connections == 0, 5.0, "the connection to end")
    assert store.inventory.entries(store.segment.id) == []  # never fully written
    fresh_round_trip(store)


def test_client_disconnects_mid_read(store: Store) -> None:
    size = 4 << 20
    with Raw(store.port) as c:
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        desc = write_desc(store.grant(GrantOp.READ, 0, size), size)
        c.send(c.header(Op.READ, len(desc)) + desc)
        c.recv_exact(HEADER_SIZE + 1000)
    wait_for(lambda: store.server.statistics().connections == 0, 5.0, "the connection to end")
    fresh_round_trip(store)


def test_a_peer_stalled_mid_frame_is_closed_but_an_idle_one_is_not(store: Store) -> None:
    with Raw(store.port) as idle, Raw(store.port) as stalled:
        assert idle.ping() == ErrorCode.OK
        stalled.send(stalled.header(Op.PING, 0)[:10])
        t0 = time.monotonic()
        assert stalled.is_closed_by_peer(timeout=10)
        assert 0.9 < time.monotonic() - t0 < 5  # the stall timeout is 1 s
        assert idle.ping() == ErrorCode.OK  # idle for > 1 s, still served


def test_too_many_connections(tmp_path: Path) -> None:
    before = threading.active_count()
    s = make_store(tmp_path, max_connections=2)
    try:
        with Raw(s.port) as a, Raw(s.port) as b:
            assert a.ping() == ErrorCode.OK
            assert b.ping() == ErrorCode.OK
            with Raw(s.port) as c:
                _op, status, _rid, _ = c.response()
                assert status == ErrorCode.TOO_MANY_CONNECTIONS
                assert c.is_closed_by_peer()
            assert s.server.statistics().connections_rejected == 1
        wait_for(lambda: s.server.statistics().connections == 0, 5.0, "connections to close")
        with Raw(s.port) as c:
            assert c.ping() == ErrorCode.OK
    finally:
        close_store(s, before)


def test_stop_closes_live_connections_and_joins_threads(tmp_path: Path) -> None:
    before = threading.active_count()
    s = make_store(tmp_path)
    clients = [Raw(s.port) for _ in range(8)]
    for c in clients:
        assert c.ping() == ErrorCode.OK
    assert s.server.statistics().connections == 8
    s.server.stop()
    for c in clients:
        assert c.is_closed_by_peer()
        c.close()
    s.server.stop()  # twice is fine
    close_store(s, before)


def test_statistics_count_requests_bytes_and_errors(store: Store) -> None:
    with Raw(store.port) as c:
        assert c.write(store.grant(GrantOp.WRITE, 0, 1000), b"a" * 1000) == ErrorCode.OK
        assert c.read(store.grant(GrantOp.READ, 0, 600))[0] == ErrorCode.OK
        assert c.read(store.grant(GrantOp.READ, 0, 600, expiry_ms=1))[0] == ErrorCode.GRANT_EXPIRED
        stats = store.server.statistics()
        assert stats.connections == 1
    store.expected[:1000] = ord("a")
    wait_for(lambda: store.server.statistics().connections == 0, 5.0, "the connection to end")
    stats = store.server.statistics()
    assert (stats.requests, stats.bytes_written, stats.bytes_read) == (3, 1000, 600)
    assert stats.errors == {"GRANT_EXPIRED": 1}
    assert stats.connections_total == 1


# ---------------------------------------------------------------------- fuzzing
@pytest.fixture(scope="module")
def fuzz_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    before = threading.active_count()
    s = make_store(tmp_path_factory.mktemp("fuzz"), stall_timeout_s=0.5)
    try:
        yield s
        s.assert_untouched_outside_grants()
    finally:
        close_store(s, before)


def _frame_like(data: bytes, op: int, length: int) -> bytes:
    """Random bytes behind a valid-looking header, so the fuzzer also reaches the descriptor parsers."""
    return HEADER.pack(MAGIC, op, 0, 0, 1, length) + data


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.one_of(
        st.binary(min_size=1, max_size=600),
        st.builds(
            _frame_like,
            st.binary(max_size=400),
            st.sampled_from([Op.READ, Op.WRITE, Op.PING, Op.STORE_INFO]),
            st.one_of(st.integers(0, 700), st.integers(0, (1 << 64) - 1)),
        ),
    )
)
def test_random_bytes_on_the_data_port(fuzz_store: Store, data: bytes) -> None:
    s = fuzz_store
    s.granted.clear()
    with Raw(s.port) as c:
        c.send(data)
        c.sock.shutdown(socket.SHUT_WR)  # no more bytes: the server must not wait for them forever
        assert c.is_closed_by_peer(timeout=5)
    wait_for(lambda: s.server.statistics().connections == 0, 5.0, "fuzz connection to end")
    fresh_round_trip(s)
    s.granted.append((SEG_SIZE - 4096, 4096))
    s.assert_untouched_outside_grants()
    s.granted.clear()


def test_struct_sizes_match_the_documented_frame_layout() -> None:
    assert HEADER_SIZE == 28
    assert DESC.size == 7 * 8 + 2 + 16
    assert struct.calcsize("<IHHiQQ") == HEADER_SIZE


# ---------------------------------------------------------------------- the segment itself
def test_segment_file_is_private_sized_and_shared(tmp_path: Path) -> None:
    seg = ShmSegment.create(str(tmp_path), "s1", 1 << 20)
    try:
        st_ = os.stat(seg.path)
        assert st_.st_mode & 0o777 == 0o600
        assert st_.st_size == seg.size == len(seg.view) == 1 << 20
        assert 0 < seg.id < 1 << 63
        seg.prefault()
        seg.view[100:105] = b"hello"
        other = ShmSegment.attach(seg.path, 1 << 20, segment_id=seg.id)
        try:
            assert bytes(other.view[100:105]) == b"hello"  # one memory, two mappings
            other.view[0:2] = b"hi"
            assert bytes(seg.view[0:2]) == b"hi"
        finally:
            other.close()
        assert os.path.exists(seg.path)  # an attached mapping never removes the file
    finally:
        seg.close()
    assert not os.path.exists(seg.path)
    seg.close()  # twice is fine


def test_segment_name_clashes_and_replace(tmp_path: Path) -> None:
    seg = ShmSegment.create(str(tmp_path), "dup", 1 << 20, segment_id=42)
    try:
        assert seg.id == 42
        with pytest.raises(KvPoolError) as exc:
            ShmSegment.create(str(tmp_path), "dup", 1 << 20)
        assert exc.value.code == ErrorCode.SEGMENT_ALREADY_EXISTS
        seg.close(unlink=False)
        assert os.path.exists(seg.path)
        seg = ShmSegment.create(str(tmp_path), "dup", 2 << 20, replace=True)
        assert os.stat(seg.path).st_size == 2 << 20
    finally:
        seg.close()


@pytest.mark.parametrize(("name", "size"), [("", 4096), ("a/b", 4096), ("..", 4096), ("ok", 0), ("ok", -5)])
def test_segment_bad_arguments(tmp_path: Path, name: str, size: int) -> None:
    with pytest.raises(KvPoolError) as exc:
        ShmSegment.create(str(tmp_path), name, size)
    assert exc.value.code == ErrorCode.INVALID_ARGUMENT


@pytest.mark.parametrize("hugepages", ["2M", "1G"])
def test_hugepages_never_fall_back_silently(tmp_path: Path, hugepages: str) -> None:
    """No hugetlbfs mount here (tmp_path is tmpfs or disk): a clear INVALID_ARGUMENT, and no file left."""
    with pytest.raises(KvPoolError) as exc:
        ShmSegment.create(str(tmp_path), "huge", 1 << 30, hugepages=hugepages)
    assert exc.value.code == ErrorCode.INVALID_ARGUMENT
    assert "hugetlbfs" in exc.value.message
    assert not os.path.exists(tmp_path / "huge")
    with pytest.raises(KvPoolError) as exc:
        ShmSegment.create(str(tmp_path), "huge", 1 << 30, hugepages="3M")
    assert exc.value.code == ErrorCode.INVALID_ARGUMENT


def test_attach_errors(tmp_path: Path) -> None:
    with pytest.raises(KvPoolError) as exc:
        ShmSegment.attach(str(tmp_path / "missing"), 4096)
    assert exc.value.code == ErrorCode.SEGMENT_NOT_FOUND
    seg = ShmSegment.create(str(tmp_path), "small", 4096)
    try:
        with pytest.raises(KvPoolError) as exc:
            ShmSegment.attach(seg.path, 8192)
        assert exc.value.code == ErrorCode.INVALID_ARGUMENT
    finally:
        seg.close()


def test_closing_with_a_live_view_does_not_raise(tmp_path: Path) -> None:
    seg = ShmSegment.create(str(tmp_path), "live", 4096)
    alive = seg.view[10:20]
    seg.close()  # the mapping stays until ``alive`` goes; the file is gone now
    assert not os.path.exists(seg.path)
    alive[0] = 1  # still valid memory
    alive.release()


def test_a_failing_store_info_callback_is_internal_and_keeps_the_connection(tmp_path: Path) -> None:
    before = threading.active_count()

    def broken() -> dict[str, object]:
        raise RuntimeError("boom")

    s = make_store(tmp_path, store_info=broken)
    try:
        with Raw(s.port) as c:
            c.send(c.header(Op.STORE_INFO, 0))
            assert c.response()[1] == ErrorCode.INTERNAL
            assert c.ping() == ErrorCode.OK
    finally:
        close_store(s, before)
