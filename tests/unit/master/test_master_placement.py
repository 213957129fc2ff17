"""Placement policies (pure) and how the state's mechanism uses their order."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from master_scenario import OK, Cluster, KiB, MiB

from kvpool.master.placement import (
    FreeRatioFirst,
    LocalFirst,
    PlacementPolicy,
    RandomPlacement,
    SegmentView,
    make_placement,
)


@dataclass
class Seg:
    id: int
    node: str
    size: int
    free_bytes: int


SEGS = [Seg(1, "a", 100, 10), Seg(2, "b", 100, 90), Seg(3, "a", 200, 100), Seg(4, "c", 100, 50)]


def choose(
    policy: PlacementPolicy,
    segments: Sequence[SegmentView] = SEGS,
    exclude: set[int] | None = None,
    preferred: Sequence[int] = (),
    writer_node: str = "",
) -> list[int]:
    return policy.choose(segments, 10, 1, exclude or set(), preferred, writer_node)


def test_free_ratio_first_orders_by_free_fraction() -> None:
    assert choose(FreeRatioFirst()) == [2, 3, 4, 1]  # 0.9, 0.5 (first of the ties), 0.5, 0.1


def test_preferred_first_then_policy_order_and_exclusions() -> None:
    policy = FreeRatioFirst()
    assert choose(policy, preferred=[1, 4, 1, 99]) == [1, 4, 2, 3]  # duplicates and unknown ids dropped
    assert choose(policy, exclude={2}) == [3, 4, 1]
    assert choose(policy, exclude={1}, preferred=[1]) == [2, 3, 4]
    assert choose(policy, segments=[]) == []


def test_random_placement_is_a_seeded_permutation_that_spreads() -> None:
    policy = RandomPlacement(random.Random(3))
    firsts: Counter[int] = Counter()
    for _ in range(400):
        order = choose(policy, preferred=[4])
        assert order[0] == 4
        assert sorted(order) == [1, 2, 3, 4]
        firsts[choose(policy)[0]] += 1
    assert set(firsts) == {1, 2, 3, 4}
    assert min(firsts.values()) > 50
    a, b = RandomPlacement(random.Random(9)), RandomPlacement(random.Random(9))
    assert [choose(a) for _ in range(5)] == [choose(b) for _ in range(5)]


def test_local_first_prefers_the_writer_node() -> None:
    policy = LocalFirst()
    assert choose(policy, writer_node="a") == [3, 1, 2, 4]  # node a by free fraction, then the others
    assert choose(policy, writer_node="zz") == [2, 3, 4, 1]
    assert choose(policy, writer_node="") == [2, 3, 4, 1]
    assert choose(policy, writer_node="a", preferred=[4]) == [4, 3, 1, 2]


def test_make_placement() -> None:
    assert isinstance(make_placement("free_ratio_first"), FreeRatioFirst)
    assert isinstance(make_placement("random", random.Random(1)), RandomPlacement)
    assert isinstance(make_placement("local_first"), LocalFirst)
    with pytest.raises(ValueError, match="free_ratio_first"):
        make_placement("round_robin")


# ====================================================================== through the mechanism


def test_a_full_segment_is_skipped_in_favour_of_the_next_candidate() -> None:
    c = Cluster(segments={1: 64 * KiB, 2: MiB})
    assert c.put(*[f"k{i}" for i in range(60)], size=KiB, preferred_segments=[1]) == [OK] * 60
    assert (c.used(1), c.used(2)) == (60 * KiB, 0)
    placed = c.start(*[f"n{i}" for i in range(10)], size=KiB, preferred_segments=[1])
    assert [r.replicas[0].segment_id for r in placed] == [1] * 4 + [2] * 6
    c.check()


def test_policy_duplicates_do_not_put_two_replicas_on_one_segment() -> None:
    class Stubborn:
        def choose(
            self,
            segments: Sequence[SegmentView],
            size: int,
            count: int,
            exclude: set[int],
            preferred: Sequence[int],
            writer_node: str,
        ) -> list[int]:
            return [1, 1, 1, 2, 99]

    c = Cluster(segments={1: MiB, 2: MiB}, state_kwargs={"placement": Stubborn()})
    [r] = c.start("k", replica_num=3)
    assert r.code == OK
    assert [g.segment_id for g in r.replicas] == [1, 2]
    c.check()


def test_random_placement_spreads_objects_over_segments() -> None:
    c = Cluster(segments={1: MiB, 2: MiB, 3: MiB}, placement="random")
    c.put(*[f"k{i}" for i in range(300)], size=KiB)
    counts = [c.objects_on(i) for i in (1, 2, 3)]
    assert sum(counts) == 300
    assert min(counts) > 60
    c.check()


def test_free_ratio_first_balances_equal_segments() -> None:
    c = Cluster(segments={1: MiB, 2: MiB, 3: MiB})
    c.put(*[f"k{i}" for i in range(300)], size=KiB)
    assert sorted(c.objects_on(i) for i in (1, 2, 3)) == [100, 100, 100]
    c.check()
