"""The carried pool of sampled eviction and bounded urgent eviction (docs/decisions/0086-eviction-pool.md).

A pool of pages put one per clock tick (every page has its own age), evicted a few pages at a time: with the
carried pool the victims are near the true LRU order; without it (``eviction_pool_size`` 0) a small eviction
takes the oldest of one small sample. Urgent eviction (a put that found the pool full) frees what the put
needs plus a bounded slack, not the whole gap down to ``eviction_target``.
"""

from __future__ import annotations

import pytest
from master_scenario import OK, Cluster, KiB

from kvpool.master.config import MasterConfig

PAGE = 1 * KiB


def aged(objects: int, **config: object) -> tuple[Cluster, list[str]]:
    """A full pool of ``objects`` pages in 4 shards, each page one tick younger than the previous."""
    config.setdefault("eviction_sample_factor", 8)
    c = Cluster(segments={1: objects * PAGE}, num_shards=4, **config)
    keys = [f"k{i:06d}" for i in range(objects)]
    for key in keys:
        assert c.put(key, size=PAGE) == [OK]
        c.advance(0.001)
    return c, keys


def rank_of_victims(c: Cluster, keys: list[str], evictions: int, victims: int) -> list[int]:
    """Each victim's position in the age order (0 = the oldest page) over ``evictions`` small evictions."""
    position = {k: i for i, k in enumerate(keys)}
    ranks: list[int] = []
    for _ in range(evictions):
        report = c.state.evict(victims * PAGE)
        assert report.objects == victims
        ranks.extend(position[k] for k in report.keys)
    return ranks


def test_small_evictions_with_the_carried_pool_take_near_lru_victims() -> None:
    evictions, victims = 100, 4  # 400 victims out of 4,000: exact LRU takes ranks 0-399
    pooled, keys = aged(4_000, eviction_pool_size=256)
    plain, _ = aged(4_000, eviction_pool_size=0)
    with_pool = rank_of_victims(pooled, keys, evictions, victims)
    without = rank_of_victims(plain, keys, evictions, victims)
    near_lru = 2 * evictions * victims  # within twice what the exact LRU would have reached
    assert sum(r < near_lru for r in with_pool) >= 0.95 * len(with_pool), sorted(with_pool)[-20:]
    assert sum(r < near_lru for r in without) < sum(r < near_lru for r in with_pool)
    pooled.check()
    plain.check()


def test_carried_candidates_are_revalidated_leased_pinned_read_or_removed_ones_stay() -> None:
    c, keys = aged(2_000, lease_ttl_s=1_000, allow_evict_soft_pinned=False)
    first = c.state.evict(2 * PAGE)  # fills the carried pool with the oldest of its sample
    assert first.objects == 2
    survivors = [k for k in keys if k not in first.keys]
    leased, pinned, touched, removed, plain = (survivors[i::5] for i in range(5))
    assert all(r.code == OK for r in c.get(*leased))  # read leases (lease_ttl_s 1,000)
    for key in pinned:
        assert c.state.pin([key], hard=True)[0] == OK
    c.advance(1)
    assert all(c.readable(*touched))  # an exists hit touches them: now the youngest
    assert c.remove(*removed) == [OK] * len(removed)
    c.advance(1)
    report = c.state.evict(10 * PAGE)
    # The carried pool ranks its stale entries first (their recorded access is the oldest); each is
    # re-validated and skipped, and the oldest plain pages go instead.
    assert report.objects == 10
    assert set(report.keys) <= set(plain)
    assert c.present(leased + pinned + touched) == leased + pinned + touched
    c.check()


def test_a_put_that_finds_the_pool_full_evicts_what_it_needs_plus_a_bounded_slack() -> None:
    objects, slack = 2_000, 32
    c, keys = aged(objects, urgent_eviction_slack=slack)  # eviction_target 0.85: 300 pages below
    c.state.tiers.progress.clear()
    assert c.put("new", size=PAGE) == [OK]
    evicted = c.state.stats().evictions
    assert 1 <= evicted <= 1 + slack  # never the 300 pages down to eviction_target
    assert c.state.tiers.progress.is_set()  # the background eviction was woken to catch up
    assert c.present(["new"]) == ["new"]
    c.check()


def test_an_urgent_eviction_never_goes_below_eviction_target() -> None:
    c, _ = aged(200, urgent_eviction_slack=1_000, eviction_target=0.95, eviction_high_watermark=0.95)
    assert c.put("new", size=PAGE) == [OK]
    assert c.state.stats().evictions == 10  # 200 pages down to 95 % of 200 = 190: the slack is capped
    c.check()


@pytest.mark.parametrize("field", ["eviction_pool_size", "urgent_eviction_slack"])
def test_a_negative_pool_size_or_slack_is_refused(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        MasterConfig(**{field: -1})
