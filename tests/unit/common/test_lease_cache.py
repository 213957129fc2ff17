"""LeaseCache: entries live until a margin before their lease (or grant) ends; bounded, LRU."""

from __future__ import annotations

from types import SimpleNamespace

from kvpool.client.lease_cache import LeaseCache
from kvpool.common.clock import ManualClock


def _result(clock: ManualClock, lease_s: float, grant_s: float | None = None) -> SimpleNamespace:
    now = clock.wall_ms()
    grant_ms = now + int(1000 * (lease_s if grant_s is None else grant_s))
    replica = SimpleNamespace(expiry_ms=grant_ms, tier=0)
    return SimpleNamespace(lease_expiry_ms=now + int(lease_s * 1000), replicas=[replica])


def test_an_entry_is_served_until_the_margin_before_its_lease_ends() -> None:
    clock = ManualClock()
    cache = LeaseCache(10, clock, margin_ms=1000)
    result = _result(clock, lease_s=10)
    cache.put("k", result)
    assert cache.get("k") is result
    clock.advance(8.9)
    assert cache.get("k") is result
    clock.advance(0.2)  # 9.1 s: less than the margin left
    assert cache.get("k") is None
    assert len(cache) == 0


def test_the_sooner_of_lease_and_grant_bounds_an_entry() -> None:
    clock = ManualClock()
    cache = LeaseCache(10, clock, margin_ms=1000)
    cache.put("k", _result(clock, lease_s=10, grant_s=3))
    clock.advance(2.1)
    assert cache.get("k") is None


def test_results_without_replicas_or_time_left_are_not_kept() -> None:
    clock = ManualClock()
    cache = LeaseCache(10, clock, margin_ms=1000)
    cache.put("none", SimpleNamespace(lease_expiry_ms=clock.wall_ms() + 10_000, replicas=[]))
    cache.put("short", _result(clock, lease_s=0.5))
    assert cache.get("none") is None
    assert cache.get("short") is None


def test_objects_only_on_an_ssd_tier_are_not_kept() -> None:
    """The master promotes an SSD object after repeated reads: it must see them."""
    clock = ManualClock()
    cache = LeaseCache(10, clock)
    result = _result(clock, 10)
    result.replicas[0].tier = 1
    cache.put("ssd", result)
    assert cache.get("ssd") is None


def test_bounded_least_recently_used_first_and_drop() -> None:
    clock = ManualClock()
    cache = LeaseCache(2, clock)
    for key in ("a", "b"):
        cache.put(key, _result(clock, 10))
    assert cache.get("a") is not None  # "b" is now the least recently used
    cache.put("c", _result(clock, 10))
    assert cache.get("b") is None
    assert cache.get("a") is not None
    assert cache.get("c") is not None
    cache.drop(["a", "zzz"])
    assert cache.get("a") is None
    cache.clear()
    assert len(cache) == 0


def test_zero_entries_turns_it_off() -> None:
    clock = ManualClock()
    cache = LeaseCache(0, clock)
    cache.put("k", _result(clock, 10))
    assert not cache.enabled
    assert cache.get("k") is None
