"""The store's SSD tier: journal format round trip, restart re-adoption, bad entries skipped, the tier worker,
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
from kvpool.store.ssd import (
    DELETE,
    FILE_MAGIC,
    PUT,
    DemoteItem,
    SsdEntry,
    SsdScan,
    SsdTier,
    encode_record,
    parse_records,
)
from kvpool.store.tiering import TierWorker, read_tier_part, serve_tier_read

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


def test_record_round_trip_and_damage_is_detected() -> None:
    rec = encode_record(PUT, b"key/1", 4096, 1000, 77) + encode_record(DELETE, b"", 4096, 1000, 0)
    records, damaged_at, _ = parse_records(FILE_MAGIC + rec)
    assert damaged_at is None
    assert records == [(PUT, SsdEntry(b"key/1", 4096, 1000, 77)), (DELETE, SsdEntry(b"", 4096, 1000, 0))]
    flipped = bytearray(FILE_MAGIC + rec)
    flipped[len(FILE_MAGIC) + 12] ^= 1
    assert parse_records(bytes(flipped))[1:] == (len(FILE_MAGIC), "record digest mismatch")
    torn = FILE_MAGIC + rec[:-3]
    records, damaged_at, why = parse_records(torn)
    assert (len(records), why) == (1, "truncated record")
    assert parse_records(b"garbage!" + rec)[1:] == (0, "not a journal (bad file header)")


def test_write_then_read_back(tier: SsdTier) -> None:
    data = value(5000)
    assert put(tier, 8192, b"a", data) == E.OK
    assert tier.entries() == [SsdEntry(b"a", 8192, 5000, checksum(data))]
    assert (len(tier), tier.used) == (1, 5000)
    dest = bytearray(5000)
    assert tier.read_into(8192, b"a", memoryview(dest), checksum(data)) == E.OK
    assert bytes(dest) == data
    # The entry must be the grant's key and length.
    assert tier.read_into(8192, b"b", memoryview(dest), checksum(data)) == E.OBJECT_NOT_FOUND
    assert tier.locate(8192, b"a", 4999) == E.OBJECT_NOT_FOUND
    assert tier.locate(0, b"a", 5000) == E.OBJECT_NOT_FOUND
    assert tier.locate(8192, b"a", 5000) == 8192


def test_write_verifies_the_checksum_and_the_bounds(tier: SsdTier) -> None:
    data = value(100)
    assert tier.write(0, b"a", memoryview(data), checksum(data) ^ 1) == E.CHECKSUM_MISMATCH
    assert put(tier, CAP - 50, b"a", data) == E.OUT_OF_BOUNDS
    assert len(tier) == 0


def test_a_new_object_replaces_what_it_overlaps_and_delete_forgets(tier: SsdTier) -> None:
    assert put(tier, 0, b"a", value(100)) == E.OK
    assert put(tier, 128, b"b", value(100)) == E.OK
    assert put(tier, 64, b"c", value(100, 1)) == E.OK  # overlaps both
    assert [e.key for e in tier.entries()] == [b"c"]
    assert put(tier, 64, b"d", value(100, 2)) == E.OK  # same range: replaced
    assert [e.key for e in tier.entries()] == [b"d"]
    assert tier.delete(64)
    assert not tier.delete(64)
    assert (len(tier), tier.used) == (0, 0)


def test_a_second_store_cannot_use_the_same_directory(tier: SsdTier) -> None:
    with pytest.raises(KvPoolError, match="used by another store"):
        SsdTier(tier.directory, CAP)


# ====================================================================== restart


def reopen(path: Path, capacity: int = CAP) -> tuple[SsdTier, SsdScan]:
    tier = SsdTier(path, capacity)
    return tier, tier.scan()


def test_a_restart_re_adopts_every_live_object(tmp_path: Path) -> None:
    first = SsdTier(tmp_path / "ssd", CAP)
    objects = {i * 4096: (f"key-{i}".encode(), value(1000 + i, i)) for i in range(20)}
    for offset, (key, data) in objects.items():
        assert put(first, offset, key, data) == E.OK
    assert first.delete(0)
    assert put(first, 4096, b"again", value(1001, 99)) == E.OK  # replaces key-1
    first.close()
    second, scan = reopen(tmp_path / "ssd")
    assert (scan.adopted, scan.dropped, scan.damaged_at) == (19, [], None)
    keys = [e.key for e in second.entries()]
    assert keys[0] == b"again"
    assert b"key-0" not in keys
    assert b"key-1" not in keys
    key, data = objects[8192]
    dest = bytearray(len(data))
    assert second.read_into(8192, key, memoryview(dest), checksum(data)) == E.OK
    assert bytes(dest) == data
    # The journal was compacted to the live entries.
    assert second.journal_bytes < (tmp_path / "ssd" / "journal.kvs").stat().st_size + 1
    second.close()
    third, scan = reopen(tmp_path / "ssd")
    assert scan.adopted == 19
    third.close()


def test_corrupt_and_truncated_objects_are_skipped_with_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = tmp_path / "ssd"
    first = SsdTier(d, CAP)
    for i in range(6):
        assert put(first, i * 4096, f"k{i}".encode(), value(2000, i)) == E.OK
    first.close()
    with open(d / "data.kvs", "r+b") as f:  # a flipped value byte in k1
        f.seek(4096 + 7)
        byte = f.read(1)
        f.seek(4096 + 7)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.truncate(d / "data.kvs", 5 * 4096 + 1000)  # k5 lost its tail
    caplog.set_level(logging.WARNING, logger="kvpool.store.ssd")
    second, scan = reopen(d)
    assert scan.adopted == 4
    assert dict(scan.dropped) == {
        4096: "value checksum mismatch",
        5 * 4096: f"data file truncated ({5 * 4096 + 1000} bytes)",
    }
    assert [e.key for e in second.entries()] == [b"k0", b"k2", b"k3", b"k4"]
    assert "dropping b'k1' at offset 4096: value checksum mismatch" in caplog.text
    assert "dropping b'k5'" in caplog.text
    second.close()
    third, scan = reopen(d)  # the dropped entries are gone from the journal for good
    assert (scan.adopted, scan.dropped) == (4, [])
    third.close()


def test_a_torn_journal_keeps_the_records_before_the_damage(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = tmp_path / "ssd"
    first = SsdTier(d, CAP)
    for i in range(3):
        assert put(first, i * 4096, f"k{i}".encode(), value(100, i)) == E.OK
    first.close()
    journal = d / "journal.kvs"
    journal.write_bytes(journal.read_bytes()[:-5])  # the last record is torn (a crash mid-append)
    caplog.set_level(logging.WARNING, logger="kvpool.store.ssd")
    second, scan = reopen(d)
    assert scan.adopted == 2
    assert scan.damaged_at is not None
    assert "damaged at byte" in caplog.text
    second.close()
    journal.write_bytes(b"not a journal at all")
    third, scan = reopen(d)
    assert (scan.adopted, scan.damaged_at) == (0, 0)
    third.close()


def test_entries_beyond_a_smaller_tier_are_dropped(tmp_path: Path) -> None:
    first = SsdTier(tmp_path / "ssd", CAP)
    assert put(first, CAP - 4096, b"far", value(1000)) == E.OK
    assert put(first, 0, b"near", value(1000)) == E.OK
    first.close()
    second, scan = reopen(tmp_path / "ssd", CAP // 2)
    assert scan.adopted == 1
    assert scan.dropped[0][1].startswith("range")
    assert (tmp_path / "ssd" / "data.kvs").stat().st_size == CAP // 2
    second.close()


def test_the_journal_is_compacted_at_run_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvpool.store.ssd.COMPACT_MIN_BYTES", 4096)
    tier = SsdTier(tmp_path / "ssd", CAP)
    for round_ in range(50):
        assert put(tier, 0, f"k{round_}".encode(), value(100, round_)) == E.OK
    assert tier.journal_bytes < 4096 + 200
    tier.close()
    again, scan = reopen(tmp_path / "ssd")
    assert [e.key for e in again.entries()] == [b"k49"]
    again.close()


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
        demote = pb.TierTask(
            id=1,
            kind=pb.TIER_DEMOTE,
            key="obj",
            src_segment=5,
            src_offset=1024,
            dst_segment=9,
            dst_offset=4096,
            length=3000,
            checksum=checksum(data),
        )
        assert worker.execute(demote) == E.OK
        assert tier.entries() == [SsdEntry(b"obj", 4096, 3000, checksum(data))]
        bad = pb.TierTask(
            id=2,
            kind=pb.TIER_DEMOTE,
            key="x",
            src_segment=5,
            src_offset=0,
            dst_segment=9,
            dst_offset=0,
            length=100,
            checksum=1,
        )
        assert worker.execute(bad) == E.CHECKSUM_MISMATCH
        promote = pb.TierTask(
            id=3,
            kind=pb.TIER_PROMOTE,
            key="obj",
            src_segment=9,
            src_offset=4096,
            dst_segment=5,
            dst_offset=8192,
            length=3000,
            checksum=checksum(data),
        )
        assert worker.execute(promote) == E.OK
        assert bytes(seg.view[8192:11192]) == data
        assert inventory.entries(5) == [InventoryEntry(5, b"obj", 8192, 3000, checksum(data))]
        foreign = pb.TierTask(
            id=4,
            kind=pb.TIER_PROMOTE,
            key="obj",
            src_segment=9,
            src_offset=4096,
            dst_segment=6,
            dst_offset=0,
            length=3000,
            checksum=checksum(data),
        )
        assert worker.execute(foreign) == E.SEGMENT_NOT_FOUND
        assert worker.execute(pb.TierTask(id=5, kind=pb.TIER_DELETE, dst_segment=9, dst_offset=4096)) == E.OK
        assert len(tier) == 0
        assert (worker.stats.demoted, worker.stats.promoted, worker.stats.deleted, worker.stats.failed) == (
            1,
            1,
            1,
            2,
        )
    finally:
        seg.close()


def test_worker_never_starts_a_task_past_its_deadline(tmp_path: Path, tier: SsdTier) -> None:
    seg = ShmSegment.create(str(tmp_path), "seg", 1 << 16, segment_id=5)
    try:
        data = bytes(seg.view[0:100])
        worker = TierWorker(FakeLink([]), "s", tier, 9, seg, Inventory())
        late = pb.TierTask(
            id=1,
            kind=pb.TIER_DEMOTE,
            key="k",
            src_segment=5,
            src_offset=0,
            dst_segment=9,
            dst_offset=0,
            length=100,
            checksum=checksum(data),
            deadline_ms=1,
        )
        assert worker.execute(late) == E.TIMEOUT
        assert len(tier) == 0
        late.deadline_ms = 2**62
        assert worker.execute(late) == E.OK
    finally:
        seg.close()


def test_worker_reports_results_with_its_next_poll(tmp_path: Path, tier: SsdTier) -> None:
    seg = ShmSegment.create(str(tmp_path), "seg", 1 << 16, segment_id=5)
    try:
        data = value(500)
        seg.view[0:500] = data
        task = pb.TierTask(
            id=7,
            kind=pb.TIER_DEMOTE,
            key="k",
            src_segment=5,
            src_offset=0,
            dst_segment=9,
            dst_offset=0,
            length=500,
            checksum=checksum(data),
        )
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

    def desc(
        key: bytes = b"obj",
        part: tuple[int, int] = (1000, 5000),
        expiry: int = 2**62,
        length: int = 10_000,
        sign_with: bytes = secret,
    ) -> TransferDesc:
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
        assert serve_tier_read(a, tier, secret, desc(length=9000, part=(0, 10)), 1, 1000)[0] == (E.OBJECT_NOT_FOUND)
    finally:
        a.close()
        b.close()
    # A READV entry on the tier: the same checks, the bytes in hand instead of sent.
    assert read_tier_part(tier, secret, desc(), 1000) == (E.OK, data[1000:6000])
    assert read_tier_part(tier, secret, desc(sign_with=b"x" * 32), 1000) == (E.AUTH_FAILED, None)
    assert read_tier_part(tier, secret, desc(expiry=999), 1000) == (E.GRANT_EXPIRED, None)
    assert read_tier_part(tier, secret, desc(part=(9000, 2000)), 1000) == (E.OUT_OF_BOUNDS, None)
    assert read_tier_part(tier, secret, desc(key=b"other"), 1000) == (E.OBJECT_NOT_FOUND, None)


# ====================================================================== batched demotion


def demote_task(task_id: int, key: str, src: int, dst: int, data: bytes, **fields: Any) -> pb.TierTask:
    return pb.TierTask(
        id=task_id,
        kind=pb.TIER_DEMOTE,
        key=key,
        src_segment=5,
        src_offset=src,
        dst_segment=9,
        dst_offset=dst,
        length=len(data),
        checksum=fields.pop("value_checksum", checksum(data)),
        **fields,
    )


def test_a_batch_of_demotions_is_written_in_runs_with_each_object_checked(tmp_path: Path, tier: SsdTier) -> None:
    page = 4096
    seg = ShmSegment.create(str(tmp_path), "seg", 1 << 18, segment_id=5)
    try:
        values = [value(2 * page, seed) for seed in range(6)]
        for i, data in enumerate(values):
            seg.view[i * 2 * page : (i + 1) * 2 * page] = data
        odd = value(3000, 77)  # not page-sized: the buffered path, next to aligned ones
        seg.view[12 * page : 12 * page + 3000] = odd
        tasks = [demote_task(i + 1, f"k{i}", i * 2 * page, (10 - 2 * i) * page, d) for i, d in enumerate(values)]
        tasks[2].checksum ^= 1  # corrupt in DRAM: refused, its neighbours still written
        tasks.append(demote_task(7, "odd", 12 * page, 12 * page, odd))
        tasks.append(demote_task(8, "far", 0, CAP - 100, value(200)))  # runs past the tier's end
        worker = TierWorker(FakeLink([]), "s", tier, 9, seg, Inventory())
        codes = {r.id: E(r.code) for r in worker.run_batch(tasks)}
        assert codes == {
            1: E.OK,
            2: E.OK,
            3: E.CHECKSUM_MISMATCH,
            4: E.OK,
            5: E.OK,
            6: E.OK,
            7: E.OK,
            8: E.OUT_OF_BOUNDS,
        }
        assert worker.stats.demoted == 6
        assert tier.written_bytes == 5 * 2 * page + 3000
        for task, data in [*zip(tasks[:6], values, strict=True), (tasks[6], odd)]:
            dest = bytearray(len(data))
            expected = E.OK if task.id != 3 else E.OBJECT_NOT_FOUND
            assert tier.read_into(task.dst_offset, task.key.encode(), memoryview(dest), checksum(data)) == expected
            if expected == E.OK:
                assert bytes(dest) == data
        # Every write is in the journal: a restart re-adopts the six objects.
        tier.close()
        again, scan = reopen(tmp_path / "ssd")
        assert (scan.adopted, scan.dropped) == (6, [])
        again.close()
    finally:
        seg.close()


def test_a_delete_between_demotions_into_the_same_range_keeps_the_later_object(tmp_path: Path, tier: SsdTier) -> None:
    seg = ShmSegment.create(str(tmp_path), "seg", 1 << 16, segment_id=5)
    try:
        first, second = value(4096, 1), value(4096, 2)
        seg.view[0:4096] = first
        seg.view[4096:8192] = second
        tasks = [
            demote_task(1, "first", 0, 0, first),
            pb.TierTask(id=2, kind=pb.TIER_DELETE, dst_segment=9, dst_offset=0),
            demote_task(3, "second", 4096, 0, second),
        ]
        worker = TierWorker(FakeLink([]), "s", tier, 9, seg, Inventory())
        assert [(r.id, r.code) for r in worker.run_batch(tasks)] == [(1, 0), (3, 0)]
        assert tier.entries() == [SsdEntry(b"second", 0, 4096, checksum(second))]
        dest = bytearray(4096)
        assert tier.read_into(0, b"second", memoryview(dest), checksum(second)) == E.OK
        assert bytes(dest) == second
    finally:
        seg.close()


def test_a_stretch_of_promotions_is_read_in_parallel_each_checked(tmp_path: Path, tier: SsdTier) -> None:
    page = 4096
    seg = ShmSegment.create(str(tmp_path), "seg", 1 << 18, segment_id=5)
    inventory = Inventory()
    try:
        values = [value(page, seed) for seed in range(5)]
        for i, data in enumerate(values):
            assert put(tier, i * page, f"p{i}".encode(), data) == E.OK

        def promote(task_id: int, i: int, **fields: Any) -> pb.TierTask:
            task = pb.TierTask(
                id=task_id,
                kind=pb.TIER_PROMOTE,
                key=f"p{i}",
                src_segment=9,
                src_offset=i * page,
                dst_segment=5,
                dst_offset=(10 + i) * page,
                length=page,
                checksum=checksum(values[i]),
            )
            for name, field_value in fields.items():
                setattr(task, name, field_value)
            return task

        tasks = [promote(i + 1, i) for i in range(5)]
        tasks[1].checksum ^= 1  # the SSD copy does not match: refused, never recorded
        tasks[3].dst_segment = 6  # not our segment
        worker = TierWorker(FakeLink([]), "s", tier, 9, seg, inventory)
        codes = [E(r.code) for r in worker.run_batch(tasks)]
        assert codes == [E.OK, E.CHECKSUM_MISMATCH, E.OK, E.SEGMENT_NOT_FOUND, E.OK]
        for i in (0, 2, 4):
            assert bytes(seg.view[(10 + i) * page : (11 + i) * page]) == values[i]
        recorded = sorted(e.key for e in inventory.entries(5))
        assert recorded == [b"p0", b"p2", b"p4"]
        assert (worker.stats.promoted, worker.stats.failed) == (3, 2)
    finally:
        seg.close()


def test_large_values_are_hashed_and_written_on_the_io_threads(tmp_path: Path, tier: SsdTier) -> None:
    big = 64 << 10
    seg = ShmSegment.create(str(tmp_path), "seg", 1 << 19, segment_id=5)
    try:
        values = [os.urandom(big) for _ in range(4)]
        for i, data in enumerate(values):
            seg.view[i * big : (i + 1) * big] = data
        # Every other 64 KiB slot: four runs, none adjacent; the third is corrupt.
        tasks = [demote_task(i + 1, f"b{i}", i * big, 2 * i * big, d) for i, d in enumerate(values)]
        tasks[2].checksum ^= 1
        worker = TierWorker(FakeLink([]), "s", tier, 9, seg, Inventory())
        assert [E(r.code) for r in worker.run_batch(tasks)] == [E.OK, E.OK, E.CHECKSUM_MISMATCH, E.OK]
        for i in (0, 1, 3):
            dest = bytearray(big)
            assert tier.read_into(2 * i * big, f"b{i}".encode(), memoryview(dest), checksum(values[i])) == E.OK
            assert bytes(dest) == values[i]
        assert tier.written_bytes == 3 * big
    finally:
        seg.close()


def test_a_batch_of_adjacent_objects_is_read_with_one_preadv_each_value_checked(
    tmp_path: Path, tier: SsdTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = 4096
    values = [value(page, seed) for seed in range(6)]
    for i, data in enumerate(values):
        assert put(tier, i * page, f"r{i}".encode(), data) == E.OK
    seg = ShmSegment.create(str(tmp_path), "seg", 1 << 16, segment_id=5)
    reads: list[int] = []
    real_preadv = os.preadv

    def counted(fd: int, buffers: Any, offset: int) -> int:
        reads.append(offset)
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counted)
    try:
        # Out of order, into scattered DRAM slots; r2 is asked with a wrong checksum, r9 does not exist.
        slots = [5, 0, 9, 2, 7, 11]
        items = [
            DemoteItem(i * page, f"r{i}".encode(), seg.view[s * page : (s + 1) * page], checksum(values[i]))
            for i, s in zip([3, 0, 2, 1, 5, 4], slots, strict=True)
        ]
        items[2] = DemoteItem(2 * page, b"r2", items[2].value, checksum(values[2]) ^ 1)
        items.append(DemoteItem(9 * page, b"r9", seg.view[14 * page : 15 * page], 0))
        codes = tier.read_many(items)
        assert codes == [E.OK, E.OK, E.CHECKSUM_MISMATCH, E.OK, E.OK, E.OK, E.OBJECT_NOT_FOUND]
        assert reads == [0]  # r0..r5 are adjacent on the SSD: one preadv for all six
        for i, s in zip([3, 0, 1, 5, 4], [5, 0, 2, 7, 11], strict=True):
            assert bytes(seg.view[s * page : (s + 1) * page]) == values[i]
        assert tier.read_bytes == 6 * page  # what left the disk, the refused r2 included
    finally:
        for item in items:
            item.value.release()
        seg.close()
