"""The store's half of drain and rebalance: the mover copies objects from other stores into this one.

The master plans each move and queues it for the TARGET store (master/moves.py). The mover thread pulls its
tasks with ``SyncMoves`` (reporting the results of the previous batch in the same call; the pull loop is the
store's one task pipeline, store/task_loop.py), and for each task:

1. checks the WRITE grant on its own segment (the master's MAC over this exact range, not expired), so that
   the inventory only ever describes ranges the master allocated for that key (docs/decisions/0002);
2. announces the write to the inventory (which forgets anything stale the range overlapped), then reads the
   source replica with its READ grant straight into the segment at the target offset: TcpTransport
   ``recv_into`` a memoryview of the shared memory, no intermediate buffer. An SSD-tier source is read the
   same way: the source store's data plane serves it from its SSD file;
3. verifies the checksum of the bytes now in the segment and records the object in the inventory (so a new
   leader adopts the copy even if the report is lost), then reports OK.

At most ``max_in_flight`` tasks run at once (one batch, copied in parallel over the transport's pooled
connections). The mover polls again at once while it gets work, briefly after that, and otherwise sleeps
until the heartbeat says tasks are waiting (``moves_pending``) or ``idle_s`` passes.

Fencing: the store calls :meth:`Mover.fence` before every (re)mount. A copy that finishes after a fence is
not recorded and not reported: the master it was planned by may be gone, and the new one may have handed
that range to another object already.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.common.checksum import checksum
from kvpool.common.clock import SYSTEM_CLOCK, Clock, Deadline
from kvpool.common.errors import ErrorCode, as_code
from kvpool.common.grants import Grant, GrantOp, verify
from kvpool.common.log import get_logger
from kvpool.proto import master_pb2 as pb
from kvpool.proto.frames import MAX_KEY_BYTES
from kvpool.store.inventory import Inventory
from kvpool.store.segment import ShmSegment
from kvpool.store.task_loop import Link, Pull, TaskLoop
from kvpool.transfer.base import TransferRequest, Transport, replica_of

__all__ = ["Mover", "MoverStats"]

log = get_logger(__name__)

GRANT_MARGIN_MS = 1000
"""A copy must end this long before its grants expire (the master frees abandoned ranges after a grace)."""


@dataclass
class MoverStats:
    moved: int = 0
    moved_bytes: int = 0
    failed: int = 0
    polls: int = 0


class Mover(TaskLoop[pb.MoveTask, pb.MoveResult]):
    """Runs this store's move tasks (see the module docstring) on the store's task loop (store/task_loop.py)."""

    def __init__(
        self,
        link: Link,
        store_id: str,
        segment: ShmSegment,
        secret: bytes,
        inventory: Inventory,
        transport: Transport | None = None,
        max_in_flight: int = 32,
        idle_s: float = 5.0,
        busy_s: float = 0.01,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__("kvpool-mover", busy_s=busy_s, idle_s=idle_s)
        self._link = link
        self._store_id = store_id
        self._segment = segment
        self._secret = secret
        self._inventory = inventory
        self._owns_transport = transport is None
        if transport is None:
            from kvpool.transfer.tcp import TcpTransport

            transport = TcpTransport()
        self._transport = transport
        self._max = max_in_flight
        self._clock = clock
        self._pull_epoch = 0
        self._fence_lock = threading.Lock()
        self._epoch = 0
        self.stats = MoverStats()

    # ------------------------------------------------------------------ control

    def fence(self) -> None:
        """A (re)mount is about to report the inventory: copies finishing after this are discarded."""
        with self._fence_lock:
            self._epoch += 1

    def stop(self, timeout: float = 5.0) -> None:
        self.stop_loop(timeout)
        if self._owns_transport:
            self._transport.close()

    # ------------------------------------------------------------------ the task loop's two steps

    def exchange(self, results: list[pb.MoveResult]) -> Pull[pb.MoveTask]:
        self._pull_epoch = self._epoch
        response = self._link.call(
            "SyncMoves",
            pb.SyncMovesRequest(store_id=self._store_id, results=results, max_tasks=self._max),
            timeout=5.0,
        )
        self.stats.polls += 1
        return Pull(as_code(response.status.code), response.tasks, response.pending)

    def run_batch(self, tasks: Sequence[pb.MoveTask]) -> list[pb.MoveResult]:
        epoch = self._pull_epoch
        results = self.execute(tasks, epoch)
        return results if epoch == self._epoch else []  # planned by a master we have since re-mounted with

    # ------------------------------------------------------------------ one batch

    def execute(self, tasks: Sequence[pb.MoveTask], epoch: int | None = None) -> list[pb.MoveResult]:
        """Copy a batch of tasks into this store's segment; one result per task. Never raises."""
        if epoch is None:
            epoch = self._epoch
        results: list[pb.MoveResult] = []
        started: list[tuple[pb.MoveTask, memoryview]] = []
        requests: list[TransferRequest] = []
        now_ms = self._clock.wall_ms()
        try:
            for task in tasks:
                code = self._check(task, now_ms)
                view = self._begin(task, epoch) if code == ErrorCode.OK else None
                if view is None:
                    results.append(self._result(task, code if code != ErrorCode.OK else ErrorCode.CANCELLED))
                    continue
                started.append((task, view))
                requests.append(TransferRequest(GrantOp.READ, task.key.encode(), replica_of(task.source), view))
            if requests:
                expiry_ms = min(task.target.expiry_ms for task, _ in started)
                deadline = Deadline(max(0.1, (expiry_ms - GRANT_MARGIN_MS - now_ms) / 1000.0))
                codes = self._transport.transfer(requests, deadline)
                for (task, view), code in zip(started, codes, strict=True):
                    results.append(self._result(task, self._commit(task, view, code, epoch)))
        except Exception:  # a bug must not stop the mover: fail what is left, the master retries later
            log.exception("move batch failed")
            done = {r.task_id for r in results}
            results += [self._result(t, ErrorCode.INTERNAL) for t in tasks if t.task_id not in done]
        finally:
            for _, view in started:
                view.release()
        return results

    def _check(self, task: pb.MoveTask, now_ms: int) -> ErrorCode:
        """Is this a move into our segment that the master really granted, with time left to do it?"""
        seg, target = self._segment, task.target
        size = task.size
        key = task.key.encode()
        if target.segment_id != seg.id:
            return ErrorCode.SEGMENT_NOT_FOUND
        if not 0 < size == target.length == task.source.length or len(key) > MAX_KEY_BYTES:
            return ErrorCode.INVALID_ARGUMENT
        if target.offset + size > seg.size:
            return ErrorCode.OUT_OF_BOUNDS
        grant = Grant(GrantOp.WRITE, target.segment_id, target.offset, size, target.expiry_ms, key, bytes(target.mac))
        if not verify(self._secret, grant):
            return ErrorCode.AUTH_FAILED
        if now_ms + GRANT_MARGIN_MS >= target.expiry_ms:
            return ErrorCode.GRANT_EXPIRED
        return ErrorCode.OK

    def _begin(self, task: pb.MoveTask, epoch: int) -> memoryview | None:
        """Announce the write to the inventory and return the target range (None if fenced meanwhile)."""
        target = task.target
        with self._fence_lock:
            if epoch != self._epoch:
                return None
            self._inventory.begin_write(self._segment.id, target.offset, task.size, task.key.encode(), task.checksum)
        return self._segment.view[target.offset : target.offset + task.size]

    def _commit(self, task: pb.MoveTask, view: memoryview, code: ErrorCode, epoch: int) -> ErrorCode:
        """Verify the copied bytes and record the object; the task's final code."""
        if code == ErrorCode.OK and checksum(view) != task.checksum:
            code = ErrorCode.CHECKSUM_MISMATCH
        if code == ErrorCode.OK and self._clock.wall_ms() >= task.target.expiry_ms:
            code = ErrorCode.GRANT_EXPIRED  # the master may already have given the range away
        if code == ErrorCode.OK:
            target = task.target
            with self._fence_lock:
                if epoch != self._epoch:
                    code = ErrorCode.CANCELLED
                else:
                    self._inventory.record_part(
                        self._segment.id,
                        target.offset,
                        task.size,
                        task.key.encode(),
                        task.checksum,
                        0,
                        task.size,
                    )
        # A failed copy leaves an uncommitted claim in the inventory: never reported, forgotten when it
        # times out or is overwritten. (Dropping it by offset could hit a newer write's claim.)
        if code == ErrorCode.OK:
            self.stats.moved += 1
            self.stats.moved_bytes += task.size
        else:
            self.stats.failed += 1
            log.debug("move %d of %r failed: %s", task.task_id, task.key, code.name)
        return code

    @staticmethod
    def _result(task: pb.MoveTask, code: ErrorCode) -> pb.MoveResult:
        return pb.MoveResult(task_id=task.task_id, code=int(code))
