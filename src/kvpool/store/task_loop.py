"""The store's one task pipeline: pull tasks from the master, run them, report the results with the next pull.

Two workers use it: the mover (drain and rebalance copies into this store, ``SyncMoves``: store/mover.py) and
the tier worker (SSD demote / promote / delete, ``TierTasks``: store/tiering.py). Both are the same loop:

* one RPC both reports the previous batch's results and takes the next batch (at most ``max_tasks``);
* while tasks come (or the master says more are pending) it pulls again at once; for ``busy_window_s`` after
  the last task it polls every ``busy_s``, then every ``idle_s``; :meth:`TaskLoop.wake` cuts a wait short
  (the heartbeat says tasks are waiting);
* an RPC failure backs off exponentially (``BACKOFF_BASE_S`` doubled per failure, at most
  ``BACKOFF_MAX_S``); after ``FORGET_RESULTS_AFTER`` failures in a row the unreported results are dropped
  (the master abandons those tasks after its timeout anyway);
* a reply other than OK (``NOT_LEADER``, ``NEED_REMOUNT``, a leader warming up) means the results mean
  nothing to that master: they are dropped and the loop waits ``REFUSED_WAIT_S``.

A subclass says how to pull (:meth:`TaskLoop.exchange`) and how to run a batch (:meth:`TaskLoop.run_batch`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.log import get_logger

__all__ = ["BACKOFF_BASE_S", "BACKOFF_MAX_S", "Link", "Pull", "TaskLoop"]

log = get_logger(__name__)

BACKOFF_BASE_S = 0.05
BACKOFF_MAX_S = 1.0
FORGET_RESULTS_AFTER = 3
REFUSED_WAIT_S = 0.2

TaskT = TypeVar("TaskT")
ResultT = TypeVar("ResultT")


class Link(Protocol):
    """What a task loop needs from the store's master link (kvpool.store.service.MasterLink)."""

    def call(self, method: str, request: Any, timeout: float) -> Any: ...


class Pull(Generic[TaskT]):
    """One answer of the master: its code, the tasks it handed out, how many more wait there."""

    __slots__ = ("code", "pending", "tasks")

    def __init__(self, code: ErrorCode, tasks: Sequence[TaskT], pending: int) -> None:
        self.code = code
        self.tasks = tasks
        self.pending = pending


def backoff_s(failures: int) -> float:
    """The wait after ``failures`` failed pulls in a row."""
    return min(BACKOFF_MAX_S, BACKOFF_BASE_S * float(2 ** min(failures, 16)))


class TaskLoop(threading.Thread, Generic[TaskT, ResultT]):
    """The pull/run/report loop (see the module docstring). Subclasses implement ``exchange`` and
    ``run_batch``; ``polls`` counts successful pulls."""

    def __init__(self, name: str, busy_s: float, idle_s: float, busy_window_s: float = 2.0) -> None:
        super().__init__(name=name, daemon=True)
        self._busy_s = busy_s
        self._idle_s = idle_s
        self._busy_window_s = busy_window_s
        self._stop_event = threading.Event()
        self._wake = threading.Event()
        self.polls = 0

    # ------------------------------------------------------------------ what a worker implements

    def exchange(self, results: list[ResultT]) -> Pull[TaskT]:
        """Report ``results`` and take the next batch (raises KvPoolError when the master is unreachable)."""
        raise NotImplementedError

    def run_batch(self, tasks: Sequence[TaskT]) -> list[ResultT]:
        """Run a batch; the results to report with the next pull. Must not raise."""
        raise NotImplementedError

    # ------------------------------------------------------------------ control

    def wake(self) -> None:
        """Tasks are waiting: poll now."""
        self._wake.set()

    def stop_loop(self, timeout: float) -> None:
        self._stop_event.set()
        self._wake.set()
        if self.is_alive():
            self.join(timeout)

    @property
    def stopping(self) -> bool:
        return self._stop_event.is_set()

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        results: list[ResultT] = []
        failures = 0
        last_work = float("-inf")
        while not self._stop_event.is_set():
            try:
                pull = self.exchange(results)
            except KvPoolError as exc:
                failures += 1
                if failures >= FORGET_RESULTS_AFTER:
                    results = []
                log.debug("%s: pulling tasks failed: %s", self.name, exc)
                self._sleep(backoff_s(failures))
                continue
            failures = 0
            results = []
            self.polls += 1
            if pull.code != ErrorCode.OK:
                self._sleep(REFUSED_WAIT_S)
                continue
            if pull.tasks:
                results = self.run_batch(pull.tasks)
                last_work = time.monotonic()
                continue
            if pull.pending:
                continue
            recent = time.monotonic() - last_work < self._busy_window_s
            self._sleep(self._busy_s if recent else self._idle_s)

    def _sleep(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()
