"""Leader election, fencing and step-down (master/leader.py) on the in-memory FakeCoordinator.

The same elector runs against a real etcd in tests/integration/test_leader_election.py; here the fake lets
a test end a lease, rewrite the key or cut etcd off at an exact point, without an etcd binary. Leases are
granted with the TTL asked for (no whole-second rounding), so a warm-up lasts TTL_S.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from kvpool.common.leader_watch import leader_key, parse_leader, vacancy_value
from kvpool.master.intents import IntentStore
from kvpool.master.leader import ElectorState, LeaderElector
from tests.support.fake_coordinator import FakeCoordinator
from tests.support.wait import wait_for

CLUSTER = "fake"
TTL_S = 0.2  # the warm-up after a crash lasts one TTL
LONG_TTL_S = 30.0  # a warm-up this long cannot finish inside a test's wait
WAIT_S = 10.0


class Recorder:
    """What an elector's callbacks reported, in order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, int]] = []

    def elected(self, view: int) -> None:
        with self.lock:
            self.calls.append(("elected", view))

    def deposed(self) -> None:
        with self.lock:
            self.calls.append(("deposed", 0))

    def kinds(self) -> list[str]:
        with self.lock:
            return [kind for kind, _ in self.calls]


@pytest.fixture
def coordinator() -> Iterator[FakeCoordinator]:
    fake = FakeCoordinator()
    yield fake
    fake.close()


@pytest.fixture
def electors() -> Iterator[list[LeaderElector]]:
    started: list[LeaderElector] = []
    yield started
    for elector in started:
        elector.stop(timeout=5.0)


def start(
    coordinator: FakeCoordinator, electors: list[LeaderElector], name: str, ttl_s: float = TTL_S
) -> tuple[LeaderElector, Recorder]:
    recorder = Recorder()
    elector = LeaderElector(
        coordinator,
        CLUSTER,
        {"id": name, "grpc": f"{name}:1"},
        ttl_s=ttl_s,
        on_elected=recorder.elected,
        on_deposed=recorder.deposed,
        name=name,
    )
    electors.append(elector)
    elector.start()
    return elector, recorder


def leaders(electors: list[LeaderElector]) -> list[str]:
    return [e.name for e in electors if e.is_leader]


def test_a_lone_elector_leads_after_its_warm_up_with_the_view_of_its_write(
    coordinator: FakeCoordinator, electors: list[LeaderElector]
) -> None:
    elector, recorder = start(coordinator, electors, "a")
    wait_for(lambda: elector.is_leader, WAIT_S, "a to lead")
    published = parse_leader(coordinator.get(leader_key(CLUSTER)))
    assert published is not None
    assert published.info["id"] == "a"
    assert elector.view == published.view > 0  # the view is the revision of the winning write
    assert recorder.calls == [("elected", elector.view)]
    assert elector.lease_valid_for() > 0
    assert elector.current_leader() == published


def test_exactly_one_of_two_leads_and_the_other_follows(
    coordinator: FakeCoordinator, electors: list[LeaderElector]
) -> None:
    a, _ = start(coordinator, electors, "a")
    b, _ = start(coordinator, electors, "b")
    wait_for(lambda: len(leaders(electors)) == 1, WAIT_S, "one leader")
    follower = b if a.is_leader else a
    assert follower.state is ElectorState.CANDIDATE
    assert follower.view == 0  # never won
    assert follower.lease_valid_for() == 0.0


def test_a_lost_lease_deposes_the_leader_and_the_successor_has_a_higher_view(
    coordinator: FakeCoordinator, electors: list[LeaderElector]
) -> None:
    a, recorder_a = start(coordinator, electors, "a")
    wait_for(lambda: a.is_leader, WAIT_S, "a to lead")
    b, recorder_b = start(coordinator, electors, "b")
    first_view = a.view
    coordinator.expire_lease(a.lease_id)  # a went silent: etcd expired its lease and deleted the key
    wait_for(lambda: recorder_a.kinds() == ["elected", "deposed"], WAIT_S, "a to be deposed")
    wait_for(lambda: len(leaders(electors)) == 1, WAIT_S, "a successor")
    successor = a if a.is_leader else b
    assert successor.view > first_view  # views fence the old leader: they only grow
    if successor is b:
        assert recorder_b.calls == [("elected", b.view)]


