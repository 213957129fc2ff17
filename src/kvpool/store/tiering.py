"""The store's half of the SSD tier: the tier worker (demote / promote / delete) and SSD reads.

The worker is one thread that owns every SSD write, so the data plane never waits for a disk write: it
polls the master's ``TierTasks`` RPC on the store's task loop (store/task_loop.py), runs the tasks in the
order they come (a DELETE of a range always precedes a later DEMOTE into it: see master/tiering.py), writing
each stretch of consecutive DEMOTEs as one batch (``SsdTier.write_many``: parallel writers, adjacent values in
one ``pwritev``, O_DIRECT from the segment), and reports the results with its next poll. It polls again at
once while it has work or results to report, and every ``idle_s`` otherwise.

SSD reads are served by the data-plane thread of the connection: the grant is checked as for DRAM, the
SSD index entry at the granted offset is checked against the grant's key and length, and the bytes go from
the data file to the socket with ``sendfile`` (no copy through Python).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.common.errors import ErrorCode, KvPoolError, as_code
from kvpool.common.failpoints import STORE_TIER_BEFORE_WRITE, failpoint
from kvpool.common.grants import verify
from kvpool.common.log import get_logger
from kvpool.proto import master_pb2 as pb
from kvpool.proto.frames import HEADER, MAGIC, Op, TransferDesc
from kvpool.store.inventory import Inventory
from kvpool.store.segment import ShmSegment
from kvpool.store.ssd import DemoteItem, SsdTier
from kvpool.store.task_loop import Link, Pull, TaskLoop
from kvpool.transfer.tcp_socket import sendfile_all

__all__ = ["StoreTier", "TierStats", "TierWorker", "serve_tier_read"]

log = get_logger(__name__)

_KIND_DEMOTE = 1
_KIND_PROMOTE = 2
_KIND_DELETE = 3


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
    # Ask for the whole value at once: one large disk read ahead of the socket, not the page cache's
    # readahead window by window behind it.
    with contextlib.suppress(OSError):
        os.posix_fadvise(tier.data_fd, start, desc.part_length, os.POSIX_FADV_WILLNEED)
    # MSG_MORE: the header and the first bytes of the value leave in one segment.
    sock.sendall(HEADER.pack(MAGIC, Op.READ, 0, 0, req_id, desc.part_length), socket.MSG_MORE)
    # The header promised the bytes: a file that refuses sendfile or ends early closes the connection.
    if sendfile_all(sock, tier.data_fd, start, desc.part_length) != desc.part_length:
        raise OSError(f"the SSD tier's file refused sendfile for {desc.grant.key!r}")
    tier.note_read(desc.part_length)
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
    tier.note_read(len(data))
    return ErrorCode.OK, data


@dataclass
class TierStats:
    demoted: int = 0
    demoted_bytes: int = 0
    promoted: int = 0
    deleted: int = 0
    failed: int = 0
    polls: int = 0


class TierWorker(TaskLoop[pb.TierTask, pb.TierTaskResult]):
    """Runs the master's tier tasks for one store (see the module docstring) on the store's task loop
    (store/task_loop.py)."""

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
        super().__init__("kvpool-tier-worker", busy_s=idle_s, idle_s=idle_s)
        self._link = link
        self._store_id = store_id
        self._ssd = ssd
        self._ssd_id = ssd_segment_id
        self._segment = segment
        self._inventory = inventory
        self._batch = batch
        self.stats = TierStats()

    def stop(self, timeout: float = 5.0) -> None:
        self.stop_loop(timeout)

    # ------------------------------------------------------------------ the task loop's two steps

    def exchange(self, results: list[pb.TierTaskResult]) -> Pull[pb.TierTask]:
        response = self._link.call(
            "TierTasks",
            pb.TierTasksRequest(store_id=self._store_id, done=results, max_tasks=self._batch),
            timeout=5.0,
        )
        self.stats.polls += 1
        return Pull(as_code(response.status.code), response.tasks, response.pending)

    def run_batch(self, tasks: Sequence[pb.TierTask]) -> list[pb.TierTaskResult]:
        """Run a batch in its order; consecutive DEMOTEs are written together (SsdTier.write_many), consecutive
        PROMOTEs read in parallel. A DELETE is never reordered with the tasks around it: it may free the very
        range a later DEMOTE writes."""
        results: list[pb.TierTaskResult] = []
        i = 0
        while i < len(tasks):
            kind = tasks[i].kind
            end = i + 1
            while end < len(tasks) and tasks[end].kind == kind and kind != _KIND_DELETE:
                end += 1
            run = tasks[i:end]
            if kind == _KIND_DEMOTE:
                results += self._results(run, self.demote_many(run))
            elif kind == _KIND_PROMOTE:
                results += self._results(run, self.promote_many(run))
            else:
                code = self.execute(run[0])
                if kind != _KIND_DELETE:
                    results.append(pb.TierTaskResult(id=run[0].id, code=int(code)))
            i = end
        return results

    @staticmethod
    def _results(tasks: Sequence[pb.TierTask], codes: Sequence[ErrorCode]) -> list[pb.TierTaskResult]:
        return [pb.TierTaskResult(id=t.id, code=int(c)) for t, c in zip(tasks, codes, strict=True)]

    # ------------------------------------------------------------------ tasks

    def execute(self, task: pb.TierTask) -> ErrorCode:
        """Run one task; never raises."""
        if task.kind == _KIND_DEMOTE:
            return self.demote_many([task])[0]
        if task.kind == _KIND_PROMOTE:
            return self.promote_many([task])[0]
        if self._late(task):
            self.stats.failed += 1
            return ErrorCode.TIMEOUT
        try:
            if task.kind == _KIND_DELETE:
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

    @staticmethod
    def _late(task: pb.TierTask) -> bool:
        # The master may already have given up on it and reused the ranges: never start it late.
        return task.kind != _KIND_DELETE and bool(task.deadline_ms) and time.time() * 1000 > task.deadline_ms

    def demote_many(self, tasks: Sequence[pb.TierTask]) -> list[ErrorCode]:
        """Copy a batch of DEMOTEs from the DRAM segment to the SSD file; one code per task. Never raises."""
        codes: list[ErrorCode] = [ErrorCode.OK] * len(tasks)
        items: list[DemoteItem] = []
        started: list[int] = []
        try:
            for i, task in enumerate(tasks):
                src = self._dram(task.src_segment, task.src_offset, task.length)
                if self._late(task):
                    codes[i] = ErrorCode.TIMEOUT
                elif src is None or task.dst_segment != self._ssd_id:
                    codes[i] = ErrorCode.SEGMENT_NOT_FOUND
                else:
                    items.append(DemoteItem(task.dst_offset, task.key.encode(), src, task.checksum))
                    started.append(i)
                    continue
                if src is not None:
                    src.release()
            failpoint(STORE_TIER_BEFORE_WRITE)  # tests: a disk slower than the puts
            for i, code in zip(started, self._ssd.write_many(items), strict=True):
                codes[i] = code
        except Exception:  # a bug must not stop the worker: report what is left as failed
            log.exception("a batch of %d demotions failed", len(tasks))
            for i in started:
                codes[i] = ErrorCode.INTERNAL if codes[i] == ErrorCode.OK else codes[i]
        finally:
            for item in items:
                item.value.release()
        for task, code in zip(tasks, codes, strict=True):
            if code == ErrorCode.OK:
                self.stats.demoted += 1
                self.stats.demoted_bytes += task.length
            else:
                self.stats.failed += 1
        return codes

    def _dram(self, segment_id: int, offset: int, length: int) -> memoryview | None:
        seg = self._segment
        if segment_id != seg.id or offset < 0 or length <= 0 or offset + length > seg.size:
            return None
        return seg.view[offset : offset + length]

    def promote_many(self, tasks: Sequence[pb.TierTask]) -> list[ErrorCode]:
        """Run a stretch of PROMOTEs as one batched read (``SsdTier.read_many``: adjacent objects in one
        ``preadv`` straight into the segment, runs in parallel); one code per task. Never raises."""
        codes: list[ErrorCode] = [ErrorCode.OK] * len(tasks)
        items: list[DemoteItem] = []
        started: list[int] = []
        try:
            for i, task in enumerate(tasks):
                dest = self._dram(task.dst_segment, task.dst_offset, task.length)
                if self._late(task):
                    codes[i] = ErrorCode.TIMEOUT
                elif task.src_segment != self._ssd_id or dest is None:
                    codes[i] = ErrorCode.SEGMENT_NOT_FOUND
                else:
                    # As for a client's WRITE: the inventory forgets what the range held before the bytes
                    # land, and records the object once they all did (so a new master re-adopts the copy).
                    key = task.key.encode()
                    self._inventory.begin_write(task.dst_segment, task.dst_offset, task.length, key, task.checksum)
                    items.append(DemoteItem(task.src_offset, key, dest, task.checksum))
                    started.append(i)
                    continue
                if dest is not None:
                    dest.release()
            for i, code in zip(started, self._ssd.read_many(items), strict=True):
                codes[i] = code
                task = tasks[i]
                if code == ErrorCode.OK:
                    self._inventory.record_part(
                        task.dst_segment, task.dst_offset, task.length, task.key.encode(), task.checksum, 0, task.length
                    )
        except Exception:  # a bug must not stop the worker: report what is left as failed
            log.exception("a batch of %d promotions failed", len(tasks))
            for i in started:
                codes[i] = ErrorCode.INTERNAL if codes[i] == ErrorCode.OK else codes[i]
        finally:
            for item in items:
                item.value.release()
        for code in codes:
            if code == ErrorCode.OK:
                self.stats.promoted += 1
            else:
                self.stats.failed += 1
        return codes


class StoreTier:
    """A store's SSD tier as the store process sees it: the directory, its segment id and grant secret, the
    data plane hook and the worker. Created at start, after ``SsdTier.scan`` re-adopted what a previous
    process of this store left in the directory."""

    COUNTERS = frozenset({"ssd_written_bytes", "ssd_read_bytes"})
    """The figures of :meth:`metrics` that only grow (Prometheus counters: SSD write and read GB/s are their
    rates)."""

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
            "ssd_written_bytes": self.ssd.written_bytes,
            "ssd_read_bytes": self.ssd.read_bytes,
            "ssd_direct_io": int(self.ssd.direct),
        }
