"""The store's SSD tier: file format round trip, restart re-adoption, bad files skipped, the tier worker,
and SSD reads over a socket (store/ssd.py, store/tiering.py)."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from kvpool.common import grants
from kvpool.common.checksum import checksum
from kvpool.common.errors import ErrorCode as E
from kvpool.common.errors import KvPoolError
from kvpool.proto import master_pb2 as pb
from kvpool.proto.frames import HEADER, TransferDesc
from kvpool.store.inventory import Inventory, InventoryEntry
from kvpool.store.segment import ShmSegment
from kvpool.store.ssd import SsdEntry, SsdTier, encode_header, parse_header
from kvpool.store.tiering import TierWorker, serve_tier_read

CAP = 1 << 20


def value(n: int, seed: int = 0) -> bytes:
    return bytes((i * 31 + seed) & 0xFF for i in range(n))


def put(tier: SsdTier, offset: int, key: bytes, data: bytes) -> E:
    return tier.write(offset, key, memoryview(data), checksum(data))


@pytest.fixture
def tier(tmp_path: Path) -> Any:
    t = SsdTier(tmp_path / "ssd", CAP)
    yield t
    t.close()


# ====================================================================== format


def test_header_round_trip_and_damage_is_detected() -> None:
    raw = encode_header(b"key/1", 4096, 1000, 77)
    entry, start = parse_header(raw + b"value")  # type: ignore[misc]
    assert entry == SsdEntry(b"key/1", 4096, 1000, 77)
    assert start == len(raw)
    damaged = bytearray(raw)
    damaged[-10] ^= 1
    assert parse_header(bytes(damaged)) == "header digest mismatch"
    assert parse_header(raw[:20]) == "truncated header"
    assert parse_header(b"X" * len(raw)) == "bad magic"


def test_write_then_read_back(tier: SsdTier) -> None:
    data = value(5000)
    assert put(tier, 8192, b"a", data) == E.OK
    assert tier.entries() == [SsdEntry(b"a", 8192, 5000, checksum(data))]
    assert (len(tier), tier.used) == (1, 5000)
    dest = bytearray(5000)
    assert tier.read_into(8192, b"a", memoryview(dest), checksum(data)) == E.OK
    assert bytes(dest) == data
    # The file must hold the grant's key and length.
    assert tier.read_into(8192, b"b", memoryview(dest), checksum(data)) == E.OBJECT_NOT_FOUND
    assert tier.open_value(8192, b"a", 4999) == E.OBJECT_NOT_FOUND
    assert tier.open_value(0, b"a", 5000) == E.OBJECT_NOT_FOUND


def test_write_verifies_the_checksum_and_the_bounds(tier: SsdTier) -> None:
    data = value(100)
    assert tier.write(0, b"a", memoryview(data), checksum(data) ^ 1) == E.CHECKSUM_MISMATCH
    assert put(tier, CAP - 50, b"a", data) == E.OUT_OF_BOUNDS
    assert len(tier) == 0
    assert list(tier.directory.glob("*.kvs")) == []


def test_a_new_object_replaces_what_it_overlaps_and_delete_forgets(tier: SsdTier) -> None:
    assert put(tier, 0, b"a", value(100)) == E.OK
    assert put(tier, 128, b"b", value(100)) == E.OK
    assert put(tier, 64, b"c", value(100, 1)) == E.OK  # overlaps both
    assert [e.key for e in tier.entries()] == [b"c"]
    assert sorted(p.name for p in tier.directory.glob("*.kvs")) == [f"{64:016x}.kvs"]
    assert put(tier, 64, b"d", value(100, 2)) == E.OK  # same range: replaced
    assert [e.key for e in tier.entries()] == [b"d"]
    assert tier.delete(64)
    assert not tier.delete(64)
    assert (len(tier), tier.used) == (0, 0)


def test_a_second_store_cannot_use_the_same_directory(tier: SsdTier) -> None:
    with pytest.raises(KvPoolError, match="used by another store"):
        SsdTier(tier.directory, CAP)


# ====================================================================== restart


def test_a_restart_re_adopts_every_object(tmp_path: Path) -> None:
    first = SsdTier(tmp_path / "ssd", CAP)
    objects = {i * 4096: (f"key-{i}".encode(), value(1000 + i, i)) for i in range(20)}
    for offset, (key, data) in objects.items():
        assert put(first, offset, key, data) == E.OK
    first.close()
    second = SsdTier(tmp_path / "ssd", CAP)
    scan = second.scan()
    assert (scan.adopted, scan.dropped, scan.temporaries) == (20, [], 0)
    assert [(e.offset, e.key) for e in second.entries()] == [(o, k) for o, (k, _) in sorted(objects.items())]
    key, data = objects[4096]
    dest = bytearray(len(data))
    assert second.read_into(4096, key, memoryview(dest), checksum(data)) == E.OK
    assert bytes(dest) == data
    second.close()


def test_corrupt_truncated_and_foreign_files_are_skipped_with_a_log_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = SsdTier(tmp_path / "ssd", CAP)
    for i in range(6):
        assert put(first, i * 4096, f"k{i}".encode(), value(2000, i)) == E.OK
    first.close()
    d = tmp_path / "ssd"

    def path(i: int) -> Path:
        return d / f"{i * 4096:016x}.kvs"

    raw = bytearray(path(1).read_bytes())
    raw[-1] ^= 0xFF  # a flipped value byte
    path(1).write_bytes(raw)
    path(2).write_bytes(path(2).read_bytes()[:-100])  # truncated value
    path(3).write_bytes(path(3).read_bytes()[:30])  # truncated header
    os.rename(path(4), d / f"{9 * 4096:016x}.kvs")  # a file whose name disagrees with its header
    (d / f"{7 * 4096:016x}.kvs.tmp").write_bytes(b"half a write")
    (d / "notes.txt").write_text("not ours")
    caplog.set_level(logging.WARNING, logger="kvpool.store.ssd")
    second = SsdTier(d, CAP)
    scan = second.scan()
    assert scan.adopted == 2
    assert scan.temporaries == 1
    reasons = dict(scan.dropped)
    assert reasons[path(1).name] == "value checksum mismatch"
    assert reasons[path(2).name].startswith("truncated")
    assert reasons[path(3).name] == "truncated header"
    assert reasons[f"{9 * 4096:016x}.kvs"].startswith("header says offset")
    assert [e.key for e in second.entries()] == [b"k0", b"k5"]
    for name in reasons:
        assert f"dropping {d / name}" in caplog.text
        assert not (d / name).exists()
    assert (d / "notes.txt").exists()
    second.close()


def test_entries_beyond_a_smaller_tier_are_dropped(tmp_path: Path) -> None:
    first = SsdTier(tmp_path / "ssd", CAP)
    assert put(first, CAP - 4096, b"far", value(1000)) == E.OK
    first.close()
    second = SsdTier(tmp_path / "ssd", CAP // 2)
    assert second.scan().adopted == 0
    second.close()


# ====================================================================== the tier worker


class FakeLink:
    def __init__(self, answers: list[pb.TierTasksResponse]) -> None:
        self.answers = answers
        self.requests: list[pb.TierTasksRequest] = []

    def call(self, method: str, request: Any, timeout: float) -> Any:
        assert method == "TierTasks"
        self.requests.append(request)
        return self.answers.pop(0) if self.answers else pb.TierTasksResponse()


def test_worker_demotes_promotes_and_deletes(tmp_path: Path, tier: SsdTier) -> None:
    seg = ShmSegment.create(str(tmp_path), "seg", 1 << 16, segment_id=5)
    inventory = Inventory()
    try:
        data = value(3000, 9)
        seg.view[1024:4024] = data
        worker = TierWorker(FakeLink([]), "s", tier, 9, seg, inventory)
        demote = pb.TierTask(id=1, kind=pb.TIER_DEMOTE, key="obj", src_segment=5, src_offset=1024,
                             dst_segment=9, dst_offset=4096, length=3000, checksum=checksum(data))
        assert worker.execute(demote) == E.OK
        assert tier.entries() == [SsdEntry(b"obj", 4096, 3000, checksum(data))]
        bad = pb.TierTask(id=2, kind=pb.TIER_DEMOTE, key="x", src_segment=5, src_offset=0, dst_segment=9,
                          dst_offset=0, length=100, checksum=1)
        assert worker.execute(bad) == E.CHECKSUM_MISMATCH
        promote = pb.TierTask(id=3, kind=pb.TIER_PROMOTE, key="obj", src_segment=9, src_offset=4096,
                              dst_segment=5, dst_offset=8192, length=3000, checksum=checksum(data))
        assert worker.execute(promote) == E.OK
        assert bytes(seg.view[8192:11192]) == data
        assert inventory.entries(5) == [InventoryEntry(5, b"obj", 8192, 3000, checksum(data))]
        foreign = pb.TierTask(id=4, kind=pb.TIER_PROMOTE, key="obj", src_segment=9, src_offset=4096,
                              dst_segment=6, dst_offset=0, length=3000, checksum=checksum(data))
        assert worker.execute(foreign) == E.SEGMENT_NOT_FOUND
        assert worker.execute(pb.TierTask(id=5, kind=pb.TIER_DELETE, dst_segment=9, dst_offset=4096)) == E.OK
        assert len(tier) == 0
        assert (worker.stats.demoted, worker.stats.promoted, worker.stats.deleted, worker.stats.failed) == (
            1, 1, 1, 2)
    finally:
        seg.close()


def test_worker_reports_results_with_its_next_poll(tmp_path: Path, tier: SsdTier) -> None:
    seg = ShmSegment.create(str(tmp_path), "seg", 1 << 16, segment_id=5)
    try:
        data = value(500)
        seg.view[0:500] = data
        task = pb.TierTask(id=7, kind=pb.TIER_DEMOTE, key="k", src_segment=5, src_offset=0, dst_segment=9,
                           dst_offset=0, length=500, checksum=checksum(data))
        link = FakeLink([pb.TierTasksResponse(tasks=[task])])
        worker = TierWorker(link, "s", tier, 9, seg, Inventory(), idle_s=0.01)
        worker.start()
        deadline = 50
        while len(link.requests) < 2 and deadline:
            worker._stop_event.wait(0.02)
            deadline -= 1
        worker.stop()
        assert [(r.id, r.code) for r in link.requests[1].done] == [(7, 0)]
        assert link.requests[0].store_id == "s"
    finally:
        seg.close()


# ====================================================================== reads


def test_serve_tier_read_sends_the_granted_part_and_refuses_bad_grants(tier: SsdTier) -> None:
    data = value(10_000)
    assert put(tier, 4096, b"obj", data) == E.OK
    secret = b"s" * 32

    def desc(key: bytes = b"obj", part: tuple[int, int] = (1000, 5000), expiry: int = 2**62,
             length: int = 10_000, sign_with: bytes = secret) -> TransferDesc:
        mac = grants.sign(sign_with, grants.GrantOp.READ, 9, 4096, length, expiry, key)
        return TransferDesc(grants.Grant(grants.GrantOp.READ, 9, 4096, length, expiry, key, mac), 0, *part)

    a, b = socket.socketpair()
    try:
        code, sent = serve_tier_read(a, tier, secret, desc(), 42, 1000)
        assert (code, sent) == (E.OK, 5000)
        head = HEADER.unpack(b.recv(HEADER.size, socket.MSG_WAITALL))
        assert (head[4], head[5]) == (42, 5000)
        assert b.recv(5000, socket.MSG_WAITALL) == data[1000:6000]
        assert serve_tier_read(a, tier, secret, desc(sign_with=b"x" * 32), 1, 1000)[0] == E.AUTH_FAILED
        assert serve_tier_read(a, tier, secret, desc(expiry=999), 1, 1000)[0] == E.GRANT_EXPIRED
        assert serve_tier_read(a, tier, secret, desc(part=(9000, 2000)), 1, 1000)[0] == E.OUT_OF_BOUNDS
        assert serve_tier_read(a, tier, secret, desc(key=b"other"), 1, 1000)[0] == E.OBJECT_NOT_FOUND
        assert serve_tier_read(a, tier, secret, desc(length=9000, part=(0, 10)), 1, 1000)[0] == (
            E.OBJECT_NOT_FOUND)
    finally:
        a.close()
        b.close()
