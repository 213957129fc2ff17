"""The store's half of the SSD tier: the tier worker (demote / promote / delete) and SSD reads.

The worker is one thread that owns every SSD write, so the data plane never waits for a disk write: it
polls the master's ``TierTasks`` RPC, runs the tasks in the order they come (a DELETE of a range always
precedes a later DEMOTE into it: see master/tiering.py), and reports the results with its next poll. It
polls again at once while it has work or results to report, and every ``idle_s`` otherwise.

SSD reads are served by the data-plane thread of the connection: the grant is checked as for DRAM, the
SSD index entry at the granted offset is checked against the grant's key and length, and the bytes go from
the data file to the socket with ``sendfile`` (no copy through Python).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from kvpool.common.errors import ErrorCode, KvPoolError, as_code
from kvpool.common.grants import verify
from kvpool.common.log import get_logger
from kvpool.proto import master_pb2 as pb
from kvpool.proto.frames import HEADER, MAGIC, Op, TransferDesc
from kvpool.store.inventory import Inventory
from kvpool.store.segment import ShmSegment
from kvpool.store.ssd import SsdTier
from kvpool.transfer.tcp import sendfile_all

__all__ = ["StoreTier", "TierStats", "TierWorker", "serve_tier_read"]

log = get_logger(__name__)

_KIND_DEMOTE = 1
_KIND_PROMOTE = 2
_KIND_DELETE = 3


class Link(Protocol):
    """What the worker needs from the store's master link (kvpool.store.service.MasterLink)."""

    def call(self, method: str, request: Any, timeout: float) -> Any: ...


def _locate_tier_part(tier: SsdTier, secret: bytes, desc: TransferDesc, now_ms: int) -> int | ErrorCode:
    """Where the part of an SSD-tier READ starts in the tier's file, or the code that refuses it."""
    g = desc.grant
    if not verify(secret, g):
        return ErrorCode.AUTH_FAILED
    if now_ms >= g.expiry_ms:
        return ErrorCode.GRANT_EXPIRED
    if desc.part_offset + desc.part_length > g.length or g.offset + g.length > tier.capacity:
        return ErrorCode.OUT_OF_BOUNDS
    start = tier.locate(g.offset, g.key, g.length)
    return start if isinstance(start, ErrorCode) else start + desc.part_offset


def serve_tier_read(
    sock: socket.socket, tier: SsdTier, secret: bytes, desc: TransferDesc, req_id: int, now_ms: int
) -> tuple[ErrorCode, int]:
    """Serve one READ of an SSD-tier replica: (code, bytes sent). On a code other than OK nothing was sent
    and the caller replies with it; an OSError mid-send means the connection must close."""
    start = _locate_tier_part(tier, secret, desc, now_ms)
    if isinstance(start, ErrorCode):
        return start, 0
    # MSG_MORE: the header and the first bytes of the value leave in one segment.
    sock.sendall(HEADER.pack(MAGIC, Op.READ, 0, 0, req_id, desc.part_length), socket.MSG_MORE)
    # The header promised the bytes: a file that refuses sendfile or ends early closes the connection.
    if sendfile_all(sock, tier.data_fd, start, desc.part_length) != desc.part_length:
        raise OSError(f"the SSD tier's file refused sendfile for {desc.grant.key!r}")
    return ErrorCode.OK, desc.part_length


def read_tier_part(tier: SsdTier, secret: bytes, desc: TransferDesc, now_ms: int) -> tuple[ErrorCode, bytes | None]:
    """The bytes of one READV entry on an SSD-tier replica (small by construction), or the refusal's code."""
    start = _locate_tier_part(tier, secret, desc, now_ms)
    if isinstance(start, ErrorCode):
        return start, None
    try:
        data = os.pread(tier.data_fd, desc.part_length, start)
    except OSError:
        return ErrorCode.TRANSFER_FAILED, None
    if len(data) != desc.part_length:  # the file is shorter than its index says
        return ErrorCode.TRANSFER_FAILED, None
    return ErrorCode.OK, data


@dataclass
class TierStats:
    demoted: int = 0
    demoted_bytes: int = 0
    promoted: int = 0
    deleted: int = 0
    failed: int = 0
    polls: int = 0


