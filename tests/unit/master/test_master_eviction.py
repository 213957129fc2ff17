"""Eviction: the LRU/FIFO policies, and the state's sampling, re-validation, watermarks, leases and pins."""

from __future__ import annotations

from typing import Any

import pytest
from master_scenario import OK, Cluster, KiB

from kvpool.common.errors import ErrorCode as E
from kvpool.master.eviction import Candidate, FifoPolicy, LruPolicy, make_eviction
from kvpool.master.state import MasterState

# ====================================================================== policies


def cand(key: str, last_access: float, size: int = 100, soft: bool = False, put_time: float = 0.0) -> Candidate:
    return Candidate(key, last_access, size, soft, put_time)


def test_lru_takes_oldest_first_until_enough_bytes() -> None:
    cands = [cand("c", 3.0), cand("a", 1.0), cand("d", 4.0), cand("b", 2.0)]
    assert LruPolicy().select(cands, 250) == ["a", "b", "c"]
    assert LruPolicy().select(cands, 100) == ["a"]
    assert LruPolicy().select(cands, 10_000) == ["a", "b", "c", "d"]
    assert LruPolicy().select(cands, 0) == []


def test_lru_puts_soft_pinned_last_whatever_their_age() -> None:
    cands = [
        cand("pinned-old", 0.5, soft=True),
        cand("b", 2.0),
        cand("a", 1.0),
        cand("pinned", 1.5, soft=True),
    ]
    assert LruPolicy().select(cands, 200) == ["a", "b"]
    assert LruPolicy().select(cands, 400) == ["a", "b", "pinned-old", "pinned"]


def test_fifo_orders_by_put_time() -> None:
    cands = [cand("new-but-cold", 1.0, put_time=9.0), cand("old-but-hot", 9.0, put_time=1.0)]
    assert FifoPolicy().select(cands, 100) == ["old-but-hot"]
    assert LruPolicy().select(cands, 100) == ["new-but-cold"]


def test_make_eviction() -> None:
    assert isinstance(make_eviction("lru"), LruPolicy)
    assert isinstance(make_eviction("fifo"), FifoPolicy)
    with pytest.raises(ValueError, match="lru or fifo"):
        make_eviction("arc")


# ====================================================================== mechanism

PAGE = 1 * KiB  # aligned: one block per object


def pool(**config: Any) -> Cluster:
    """One 100-page segment; exact LRU (scan every shard) unless the test says otherwise."""
    config.setdefault("eviction_sample_factor", 0)
    return Cluster(segments={1: 100 * PAGE}, lease_ttl_s=10, **config)


def put_aged(c: Cluster, keys: list[str]) -> None:
    """Put keys one second apart, oldest first."""
    for key in keys:
        assert c.put(key, size=PAGE) == [OK]
        c.advance(1)


def test_eviction_order_is_lru() -> None:
    c = pool()
    keys = [f"k{i}" for i in range(10)]
    put_aged(c, keys)
    c.get("k0")  # touched: now the most recent
    c.readable("k2")  # exists() touches too
    c.advance(11)  # the lease from the get has expired
    report = c.state.evict(4 * PAGE)
    assert report.keys == ["k1", "k3", "k4", "k5"]
    assert (report.objects, report.bytes) == (4, 4 * PAGE)
    assert c.present(keys) == ["k0", "k2", "k6", "k7", "k8", "k9"]
    stats = c.state.stats()
    assert (stats.evictions, stats.evicted_bytes) == (4, 4 * PAGE)
    c.check()


def test_fifo_eviction_ignores_reads() -> None:
    c = pool(eviction="fifo")
    put_aged(c, ["a", "b", "c"])
    c.get("a")
    c.advance(11)
    assert c.state.evict(PAGE).keys == ["a"]
    c.check()


def test_leased_objects_are_not_evicted() -> None:
    c = pool()
    put_aged(c, ["a", "b", "c"])
    c.get("a", "b")
    assert c.state.evict(3 * PAGE).keys == ["c"]
    c.advance(10.5)
    assert c.state.evict(3 * PAGE).keys == ["a", "b"]
    c.check()


def test_hard_pinned_and_in_flight_objects_are_never_evicted() -> None:
    c = pool()
    c.put("pinned", size=PAGE, hard_pin=True)
    c.start("inflight", size=PAGE)
    put_aged(c, ["x"])
    report = c.state.evict(100 * PAGE)
    assert report.keys == ["x"]
    assert c.present(["pinned"]) == ["pinned"]
    assert c.get_codes("inflight") == [E.OBJECT_NOT_READY]
    c.check()


