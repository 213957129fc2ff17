"""The sampled evictor at scale: bounded work per freed object, the same protections as the exact one, steps.

Shards here are large on purpose (few shards, thousands of objects each): a collection that scanned whole
shards would examine a number of objects per freed object that grows with the shard size.
"""

from __future__ import annotations

from master_scenario import OK, Cluster, KiB

from kvpool.master.evictor import EVICTION_STEP, SAMPLE_WINDOW

PAGE = 1 * KiB
FACTOR = 8


def filled(objects: int, shards: int = 4, **config: object) -> tuple[Cluster, list[str]]:
    """A pool of ``objects`` pages, full, put in batches one second apart (oldest first)."""
    c = Cluster(segments={1: objects * PAGE}, num_shards=shards, eviction_sample_factor=FACTOR, **config)
    keys = [f"k{i:06d}" for i in range(objects)]
    for i in range(0, objects, 500):
        assert c.put(*keys[i : i + 500], size=PAGE) == [OK] * len(keys[i : i + 500])
        c.advance(1)
    return c, keys


def examined_per_freed(c: Cluster, evictions: int, victims: int) -> float:
    before = c.state.eviction_work()
    for _ in range(evictions):
        assert c.state.evict(victims * PAGE).objects == victims
    after = c.state.eviction_work()
    return (after.examined - before.examined) / (after.evicted - before.evicted)


def test_objects_examined_per_freed_object_do_not_grow_with_the_object_count() -> None:
    small, _ = filled(2_000)
    large, _ = filled(20_000)  # 5,000 objects per shard
    per_freed_small = examined_per_freed(small, evictions=20, victims=4)
    per_freed_large = examined_per_freed(large, evictions=20, victims=4)
    # factor x victims candidates, in windows of SAMPLE_WINDOW: at most one window more than the sample.
    bound = FACTOR + SAMPLE_WINDOW / 4
    assert per_freed_small <= bound
    assert per_freed_large <= bound
    assert per_freed_large <= 1.25 * per_freed_small
    small.check()
    large.check()


def test_the_sampled_evictor_takes_from_the_oldest_part_of_a_large_pool() -> None:
    c, keys = filled(8_000)
    report = c.state.evict(200 * PAGE)
    assert report.objects == 200
    # A sample of factor x 200 objects out of 8,000 puts its 200 oldest in roughly the oldest 1/FACTOR.
    oldest_half = set(keys[:4_000])
    assert sum(k in oldest_half for k in report.keys) >= 190, report.keys
    c.check()


def test_windows_move_on_so_that_repeated_evictions_see_new_objects() -> None:
    c, _ = filled(8_000, shards=2)
    seen: set[str] = set()
    for _ in range(10):
        seen.update(c.state.evict(4 * PAGE).keys)
    assert len(seen) == 40  # each call evicted objects the previous ones had not examined
    c.check()


def test_the_sampled_evictor_never_takes_leased_pinned_or_unfinished_objects() -> None:
    c = Cluster(
        segments={1: 4_000 * PAGE},
        num_shards=2,
        eviction_sample_factor=FACTOR,
        allow_evict_soft_pinned=False,
        lease_ttl_s=1_000,
    )
    protected = {
        "hard": [f"hard{i}" for i in range(200)],
        "soft": [f"soft{i}" for i in range(200)],
        "leased": [f"leased{i}" for i in range(200)],
    }
    assert c.put(*protected["hard"], size=PAGE, hard_pin=True) == [OK] * 200
    assert c.put(*protected["soft"], size=PAGE, soft_pin_ttl_s=1_000) == [OK] * 200
    assert c.put(*protected["leased"], size=PAGE) == [OK] * 200
    unfinished = [f"open{i}" for i in range(200)]
    assert [r.code for r in c.start(*unfinished, size=PAGE)] == [OK] * 200
    c.advance(1)
    assert all(r.code == OK for r in c.get(*protected["leased"]))
    plain = [f"p{i:05d}" for i in range(3_200)]
    for i in range(0, len(plain), 400):
        assert c.put(*plain[i : i + 400], size=PAGE) == [OK] * 400
    # Ask for more than every evictable object: everything plain goes, nothing protected.
    report = c.state.evict(4_000 * PAGE)
    assert report.objects == len(plain)
    for group in protected.values():
        assert c.present(group) == group
    assert c.state.stats().processing == len(unfinished)
    c.check()


def test_a_background_eviction_frees_everything_it_was_asked_in_steps() -> None:
    c, keys = filled(4_000)
    victims = 5 * EVICTION_STEP + 3
    report = c.state.evict(victims * PAGE)  # not urgent: works in steps of EVICTION_STEP victims
    assert report.objects == victims
    assert c.state.eviction_work().evicted == victims
    assert len(set(report.keys)) == victims
    c.check()
    urgent = c.state.evict(victims * PAGE, urgent=True)  # a failed allocation: one go
    assert urgent.objects == victims
    c.check()


def test_exact_mode_ranks_every_object() -> None:
    c = Cluster(segments={1: 3_000 * PAGE}, num_shards=4, eviction_sample_factor=0)
    keys = [f"k{i:05d}" for i in range(3_000)]
    for i in range(0, 3_000, 300):
        assert c.put(*keys[i : i + 300], size=PAGE) == [OK] * 300
        c.advance(1)
    before = c.state.eviction_work()
    report = c.state.evict(10 * PAGE)
    assert set(report.keys) <= set(keys[:300])  # exactly from the oldest batch
    assert c.state.eviction_work().examined - before.examined == 3_000
    c.check()