class TierWorker(threading.Thread):
    """Runs the master's tier tasks for one store (see the module docstring)."""

    def __init__(
        self,
        link: Link,
        store_id: str,
        ssd: SsdTier,
        ssd_segment_id: int,
        segment: ShmSegment,
        inventory: Inventory,
        idle_s: float = 0.02,
        batch: int = 256,
    ) -> None:
        super().__init__(name="kvpool-tier-worker", daemon=True)
        self._link = link
        self._store_id = store_id
        self._ssd = ssd
        self._ssd_id = ssd_segment_id
        self._segment = segment
        self._inventory = inventory
        self._idle_s = idle_s
        self._batch = batch
        self._stop_event = threading.Event()
        self.stats = TierStats()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout)

    def run(self) -> None:
        done: list[pb.TierTaskResult] = []
        failures = 0
        while not self._stop_event.is_set():
            try:
                response = self._link.call(
                    "TierTasks",
                    pb.TierTasksRequest(store_id=self._store_id, done=done, max_tasks=self._batch),
                    timeout=5.0,
                )
            except KvPoolError as exc:
                failures += 1
                if failures >= 3:
                    done = []  # the master abandons them after its task timeout
                log.debug("tier tasks: %s", exc)
                self._stop_event.wait(min(1.0, self._idle_s * 2**failures))
                continue
            failures = 0
            self.stats.polls += 1
            done = []
            if as_code(response.status.code) != ErrorCode.OK:
                # NEED_REMOUNT (the heartbeat re-mounts), NOT_LEADER...: results mean nothing to that master.
                self._stop_event.wait(0.2)
                continue
            for task in response.tasks:
                code = self.execute(task)
                if task.kind != _KIND_DELETE:
                    done.append(pb.TierTaskResult(id=task.id, code=int(code)))
            if not response.tasks and not done:
                self._stop_event.wait(self._idle_s)

    def execute(self, task: pb.TierTask) -> ErrorCode:
        """Run one task; never raises."""
        if task.kind != _KIND_DELETE and task.deadline_ms and time.time() * 1000 > task.deadline_ms:
            # The master may already have given up on it and reused the ranges: never start it late.
            self.stats.failed += 1
            return ErrorCode.TIMEOUT
        try:
            if task.kind == _KIND_DEMOTE:
                code = self._demote(task)
            elif task.kind == _KIND_PROMOTE:
                code = self._promote(task)
            elif task.kind == _KIND_DELETE:
                code = ErrorCode.OK
                if task.dst_segment == self._ssd_id and self._ssd.delete(task.dst_offset):
                    self.stats.deleted += 1
            else:
                code = ErrorCode.UNKNOWN_OP
        except Exception:  # a bug must not stop the worker: report the task as failed
            log.exception("tier task %s failed", task.id)
            code = ErrorCode.INTERNAL
        if code != ErrorCode.OK:
            self.stats.failed += 1
        return code

    def _dram(self, segment_id: int, offset: int, length: int) -> memoryview | None:
        seg = self._segment
        if segment_id != seg.id or offset < 0 or length <= 0 or offset + length > seg.size:
            return None
        return seg.view[offset : offset + length]

    def _demote(self, task: pb.TierTask) -> ErrorCode:
        src = self._dram(task.src_segment, task.src_offset, task.length)
        if src is None or task.dst_segment != self._ssd_id:
            return ErrorCode.SEGMENT_NOT_FOUND
        try:
            code = self._ssd.write(task.dst_offset, task.key.encode(), src, task.checksum)
        finally:
            src.release()
        if code == ErrorCode.OK:
            self.stats.demoted += 1
            self.stats.demoted_bytes += task.length
        return code

    def _promote(self, task: pb.TierTask) -> ErrorCode:
        if task.src_segment != self._ssd_id:
            return ErrorCode.SEGMENT_NOT_FOUND
        dest = self._dram(task.dst_segment, task.dst_offset, task.length)
        if dest is None:
            return ErrorCode.SEGMENT_NOT_FOUND
        key = task.key.encode()
        # As for a client's WRITE: the inventory forgets what the range held before the bytes land, and
        # records the object once they all did (so a new master re-adopts the promoted copy).
        self._inventory.begin_write(task.dst_segment, task.dst_offset, task.length, key, task.checksum)
        try:
            code = self._ssd.read_into(task.src_offset, key, dest, task.checksum)
        finally:
            dest.release()
        if code == ErrorCode.OK:
            self._inventory.record_part(
                task.dst_segment, task.dst_offset, task.length, key, task.checksum, 0, task.length
            )
            self.stats.promoted += 1
        return code


