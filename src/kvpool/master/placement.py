"""Placement POLICY: which segments a new object's replicas should go to, in order of preference.

A policy only orders candidates; the mechanism (``MasterState``) tries them in that order, skips a segment
whose allocator cannot fit the object, and stops after ``count`` successes. Every policy puts the caller's
``preferred`` segments first (in the caller's order), then orders the rest its own way. The mechanism passes
only segments that take allocations (status OK), so a policy never sees a DRAINING segment.

Policies are called once per key on the hot path of put_start: keep them O(segments) with small constants.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol

from kvpool.common.registry import Registry

__all__ = [
    "PLACEMENT_POLICIES",
    "FreeRatioFirst",
    "LocalFirst",
    "PlacementPolicy",
    "RandomPlacement",
    "SegmentView",
    "make_placement",
]


class SegmentView(Protocol):
    """What a placement policy may look at: a segment's identity and its current free space."""

    @property
    def id(self) -> int: ...

    @property
    def node(self) -> str: ...

    @property
    def size(self) -> int: ...

    @property
    def free_bytes(self) -> int: ...


class PlacementPolicy(Protocol):
    """Orders candidate segments for one object."""

    def choose(
        self,
        segments: Sequence[SegmentView],
        size: int,
        count: int,
        exclude: set[int],
        preferred: Sequence[int],
        writer_node: str,
    ) -> list[int]:
        """Segment ids to try, best first; may be longer than ``count`` (fallbacks)."""
        ...


def _split_preferred(
    segments: Sequence[SegmentView], exclude: set[int], preferred: Sequence[int]
) -> tuple[list[int], list[SegmentView]]:
    """(preferred ids that are present and not excluded, in order without duplicates; the other segments)."""
    if not preferred:
        if not exclude:
            return [], list(segments)
        return [], [s for s in segments if s.id not in exclude]
    present = {s.id for s in segments}
    first: list[int] = []
    for sid in preferred:
        if sid in present and sid not in exclude and sid not in first:
            first.append(sid)
    skip = exclude.union(first)
    return first, [s for s in segments if s.id not in skip]


def _free_fraction(segment: SegmentView) -> float:
    return segment.free_bytes / segment.size if segment.size else 0.0


def _by_free_fraction(segments: list[SegmentView]) -> list[int]:
    # Stable sort: among equally free segments the mechanism's order (mount order) decides.
    segments.sort(key=_free_fraction, reverse=True)
    return [s.id for s in segments]


class FreeRatioFirst:
    """Most free fraction first: a newly mounted (empty) store fills first and the pool stays balanced."""

    def choose(
        self,
        segments: Sequence[SegmentView],
        size: int,
        count: int,
        exclude: set[int],
        preferred: Sequence[int],
        writer_node: str,
    ) -> list[int]:
        first, rest = _split_preferred(segments, exclude, preferred)
        return first + _by_free_fraction(rest)


class RandomPlacement:
    """Uniformly random start, then the other segments in order (O(n), like Mooncake's default)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(
        self,
        segments: Sequence[SegmentView],
        size: int,
        count: int,
        exclude: set[int],
        preferred: Sequence[int],
        writer_node: str,
    ) -> list[int]:
        first, rest = _split_preferred(segments, exclude, preferred)
        if len(rest) > 1:
            # A random rotation rather than a shuffle: O(n) with a tiny constant, and still spreads load.
            k = self._rng.randrange(len(rest))
            rest = rest[k:] + rest[:k]
        return first + [s.id for s in rest]


class LocalFirst:
    """The writer's own node first (same-node clients copy through shared memory), then ``fallback``."""

    def __init__(self, fallback: PlacementPolicy | None = None) -> None:
        self._fallback: PlacementPolicy = fallback or FreeRatioFirst()

    def choose(
        self,
        segments: Sequence[SegmentView],
        size: int,
        count: int,
        exclude: set[int],
        preferred: Sequence[int],
        writer_node: str,
    ) -> list[int]:
        first, rest = _split_preferred(segments, exclude, preferred)
        if not writer_node:
            return first + self._fallback.choose(rest, size, count, set(), (), writer_node)
        local = [s for s in rest if s.node == writer_node]
        remote = [s for s in rest if s.node != writer_node]
        others = self._fallback.choose(remote, size, count, set(), (), writer_node)
        return first + _by_free_fraction(local) + others


PlacementFactory = Callable[[random.Random | None], PlacementPolicy]
"""Builds a policy; the argument is the master's seeded random source, for policies that draw."""

# The one list of placement policies: MasterConfig.placement's choices and --help come from it.
PLACEMENT_POLICIES: Registry[PlacementFactory] = Registry("placement policy")
PLACEMENT_POLICIES.add("free_ratio_first", lambda rng: FreeRatioFirst())
PLACEMENT_POLICIES.add("random", RandomPlacement)
PLACEMENT_POLICIES.add("local_first", lambda rng: LocalFirst())


def make_placement(name: str, rng: random.Random | None = None) -> PlacementPolicy:
    """The policy called ``name`` (MasterConfig.placement); ValueError lists the known names."""
    return PLACEMENT_POLICIES.get(name)(rng)
