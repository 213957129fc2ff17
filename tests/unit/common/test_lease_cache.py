"""LeaseCache: entries live until a margin before their lease (or grant) ends; bounded, LRU; a read in the
last third of an entry's life asks once for its renewal. LeaseRenewer: renewals in batches, off the
caller's thread. Hints: ended entries kept where the object was (decision 0014)."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from kvpool.client.lease_cache import RENEW_RETRY_MS, LeaseCache, LeaseRenewer
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


def test_a_read_in_the_last_third_of_an_entry_asks_once_for_its_renewal() -> None:
    clock = ManualClock()
    due: list[str] = []
    cache = LeaseCache(10, clock, margin_ms=1000, on_renewal_due=due.append)
    first = _result(clock, lease_s=10)  # usable for 9 s: renewal due after 6 s
    cache.put("k", first)
    clock.advance(5.9)
    assert cache.get("k") is first
    assert due == []
    clock.advance(0.2)
    assert cache.get("k") is first  # still served while the renewal runs
    assert cache.get("k") is first
    assert due == ["k"]  # asked once, not once per read
    renewed = _result(clock, lease_s=10)
    cache.put("k", renewed)
    clock.advance(3.0)  # past the first entry's end
    assert cache.get("k") is renewed
    assert due == ["k"]
    clock.advance(3.1)  # 6.1 s into the renewed entry
    assert cache.get("k") is renewed
    assert due == ["k", "k"]


def test_an_entry_not_read_in_its_last_third_is_not_renewed() -> None:
    clock = ManualClock()
    due: list[str] = []
    cache = LeaseCache(10, clock, margin_ms=1000, on_renewal_due=due.append)
    cache.put("k", _result(clock, lease_s=10))
    clock.advance(9.5)
    assert cache.get("k") is None
    assert due == []


def test_a_fresh_answer_that_cannot_be_cached_drops_the_old_entry() -> None:
    """A renewal that finds the object only on SSD now (or with no time left) ends the cached entry."""
    clock = ManualClock()
    cache = LeaseCache(10, clock)
    cache.put("k", _result(clock, 10))
    moved = _result(clock, 10)
    moved.replicas[0].tier = 1
    cache.put("k", moved)
    assert cache.get("k") is None
    cache.put("k", _result(clock, 10))
    cache.put("k", _result(clock, 0.5))
    assert cache.get("k") is None


def test_a_renewal_that_overlapped_a_drop_keeps_nothing() -> None:
    """A client that removes a key while its renewal is in flight must not get the entry back."""
    clock = ManualClock()
    cache = LeaseCache(10, clock)
    before = cache.drops
    cache.drop(["removed"])
    cache.put("removed", _result(clock, 10), unless_dropped_since=before)
    assert cache.get("removed") is None
    now = cache.drops
    cache.put("kept", _result(clock, 10), unless_dropped_since=now)
    assert cache.get("kept") is not None
    ssd_only = _result(clock, 10)
    ssd_only.replicas[0].tier = 1
    cache.put("moved", ssd_only, unless_dropped_since=now)  # an answer not kept is not a removal
    cache.put("also-kept", _result(clock, 10), unless_dropped_since=now)
    assert cache.get("also-kept") is not None
    cache.clear()
    cache.put("kept", _result(clock, 10), unless_dropped_since=now)
    assert cache.get("kept") is None


def test_an_ended_entry_is_kept_as_a_hint_that_asks_for_its_renewal() -> None:
    """keep_hints (decision 0014): after its lease, an entry still says where the object was."""
    clock = ManualClock()
    due: list[str] = []
    cache = LeaseCache(10, clock, margin_ms=1000, on_renewal_due=due.append, keep_hints=True)
    first = _result(clock, lease_s=10)
    cache.put("k", first)
    assert cache.keeps_hints
    assert cache.hint("k") is None  # a live entry is no hint: get() serves it
    clock.advance(9.5)
    assert cache.get("k") is None
    assert cache.hint("k") is first
    assert due == []  # a hint nobody reads from asks for nothing
    cache.hint_used("k")
    cache.hint_used("k")
    assert due == ["k"]  # asked once ...
    clock.advance(RENEW_RETRY_MS / 1000 + 0.01)
    assert cache.hint("k") is first
    cache.hint_used("k")
    assert due == ["k", "k"]  # ... and again if that renewal did not land
    renewed = _result(clock, lease_s=10)
    cache.put("k", renewed)
    assert cache.get("k") is renewed
    assert cache.hint("k") is None
    assert cache.hint("never-cached") is None


def test_hints_go_with_a_drop_an_uncacheable_answer_and_the_lru_bound() -> None:
    clock = ManualClock()
    cache = LeaseCache(2, clock, keep_hints=True)
    for key in ("a", "b", "c"):
        cache.put(key, _result(clock, 10))
    clock.advance(20)
    assert cache.hint("a") is None  # pushed out by "c"
    assert cache.hint("b") is not None
    cache.drop(["b"])
    assert cache.hint("b") is None
    ssd_only = _result(clock, 10)
    ssd_only.replicas[0].tier = 1
    cache.put("c", ssd_only)
    assert cache.hint("c") is None
    assert len(cache) == 0


def test_without_keep_hints_an_ended_entry_is_gone() -> None:
    clock = ManualClock()
    cache = LeaseCache(10, clock)
    cache.put("k", _result(clock, 10))
    clock.advance(9.5)
    assert not cache.keeps_hints
    assert cache.get("k") is None
    assert cache.hint("k") is None
    assert len(cache) == 0


class _Calls:
    """What a LeaseRenewer asked for, with a way to wait for it."""

    def __init__(self, fail_first: bool = False) -> None:
        self.batches: list[list[str]] = []
        self.cond = threading.Condition()
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail_first = fail_first

    def renew(self, keys: list[str]) -> None:
        self.entered.set()
        self.gate.wait(5)
        with self.cond:
            self.batches.append(keys)
            self.cond.notify_all()
        if self.fail_first and len(self.batches) == 1:
            raise RuntimeError("master unreachable")

    def wait_for(self, n_batches: int) -> list[list[str]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.batches) >= n_batches, timeout=5), self.batches
            return list(self.batches)


def test_the_renewer_batches_keys_that_come_due_together() -> None:
    calls = _Calls()
    calls.gate.clear()  # hold the first call so that the next keys queue behind it
    renewer = LeaseRenewer(calls.renew, linger_s=0.05, max_batch=3)
    try:
        renewer.request("a")
        assert calls.entered.wait(5)
        for key in ("b", "c", "b", "d", "e"):  # come due while the renewal of "a" runs
            renewer.request(key)
        calls.gate.set()
        batches = calls.wait_for(3)
        assert batches[1:] == [["b", "c", "d"], ["e"]]  # at most max_batch keys a call; "b" once
    finally:
        renewer.close()


def test_a_failed_renewal_is_logged_and_the_renewer_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    calls = _Calls(fail_first=True)
    renewer = LeaseRenewer(calls.renew, linger_s=0.0)
    try:
        with caplog.at_level(logging.ERROR, logger="kvpool.client.lease_cache"):
            renewer.request("a")
            calls.wait_for(1)
            renewer.request("b")
            assert calls.wait_for(2)[1] == ["b"]
        assert "lease renewal of 1 keys failed" in caplog.text
    finally:
        renewer.close()


def test_a_closed_renewer_stops_its_thread_and_takes_no_keys() -> None:
    calls = _Calls()
    renewer = LeaseRenewer(calls.renew, linger_s=0.0)
    renewer.request("a")
    calls.wait_for(1)
    renewer.close()
    thread = renewer._thread
    assert thread is not None
    assert not thread.is_alive()
    renewer.request("b")
    assert calls.batches == [["a"]]


def test_put_many_keeps_what_put_would_keep_one_by_one() -> None:
    clock = ManualClock()
    batched = LeaseCache(3, clock, margin_ms=1000)
    single = LeaseCache(3, clock, margin_ms=1000)
    ssd = _result(clock, 10)
    ssd.replicas[0].tier = 1
    items = [
        ("a", _result(clock, 10)),
        ("short", _result(clock, 0.5)),
        ("ssd", ssd),
        ("b", _result(clock, 10, grant_s=3)),
        ("c", _result(clock, 10)),
        ("d", _result(clock, 10)),  # a fourth entry: "a", the least recently used, goes
    ]
    batched.put_many(items)
    for key, result in items:
        single.put(key, result)
    for cache in (batched, single):
        assert [k for k, _ in items if cache.get(k) is not None] == ["b", "c", "d"]
    clock.advance(2.1)  # past the margin before b's grant ends
    assert batched.get("b") is None
    assert batched.get("c") is items[4][1]


def test_put_many_keeps_nothing_when_entries_were_dropped_since() -> None:
    clock = ManualClock()
    cache = LeaseCache(10, clock)
    drops = cache.drops
    cache.drop(["x"])
    cache.put_many([("k", _result(clock, 10))], unless_dropped_since=drops)
    assert cache.get("k") is None
    cache.put_many([("k", _result(clock, 10))], unless_dropped_since=cache.drops)
    assert cache.get("k") is not None