def test_soft_pinned_objects_go_last_and_only_if_allowed() -> None:
    c = pool()
    c.put("soft", size=PAGE, soft_pin_ttl_s=60)
    put_aged(c, ["a", "b"])
    assert c.state.evict(2 * PAGE).keys == ["a", "b"]
    assert c.state.evict(1 * PAGE).keys == ["soft"]

    strict = pool(allow_evict_soft_pinned=False)
    strict.put("soft", size=PAGE, soft_pin_ttl_s=60)
    strict.put("other", size=PAGE)
    assert strict.state.pin(["other"], soft_ttl_s=5) == [OK]
    assert strict.state.evict(10 * PAGE).keys == []
    strict.advance(6)  # the explicit 5 s pin lapsed; the 60 s one holds
    assert strict.state.evict(10 * PAGE).keys == ["other"]
    strict.advance(60)
    assert strict.state.evict(10 * PAGE).keys == ["soft"]
    c.check()
    strict.check()


def test_watermark_math() -> None:
    c = pool(eviction_high_watermark=0.9, eviction_target=0.85)
    put_aged(c, [f"k{i}" for i in range(90)])
    assert not c.state.needs_eviction()  # exactly at the watermark is not above it
    put_aged(c, ["k90"])
    assert c.state.needs_eviction()
    report = c.state.evict()  # default: down to 85 % of capacity
    assert report.keys == [f"k{i}" for i in range(6)]
    assert c.used(1) == 85 * PAGE
    assert not c.state.needs_eviction()
    assert c.state.evict().objects == 0  # already below target: nothing to do
    c.check()


def test_allocation_failure_triggers_eviction_that_makes_room() -> None:
    c = pool()
    keys = [f"k{i}" for i in range(100)]
    put_aged(c, keys)
    assert c.used(1) == 100 * PAGE
    assert c.put("new", size=PAGE) == [OK]
    # The synchronous eviction went down to the target (85 %), oldest first.
    assert c.present(keys) == keys[15:]
    assert c.state.stats().evictions == 15
    c.check()


def test_no_space_when_everything_is_leased() -> None:
    c = pool()
    keys = [f"k{i}" for i in range(100)]
    put_aged(c, keys)
    c.get(*keys)
    assert c.put("new", size=PAGE) == [E.NO_SPACE]
    assert c.state.stats().evictions == 0
    c.advance(11)
    assert c.put("new", size=PAGE) == [OK]
    c.check()


def test_an_object_larger_than_every_segment_evicts_nothing() -> None:
    c = pool()
    put_aged(c, [f"k{i}" for i in range(100)])
    assert c.put("huge", size=101 * PAGE) == [E.NO_SPACE]
    assert c.state.stats().evictions == 0
    c.check()


def test_a_victim_read_between_the_phases_is_skipped() -> None:
    class ReadDuringSelection(LruPolicy):
        state: MasterState

        def rank(self, candidates: list[Candidate]) -> list[Candidate]:
            ranked = super().rank(candidates)
            self.state.get_replicas(["a"])  # a reader leases "a" after the scan, before the free
            return ranked

    policy = ReadDuringSelection()
    racy = Cluster(segments={1: 100 * PAGE}, eviction_sample_factor=0, state_kwargs={"eviction": policy})
    policy.state = racy.state
    put_aged(racy, ["a", "b", "c"])
    report = racy.state.evict(PAGE)
    assert report.keys == ["b"]  # "a" was re-validated, found leased and skipped; the next in order was taken
    assert racy.present(["a", "c"]) == ["a", "c"]
    racy.check()


def test_sampled_eviction_is_approximately_lru() -> None:
    c = Cluster(segments={1: 2000 * PAGE}, num_shards=64, eviction_sample_factor=8)
    keys = [f"k{i:04d}" for i in range(1000)]
    for i in range(0, 1000, 100):
        c.put(*keys[i : i + 100], size=PAGE)
        c.advance(1)
    for _ in range(3):  # successive calls start at different shards
        report = c.state.evict(10 * PAGE)
        assert report.objects == 10
        assert 80 <= report.scanned < 1000  # a sample, not a full scan
        assert all(int(k[1:]) < 300 for k in report.keys), report.keys  # from the oldest 30 %
    c.check()


def test_free_notifications_follow_eviction_order() -> None:
    c = pool()
    put_aged(c, ["a", "b"])
    offsets = {k: c.get(k, lease=False)[0].replicas[0].offset for k in "ab"}
    c.state.evict(2 * PAGE)
    freed = c.state.heartbeat("store1", [1], 0).freed
    assert [(off, key) for _, off, _, key in freed] == [(offsets["a"], "a"), (offsets["b"], "b")]
    c.check()
