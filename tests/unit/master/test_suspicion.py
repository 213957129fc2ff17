"""Dead-store suspicion rules (master/suspicion.py) and their effect on MasterState, without sockets."""

from __future__ import annotations

from master_scenario import OK, Cluster, MiB

from kvpool.common.errors import ErrorCode as E
from kvpool.master.suspicion import StoreSuspicion, Verdict


def test_a_lone_report_asks_for_a_probe_and_a_healthy_probe_clears_it() -> None:
    rules = StoreSuspicion()
    assert rules.report("s1", "client-a", 10.0) == Verdict.PROBE
    assert not rules.is_suspected("s1")
    assert not rules.probe_result("s1", reachable=True, now=10.1)
    assert not rules.is_suspected("s1")
    # The cleared report no longer counts towards agreement: one more client is still only one.
    assert rules.report("s1", "client-b", 10.7) == Verdict.PROBE
    assert not rules.is_suspected("s1")


def test_one_client_repeating_itself_never_suspects_a_healthy_store() -> None:
    rules = StoreSuspicion()
    now = 0.0
    for _ in range(50):
        verdict = rules.report("s1", "liar", now)
        assert verdict in (Verdict.PROBE, Verdict.WAIT)
        if verdict == Verdict.PROBE:
            rules.probe_result("s1", reachable=True, now=now)
        now += 0.1
    assert not rules.is_suspected("s1")


def test_probes_of_one_store_are_rate_limited() -> None:
    rules = StoreSuspicion(probe_interval_s=0.5)
    assert rules.report("s1", "a", 1.0) == Verdict.PROBE
    assert rules.report("s1", "a", 1.2) == Verdict.WAIT
    assert rules.report("s1", "a", 1.6) == Verdict.PROBE


def test_a_failed_probe_suspects() -> None:
    rules = StoreSuspicion()
    assert rules.report("s1", "a", 5.0) == Verdict.PROBE
    assert rules.probe_result("s1", reachable=False, now=5.01)
    assert rules.is_suspected("s1")
    assert rules.report("s1", "a", 5.2) == Verdict.SUSPECTED


def test_two_clients_agreeing_suspect_at_once() -> None:
    rules = StoreSuspicion()
    assert rules.report("s1", "a", 1.0) == Verdict.PROBE
    assert rules.report("s1", "b", 1.5) == Verdict.SUSPECTED
    assert rules.is_suspected("s1")
    assert not rules.is_suspected("s2")


def test_reports_outside_the_window_do_not_agree() -> None:
    rules = StoreSuspicion(report_window_s=2.0)
    rules.report("s1", "a", 1.0)
    assert rules.report("s1", "b", 3.5) != Verdict.SUSPECTED
    assert not rules.is_suspected("s1")


def test_a_heartbeat_after_the_suspicion_began_lifts_it() -> None:
    rules = StoreSuspicion()
    rules.report("s1", "a", 1.0)
    rules.report("s1", "b", 1.0)
    assert rules.is_suspected("s1")
    assert not rules.heartbeat("s1", 1.0)  # not after the suspicion began
    assert rules.is_suspected("s1")
    assert rules.heartbeat("s1", 1.3)
    assert not rules.is_suspected("s1")
    assert not rules.heartbeat("s1", 1.4)  # nothing left to lift
    # Old reports do not linger: a fresh lone report asks for a probe again.
    assert rules.report("s1", "a", 1.5) == Verdict.PROBE


# ---------------------------------------------------------------------- applied by MasterState
def _cluster() -> Cluster:
    """Two stores of one segment each; objects a1.. on segment 1 (store1), b1.. on segment 2 (store2)."""
    c = Cluster(segments={1: MiB, 2: MiB}, store_report_agreement=2)
    for prefix, segment in (("a", 1), ("b", 2)):
        keys = [f"{prefix}{i}" for i in range(5)]
        assert c.put(*keys, preferred_segments=[segment]) == [OK] * 5
        assert {r.replicas[0].segment_id for r in c.get(*keys, lease=False)} == {segment}
    return c


