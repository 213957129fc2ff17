"""Leader election (kvpool.master.leader) against a real etcd, with electors in-process and in subprocesses.

Run directly (``python test_leader_election.py ENDPOINTS CLUSTER ID TTL``), this file is the subprocess
elector: it prints ``ELECTED <view>``, ``DEPOSED`` and ``RESIGNED`` lines and resigns on SIGTERM.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

TTL = 1.0  # seconds; etcd's minimum with the fixture's raft timings
SLACK = 2.0  # scheduling, etcd's 0.5 s expiry scan, watch latency on a 2-core machine

# ---- the subprocess elector --------------------------------------------------------------------------------


def _child_main(argv: list[str]) -> int:
    from kvpool.common.etcd import EtcdClient
    from kvpool.master.leader import LeaderElector

    endpoints, cluster, ident, ttl = argv[0], argv[1], argv[2], float(argv[3])

    def say(line: str) -> None:
        print(line, flush=True)

    client = EtcdClient(endpoints, timeout=2.0)
    elector = LeaderElector(
        client,
        cluster,
        {"id": ident, "grpc": f"127.0.0.1:{os.getpid()}"},
        ttl,
        on_elected=lambda view: say(f"ELECTED {view}"),
        on_deposed=lambda: say("DEPOSED"),
    )
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    elector.start()
    say("STARTED")
    done.wait()
    elector.resign()
    say("RESIGNED")
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))


# ---- helpers -----------------------------------------------------------------------------------------------

from kvpool.common.etcd import EtcdClient  # noqa: E402
from kvpool.common.leader_watch import LeaderWatch, leader_key  # noqa: E402
from kvpool.master.leader import ElectorState, LeaderElector  # noqa: E402
from tests.support.etcd_cluster import EtcdCluster  # noqa: E402
from tests.support.wait import wait_for  # noqa: E402

pytestmark = [pytest.mark.etcd, pytest.mark.integration]


@dataclass
class Timeline:
    """What the electors' callbacks reported, in order; checks that two leaders never overlap."""

    entries: list[tuple[float, str, str, int]] = field(default_factory=list)  # (t, who, what, view)
    leading: set[str] = field(default_factory=set)
    overlaps: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def elected(self, who: str, view: int) -> None:
        with self.lock:
            if self.leading:
                self.overlaps.append(f"{who} elected (view {view}) while {self.leading} still lead")
            self.leading.add(who)
            self.entries.append((time.monotonic(), who, "elected", view))

    def deposed(self, who: str) -> None:
        with self.lock:
            self.leading.discard(who)
            self.entries.append((time.monotonic(), who, "deposed", 0))

    def views(self) -> list[int]:
        with self.lock:
            return [v for _, _, what, v in self.entries if what == "elected"]

    def count(self, what: str, who: str | None = None) -> int:
        with self.lock:
            return sum(1 for _, w, x, _ in self.entries if x == what and (who is None or w == who))

    def last_elected(self) -> tuple[float, str, int]:
        with self.lock:
            t, who, _, view = [e for e in self.entries if e[2] == "elected"][-1]
            return t, who, view


@pytest.fixture
def client(etcd1: EtcdCluster) -> Iterator[EtcdClient]:
    with EtcdClient(etcd1.endpoints, timeout=2.0) as c:
        yield c


def make_electors(client: EtcdClient, n: int, timeline: Timeline, cluster: str = "le") -> list[LeaderElector]:
    electors = []
    for i in range(n):
        who = f"m{i}"
        electors.append(
            LeaderElector(
                client,
                cluster,
                {"id": who, "grpc": f"127.0.0.1:{7000 + i}"},
                TTL,
                on_elected=lambda view, who=who: timeline.elected(who, view),
                on_deposed=lambda who=who: timeline.deposed(who),
                name=who,
            )
        )
    return electors


def leaders(electors: list[LeaderElector]) -> list[LeaderElector]:
    return [e for e in electors if e.state is ElectorState.LEADER]


@pytest.fixture
def running() -> Iterator[list[LeaderElector]]:
    """Electors a test started; all stopped at the end."""
    started: list[LeaderElector] = []
    yield started
    for e in started:
        e.stop(timeout=5.0)


# ---- in-process electors -----------------------------------------------------------------------------------


