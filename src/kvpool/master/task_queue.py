"""The master's one task pipeline: per-store queues of work a store pulls, runs and reports (pure, no locks).

Two engines hand stores work this way: moves for drain and rebalance (master/moves.py, pulled with
``SyncMoves``) and SSD-tier tasks (master/tiering.py, pulled with ``TierTasks``). Each keeps one
:class:`TaskQueue` per store: tasks wait in FIFO order until the store pulls them (:meth:`TaskQueue.take`),
then sit in the in-flight table until the store reports them (:meth:`TaskQueue.finish`), or the engine
withdraws them (cancelled, expired, the store gone). The store's side of the same pipeline is
store/task_loop.py.

The queue takes no lock: each engine guards it with the lock its own invariants need (the tier channel's
lock also covers the SSD allocator, so that a range's DELETE is queued before any later DEMOTE into it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["TaskQueue"]

T = TypeVar("T")


class TaskQueue(Generic[T]):
    """One store's tasks: queued (FIFO) and in flight (handed out, not reported). ``id_of`` names a task."""

    __slots__ = ("_id_of", "inflight", "queue")

    def __init__(self, id_of: Callable[[T], int]) -> None:
        self._id_of = id_of
        self.queue: deque[T] = deque()
        self.inflight: dict[int, T] = {}

    def push(self, task: T) -> None:
        self.queue.append(task)

    def take(
        self,
        limit: int,
        cost: Callable[[T], int] | None = None,
        budget: int = 0,
        tracked: Callable[[T], bool] | None = None,
    ) -> list[T]:
        """Hand out up to ``limit`` tasks in FIFO order. With ``cost``, stop before the total cost would pass
        ``budget`` (the first task always goes). A task for which ``tracked`` is False (a fire-and-forget
        one) is not kept in flight; by default every task is."""
        out: list[T] = []
        spent = 0
        queue = self.queue
        while queue and len(out) < limit:
            task = queue[0]
            if cost is not None:
                price = cost(task)
                if out and price and spent + price > budget:
                    break
                spent += price
            queue.popleft()
            if tracked is None or tracked(task):
                self.inflight[self._id_of(task)] = task
            out.append(task)
        return out

    def finish(self, task_id: int) -> T | None:
        """The store reported this task: forget it (None if it is not in flight: unknown, or withdrawn)."""
        return self.inflight.pop(task_id, None)

    def withdraw(self, task_id: int) -> T | None:
        """Take a task out wherever it is (queued or in flight)."""
        task = self.inflight.pop(task_id, None)
        if task is not None:
            return task
        for queued in self.queue:
            if self._id_of(queued) == task_id:
                self.queue.remove(queued)
                return queued
        return None

    def remove_where(self, doomed: Callable[[T], bool]) -> list[T]:
        """Take out every task (in flight first, then queued, each in order) for which ``doomed`` is True."""
        out = [task for task in self.inflight.values() if doomed(task)]
        for task in out:
            del self.inflight[self._id_of(task)]
        if any(doomed(task) for task in self.queue):
            keep: deque[T] = deque()
            for task in self.queue:
                if doomed(task):
                    out.append(task)
                else:
                    keep.append(task)
            self.queue = keep
        return out

    def drain(self) -> list[T]:
        """Take out everything: in flight first, then queued."""
        out = [*self.inflight.values(), *self.queue]
        self.inflight.clear()
        self.queue.clear()
        return out

    def queued(self) -> int:
        return len(self.queue)

    def __len__(self) -> int:
        return len(self.queue) + len(self.inflight)

    def __iter__(self) -> Iterator[T]:
        yield from self.inflight.values()
        yield from self.queue