DEAD = "10.0.0.1:7000"  # segment 1's data plane (Cluster.spec)


def _placed_on(c: Cluster, n: int = 20) -> set[int]:
    started = c.start(*[f"new{i}" for i in range(n)])
    return {rep.segment_id for r in started for rep in r.replicas}


def test_a_false_report_with_a_healthy_probe_changes_nothing() -> None:
    c = _cluster()
    report = c.state.report_store_failures("liar", [DEAD])
    assert (report.suspected, report.probe) == ([], [DEAD])
    assert not c.state.store_probe_result(DEAD, reachable=True)
    assert c.readable("a0", "b0") == [True, True]
    assert c.state.suspected_stores() == []
    assert _placed_on(c) == {1, 2}


def test_a_failed_probe_suspects_the_store_reads_miss_and_puts_avoid_it() -> None:
    c = _cluster()
    assert c.state.report_store_failures("c1", [DEAD]).probe == [DEAD]
    assert c.state.store_probe_result(DEAD, reachable=False)
    assert c.state.suspected_stores() == ["store1"]
    assert c.readable("a0", "a4", "b0") == [False, False, True]
    assert c.get_codes("a0", "b0") == [E.OBJECT_NOT_FOUND, OK]
    assert c.state.prefix_length(["b0", "b1", "a0", "b2"]) == 2
    assert _placed_on(c) == {2}
    c.check()


def test_two_clients_agreeing_suspect_without_a_probe() -> None:
    c = _cluster()
    assert c.state.report_store_failures("c1", [DEAD]).suspected == []
    assert c.state.report_store_failures("c2", [DEAD, "10.9.9.9:1"]).suspected == [DEAD]
    assert c.get_codes("a0") == [E.OBJECT_NOT_FOUND]


def test_a_heartbeat_after_the_suspicion_lifts_it_and_nothing_was_lost() -> None:
    c = _cluster()
    c.state.report_store_failures("c1", [DEAD])
    c.state.report_store_failures("c2", [DEAD])
    assert c.readable("a0") == [False]
    c.advance(0.2)
    assert c.state.heartbeat("store1", [1]).code == OK
    assert c.state.suspected_stores() == []
    assert c.readable("a0", "a4") == [True, True]
    assert _placed_on(c) == {1, 2}
    c.check()


def test_an_object_with_a_replica_on_a_healthy_store_stays_readable() -> None:
    c = Cluster(segments={1: MiB, 2: MiB}, store_report_agreement=2)
    assert c.put("both", replica_num=2) == [OK]
    c.state.report_store_failures("c1", [DEAD])
    c.state.report_store_failures("c2", [DEAD])
    [result] = c.get("both")
    assert result.code == OK
    assert [r.segment_id for r in result.replicas] == [2]


def test_a_remount_after_the_suspicion_lifts_it() -> None:
    c = _cluster()
    c.state.report_store_failures("c1", [DEAD])
    assert c.state.store_probe_result(DEAD, reachable=False)
    c.advance(0.5)
    assert c.mount(1, MiB, remount=True).code == OK
    assert c.state.suspected_stores() == []
    assert c.readable("a0") == [True]
    c.check()


def test_by_default_only_a_failed_probe_suspects() -> None:
    """Clients cut off from a healthy store by their own partition agree, yet it stays in service."""
    c = Cluster(segments={1: MiB, 2: MiB})
    assert c.put("a0", preferred_segments=[1]) == [OK]
    assert c.state.report_store_failures("c1", [DEAD]).probe == [DEAD]
    assert c.state.report_store_failures("c2", [DEAD]).suspected == []
    assert c.state.suspected_stores() == []
    assert c.get_codes("a0") == [OK]
    assert c.state.store_probe_result(DEAD, reachable=False)
    assert c.state.suspected_stores() == ["store1"]