def test_exactly_one_leader_and_views_increase(client: EtcdClient, running: list[LeaderElector]) -> None:
    timeline = Timeline()
    electors = make_electors(client, 3, timeline)
    running.extend(electors)
    t0 = time.monotonic()
    for e in electors:
        e.start()
    took = wait_for(lambda: timeline.count("elected") == 1, TTL + 1 + SLACK, "the first leader")
    print(f"first leader after {took:.2f}s (includes the {TTL:.0f}s warm-up)")
    assert time.monotonic() - t0 >= TTL  # it warmed up before serving
    leader = leaders(electors)
    assert len(leader) == 1
    published = electors[0].current_leader()
    assert published is not None
    assert published.view == leader[0].view
    assert published.info["id"] == leader[0].name
    assert published.address("grpc") is not None

    # Re-elections: revoke the leader's lease behind its back (as if etcd expired it).
    for _round in range(3):
        old = leaders(electors)[0]
        n = timeline.count("elected")
        d = timeline.count("deposed", old.name)
        client.lease_revoke(old.lease_id)
        revoked = time.monotonic()
        wait_for(
            lambda old=old, d=d: timeline.count("deposed", old.name) > d and old.state is not ElectorState.LEADER,
            2.0,
            "the old leader's on_deposed",
        )
        wait_for(lambda n=n: timeline.count("elected") == n + 1, TTL + 1 + SLACK, "a new leader")
        print(f"re-elected {time.monotonic() - revoked:.2f}s after the leader's lease was revoked")
        assert len(leaders(electors)) == 1
    views = timeline.views()
    assert views == sorted(set(views)), f"views must strictly increase: {views}"
    assert timeline.overlaps == []


def test_resign_hands_over_without_warmup(client: EtcdClient, running: list[LeaderElector]) -> None:
    timeline = Timeline()
    electors = make_electors(client, 3, timeline)
    running.extend(electors)
    for e in electors:
        e.start()
    wait_for(lambda: timeline.count("elected") == 1, TTL + 1 + SLACK, "the first leader")
    with LeaderWatch(client, "le") as watch:
        first = watch.wait_for_change(None, 2.0)
        assert first is not None
        old = leaders(electors)[0]
        assert first.view == old.view
        t0 = time.monotonic()
        assert old.resign() is True
        took = wait_for(lambda: timeline.count("elected") == 2, 2.0, "the successor")
        print(f"handover after resign(): {took:.3f}s (no warm-up needed)")
        assert took < TTL  # the successor did not wait out a TTL
        assert old.state is ElectorState.STOPPED
        assert timeline.count("deposed", old.name) == 1
        new = watch.wait_for_change(first.view, 2.0)
        assert new is not None
        assert new.view > first.view
        assert new.info["id"] != old.name
        assert time.monotonic() - t0 < 2.0
    assert timeline.overlaps == []


def test_stop_of_a_follower_keeps_the_leader(client: EtcdClient, running: list[LeaderElector]) -> None:
    timeline = Timeline()
    electors = make_electors(client, 2, timeline)
    running.extend(electors)
    for e in electors:
        e.start()
    wait_for(lambda: timeline.count("elected") == 1, TTL + 1 + SLACK, "the first leader")
    follower = next(e for e in electors if e.state is not ElectorState.LEADER)
    assert follower.resign() is False
    assert timeline.count("deposed") == 0
    assert len(leaders(electors)) == 1


def test_leader_keeps_leading_through_an_etcd_member_failure(
    etcd3: EtcdCluster,
    running: list[LeaderElector],
) -> None:
    with EtcdClient(etcd3.endpoints, timeout=2.0) as c:
        timeline = Timeline()
        elector = LeaderElector(
            c,
            "le3",
            {"id": "solo"},
            2.0,
            on_elected=lambda v: timeline.elected("solo", v),
            on_deposed=lambda: timeline.deposed("solo"),
        )
        running.append(elector)
        elector.start()
        wait_for(lambda: elector.is_leader, 2.0 + 1 + SLACK, "the leader")
        etcd3.kill(etcd3.leader_index())  # etcd elects a new raft leader; our lease must survive
        time.sleep(3.0)  # observe: nothing may happen for longer than the lease TTL
        assert elector.is_leader
        assert timeline.count("deposed") == 0


# ---- subprocess electors -----------------------------------------------------------------------------------


