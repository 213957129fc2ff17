"""OffsetAllocator: best fit, coalescing, utilisation, exhaustion, reserve, and a property test."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.master.allocator import OffsetAllocator

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


def must(offset: int | None) -> int:
    assert offset is not None
    return offset


def fill(alloc: OffsetAllocator, length: int) -> list[int]:
    offsets = []
    while (off := alloc.allocate(length)) is not None:
        offsets.append(off)
    return offsets


def test_uniform_pages_fill_a_gib_segment_above_95_percent() -> None:
    alloc = OffsetAllocator(1 * GiB)
    offsets = fill(alloc, 320 * KiB)
    assert alloc.used / alloc.size >= 0.95
    assert len(offsets) == (1 * GiB) // (320 * KiB)
    alloc.check()


def test_uniform_churn_keeps_utilisation_and_reuses_exact_fits() -> None:
    alloc = OffsetAllocator(64 * MiB)
    rng = random.Random(7)
    live = fill(alloc, 320 * KiB)
    for _ in range(2000):  # evict a random page, write a new one: the steady state of a KV cache
        victim = live.pop(rng.randrange(len(live)))
        assert alloc.free(victim) == 320 * KiB
        new = alloc.allocate(320 * KiB)
        assert new == victim  # the only hole is exactly the freed block
        live.append(new)
    assert alloc.allocate(320 * KiB) is None
    assert alloc.used / alloc.size >= 0.95
    alloc.check()


def test_uniform_pages_with_unaligned_size_round_up() -> None:
    alloc = OffsetAllocator(1 * MiB, alignment=64)
    offsets = fill(alloc, 1000)  # rounded to 1024
    assert all(off % 64 == 0 for off in offsets)
    assert len(offsets) == 1024
    assert alloc.used == 1 * MiB
    alloc.check()


def test_exhaustion_returns_none_and_counts_failures() -> None:
    alloc = OffsetAllocator(4 * KiB)
    assert alloc.allocate(4 * KiB) == 0
    assert alloc.allocate(64) is None
    assert alloc.allocate(10 * GiB) is None
    assert alloc.statistics().failures == 2
    assert (alloc.free_bytes, alloc.largest_free) == (0, 0)
    empty = OffsetAllocator(0)
    assert empty.allocate(1) is None


def test_bad_arguments_raise() -> None:
    alloc = OffsetAllocator(4 * KiB)
    with pytest.raises(ValueError, match="length must be > 0"):
        alloc.allocate(0)
    with pytest.raises(KeyError):
        alloc.free(0)
    off = alloc.allocate(100)
    assert off is not None
    alloc.free(off)
    with pytest.raises(KeyError):
        alloc.free(off)  # double free
    with pytest.raises(ValueError, match="power of two"):
        OffsetAllocator(100, alignment=3)


def test_free_coalesces_with_both_neighbours() -> None:
    alloc = OffsetAllocator(10 * KiB, alignment=1024)
    a, b, c = must(alloc.allocate(KiB)), must(alloc.allocate(KiB)), must(alloc.allocate(KiB))
    assert (a, b, c) == (0, KiB, 2 * KiB)
    alloc.free(a)
    alloc.free(c)  # coalesces with the tail
    assert alloc.statistics().free_extents == 2
    alloc.free(b)  # joins left and right: one extent again
    stats = alloc.statistics()
    assert (stats.free_extents, stats.largest_free, stats.used) == (1, 10 * KiB, 0)
    alloc.check()


def test_best_fit_picks_the_smallest_hole_and_splits_it() -> None:
    alloc = OffsetAllocator(100 * KiB, alignment=KiB)
    blocks = [must(alloc.allocate(n * KiB)) for n in (8, 1, 4, 1, 16, 1)]
    alloc.free(blocks[0])  # 8 KiB hole at 0
    alloc.free(blocks[2])  # 4 KiB hole at 9 KiB
    alloc.free(blocks[4])  # 16 KiB hole
    assert alloc.allocate(3 * KiB) == 9 * KiB  # the 4 KiB hole is the best fit
    assert alloc.allocate(KiB) == 12 * KiB  # what remains of it (exact fit)
    assert alloc.allocate(8 * KiB) == 0
    alloc.check()


def test_mixed_sizes_fragmentation_stays_bounded() -> None:
    alloc = OffsetAllocator(256 * MiB)
    rng = random.Random(3)
    sizes = [64 * KiB, 100 * KiB, 320 * KiB, 1 * MiB, 2 * MiB + 5]
    live: dict[int, int] = {}
    failures = 0
    for _ in range(20_000):
        if live and (rng.random() < 0.45 or alloc.free_bytes < 4 * MiB):
            victim = rng.choice(list(live))
            alloc.free(victim)
            del live[victim]
        else:
            length = rng.choice(sizes)
            got = alloc.allocate(length)
            if got is None:
                failures += 1
            else:
                live[got] = length
    # Fill what is left with the smallest size: mixed sizes still pack well with best fit.
    while (off := alloc.allocate(64 * KiB)) is not None:
        live[off] = 64 * KiB
    assert alloc.used / alloc.size >= 0.95
    alloc.check()


def test_reserve_claims_exact_ranges_and_refuses_overlaps() -> None:
    alloc = OffsetAllocator(1 * MiB)
    assert alloc.reserve(4096, 1000)  # block [4096, 5120)
    assert not alloc.reserve(4096, 10)  # same start
    assert not alloc.reserve(4032, 128)  # overlaps the start
    assert not alloc.reserve(5056, 64)  # overlaps the end
    assert alloc.reserve(5120, 64)  # right after it
    assert not alloc.reserve(100, 64)  # unaligned
    assert not alloc.reserve(1 * MiB - 64, 128)  # beyond the end
    assert not alloc.reserve(-64, 64)
    assert not alloc.reserve(0, 0)
    assert alloc.used == 1024 + 64
    assert alloc.allocate(4096) == 0  # the hole before the reserved block
    assert alloc.free(4096) == 1024
    alloc.check()


def test_reserve_at_an_unaligned_end_clips_the_block() -> None:
    alloc = OffsetAllocator(1000)
    assert alloc.reserve(960, 40)
    assert alloc.block_length(960) == 40
    assert alloc.free(960) == 40
    alloc.check()


def test_rebuild_from_inventory_in_any_order() -> None:
    original = OffsetAllocator(8 * MiB)
    rng = random.Random(11)
    live = {}
    for _ in range(500):
        length = rng.choice([3000, 16 * KiB, 50_000])
        off = original.allocate(length)
        if off is not None:
            live[off] = length
    for off in rng.sample(list(live), len(live) // 2):
        original.free(off)
        del live[off]
    rebuilt = OffsetAllocator(8 * MiB)
    items = list(live.items())
    rng.shuffle(items)
    assert all(rebuilt.reserve(off, length) for off, length in items)
    assert rebuilt.used == original.used
    assert rebuilt.allocated_ranges() == original.allocated_ranges()
    rebuilt.check()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5000), st.integers(0, 10**6)), max_size=200))
def test_property_random_sequences_never_overlap(ops: list[tuple[bool, int, int]]) -> None:
    alloc = OffsetAllocator(64 * KiB)
    live: dict[int, int] = {}
    for is_alloc, length, pick in ops:
        if is_alloc or not live:
            off = alloc.allocate(length)
            if off is None:
                assert alloc.largest_free < ((length + 63) & ~63)
                continue
            assert off % 64 == 0
            assert off + length <= alloc.size
            for other, olen in live.items():
                assert off + length <= other or other + olen <= off, "overlapping allocations"
            live[off] = length
        else:
            off = sorted(live)[pick % len(live)]
            assert alloc.free(off) == (live.pop(off) + 63) & ~63
        assert alloc.used == sum((n + 63) & ~63 for n in live.values())
    alloc.check()
    for off in list(live):
        alloc.free(off)
    stats = alloc.statistics()
    assert (stats.used, stats.free_extents, stats.largest_free) == (0, 1, alloc.size)
