"""The store's mover (store/mover.py) against a real source data plane, in-process: the copy lands at the
granted offset and is recorded; a bad checksum, a forged or expired grant, or a fence records nothing."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpool.common.checksum import checksum
from kvpool.common.errors import ErrorCode
from kvpool.common.grants import GrantOp, make_grant, new_secret
from kvpool.proto import master_pb2 as pb
from kvpool.store.dataplane import DataPlaneServer
from kvpool.store.inventory import Inventory
from kvpool.store.mover import Mover
from kvpool.store.segment import ShmSegment

pytestmark = pytest.mark.integration

SIZE = 4 << 20


@dataclass
class Side:
    segment: ShmSegment
    secret: bytes
    inventory: Inventory


class NoLink:
    def call(self, method: str, request: Any, timeout: float) -> Any:
        raise AssertionError("execute() never calls the master")


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[Side, DataPlaneServer, Side, Mover]]:
    src = Side(ShmSegment.create(str(tmp_path), "src", SIZE), new_secret(), Inventory())
    dst = Side(ShmSegment.create(str(tmp_path), "dst", SIZE), new_secret(), Inventory())
    server = DataPlaneServer("127.0.0.1", 0, {src.segment.id: src.segment}, {src.segment.id: src.secret}, src.inventory)
    server.start()
    mover = Mover(NoLink(), "dst-store", dst.segment, dst.secret, dst.inventory)
    try:
        yield src, server, dst, mover
    finally:
        mover.stop()
        server.stop()
        src.segment.close()
        dst.segment.close()


def _task(
    src: Side,
    server: DataPlaneServer,
    dst: Side,
    task_id: int,
    key: str,
    value: bytes,
    src_off: int,
    dst_off: int,
    *,
    csum: int | None = None,
    expiry_ms: int | None = None,
    forge: bool = False,
) -> pb.MoveTask:
    src.segment.view[src_off : src_off + len(value)] = value
    expiry = expiry_ms or time.time_ns() // 1_000_000 + 30_000
    kb = key.encode()
    read = make_grant(src.secret, GrantOp.READ, src.segment.id, src_off, len(value), expiry, kb)
    write = make_grant(
        new_secret() if forge else dst.secret, GrantOp.WRITE, dst.segment.id, dst_off, len(value), expiry, kb
    )
    return pb.MoveTask(
        task_id=task_id,
        key=key,
        size=len(value),
        checksum=checksum(value) if csum is None else csum,
        source=pb.ReplicaDescriptor(
            segment_id=src.segment.id,
            tcp_endpoint=f"127.0.0.1:{server.port}",
            offset=src_off,
            length=len(value),
            expiry_ms=expiry,
            mac=read.mac,
        ),
        target=pb.ReplicaDescriptor(
            segment_id=dst.segment.id, offset=dst_off, length=len(value), expiry_ms=expiry, mac=write.mac
        ),
    )


def test_copies_land_at_the_granted_offset_and_are_recorded(stores: Any) -> None:
    src, server, dst, mover = stores
    values = [os.urandom(n) for n in (100, 64 << 10, 1 << 20)]
    tasks = [
        _task(src, server, dst, i + 1, f"k{i}", v, i * (2 << 20) // 2, 4096 + i * (1 << 20) + i * 64)
        for i, v in enumerate(values)
    ]
    results = mover.execute(tasks)
    assert [(r.task_id, r.code) for r in results] == [(1, 0), (2, 0), (3, 0)]
    for task, value in zip(tasks, values, strict=True):
        off = task.target.offset
        assert bytes(dst.segment.view[off : off + len(value)]) == value
    entries = {e.key: (e.offset, e.length, e.checksum) for e in dst.inventory.entries(dst.segment.id)}
    assert entries == {t.key.encode(): (t.target.offset, t.size, t.checksum) for t in tasks}
    assert mover.stats.moved == 3


def test_bad_copies_are_refused_and_never_recorded(stores: Any) -> None:
    src, server, dst, mover = stores
    value = os.urandom(8192)
    now = time.time_ns() // 1_000_000
    bad = [
        _task(src, server, dst, 1, "wrong-sum", value, 0, 0, csum=checksum(value) ^ 1),
        _task(src, server, dst, 2, "forged", value, 0, 65536, forge=True),
        _task(src, server, dst, 3, "expired", value, 0, 131072, expiry_ms=now + 500),
    ]
    results = {r.task_id: ErrorCode(r.code) for r in mover.execute(bad)}
    assert results == {1: ErrorCode.CHECKSUM_MISMATCH, 2: ErrorCode.AUTH_FAILED, 3: ErrorCode.GRANT_EXPIRED}
    assert dst.inventory.entries(dst.segment.id) == []
    # Forged and expired grants were refused before any byte moved.
    assert bytes(dst.segment.view[65536 : 65536 + 8192]) == bytes(8192)


def test_a_fence_discards_copies_planned_before_a_remount(stores: Any) -> None:
    src, server, dst, mover = stores
    task = _task(src, server, dst, 1, "k", os.urandom(4096), 0, 0)
    mover.fence()  # the store re-mounted (new leader) after this batch was fetched with epoch 0
    [result] = mover.execute([task], epoch=0)
    assert result.code == ErrorCode.CANCELLED
    assert dst.inventory.entries(dst.segment.id) == []