class ChildElector:
    """An elector in its own process, so that it can be SIGKILLed or SIGSTOPped like a real master."""

    def __init__(self, endpoints: str, cluster: str, ident: str, ttl: float) -> None:
        import kvpool

        src = str(Path(kvpool.__file__).resolve().parents[1])
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, root, os.environ.get("PYTHONPATH", "")]))
        self.ident = ident
        self.proc = subprocess.Popen(
            [sys.executable, __file__, endpoints, cluster, ident, str(ttl)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        self.lines: queue.Queue[tuple[float, str]] = queue.Queue()
        self.seen: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put((time.monotonic(), line.strip()))

    def expect(self, prefix: str, timeout: float) -> tuple[float, str]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                t, line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"{self.ident}: no {prefix!r} within {timeout:.1f}s (saw {self.seen})")
            self.seen.append((t, line))
            if line.startswith(prefix):
                return t, line

    def drain(self) -> list[str]:
        """Lines printed since the last expect()."""
        out = []
        while not self.lines.empty():
            t, line = self.lines.get()
            self.seen.append((t, line))
            out.append(line)
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(10)  # it ends at the pipe's end of file; then the pipe can be closed
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def children() -> Iterator[list[ChildElector]]:
    procs: list[ChildElector] = []
    yield procs
    for p in procs:
        p.close()


def test_crashed_leader_is_replaced(etcd1: EtcdCluster, children: list[ChildElector]) -> None:
    with EtcdClient(etcd1.endpoints, timeout=2.0) as c, LeaderWatch(c, "crash") as watch:
        for i in range(3):
            children.append(ChildElector(etcd1.endpoints_str, "crash", f"c{i}", TTL))
        first = watch.wait_for_change(None, 10.0)
        assert first is not None
        leader = next(ch for ch in children if ch.ident == first.info["id"])
        _, line = leader.expect("ELECTED", TTL + 1 + SLACK)
        assert int(line.split()[1]) == first.view
        leader.proc.kill()
        killed = time.monotonic()
        new = watch.wait_for_change(first.view, TTL + 0.5 + SLACK)
        assert new is not None
        assert new.view > first.view
        successor = next(ch for ch in children if ch.ident == new.info["id"])
        t, line = successor.expect("ELECTED", 2 * TTL + SLACK)
        took = t - killed
        print(f"leader SIGKILLed: successor serving after {took:.2f}s (ttl {TTL:.0f}s + warm-up {TTL:.0f}s)")
        assert int(line.split()[1]) == new.view
        assert took <= 2 * TTL + 0.5 + SLACK
        others = [ch for ch in children if ch is not leader and ch is not successor]
        for ch in others:
            assert not any(x.startswith("ELECTED") for _, x in ch.seen)


def test_frozen_leader_is_deposed_when_it_resumes(
    etcd1: EtcdCluster,
    children: list[ChildElector],
    running: list[LeaderElector],
) -> None:
    with EtcdClient(etcd1.endpoints, timeout=2.0) as c:
        stale = ChildElector(etcd1.endpoints_str, "freeze", "stale", TTL)
        children.append(stale)
        _, line = stale.expect("ELECTED", 10.0)
        old_view = int(line.split()[1])
        timeline = Timeline()
        (other,) = make_electors(c, 1, timeline, cluster="freeze")
        running.append(other)
        other.start()
        os.kill(stale.proc.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        took = wait_for(lambda: timeline.count("elected") == 1, TTL + 0.5 + TTL + SLACK, "a new leader")
        print(f"leader frozen: replaced after {took:.2f}s")
        new_view = timeline.views()[0]
        assert new_view > old_view
        assert time.monotonic() - frozen > TTL  # its lease had expired while it was frozen
        os.kill(stale.proc.pid, signal.SIGCONT)
        resumed = time.monotonic()
        t, _ = stale.expect("DEPOSED", 3.0)
        print(f"stale leader deposed itself {t - resumed:.3f}s after resuming; views {old_view} -> {new_view}")
        assert other.is_leader
        assert other.view == new_view
        published = other.current_leader()
        assert published is not None
        assert published.view == new_view
        assert published.info["id"] == "m0"
        assert c.get(leader_key("freeze")) is not None
        # The resumed elector is a candidate again and cannot win back while the new leader holds the key.
        time.sleep(0.5)  # observation window for something that must not happen
        assert stale.drain() == []
        assert other.is_leader


def test_sigterm_resigns_and_hands_over_fast(etcd1: EtcdCluster, children: list[ChildElector]) -> None:
    with EtcdClient(etcd1.endpoints, timeout=2.0) as c, LeaderWatch(c, "term") as watch:
        a = ChildElector(etcd1.endpoints_str, "term", "a", TTL)
        children.append(a)
        a.expect("ELECTED", 10.0)
        b = ChildElector(etcd1.endpoints_str, "term", "b", TTL)
        children.append(b)
        b.expect("STARTED", 10.0)
        first = watch.get()
        assert first is not None
        assert first.info["id"] == "a"
        a.proc.terminate()
        sent = time.monotonic()
        a.expect("DEPOSED", 3.0)
        t, _ = b.expect("ELECTED", 3.0)
        print(f"SIGTERM to the leader: successor serving after {t - sent:.3f}s")
        assert t - sent < TTL
        a.expect("RESIGNED", 3.0)
        new = watch.wait_for_change(first.view, 2.0)
        assert new is not None
        assert new.info["id"] == "b"