class StoreTier:
    """A store's SSD tier as the store process sees it: the directory, its segment id and grant secret, the
    data plane hook and the worker. Created at start, after ``SsdTier.scan`` re-adopted what a previous
    process of this store left in the directory."""

    def __init__(self, ssd: SsdTier, segment_id: int, secret: bytes) -> None:
        self.ssd = ssd
        self.segment_id = segment_id
        self.secret = secret
        self.worker: TierWorker | None = None

    @classmethod
    def open(cls, directory: str, capacity: int) -> StoreTier:
        from kvpool.common.grants import new_secret
        from kvpool.store.segment import new_segment_id

        ssd = SsdTier(directory, capacity)
        ssd.scan()
        return cls(ssd, new_segment_id(), new_secret())

    def segment_info(self, dram: pb.SegmentInfo) -> pb.SegmentInfo:
        """The SSD segment's description: the DRAM segment's store and endpoint, no shared memory."""
        return pb.SegmentInfo(
            id=self.segment_id,
            node=dram.node,
            store_id=dram.store_id,
            size=self.ssd.capacity,
            tcp_endpoint=dram.tcp_endpoint,
            shm_path="",
            status=pb.SEGMENT_OK,
            numa_node=dram.numa_node,
            tier=1,
        )

    def mount(self, link: Link, dram: pb.SegmentInfo, remount: bool) -> bool:
        """Mount the SSD segment with its inventory (every object on the SSD, ``tier=1``)."""
        entries = [
            pb.InventoryEntry(
                key=e.key.decode(errors="replace"),
                offset=e.offset,
                length=e.length,
                checksum=e.checksum,
                tier=1,
            )
            for e in self.ssd.entries()
        ]
        request = pb.MountSegmentRequest(
            segment=self.segment_info(dram), secret=self.secret, inventory=entries, remount=remount
        )
        try:
            response = link.call("RemountSegment" if remount else "MountSegment", request, timeout=30.0)
        except KvPoolError as exc:
            log.warning("SSD tier mount failed: %s", exc)
            return False
        code = as_code(response.status.code)
        if code != ErrorCode.OK:
            log.warning("SSD tier mount refused: %s %s", code.name, response.status.message)
            return False
        log.info(
            "SSD tier %s mounted: %d objects adopted, %d rejected",
            self.ssd.directory,
            response.adopted,
            response.rejected,
        )
        return True

    def unmount(self, link: Link, store_id: str) -> None:
        try:
            request = pb.UnmountSegmentRequest(segment_id=self.segment_id, store_id=store_id)
            link.call("UnmountSegment", request, timeout=2.0)
        except KvPoolError as exc:
            log.warning("SSD tier unmount failed (the master will expire this store): %s", exc)

    def start_worker(self, link: Link, store_id: str, segment: ShmSegment, inventory: Inventory) -> None:
        self.worker = TierWorker(link, store_id, self.ssd, self.segment_id, segment, inventory)
        self.worker.start()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()
        self.ssd.close()

    def metrics(self) -> dict[str, int]:
        stats = self.worker.stats if self.worker is not None else TierStats()
        return {
            "ssd_objects": len(self.ssd),
            "ssd_used_bytes": self.ssd.used,
            "ssd_capacity_bytes": self.ssd.capacity,
            "ssd_demoted": stats.demoted,
            "ssd_demoted_bytes": stats.demoted_bytes,
            "ssd_promoted": stats.promoted,
            "ssd_deleted": stats.deleted,
            "ssd_task_failures": stats.failed,
        }
