"""The master's one task pipeline (master/task_queue.py): FIFO hand-out, in-flight tracking, byte budgets,
withdrawal from either place."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.master.task_queue import TaskQueue


@dataclass
class Job:
    id: int
    size: int = 0
    report: bool = True


def queue_of(*jobs: Job) -> TaskQueue[Job]:
    q: TaskQueue[Job] = TaskQueue(lambda j: j.id)
    for job in jobs:
        q.push(job)
    return q


def test_tasks_leave_in_order_and_wait_in_flight_until_reported() -> None:
    q = queue_of(Job(1), Job(2), Job(3))
    assert [j.id for j in q.take(2)] == [1, 2]
    assert (q.queued(), len(q), sorted(q.inflight)) == (1, 3, [1, 2])
    assert q.finish(2) == Job(2)
    assert q.finish(2) is None  # reported twice, or by another leader's store
    assert [j.id for j in q.take(10)] == [3]
    assert [j.id for j in q] == [1, 3]


def test_a_budget_stops_before_the_task_that_would_pass_it_and_untracked_tasks_are_not_kept() -> None:
    q = queue_of(Job(1, 4), Job(2, 0, report=False), Job(3, 4), Job(4, 4))
    cost, tracked = (lambda j: j.size), (lambda j: j.report)
    assert [j.id for j in q.take(10, cost=cost, budget=8, tracked=tracked)] == [1, 2, 3]
    assert sorted(q.inflight) == [1, 3]
    assert [j.id for j in q.take(10, cost=cost, budget=1, tracked=tracked)] == [4]  # the first always goes


def test_withdraw_remove_where_and_drain_find_tasks_wherever_they_are() -> None:
    q = queue_of(*(Job(i) for i in range(1, 7)))
    q.take(2)
    assert q.withdraw(1) == Job(1)  # in flight
    assert q.withdraw(5) == Job(5)  # queued
    assert q.withdraw(5) is None
    assert [j.id for j in q.remove_where(lambda j: j.id % 2 == 0)] == [2, 4, 6]
    assert [j.id for j in q.drain()] == [3]
    assert len(q) == 0
