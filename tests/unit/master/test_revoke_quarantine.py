"""A revoked put's ranges are not reused while its WRITE grant may still be honoured (quarantine.py)."""

from __future__ import annotations

from kvpool.master.state import RECLAIM_GRACE_S
from tests.unit.master.master_scenario import OK, Cluster, KiB, MiB


def test_a_revoked_range_is_not_given_to_the_next_put_until_its_grant_is_dead() -> None:
    c = Cluster(segments={1: MiB}, put_timeout_s=10.0)
    first = c.start("a", size=64 * KiB, client="w")[0]
    assert c.state.put_revoke("w", ["a"]) == [OK]
    again = c.start("a", size=64 * KiB, client="w")[0]  # the key itself is free at once: a retry works
    other = c.start("b", size=64 * KiB, client="w")[0]
    held = first.replicas[0].offset
    assert {again.replicas[0].offset, other.replicas[0].offset}.isdisjoint({held})
    c.check()
    c.clock.advance(10.0 + RECLAIM_GRACE_S - 0.1)
    c.state.reclaim_abandoned_puts()
    assert c.used(1) == 3 * 64 * KiB, "released before the grant could have expired"
    c.clock.advance(0.2)
    assert c.state.reclaim_abandoned_puts() == 2  # a and b were never ended: abandoned, reclaimed too
    assert c.used(1) == 0
    c.check()


def test_held_ranges_of_an_unmounted_segment_are_dropped() -> None:
    c = Cluster(segments={1: MiB, 2: MiB}, put_timeout_s=1.0)
    c.start("a", "b", "c", size=32 * KiB, client="w")
    assert c.state.put_revoke("w", ["a", "b", "c"]) == [OK, OK, OK]
    c.check()
    c.state.unmount_segment(1)
    c.check()
    c.clock.advance(1.0 + RECLAIM_GRACE_S + 0.1)
    c.state.reclaim_abandoned_puts()
    assert c.used(2) == 0
    c.check()