def test_a_rewritten_key_deposes_the_leader_at_once(
    coordinator: FakeCoordinator, electors: list[LeaderElector]
) -> None:
    a, recorder = start(coordinator, electors, "a", ttl_s=LONG_TTL_S)
    # A leader with a 30 s warm-up cannot get there in a test: promote it by a vacancy handover instead.
    coordinator.put(leader_key(CLUSTER), vacancy_value(0))
    wait_for(lambda: a.is_leader, WAIT_S, "a to take the vacancy without a warm-up")
    coordinator.put(leader_key(CLUSTER), b'{"id": "intruder"}')  # someone else's write: a newer view
    wait_for(lambda: recorder.kinds() == ["elected", "deposed"], WAIT_S, "a to step down")
    assert not a.is_leader
    assert a.lease_id not in coordinator.leases()  # its lease was revoked on the way out


def test_resign_publishes_a_vacancy_that_the_follower_takes_without_a_warm_up(
    coordinator: FakeCoordinator, electors: list[LeaderElector]
) -> None:
    a, recorder_a = start(coordinator, electors, "a", ttl_s=TTL_S)
    wait_for(lambda: a.is_leader, WAIT_S, "a to lead")
    b, _ = start(coordinator, electors, "b", ttl_s=LONG_TTL_S)
    old_view = a.view
    assert a.resign(timeout=5.0) is True
    assert recorder_a.kinds() == ["elected", "deposed"]  # on_deposed ran before resign returned
    # b's warm-up after a crash would take 30 s: leading within the wait proves the handover skipped it.
    wait_for(lambda: b.is_leader, WAIT_S, "b to take over the vacancy")
    assert b.view > old_view
    assert a.state is ElectorState.STOPPED


def test_an_unreachable_etcd_does_not_crash_a_candidate_and_it_campaigns_once_back(
    coordinator: FakeCoordinator, electors: list[LeaderElector]
) -> None:
    coordinator.partition()
    a, recorder = start(coordinator, electors, "a")
    wait_for(lambda: a.state is ElectorState.CANDIDATE, WAIT_S, "a to be campaigning")
    assert recorder.calls == []
    coordinator.partition(False)
    wait_for(lambda: a.is_leader, WAIT_S, "a to lead once etcd answers")


def test_stop_of_a_follower_keeps_the_leader(coordinator: FakeCoordinator, electors: list[LeaderElector]) -> None:
    a, _ = start(coordinator, electors, "a")
    wait_for(lambda: a.is_leader, WAIT_S, "a to lead")
    b, recorder_b = start(coordinator, electors, "b")
    b.stop(timeout=5.0)
    assert b.state is ElectorState.STOPPED
    assert a.is_leader
    assert recorder_b.calls == []


def test_intents_compare_on_revisions(coordinator: FakeCoordinator) -> None:
    intents = IntentStore(coordinator, CLUSTER)
    first = intents.create("drain", "node-a", {"state": "RUNNING"})
    assert first is not None
    assert intents.create("drain", "node-a", {"state": "RUNNING"}) is None  # exists already
    second = intents.update("drain", "node-a", {"state": "DRAINED"}, first)
    assert second is not None
    assert second > first
    assert intents.update("drain", "node-a", {"state": "RUNNING"}, first) is None  # stale revision
    assert not intents.delete("drain", "node-a", expected_revision=first)
    assert intents.delete("drain", "node-a", expected_revision=second)
    assert intents.get("drain", "node-a") is None
